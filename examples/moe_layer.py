"""A Mixture-of-Experts feed-forward layer on torch.ops.moe.grouped_mm, trained for a few steps.

The layer: a top-k softmax router, tokens sorted by expert (a stable argsort, no host sync),
per-expert SwiGLU MLPs as two grouped matmuls over the sorted tokens, and a weighted combine
back into token order. Experts that receive no token are empty groups.

Run: ``python examples/moe_layer.py [--steps N] [--device cpu|cuda]``. It trains eagerly, then
under torch.compile(fullgraph=True), on the best device present, and prints the device, the
kernel that served the op, and the loss going down.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

import moe_ops


class MoEFeedForward(nn.Module):
    """x [T, d_model] -> [T, d_model]; each token goes to its top_k of n_experts SwiGLU MLPs."""

    def __init__(self, d_model: int, d_ff: int, n_experts: int, top_k: int):
        super().__init__()
        self.n_experts, self.top_k = n_experts, top_k
        self.router = nn.Linear(d_model, n_experts, bias=False)
        # Weights stored [G, N, K] like nn.Linear and passed transposed ([G, K, N] views): the
        # layout the contract calls the common case.
        self.w_gate_up = nn.Parameter(torch.randn(n_experts, 2 * d_ff, d_model) * d_model ** -0.5)
        self.w_down = nn.Parameter(torch.randn(n_experts, d_model, d_ff) * d_ff ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        probs = F.softmax(self.router(x).float(), dim=-1)
        weight, expert = probs.topk(self.top_k, dim=-1)  # [T, k]
        weight = (weight / weight.sum(-1, keepdim=True)).to(x.dtype)

        # Sort the T*k (token, expert) pairs by expert; offs = cumulative tokens per expert.
        flat_expert = expert.flatten()
        order = torch.argsort(flat_expert, stable=True)
        token = order // self.top_k
        counts = torch.zeros(self.n_experts, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, flat_expert, torch.ones_like(flat_expert))
        offs = counts.cumsum(0)

        h = moe_ops.grouped_mm(x[token], self.w_gate_up.transpose(1, 2), offs)  # [T*k, 2*d_ff]
        gate, up = h.chunk(2, dim=-1)
        y = moe_ops.grouped_mm(F.silu(gate) * up, self.w_down.transpose(1, 2), offs)  # [T*k, d_model]
        y = y * weight.flatten()[order, None]
        return torch.zeros(T, x.shape[1], dtype=y.dtype, device=x.device).index_add_(0, token, y)


def best_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def train(layer, steps: int, device, *, compile_: bool = False, tokens: int = 256, seed: int = 0):
    """Fit the layer to a fixed random teacher; returns the losses."""
    gen = torch.Generator().manual_seed(seed)
    d = layer.w_down.shape[1]
    teacher = torch.randn(d, d, generator=gen) / d ** 0.5
    x_all = torch.randn(steps, tokens, d, generator=gen)
    dtype = layer.w_down.dtype
    teacher, x_all = teacher.to(device, dtype), x_all.to(device, dtype)
    opt = torch.optim.Adam(layer.parameters(), lr=3e-3)
    step_fn = torch.compile(layer, fullgraph=True) if compile_ else layer
    losses = []
    for i in range(steps):
        x = x_all[i]
        loss = F.mse_loss(step_fn(x).float(), torch.tanh(x @ teacher).float())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    device = torch.device(args.device) if args.device else best_device()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    layer = MoEFeedForward(d_model=64, d_ff=128, n_experts=8, top_k=2).to(device, dtype)
    print(f"device: {device} ({dtype}), torch {torch.__version__}, moe_ops {moe_ops.__version__}")
    for mode in ("eager", "torch.compile"):
        moe_ops.reset_kernel_counts()
        t0 = time.perf_counter()
        losses = train(layer, args.steps, device, compile_=mode != "eager", seed=len(mode))
        dt = time.perf_counter() - t0
        served = ", ".join(f"{k} x{v}" for k, v in sorted(moe_ops.kernel_counts().items()))
        print(f"{mode:>13}: loss {losses[0]:.4f} -> {losses[-1]:.4f} in {len(losses)} steps ({dt:.1f} s); "
              f"moe.grouped_mm served by: {served}")


if __name__ == "__main__":
    main()

"""Benchmark problems: shapes from the issue and from real MoE models, and their tensors.

A case is one (shape, mode, dtype). Modes are the three grouped matmuls of an MoE layer's
training step, all with the same (G, M, K, N) so their ratios to the dense roofline compare:

* fwd:   2D x 3D, mat_a [M, K], mat_b [G, K, N] viewed from [G, N, K] weights (nn.Linear
         layout, k-contiguous): the forward.
* dgrad: 2D x 3D with mat_b [G, K, N] stored as is (n-contiguous): the layout of the input
         gradient, grad [M, N'] @ W[g] with W stored [G, N', K'].
* wgrad: 2D x 2D, op(x.t(), dy, offs) -> [G, K, N]: the weight gradient, against the dense
         x.t() @ dy.

Group sizes: a Dirichlet(1) split of the M rows (seeded), so some experts get many tokens and
some none.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MODES = ("fwd", "dgrad", "wgrad")


@dataclass(frozen=True)
class Shape:
    name: str
    G: int
    M: int
    K: int
    N: int
    source: str


# The fixed shapes of issue #6 (its performance targets are stated on these).
ISSUE_SHAPES = (
    Shape("G8 M4096 K1024 N2048", 8, 4096, 1024, 2048, "issue #6"),
    Shape("G64 M2048 K512 N512", 64, 2048, 512, 512, "issue #6"),
    Shape("G256 M4096 K512 N256", 256, 4096, 512, 256, "issue #6"),
)

# (name, experts, top-k, hidden, expert ffn) of real MoE models: one expert projection
# hidden -> ffn for `tokens` tokens, i.e. M = tokens * top-k rows.
MODELS = (
    ("Mixtral-8x7B", 8, 2, 4096, 14336),
    ("GPT-OSS-20B", 32, 4, 2880, 2880),
    ("OLMoE-1B-7B", 64, 8, 2048, 1024),
    ("Qwen3-30B-A3B", 128, 8, 2048, 768),
    ("DeepSeek-V3", 256, 8, 7168, 2048),
)


def model_shapes(tokens: int, weight_budget_bytes: int) -> list:
    """The MODELS with hidden and ffn divided by the smallest power of two that fits the
    expert weights (bf16) into the budget: "scaled to the machine"."""
    out = []
    for name, G, top_k, hidden, ffn in MODELS:
        s = 1
        while G * (hidden // s) * (ffn // s) * 2 > weight_budget_bytes:
            s *= 2
        tag = f"{name} /{s}" if s > 1 else name
        out.append(Shape(tag, G, tokens * top_k, hidden // s, ffn // s, f"{name}: {G} experts, top-{top_k}, "
                         f"hidden {hidden}, ffn {ffn}, {tokens} tokens, dims / {s}"))
    return out


QUICK_SHAPES = (
    Shape("quick G4", 4, 96, 64, 80, "smoke"),
    Shape("quick G32", 32, 256, 64, 48, "smoke"),
)


def dirichlet_offs(G: int, M: int, seed: int = 0) -> torch.Tensor:
    """[G] int32 cumulative ends of a Dirichlet(1) split of M rows (offs[-1] == M)."""
    gen = torch.Generator().manual_seed(seed)
    p = torch._sample_dirichlet(torch.ones(G, dtype=torch.float64), generator=gen)
    sizes = torch.floor(p * M).to(torch.int64)
    sizes[torch.argmax(p)] += M - int(sizes.sum())
    return torch.cumsum(sizes, 0).to(torch.int32)


@dataclass
class Tensors:
    """Inputs of one case on one device. For fwd/dgrad: a [M, K], b [G, K, N]; for wgrad:
    x [M, K], dy [M, N] (the op gets x.t()). dense_b is the dense roofline's right operand
    with the same memory layout as one expert's."""

    mode: str
    offs: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    dense_b: torch.Tensor


def make_tensors(shape: Shape, mode: str, dtype: torch.dtype, device, seed: int = 0) -> Tensors:
    gen = torch.Generator().manual_seed(seed + 1)
    G, M, K, N = shape.G, shape.M, shape.K, shape.N
    offs = dirichlet_offs(G, M, seed).to(device)

    def randn(*size):
        return torch.randn(*size, generator=gen, dtype=torch.float32).to(dtype).to(device)

    if mode == "fwd":
        b = randn(G, N, K).transpose(1, 2)
        return Tensors(mode, offs, randn(M, K), b, randn(N, K).t())
    if mode == "dgrad":
        return Tensors(mode, offs, randn(M, K), randn(G, K, N), randn(K, N))
    if mode == "wgrad":
        return Tensors(mode, offs, randn(M, K), randn(M, N), randn(M, N))
    raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")


def flops(shape: Shape) -> float:
    return 2.0 * shape.M * shape.K * shape.N

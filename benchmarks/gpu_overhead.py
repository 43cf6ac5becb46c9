"""Host-side cost of one call of the op on a CUDA GPU, piece by piece (a CUDA GPU only).

    python3 benchmarks/gpu_overhead.py --out DIR

Small grouped GEMMs finish on the GPU in tens of microseconds, so what the host spends per call
decides their speed. For a tiny problem (G=4, M=128, K=N=64) and Qwen3-30B-A3B's expert GEMM at
4096 routed rows, this times, per call, the host alone (N calls back to back, clock read before
the final synchronize) and the host plus the GPU (after it), for: ``moe_ops.grouped_mm``;
``torch.ops.moe.grouped_mm``; the pieces of the op's CUDA path (``check_args``, ``select``, the
Triton launcher ``triton_kernels.grouped_mm``; offs is clamped inside the Triton kernels);
``torch._grouped_mm``; and a forward + backward (``torch.autograd.grad`` for both inputs) of
the op with each of its Autograd kernels (C++ and Python) and of ``torch._grouped_mm``.
Writes ``overhead.json``, and ``overhead_profile.txt``: cProfile's 40 most expensive functions
(own time) over 300 calls of the op on the Qwen3 problem.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402

from gpu_check import group_sizes  # noqa: E402


def per_call_us(fn, n: int = 200) -> dict:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    total = time.perf_counter() - t0
    return {"host_us": host / n * 1e6, "host_and_gpu_us": total / n * 1e6}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "bench-out")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_overhead.py needs a CUDA GPU; none is visible to torch here", file=sys.stderr)
        return 2
    import moe_ops
    from moe_ops import _contract, _op
    from moe_ops.backends import cuda
    from moe_ops.backends.cuda import triton_kernels as tk

    cap = torch.cuda.get_device_capability()
    arch = 10 * cap[0] + cap[1]
    doc = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": __import__("triton").__version__, "problems": {}}
    for name, (G, M, K, N) in {"tiny": (4, 128, 64, 64), "qwen3-30b-a3b@4096": (128, 4096, 2048, 768)}.items():
        offs = torch.tensor(group_sizes(M, G), device="cuda").cumsum(0).to(torch.int32)
        a = torch.randn(M, K, device="cuda").to(torch.bfloat16)
        b = torch.randn(G, K, N, device="cuda").to(torch.bfloat16)
        p = _contract.check_args(a, b, offs)
        toolchains = cuda.toolchains()
        pieces = {
            "moe_ops.grouped_mm": lambda: moe_ops.grouped_mm(a, b, offs),
            "torch.ops.moe.grouped_mm": lambda: torch.ops.moe.grouped_mm(a, b, offs),
            "check_args": lambda: _contract.check_args(a, b, offs),
            "select": lambda: cuda.select(cap, toolchains, p.dtype, p.layout),
            "triton_kernels.grouped_mm": lambda: tk.grouped_mm(p, a, b, offs, None, arch=arch),
            "torch._grouped_mm": lambda: torch._grouped_mm(a, b, offs=offs),
        }
        doc["problems"][name] = {k: per_call_us(fn) for k, fn in pieces.items()}
        a_g, b_g = a.detach().requires_grad_(), b.detach().requires_grad_()
        ones = torch.ones(M, N, device="cuda", dtype=torch.bfloat16)

        def fwd_bwd(fn):
            return lambda: torch.autograd.grad(fn(a_g, b_g, offs=offs), (a_g, b_g), ones)

        before = _op._Autograd.active
        for kind in ("cpp", "python"):
            try:
                _op.use_autograd(kind)
            except RuntimeError as e:
                print(f"{name}: no {kind} Autograd kernel here ({e})", flush=True)
                continue
            doc["problems"][name][f"fwd+bwd moe_ops ({kind} autograd)"] = per_call_us(fwd_bwd(moe_ops.grouped_mm), 50)
        _op.use_autograd(before)
        doc["problems"][name]["fwd+bwd torch._grouped_mm"] = per_call_us(fwd_bwd(torch._grouped_mm), 50)
        for k, v in doc["problems"][name].items():
            print(f"{name:>20} {k:>36}: host {v['host_us']:8.1f} us, host+gpu {v['host_and_gpu_us']:8.1f} us",
                  flush=True)
    path = Path(args.out) / "overhead.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(300):
        moe_ops.grouped_mm(a, b, offs)  # the last problem of the loop above: Qwen3 at 4096 rows
    torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
    (Path(args.out) / "overhead_profile.txt").write_text(text.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""CPU bf16: the AVX512-BF16 schemes for k-contiguous weights, side by side in one process.

    python benchmarks/schemes.py [--threads 2] [--rounds 20] [--shared] [--out DIR]

On CPUs with AVX512-BF16 and no AMX the CPU kernel computes bf16 with [G, N, K] weights (viewed
as [G, K, N]: k-contiguous) either directly (columns of C in 512-bit lanes, every group's
weights transpose-packed) or swapped (C^T = W @ A^T, the weights read in place), with the rows
of A in 256-bit lanes ("swapped") or 512-bit ones ("swapped512"); the CPU picks one (README,
"AMD EPYC (Zen 4)" and "AMD EPYC (Zen 5)"). This forces each through the op's private
``bf16_scheme`` argument and times the forward of the issue's and the models' shapes: each round
runs the dense roofline (one ``torch.mm`` with the same M, K, N) and the three schemes in a fresh
seeded order, each call with its own Dirichlet draw of group sizes and, unless --flush-mib 0,
after writing that many MiB so that no call finds the weights of the one before in cache. Whole
runs of bench.py move by up to a quarter on a shared VM; variants alternating call by call in
one process see the same machine. Reported per shape: medians, the ratio of each scheme to the
dense roofline, and each swapped scheme's time over the direct one's. --shared gives all groups
one weight matrix (an expanded view), which stays in cache: the compute alone. Writes
``schemes.json`` to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import moe_ops  # noqa: E402
from cases import ISSUE_SHAPES, QUICK_SHAPES, Shape, dirichlet_offs, make_tensors, model_shapes  # noqa: E402
from devices import tensor_pages  # noqa: E402

SCHEMES = {"direct": 0, "swapped": 1, "swapped512": 2}  # the op's bf16_scheme numbers
DEFAULT = {number: name for name, number in SCHEMES.items()}
DENSE = "dense torch.mm"


def time_shape(shape: Shape, rounds: int, flush: torch.Tensor | None, shared: bool, seed: int) -> dict:
    t = make_tensors(shape, "fwd", torch.bfloat16, "cpu", seed)  # b: [G, N, K] weights as [G, K, N], k-contiguous
    a, b, dense_b = t.a, t.b, t.dense_b
    if shared:
        b = b[:1].expand(shape.G, shape.K, shape.N)
    offs = [dirichlet_offs(shape.G, shape.M, seed + i) for i in range(25)]
    op = torch.ops.moe_cpu.grouped_mm.default

    def call(scheme: int, i: int):
        return op("2d3d", a, b, offs[i % len(offs)], None, torch.bfloat16, -1, scheme)

    ref = moe_ops.reference.grouped_mm(a, b, offs[0])
    for name, scheme in SCHEMES.items():
        torch.testing.assert_close(call(scheme, 0), ref, atol=0.1, rtol=0.02, msg=lambda m: f"{name}: {m}")
    runs = {DENSE: lambda i: torch.mm(a, dense_b), **{n: (lambda i, s=s: call(s, i)) for n, s in SCHEMES.items()}}
    times = {n: [] for n in runs}
    order = random.Random(seed)
    for r in range(rounds + 1):  # round 0 warms up
        names = list(runs)
        order.shuffle(names)
        for n in names:
            if flush is not None:
                flush.add_(1)
            t0 = time.perf_counter()
            runs[n](r)
            if r:
                times[n].append(time.perf_counter() - t0)
    med = {n: statistics.median(v) * 1e3 for n, v in times.items()}
    return {"shape": shape.name, "G": shape.G, "M": shape.M, "K": shape.K, "N": shape.N, "median_ms": med,
            "ratio": {n: med[n] / med[DENSE] for n in SCHEMES},
            "over_direct": {n: med[n] / med["direct"] for n in SCHEMES if n != "direct"},
            "rounds": rounds}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's default)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--shapes", default="issue,models", help="comma list of issue, models, quick")
    ap.add_argument("--flush-mib", type=int, default=48, help="MiB written before every timed call (0: none)")
    ap.add_argument("--shared", action="store_true", help="one weight matrix for all groups: the compute alone")
    ap.add_argument("--out", default="bench-out", help="directory for schemes.json")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu = moe_ops.backends.module("cpu").status()
    if cpu.mode is None:
        print(f"schemes: the CPU extension does not run here ({cpu.detail}): nothing to compare")
        return 0
    machine = torch.ops.moe_cpu.machine()
    if machine != "avx512_bf16":
        print(f"schemes: this CPU's bf16 kernel level is {machine!r}; the schemes exist only on 'avx512_bf16' "
              "(AVX512-BF16 without AMX): nothing to compare")
        return 0
    kinds = [k for k in args.shapes.split(",") if k]
    shapes = (list(ISSUE_SHAPES) if "issue" in kinds else []) + (
        model_shapes(512, 64 << 20) if "models" in kinds else []) + (list(QUICK_SHAPES) if "quick" in kinds else [])
    flush = torch.zeros(args.flush_mib << 20, dtype=torch.uint8) if args.flush_mib > 0 else None
    pages = tensor_pages()
    print(f"schemes: {torch.get_num_threads()} threads, default here: "
          f"{DEFAULT[torch.ops.moe_cpu.bf16_scheme()]}"
          + (f", {pages}" if pages else "") + (", one shared weight matrix" if args.shared else "")
          + (f", {args.flush_mib} MiB written before each call" if flush is not None else ""))
    rows = []
    for i, shape in enumerate(shapes):
        row = time_shape(shape, args.rounds, flush, args.shared, seed=i)
        rows.append(row)
        med, ratio = row["median_ms"], row["ratio"]
        print(f"{shape.name:22s} dense {med[DENSE]:7.2f} ms | "
              + " | ".join(f"{n} {med[n]:7.2f} ms x{ratio[n]:.2f}" for n in SCHEMES) + " | over direct "
              + " / ".join(f"{v:.2f}" for v in row["over_direct"].values()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"threads": torch.get_num_threads(), "torch": torch.__version__, "pages": pages, "shared": args.shared,
            "flush_mib": args.flush_mib, "default": DEFAULT[torch.ops.moe_cpu.bf16_scheme()]}
    (out / "schemes.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=1))
    print(f"wrote {out / 'schemes.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Host time of one small call: moe_ops with each of its Autograd kernels against torch._grouped_mm.

    python benchmarks/host_overhead.py [--rounds 15] [--calls 500] [--out DIR]

Problems too small for the math to matter (CPU tensors, one thread): what is left is the time
the op's layers take on the host (dispatcher, Autograd kernel, contract checks, kernel entry),
which small MoE calls pay on every device. Three ways of calling, each timed as the mean of
``--calls`` back-to-back calls, in rounds that run every implementation once in alternating
order; the table gives the median over the rounds and the ratio to ``torch._grouped_mm``:

* forward: inputs without requires_grad;
* forward with grad: inputs with requires_grad (the autograd node is built);
* forward + backward: ``torch.autograd.grad`` of the output with respect to both inputs.

Implementations: ``moe_ops.grouped_mm`` with the C++ Autograd kernel (moe_ops._autograd, when it
loads), with the Python one, and ``torch._grouped_mm``. Writes ``host_overhead.json`` to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import moe_ops  # noqa: E402
from moe_ops import _op  # noqa: E402

# (name, G, M, K, N): a minimal call, and a decode-sized one (16 routed rows over 8 experts).
PROBLEMS = (("G2 M8 K16 N8", 2, 8, 16, 8), ("G8 M16 K64 N64", 8, 16, 64, 64))
MODES = ("forward", "forward with grad", "forward + backward")


def _inputs(G, M, K, N, grad):
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(M, K, generator=gen).requires_grad_(grad)
    b = torch.randn(G, N, K, generator=gen).transpose(1, 2).requires_grad_(grad)
    offs = torch.linspace(M / G, M, G).round().to(torch.int32)
    return a, b, offs


def _call(fn, mode, a, b, offs, a_g, b_g):
    if mode == "forward":
        return lambda: fn(a, b, offs=offs)
    if mode == "forward with grad":
        return lambda: fn(a_g, b_g, offs=offs)
    ones = torch.ones(a.shape[0], b.shape[2])
    return lambda: torch.autograd.grad(fn(a_g, b_g, offs=offs), (a_g, b_g), ones)


def _impls():
    """(name, autograd kernel to register or None, function)."""
    out, before = [], _op._Autograd.active
    try:
        _op.use_autograd("cpp")
        out.append(("moe_ops (C++ autograd)", "cpp", moe_ops.grouped_mm))
    except RuntimeError as e:
        print(f"moe_ops with the C++ Autograd kernel: not here ({e})", file=sys.stderr)
    _op.use_autograd(before)  # the probe leaves the kernel as it was; measure() selects per row
    out.append(("moe_ops (Python autograd)", "python", moe_ops.grouped_mm))
    out.append(("torch._grouped_mm", None, torch._grouped_mm))
    return out


def measure(impls, rounds, calls, clock=time.perf_counter) -> dict:
    """{"problem | mode": {implementation: median us per call}}: every problem and mode, in
    ``rounds`` rounds that run each of ``impls`` (as _impls gives them) once, in alternating
    order, as the mean of ``calls`` back-to-back calls (clock: time.perf_counter, or a test's).
    The Autograd kernel registered before is registered again afterwards."""
    before = _op._Autograd.active
    results = {}
    try:
        for pname, G, M, K, N in PROBLEMS:
            a, b, offs = _inputs(G, M, K, N, False)
            a_g, b_g, _ = _inputs(G, M, K, N, True)
            for mode in MODES:
                times = {name: [] for name, _, _ in impls}
                for r in range(rounds):
                    for name, kind, fn in impls if r % 2 == 0 else impls[::-1]:
                        if kind is not None:
                            _op.use_autograd(kind)
                        call = _call(fn, mode, a, b, offs, a_g, b_g)
                        call()
                        t0 = clock()
                        for _ in range(calls):
                            call()
                        times[name].append((clock() - t0) / calls * 1e6)
                results[f"{pname} | {mode}"] = {name: statistics.median(v) for name, v in times.items()}
    finally:
        _op.use_autograd(before)
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    impls = _impls()
    results = measure(impls, args.rounds, args.calls)
    names = [name for name, _, _ in impls]
    head = ["problem", "mode"] + names
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for key, row in results.items():
        base = row["torch._grouped_mm"]
        cells = [f"{row[n]:.1f} us" + ("" if n == "torch._grouped_mm" else f" (x{row[n] / base:.1f})") for n in names]
        print(f"| {key} | " + " | ".join(cells) + " |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "threads": 1, "rounds": args.rounds, "calls": args.calls,
            "date": time.strftime("%Y-%m-%d")}
    (out / "host_overhead.json").write_text(json.dumps({"meta": meta, "us_per_call": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

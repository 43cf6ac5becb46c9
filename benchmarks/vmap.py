"""torch.vmap and the transforms built on it, with the op's batching rule against torch's fallback.

    python benchmarks/vmap.py [--threads 2] [--rounds 7] [--out DIR]

The batching rule (moe_ops/_batching.py) folds a batch into one call of the op; without it
(``moe_ops._op.use_batching_rule(False)``) torch calls the op once per batch element. Each
case's result with the rule is checked against the fallback's before either is timed (a rule
that computed less, or NaN, would otherwise be timed as a speed-up), and the op calls one run
of each makes are counted (JSON ``op_calls``: the rule folds the batch into fewer). Both run
in one process, in rounds that time each way once, in alternating order; a way's time in a
round is the mean of back-to-back calls for at least --min-s seconds. The table gives the
medians and the fallback / rule ratio. CPU tensors, fp32. Writes ``vmap.json`` to --out.

Cases (G=8 experts, K=N=64, 64 routed rows per sample unless said):
* vmap forward: 32 samples through shared weights and routing (batched mat_a);
* per-sample gradients: vmap(grad) of a squared loss over 32 samples, weight gradient per sample;
* ensemble: 8 members, each with its own weights and routing (mat_a, mat_b and offs batched);
* routed per sample: 32 samples through shared weights, each with its own routing (mat_a and
  offs batched);
* jacrev: the [64, 64] output's Jacobian with respect to the [64, 64] input (4096 cotangents);
* jacfwd: the Jacobian with respect to the weights of a small layer (4 experts of 16 x 16).
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
from torch.func import grad, jacfwd, jacrev, vmap  # noqa: E402

import moe_ops  # noqa: E402
from moe_ops import _op  # noqa: E402

WAYS = ("rule", "fallback")


def _cases():
    gen = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    op = moe_ops.grouped_mm
    offs = torch.tensor([8, 16, 16, 30, 40, 50, 60, 64])
    w, xs = r(8, 64, 64), r(32, 64, 64)
    ws, rows = r(8, 8, 64, 64), torch.sort(torch.randint(0, 65, (8, 8), generator=gen), 1).values
    routes = torch.sort(torch.randint(0, 65, (32, 8), generator=gen), 1).values
    w_small, x_small, offs_small = r(4, 16, 16), r(8, 16), torch.tensor([2, 4, 6, 8])

    def loss(weights, x):
        return op(x, weights, offs).square().sum()

    return {
        "vmap forward (32 samples)": lambda: vmap(lambda x: op(x, w, offs))(xs),
        "per-sample gradients (32)": lambda: vmap(grad(loss), in_dims=(None, 0))(w, xs),
        "ensemble (8 members)": lambda: vmap(lambda x, v, o: op(x, v, o))(xs[:8], ws, rows),
        "routed per sample (32)": lambda: vmap(lambda x, o: op(x, w, o))(xs, routes),
        "jacrev d out / d x": lambda: jacrev(lambda x: op(x, w, offs))(xs[0]),
        "jacfwd d out / d w (small)": lambda: jacfwd(lambda v: op(x_small, v, offs_small))(w_small),
    }


def _time(fn, min_s, clock=time.perf_counter):
    """Seconds per call of fn: the mean of back-to-back calls for at least min_s (clock: a test's)."""
    fn()
    start, n = clock(), 0
    while True:
        fn()
        n += 1
        elapsed = clock() - start
        if elapsed >= min_s:
            return elapsed / n


def _op_calls() -> int:
    return sum(moe_ops.kernel_counts().values())


def _use(way: str) -> None:
    _op.use_batching_rule(way == "rule")


def compare(fn, rounds: int, min_s: float, clock=time.perf_counter) -> dict:
    """One case: its result with the batching rule checked against torch's fallback (NaN fails)
    before either is timed, the op calls one run of each makes (the rule folds the batch: fewer),
    then ``rounds`` rounds timing each way once in alternating order; medians, in ms. The rule is
    registered again afterwards."""
    try:
        result, calls = {}, {}
        for way in WAYS:
            _use(way)
            before = _op_calls()
            result[way] = fn()
            calls[way] = _op_calls() - before
        ref = result["fallback"].double()
        err = (result["rule"].double() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)
        if not err <= 1e-4:  # not '>': NaN must fail
            raise RuntimeError(f"the batching rule's result differs from torch's fallback by {err:.2e}")
        times = {way: [] for way in WAYS}
        for r in range(rounds):
            for way in WAYS if r % 2 == 0 else WAYS[::-1]:
                _use(way)
                times[way].append(_time(fn, min_s, clock))
    finally:
        _op.use_batching_rule(True)
    rule, fallback = statistics.median(times["rule"]), statistics.median(times["fallback"])
    return {"rule_ms": rule * 1e3, "fallback_ms": fallback * 1e3, "fallback_over_rule": fallback / rule,
            "op_calls": calls}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--min-s", type=float, default=0.3, help="seconds of calls per timing")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    # torch's fallback prints a "performance drop" warning to stderr on every call; the printing
    # is not what is measured here.
    torch._C._functorch._set_vmap_fallback_warning_enabled(False)
    results = []
    for name, fn in _cases().items():
        row = {"case": name, **compare(fn, args.rounds, args.min_s)}
        results.append(row)
        print(f"{name:28s} rule {row['rule_ms']:9.3f} ms   fallback {row['fallback_ms']:9.3f} ms   "
              f"x{row['fallback_over_rule']:6.2f}", flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {"torch": torch.__version__, "threads": args.threads, "rounds": args.rounds,
                "date": time.strftime("%Y-%m-%d"), "kernels": moe_ops.kernel_counts()}
        (args.out / "vmap.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
        print(f"wrote {args.out / 'vmap.json'}")


if __name__ == "__main__":
    main()

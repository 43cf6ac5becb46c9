"""One run on a TPU host: the property suite on the TPU, then grouped-matmul benchmarks, as JSON.

Usage, from the repository (nothing is installed; the repository is put on sys.path):

    python3 benchmarks/tpu_check.py --out DIR              # suite + benchmarks
    python3 benchmarks/tpu_check.py --out DIR --no-suite   # benchmarks only
    python3 benchmarks/tpu_check.py --list                 # the benchmark cases, no TPU needed
    python3 benchmarks/tpu_check.py --out DIR --interpret  # smoke run of this script on a CPU:
                                                           # tiny shapes, kernels interpreted

Needs ``jax[tpu]`` (our kernels were compiled here with jax 0.10.2 / libtpu 0.0.42), torch (CPU
build is enough: the suite moves tensors through numpy), pytest and hypothesis. Writes
``tpu_check.json`` (rewritten after every step, so a run cut short keeps what it measured) and
``pytest.log`` into DIR. Bounded for a short loan: the suite is stopped after ``--suite-s``
(recorded as failed), and no benchmark case starts after ``--bench-s``; a case that raises
costs that case only.

Phase 1, the suite: ``pytest tests/test_properties.py tests/test_tpu.py -k tpu`` with
MOE_OPS_TPU_NATIVE=1 (run_here compiles the kernels with Mosaic for jax's TPU instead of
interpreting them) and MOE_OPS_REQUIRE_BACKENDS=tpu. The tests of tests/test_tpu.py that pass
explicit ``interpret=`` arguments still interpret. Hypothesis uses the derandomized "ci" profile
(60 examples per property; natively every new shape costs a Mosaic compile of ~1 s).

Phase 2, benchmarks, bf16, for each MoE shape (expert GEMMs of Mixtral 8x7B, DeepSeek-V3,
Qwen3-30B-A3B) and M routed rows, three grouped matmuls of a training step:
  * "forward":  [M, K] x [G, K, N] (2Dx3D),
  * "d_input":  [M, N] x [G, K, N] read transposed (2Dx3D, transpose_b),
  * "d_weight": [M, K] read transposed x [M, N] -> [G, K, N] (2Dx2D, ragged contraction),
each by
  * ours (``tpu_pallas.gmm`` / ``tgmm``, tiles from ``choose_tiles`` for this generation),
  * MegaBlox (``jax.experimental.pallas.ops.tpu.megablox``) with the same tiles,
  * ``jax.lax.ragged_dot`` (XLA's own grouped matmul),
  * a dense ``jnp.dot`` with the same FLOPs ([M, K] @ [K, N]), the throughput ceiling.
Group sizes are a Dirichlet(1) split of M (seeded). Every result is compared with ragged_dot
before timing (max |difference| / max |ragged_dot| is recorded, None if the result is not
finite, and ``correct`` is whether it is below REL_DIFF_LIMIT). Times are medians of
``--reps`` runs after warm-up, each ended by ``block_until_ready``. Finally, the number of jax
compilations while the group sizes change (expected: 0).

The exit status is 1 when anything in ``failures`` (also written to the JSON) went wrong: the
suite failed or timed out, our kernels differ from ragged_dot or raise, a case raises as a whole,
the benchmarks raise, new group sizes recompile, or our kernel was timed unchecked because
ragged_dot raised. Another peer (MegaBlox, dense) raising and a case not started for
``--bench-s`` are recorded only.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# name: (G experts, K = hidden size, N = expert intermediate size) of the first expert GEMM.
MODELS = {
    "mixtral-8x7b": (8, 4096, 14336),
    "deepseek-v3": (256, 7168, 2048),
    "qwen3-30b-a3b": (128, 2048, 768),
}
TOKENS = (16384, 65536)  # M, routed rows (tokens x top-k)
SMOKE = {"smoke": (4, 256, 384)}
SMOKE_TOKENS = (512,)
# Largest max|got - ragged_dot| / max|ragged_dot| that passes: both are bf16 results of fp32
# accumulations, a few bf16 roundings (2^-8 each) apart; gpu_check.REL_ERR_LIMIT's twin (this
# script imports jax only, not gpu_check's torch).
REL_DIFF_LIMIT = 2e-2


def cases(interpret: bool):
    models, tokens = (SMOKE, SMOKE_TOKENS) if interpret else (MODELS, TOKENS)
    return [(name, G, K, N, M) for name, (G, K, N) in models.items() for M in tokens]


def _write(out_dir: Path, report: dict) -> None:
    # Strict JSON (jq rejects Infinity): a result that is not finite is recorded as None.
    (out_dir / "tpu_check.json").write_text(json.dumps(report, indent=1, allow_nan=False))


def suite_command() -> tuple:
    """(argv, environment) of the property suite's pytest run on the TPU."""
    env = {**os.environ, "MOE_OPS_TPU_NATIVE": "1", "MOE_OPS_REQUIRE_BACKENDS": "tpu",
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_properties.py",
           "tests/test_tpu.py", "-k", "tpu"]
    return cmd, env


def run_suite(out_dir: Path, report: dict, timeout_s: float = 300.0) -> None:
    cmd, env = suite_command()
    t = time.time()
    try:  # bounded: natively every new shape is a Mosaic compile, and the benchmarks come after
        r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        text = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr))
        (out_dir / "pytest.log").write_text(text)
        report["suite"] = {"returncode": None, "summary": f"timed out after {timeout_s} s",
                           "seconds": round(time.time() - t, 1)}
        return
    (out_dir / "pytest.log").write_text(r.stdout + r.stderr)
    tail = [line for line in r.stdout.splitlines() if " passed" in line or " failed" in line or " error" in line]
    report["suite"] = {"returncode": r.returncode, "summary": tail[-1] if tail else None,
                       "seconds": round(time.time() - t, 1)}


def _split(M: int, G: int, seed: int):
    import numpy as np

    rng = np.random.default_rng(seed)
    sizes = np.floor(rng.dirichlet(np.ones(G)) * M).astype(np.int32)
    sizes[-1] += M - sizes.sum()
    return sizes


def _time(fn, args, reps: int) -> float:
    import jax

    for _ in range(2):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run_benchmarks(out_dir: Path, report: dict, interpret: bool, reps: int, budget_s: float = 300.0) -> None:
    import jax

    from moe_ops.backends import tpu_pallas as tp

    generation = "interpret" if interpret else tp.generation_of(jax.devices()[0].device_kind)
    report["generation"] = generation
    report["benchmarks"] = []
    report["not_run"] = []
    deadline = time.perf_counter() + budget_s
    for case in cases(interpret):
        if time.perf_counter() > deadline:
            report["not_run"].append(dict(zip(("model", "G", "K", "N", "M"), case)))
            continue
        try:  # one case's failure (e.g. running out of HBM) costs that case only
            _bench_case(out_dir, report, generation, interpret, reps, *case)
        except Exception:
            name, G, K, N, M = case
            report["benchmarks"].append({"model": name, "G": G, "M": M, "K": K, "N": N,
                                         "error": traceback.format_exc()[-3000:]})
            _write(out_dir, report)
    report["recompiles_on_new_group_sizes"] = count_recompiles(interpret, generation)
    _write(out_dir, report)


@functools.lru_cache(maxsize=None)
def _rel_diff_fn():
    import jax
    import jax.numpy as jnp

    # One fused reduction, no fp32 copies: DeepSeek-V3's weight gradient at 65536 rows is
    # [256, 7168, 2048], 7.5 GB in bf16 and 15 GB per fp32 copy.
    def rel_diff(got, ref):
        diff = jnp.max(jnp.abs(got.astype(jnp.float32) - ref.astype(jnp.float32)))
        # inf where got is not finite: XLA's fused max reduction drops NaN (on CPU a result
        # with NaN rows came out 0.0, i.e. exact), so the check asks for it explicitly.
        rel = diff / jnp.max(jnp.abs(ref.astype(jnp.float32)))
        return jnp.where(jnp.all(jnp.isfinite(got)), rel, jnp.inf)

    return jax.jit(rel_diff)


def _bench_case(out_dir: Path, report: dict, generation: str, interpret: bool, reps: int,
                name: str, G: int, K: int, N: int, M: int) -> None:
    """The three grouped matmuls of one MoE shape; its arrays are freed on return, before the
    next case allocates its own."""
    import importlib

    import jax
    import jax.numpy as jnp

    from moe_ops.backends import tpu_pallas as tp

    mb = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")
    key = jax.random.PRNGKey(0)
    bf16 = jnp.bfloat16
    sizes = jnp.asarray(_split(M, G, seed=M + G))
    offs = jnp.cumsum(sizes).astype(jnp.int32)
    ka, kb, kg = jax.random.split(jax.random.fold_in(key, M + G), 3)
    x = jax.random.normal(ka, (M, K), bf16)
    w = jax.random.normal(kb, (G, K, N), bf16) / K ** 0.5
    dy = jax.random.normal(kg, (M, N), bf16)
    flops = 2 * M * K * N
    fwd_tiles = tp.choose_tiles("gmm", M, K, N, G, bf16, bf16, generation)
    din_tiles = tp.choose_tiles("gmm", M, N, K, G, bf16, bf16, generation)
    dw_tiles = tp.choose_tiles("tgmm", K, M, N, G, bf16, bf16, generation)
    kw = dict(interpret=interpret, generation=generation)
    mkw = dict(interpret=interpret, preferred_element_type=bf16)
    jobs = {
        "forward": {
            "ours": (functools.partial(tp.gmm, tiles=fwd_tiles, **kw), (x, w, offs, None)),
            "megablox": (jax.jit(functools.partial(mb.gmm, tiling=(fwd_tiles.tm, fwd_tiles.tk, fwd_tiles.tn), **mkw)),
                         (x, w, sizes)),
            "ragged_dot": (jax.jit(jax.lax.ragged_dot), (x, w, sizes)),
            "dense": (jax.jit(jnp.dot), (x, w[0])),
        },
        "d_input": {
            "ours": (functools.partial(tp.gmm, tiles=din_tiles, transpose_b=True, **kw), (dy, w, offs, None)),
            "megablox": (jax.jit(functools.partial(mb.gmm, tiling=(din_tiles.tm, din_tiles.tk, din_tiles.tn),
                                                   transpose_rhs=True, **mkw)), (dy, w, sizes)),
            "ragged_dot": (jax.jit(lambda a, b, s: jax.lax.ragged_dot(a, jnp.swapaxes(b, 1, 2), s)), (dy, w, sizes)),
            "dense": (jax.jit(lambda a, b: a @ b.T), (dy, w[0])),
        },
        "d_weight": {
            "ours": (functools.partial(tp.tgmm, tiles=dw_tiles, transpose_a=True, **kw), (x, dy, offs)),
            "megablox": (jax.jit(lambda a, b, s: mb.tgmm(a.T, b, s, tiling=(dw_tiles.tk, dw_tiles.tm, dw_tiles.tn),
                                                         **mkw)), (x, dy, sizes)),
            "ragged_dot": (jax.jit(lambda a, b, s: jax.lax.ragged_dot_general(
                a, b, s, jax.lax.RaggedDotDimensionNumbers(
                    dot_dimension_numbers=(((0,), (0,)), ((), ())),
                    lhs_ragged_dimensions=[0], rhs_group_dimensions=[]))), (x, dy, sizes)),
            "dense": (jax.jit(lambda a, b: a.T @ b), (x, dy)),
        },
    }
    for op, impls in jobs.items():
        row = {"model": name, "G": G, "M": M, "K": K, "N": N, "op": op, "gflop": flops / 1e9,
               "tiles": {"forward": fwd_tiles, "d_input": din_tiles, "d_weight": dw_tiles}[op].__dict__}
        reference = None
        try:
            reference = impls["ragged_dot"][0](*impls["ragged_dot"][1])
        except Exception as e:  # ragged_dot_general may be missing in older jax
            row["ragged_dot_error"] = f"{type(e).__name__}: {e}"[:300]
        for impl, (fn, args) in impls.items():
            try:
                if impl != "dense" and reference is not None:
                    got = fn(*args)
                    diff = float(_rel_diff_fn()(got, reference))
                    row[f"{impl}_rel_diff"] = diff if math.isfinite(diff) else None
                    # Before, nothing judged the difference: a wrong kernel's time was published
                    # and the exit status was 0.
                    row[f"{impl}_correct"] = diff < REL_DIFF_LIMIT
                    del got
                seconds = _time(fn, args, reps)
                row[f"{impl}_ms"] = round(seconds * 1e3, 4)
                row[f"{impl}_tflops"] = round(flops / seconds / 1e12, 3)
            except Exception as e:
                row[f"{impl}_error"] = f"{type(e).__name__}: {e}"[:300]
        if "dense_ms" in row:
            for impl in ("ours", "megablox", "ragged_dot"):
                if f"{impl}_ms" in row:
                    row[f"{impl}_vs_dense"] = round(row[f"{impl}_ms"] / row["dense_ms"], 3)
        report["benchmarks"].append(row)
        _write(out_dir, report)
        print(json.dumps(row), flush=True)


def count_recompiles(interpret: bool, generation: str) -> int:
    """jax compilations while only the group sizes change (forward and weight gradient)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from moe_ops.backends import tpu_pallas as tp

    G, K, N, M = (4, 256, 384, 512) if interpret else (8, 1024, 1024, 8192)
    x = jnp.ones((M, K), jnp.bfloat16)
    w = jnp.ones((G, K, N), jnp.bfloat16)
    dy = jnp.ones((M, N), jnp.bfloat16)
    kw = dict(interpret=interpret, generation=generation)
    run = lambda offs: (tp.gmm(x, w, offs, None, **kw), tp.tgmm(x, dy, offs, transpose_a=True, **kw))  # noqa: E731
    # Group ends made on the host: a jnp op here would count its own compilation.
    partitions = [np.cumsum(_split(M, G, seed)).astype(np.int32) for seed in range(4)]
    partitions.append(np.full((G,), M // 2, np.int32))  # every row in group 0, the rest past offs[-1]
    jax.block_until_ready(run(jnp.asarray(partitions[0])))
    count = [0]

    def listen(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            count[0] += 1

    jax.monitoring.register_event_duration_secs_listener(listen)
    for offs in partitions[1:]:
        jax.block_until_ready(run(jnp.asarray(offs)))
    return count[0]


def failures(report: dict) -> list:
    """Why the run fails, one line each (the exit status is 1 unless this is empty): the suite
    failed or timed out (returncode None), the benchmarks raised, a case raised as a whole, our
    kernel (``ours``) differs from ragged_dot or raised, ours was timed with nothing to check
    it against (ragged_dot raised), or new group sizes recompiled. Not a peer raising otherwise,
    nor a case not started for the time budget (``not_run``)."""
    out = []
    if "suite" in report and report["suite"]["returncode"] != 0:
        out.append(f"suite: {report['suite']['summary']}")
    if "benchmark_error" in report:
        out.append("the benchmarks raised")
    for row in report.get("benchmarks", []):
        where = f"{row['model']} G={row['G']} M={row['M']} K={row['K']} N={row['N']}"
        if "op" not in row:
            out.append(f"{where}: the case raised")
            continue
        if row.get("ours_correct") is False:
            diff = row["ours_rel_diff"]
            out.append(f"{where} {row['op']}: ours differs from ragged_dot by "
                       + ("a result that is not finite" if diff is None else f"{diff}"))
        if "ours_error" in row:
            out.append(f"{where} {row['op']}: ours raised {row['ours_error']}")
        elif "ours_correct" not in row:  # its time would be published unchecked
            out.append(f"{where} {row['op']}: ours not checked: ragged_dot raised {row.get('ragged_dot_error')}")
    if report.get("recompiles_on_new_group_sizes"):
        out.append(f"{report['recompiles_on_new_group_sizes']} compilations for new group sizes")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="output directory")
    ap.add_argument("--no-suite", action="store_true", help="skip the property suite")
    ap.add_argument("--interpret", action="store_true", help="CPU smoke run: tiny shapes, interpreted")
    ap.add_argument("--list", action="store_true", help="print the benchmark cases and exit")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--suite-s", type=float, default=300.0, help="at most this long for the property suite (s)")
    ap.add_argument("--bench-s", type=float, default=300.0,
                    help="no new benchmark case starts after this many seconds of benchmarks")
    args = ap.parse_args(argv)
    if args.list:
        for case in cases(args.interpret):
            print(dict(zip(("model", "G", "K", "N", "M"), case)))
        return 0
    if args.out is None:
        ap.error("--out is required")
    args.out.mkdir(parents=True, exist_ok=True)
    import jax

    device = jax.devices()[0]
    if device.platform != "tpu" and not args.interpret:
        print(f"jax's device is {device.platform}, not a TPU; use --interpret for a CPU smoke run", file=sys.stderr)
        return 2
    report = {"host": platform.node(), "python": platform.python_version(), "jax": jax.__version__,
              "device_kind": device.device_kind, "interpret": args.interpret,
              "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    _write(args.out, report)
    if not args.no_suite and not args.interpret:
        run_suite(args.out, report, args.suite_s)
        _write(args.out, report)
    try:
        run_benchmarks(args.out, report, args.interpret, args.reps, args.bench_s)
    except Exception:
        report["benchmark_error"] = traceback.format_exc()[-3000:]
    report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    report["failures"] = failures(report)
    _write(args.out, report)
    keys = ("suite", "recompiles_on_new_group_sizes", "benchmark_error", "failures")
    print(json.dumps({k: report.get(k) for k in keys}))
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())

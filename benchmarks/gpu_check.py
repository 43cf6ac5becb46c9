"""One blind run on a CUDA machine: the property suite on the device, then MoE benchmarks, as JSON.

Usage, from anywhere (nothing is installed; the repository is put on sys.path):

    python3 benchmarks/gpu_check.py --out "$OUT"          # suite + benchmarks, < 5 minutes
    python3 benchmarks/gpu_check.py --out DIR --no-suite  # benchmarks only
    python3 benchmarks/gpu_check.py --list                # the benchmark cases, no GPU needed

Needs torch with CUDA and triton (tested against torch 2.13 / triton 3.9 here; written for
torch >= 2.9 and triton >= 3.4 too); the suite needs pytest and hypothesis. Writes
``gpu_check.json`` (updated after every step, so a run cut short keeps what it measured),
``pytest.log`` and ``pytest.xml`` into the output directory.

Phase 1, the suite: ``pytest tests --ignore=tests/test_cuda_blackwell.py -k "cuda and not
compile and not interpreter"`` with MOE_OPS_REQUIRE_BACKENDS=cuda: the shared property suite for
the implementations "cuda" (the backend's kernel on the GPU through run_here) and "op@cuda" (the
whole op on CUDA tensors), the selection tests and tests/test_cuda_device.py (no host sync,
CUDA-graph capture, autograd, results past 2^31 elements). test_cuda_blackwell.py is
ahead-of-time compiles and planning, which CI runs; on an sm_100 GPU with nvidia-cutlass-dsl
installed the property suite reaches the Blackwell kernel through the op. Hypothesis draws
``--examples`` examples per property (this file is also loaded as a pytest plugin,
``-p gpu_check``, to set that), because every new argument specialisation costs a Triton
compile.

Phase 2, benchmarks, bf16: for each MoE shape (Mixtral 8x7B, DeepSeek-V3, Qwen3-30B-A3B expert
GEMMs) and M routed rows, forward (2Dx3D) and forward+backward (adds 2Dx3D with mat_b
transposed and the 2Dx2D weight gradient) of
  * moe_ops.grouped_mm (the registered CUDA kernel, through the op),
  * torch._grouped_mm (CUTLASS on sm_90/sm_100),
  * a loop of torch.mm over the groups (host-side group bounds computed once, outside timing:
    the loop's best case; a real loop syncs to read offs),
  * dense torch.mm with the same FLOPs ([M, K] @ [K, N]), the throughput ceiling.
With ``--variants tma,launch-cache,tma+launch-cache`` the op is also timed with the CUDA
backend's opt-ins (TMA operand copies, the launch cache; VARIANTS), each as one more
implementation "moe_ops (name)" on the same tensors, with its speedup over the default in
"variant_speedup". Group sizes are a Dirichlet(1) split of M in multiples of 16 rows (seeded). Each result is
checked against the loop before it is timed (one that fails, NaN included, gets no speedups, and
"goals" says "moe_ops correct": false). Times are medians of CUDA-event timings.

"goals" has, per case, a verdict on every issue #3 target that applies to it: true, false, or
null where it could not be judged (a peer raised, failed its check or was not run). Exit status:
1 when the suite failed, timed out or could not run (pytest or hypothesis missing), or the op
failed its check or raised in a benchmark; 2 without a CUDA device; else 0 (a target not met,
or a case cut by the budget, is data).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]

# name: (G experts, K = hidden size, N = expert intermediate size) of the first expert GEMM.
MODELS = {
    "mixtral-8x7b": (8, 4096, 14336),
    "deepseek-v3": (256, 7168, 2048),
    "qwen3-30b-a3b": (128, 2048, 768),
}
# M, routed rows (tokens x top-k) per grouped GEMM. The middle size goes first so that a run cut
# short by its time budget still has every model.
TOKENS = (16384, 65536, 4096)
ALIGN = 16
# The CUDA backend's opt-ins (off by default until measured) that --variants times next to the
# default op, in the same process on the same tensors: the environment each sets, and whether
# the launch cache is on.
VARIANTS = {
    "tma": ({"MOE_OPS_CUDA_TMA": "1"}, False),
    "launch-cache": ({}, True),
    "tma+launch-cache": ({"MOE_OPS_CUDA_TMA": "1"}, True),
}
# Issue #3's goals when measured on Hopper or Blackwell.
LARGE_EXPERT_MODELS = ("mixtral-8x7b", "deepseek-v3")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "bench-out"),
                   help="directory for gpu_check.json, pytest.log, pytest.xml (default: $OUT or bench-out)")
    p.add_argument("--budget-s", type=float, default=280.0, help="wall-clock budget of the whole run (s)")
    # The suite's defaults are the H200 run of 2026-11-30 (5 examples, 170 s; the suite took 119 s
    # with the tests after test_cuda_gpu_check.py at 60 examples): 20 examples had never run on a
    # GPU and would likely pass --suite-s and report the suite as timed out.
    p.add_argument("--suite-s", type=float, default=170.0,
                   help="at most this long for the test suite (s)")
    p.add_argument("--examples", type=int, default=5, help="hypothesis examples per property test")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of " + ", ".join(MODELS))
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated routed-row counts M")
    p.add_argument("--variants", default="", help="comma-separated opt-ins to time next to moe_ops: "
                   + ", ".join(VARIANTS) + " (the suite runs with the environment as given)")
    p.add_argument("--no-suite", action="store_true", help="skip the test suite")
    p.add_argument("--no-bench", action="store_true", help="skip the benchmarks")
    p.add_argument("--list", action="store_true", help="print the benchmark cases and exit")
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        p.error(f"unknown model(s) {unknown}; known: {list(MODELS)}")
    args.tokens = [int(t) for t in args.tokens.split(",") if t]
    args.variants = [v for v in args.variants.split(",") if v]
    if any(v not in VARIANTS for v in args.variants):
        p.error(f"--variants: known ones are {', '.join(VARIANTS)}")
    if any(t < ALIGN or t % ALIGN for t in args.tokens):
        p.error(f"--tokens must be positive multiples of {ALIGN}")
    return args


def cases(models, tokens) -> list:
    """The benchmark cases, in run order: [{"model", "G", "K", "N", "M"}]."""
    return [dict(model=m, G=MODELS[m][0], K=MODELS[m][1], N=MODELS[m][2], M=t) for t in tokens for m in models]


def group_sizes(M: int, G: int, seed: int = 0, align: int = ALIGN) -> list:
    """G group sizes, multiples of ``align``, summing to M: a Dirichlet(1) split (empty groups occur)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    units = M // align
    weights = -torch.log(torch.rand(G, generator=gen, dtype=torch.float64))  # Exp(1) -> Dirichlet(1)
    counts = torch.floor(weights / weights.sum() * units).to(torch.int64)
    counts[torch.argmax(weights)] += units - int(counts.sum())
    return [int(c) * align for c in counts]


def flops(case: dict, direction: str) -> float:
    """Useful FLOPs: 2*M*K*N forward; backward adds d mat_a and d mat_b (2x the forward)."""
    forward = 2.0 * case["M"] * case["K"] * case["N"]
    return forward if direction == "forward" else 3.0 * forward


class Report:
    """The JSON document, rewritten after every step."""

    def __init__(self, out_dir: Path):
        self.path = Path(out_dir) / "gpu_check.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.data = {"script": "benchmarks/gpu_check.py", "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                     "complete": False}

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(_strict(self.data), indent=2, default=str, allow_nan=False))
        tmp.replace(self.path)


def _strict(value):
    """value with every non-finite float as the string "inf", "-inf" or "nan" (a NaN result's
    error is inf; json.dumps wrote it as Infinity, which strict JSON readers such as jq reject)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


def moe_ops_env() -> dict:
    """The MOE_OPS_* variables in force (the opt-ins MOE_OPS_CUDA_TMA, MOE_OPS_CUDA_LAUNCH_CACHE,
    ...), recorded with every GPU result so that A/B runs can be told apart."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("MOE_OPS_")}


def environment() -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "cuda_available": torch.cuda.is_available(),
           "moe_ops_env": moe_ops_env()}
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception as e:  # the run continues: the op then uses the reference
        env["triton"] = f"not importable: {e}"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, capability=f"sm_{props.major}{props.minor}", sms=props.multi_processor_count,
                   memory_gib=round(props.total_memory / 2**30, 1))
    return env


# ----------------------------------------------------------------------------------------------
# Phase 1: the test suite on the device


def pytest_configure(config):
    """Pytest plugin hook (``-p gpu_check``): fewer hypothesis examples, set by the parent run."""
    examples = os.environ.get("MOE_OPS_GPU_CHECK_EXAMPLES")
    if not examples:
        return
    from hypothesis import settings

    try:
        parent = settings.get_profile("ci")
    except Exception:
        parent = settings.default
    settings.register_profile("gpu-check", parent=parent, max_examples=int(examples))
    settings.load_profile("gpu-check")


def run_suite(out_dir: Path, timeout_s: float, examples: int) -> dict:
    missing = [m for m in ("pytest", "hypothesis") if not _importable(m)]
    if missing:
        return {"status": "skipped", "reason": f"not installed: {', '.join(missing)}"}
    log_path, xml_path = out_dir / "pytest.log", out_dir / "pytest.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfEs", "tests", "--ignore=tests/test_cuda_blackwell.py",
           "-k", "cuda and not compile and not interpreter",
           "-p", "gpu_check", "-p", "no:cacheprovider", "--durations=25", f"--junitxml={xml_path}"]
    env = dict(os.environ, MOE_OPS_REQUIRE_BACKENDS="cuda", MOE_OPS_GPU_CHECK_EXAMPLES=str(examples),
               PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "benchmarks"), os.environ.get("PYTHONPATH", "")]))
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=max(timeout_s, 10))
        except subprocess.TimeoutExpired:
            # SIGINT first: pytest then stops like on Ctrl-C and still writes its summary,
            # the FAILED lines and pytest.xml (a SIGKILL left only the log's tail).
            rc = None
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    result = {"command": " ".join(cmd), "returncode": rc, "seconds": round(time.perf_counter() - start, 1)}
    result.update(suite_outcome(rc, log_path.read_text(errors="replace")))
    return result


def suite_outcome(rc: Optional[int], text: str) -> dict:
    """pytest's exit status (None: stopped at the time limit) and log as run_suite's "status"
    ("passed" only for 0; 5, no test collected, is "failed"), "summary" (the counts of the last
    line) and, unless it passed, "failures" and "log_tail"."""
    summary = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", text.splitlines()[-1] if text else "")}
    result = {"summary": summary, "status": "timeout" if rc is None else ("passed" if rc == 0 else "failed")}
    if rc != 0:
        result["failures"] = [line for line in text.splitlines() if line.startswith(("FAILED", "ERROR"))][:40]
        result["log_tail"] = text[-4000:]
    return result


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


# ----------------------------------------------------------------------------------------------
# Phase 2: benchmarks


def _time_ms(fn, device, budget_s: float = 0.4, max_reps: int = 25) -> float:
    """Median time of one call in ms: warm-up (compiles), then timings of batches of calls long
    enough (>= ~1 ms) that launch gaps do not dominate small problems. CUDA events on a GPU;
    the wall clock on CPU (used only by the CPU test of this script)."""
    import torch

    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    fn()
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    once = time.perf_counter() - t0
    inner = max(1, min(50, int(1e-3 / max(once, 1e-6))))
    times = []
    start = time.perf_counter()
    while len(times) < 3 or (len(times) < max_reps and time.perf_counter() - start < budget_s):
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / inner)
        else:
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            times.append((time.perf_counter() - t0) * 1e3 / inner)
    return statistics.median(times)


@contextlib.contextmanager
def variant(name: Optional[str]):
    """The opt-ins of VARIANTS[name] in force inside the block (None: the defaults as given),
    the environment and the launch cache restored after."""
    if name is None:
        yield
        return
    env, launch_cache = VARIANTS[name]
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    tk = None
    if launch_cache:
        from moe_ops.backends.cuda import triton_kernels as tk

        before = tk._launch_cache_on
        tk.use_launch_cache(True)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if tk is not None:
            tk.use_launch_cache(before)


def _release_cache() -> Optional[str]:
    """torch.cuda.empty_cache(), or why it failed: after an illegal address every CUDA call
    raises, and the entry that caused it already says why."""
    import torch

    try:
        torch.cuda.empty_cache()
    except Exception as e:
        return f"{type(e).__name__}: {e}"[:500]
    return None


# Largest _rel_err that passes: bf16 results of fp32 sums, a few bf16 roundings (2^-8 each)
# apart. gpu_tile_sweep.py and neuron_check.py import it; tpu_check.py (jax only) has its twin.
REL_ERR_LIMIT = 2e-2


def _rel_err(x, ref, chunk: int = 1 << 26) -> float:
    """max |x - ref| / max |ref|, in fp32 a chunk of elements at a time: DeepSeek-V3's weight
    gradient is 3.8e9 elements (7 GiB in bf16), and four whole fp32 copies of it did not fit
    beside the operands on an 80 GB GPU."""
    import torch

    x, ref = x.detach().reshape(-1), ref.detach().reshape(-1)
    err = top = 0.0
    for s in range(0, x.numel(), chunk):
        xs, rs = x[s:s + chunk].float(), ref[s:s + chunk].float()
        e = float((xs - rs).abs().max())
        # A NaN in either: inf, so that every threshold test (< or >) calls it wrong. Python's
        # max(err, nan) keeps err, which reported a result full of NaN as exact; and x is asked
        # for finiteness itself, since XLA's fused max reduction drops NaN (tpu_check.py saw a
        # result with NaN rows come out exact) and neuron_check.py calls this on XLA devices.
        if math.isnan(e) or not bool(torch.isfinite(xs).all()):
            return math.inf
        err = max(err, e)
        top = max(top, float(rs.abs().max()))
    return err / max(top, 1e-12)


def bench_case(case: dict, seed: int = 0, device: str = "cuda", budget_s: float = 0.4, variants=(),
               deadline: Optional[float] = None) -> dict:
    """Check and time one case (see the module docstring); every failure is recorded, not raised.
    variants: names of VARIANTS, each timed as one more implementation "moe_ops (name)".
    deadline: a time.perf_counter() value past which no further implementation starts."""
    import torch

    import moe_ops

    dev, dtype = torch.device(device), torch.bfloat16
    G, K, N, M = case["G"], case["K"], case["N"], case["M"]
    sizes = group_sizes(M, G, seed)
    ends = torch.tensor(sizes).cumsum(0)
    offs = ends.to(device=dev, dtype=torch.int32)
    gen = torch.Generator(device=dev).manual_seed(seed)
    a = (torch.randn(M, K, device=dev, generator=gen) * K ** -0.5).to(dtype)
    b = torch.randn(G, K, N, device=dev, generator=gen).to(dtype)
    w = torch.randn(K, N, device=dev, generator=gen).to(dtype)
    dy = (torch.randn(M, N, device=dev, generator=gen) * N ** -0.5).to(dtype)
    result = dict(case, group_sizes={"min": min(sizes), "max": max(sizes), "empty": sizes.count(0)},
                  flops_forward=flops(case, "forward"), impls={})

    def loop(x, y):
        # unbind, not y[g]: the backward of G selects adds G zero-filled [G, K, N] gradients
        # (H200, DeepSeek-V3 shapes: ~2 s per backward); unbind's backward stacks them once.
        # split, not x[s:e], for the same reason on mat_a's side (G zero-filled [M, K] slices).
        return torch.cat([xs @ w for w, xs in zip(y.unbind(0), x.split(sizes))])

    # torch._grouped_mm gets mat_b row-major if it takes it, else column-major ([G, N, K] storage
    # viewed as [G, K, N]), decided once, outside the timings.
    b_torch = b
    try:
        torch._grouped_mm(a, b, offs=offs)
    except Exception as e:
        result["torch._grouped_mm row-major mat_b"] = f"{type(e).__name__}: {e}"[:300]
        b_torch = b.transpose(1, 2).contiguous().transpose(1, 2)

    forward = {  # name: (function, mat_a, mat_b)
        "moe_ops": (lambda x, y: moe_ops.grouped_mm(x, y, offs), a, b),
        "torch._grouped_mm": (lambda x, y: torch._grouped_mm(x, y, offs=offs), a, b_torch),
        "loop_torch.mm": (loop, a, b),
        "dense_torch.mm": (lambda x, y: x @ y, a, w),
    }
    variant_of = {f"moe_ops ({v})": v for v in variants}
    for name in variant_of:
        forward[name] = forward["moe_ops"]
    # Correctness first, against the loop (bf16 matmuls with fp32 accumulation).
    ref_leaves = [a.clone().requires_grad_(True), b.clone().requires_grad_(True)]
    ref_out = loop(*ref_leaves)
    ref_grads = torch.autograd.grad(ref_out, ref_leaves, dy)
    # Detached, the graph (which holds the leaves, a copy of the weights) goes with the leaves.
    ref_out = ref_out.detach()
    del ref_leaves
    moe_ops.reset_kernel_counts()
    for name, (f, x, y) in forward.items():
        entry = result["impls"][name] = {}
        if deadline is not None and time.perf_counter() > deadline:
            entry["error"] = "not run: the time budget was spent"
            continue
        try:
            with variant(variant_of.get(name)):
                _check_and_time(entry, f, x, y, name not in ("loop_torch.mm", "dense_torch.mm"),
                                ref_out, ref_grads, dy, case, dev, budget_s)
        except Exception as e:  # one baseline failing (e.g. _grouped_mm on an older GPU) is data
            entry["error"] = f"{type(e).__name__}: {e}"[:500]
        if dev.type == "cuda" and (why := _release_cache()):
            entry.setdefault("error", f"after the run: {why}")
        if name == "moe_ops":
            result["moe_ops_kernels"] = moe_ops.kernel_counts()
    speedups(result, variants)
    return result


def speedups(result: dict, variants=()) -> None:
    """result["speedup_vs"][peer][phase]: the peer's time over moe_ops' (> 1: moe_ops is faster),
    and result["variant_speedup"][v][phase]: moe_ops' default time over the variant's, from
    result["impls"] (bench_case's entries), phase "forward" or "backward"."""
    ours = result["impls"]["moe_ops"]
    for name in ("torch._grouped_mm", "loop_torch.mm", "dense_torch.mm"):
        other = result["impls"][name]
        if ours.get("correct") is False or other.get("correct") is False:
            continue  # the time of a wrong result is no speed (goals() says why they are missing)
        for phase in ("forward_ms", "backward_ms"):
            if phase in ours and phase in other:
                result.setdefault("speedup_vs", {}).setdefault(name, {})[phase[:-3]] = other[phase] / ours[phase]
    for v in variants:
        other = result["impls"][f"moe_ops ({v})"]
        if ours.get("correct") is False or other.get("correct") is False:
            continue
        for phase in ("forward_ms", "backward_ms"):
            if phase in ours and phase in other:
                result.setdefault("variant_speedup", {}).setdefault(v, {})[phase[:-3]] = ours[phase] / other[phase]


def _check_and_time(entry, f, x, y, check, ref_out, ref_grads, dy, case, dev, budget_s) -> None:
    """One implementation of bench_case into entry: checked against the loop (check), then its
    forward and forward + backward timed."""
    import torch

    if check:
        leaves = [x.clone().requires_grad_(True), y.clone().requires_grad_(True)]
        out = f(*leaves)
        grads = torch.autograd.grad(out, leaves, dy)
        entry["rel_err"] = {"out": _rel_err(out, ref_out), "d_mat_a": _rel_err(grads[0], ref_grads[0]),
                            "d_mat_b": _rel_err(grads[1], ref_grads[1])}
        entry["correct"] = all(v < REL_ERR_LIMIT for v in entry["rel_err"].values())
        del out, grads, leaves
    entry["forward_ms"] = _time_ms(lambda: f(x, y), dev, budget_s)
    params = [x.clone().requires_grad_(True), y.clone().requires_grad_(True)]
    entry["forward_backward_ms"] = _time_ms(lambda: torch.autograd.grad(f(*params), params, dy), dev, budget_s)
    entry["forward_tflops"] = flops(case, "forward") / entry["forward_ms"] * 1e-9
    backward = entry["forward_backward_ms"] - entry["forward_ms"]
    if backward > 0:
        entry["backward_ms"] = backward
        entry["backward_tflops"] = 2 * flops(case, "forward") / backward * 1e-9
    else:  # the two medians' noise larger than the backward: no time, so no speedup or target from it
        entry["backward_unmeasured"] = f"forward + backward {entry['forward_backward_ms']} ms <= forward {entry['forward_ms']} ms"


def goals(results: list) -> dict:
    """Issue #3's targets, evaluated on what was measured (informational; for Hopper/Blackwell).
    Every target that applies to a case gets a verdict: True, False, or None where it could not
    be judged (moe_ops or the peer raised, failed its check or was not run), so that a missing
    measurement never reads as a target met. "moe_ops correct" (and "torch._grouped_mm correct"
    where it was checked) says whether the result passed the check against the loop, and "moe_ops
    on CUDA kernels" whether every call it made ran on one (kernel_counts)."""
    out = {}
    for r in results:
        s, impls = r.get("speedup_vs", {}), r.get("impls", {})

        def at_least(peer, phase, ratio):
            value = s.get(peer, {}).get(phase)
            return None if value is None else value >= ratio

        g = {"moe_ops correct": impls.get("moe_ops", {}).get("correct")}
        if "moe_ops_kernels" in r:
            # Its times are the CUDA kernels' only if no call fell back (to the reference, say):
            # the suite's MOE_OPS_REQUIRE_BACKENDS=cuda does not cover --no-suite runs.
            kernels = r["moe_ops_kernels"]
            g["moe_ops on CUDA kernels"] = all(k.startswith("cuda:") for k in kernels) if kernels else None
        if "correct" in impls.get("torch._grouped_mm", {}):
            g["torch._grouped_mm correct"] = impls["torch._grouped_mm"]["correct"]
        if r["model"] in LARGE_EXPERT_MODELS:
            g["forward >= 70% of dense"] = at_least("dense_torch.mm", "forward", 0.7)
        for phase in ("forward", "backward"):
            g[f"{phase} not slower than _grouped_mm"] = at_least("torch._grouped_mm", phase, 1.0)
        if r["G"] >= 128:
            g["forward >= 1.5x loop"] = at_least("loop_torch.mm", "forward", 1.5)
        out[f"{r['model']}@{r['M']}"] = g
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list:
        for c in cases(args.models, args.tokens):
            print(f"{c['model']:>14}  G={c['G']:<4} K={c['K']:<5} N={c['N']:<6} M={c['M']}")
        return 0
    deadline = time.perf_counter() + args.budget_s
    sys.path.insert(0, str(REPO))
    out_dir = Path(args.out)
    report = Report(out_dir)
    try:
        return _checks(args, report, deadline, out_dir)
    except BaseException:  # whatever stops the run (a CUDA error, Ctrl-C), the report says it
        report.data["error"] = traceback.format_exc()[-4000:]
        report.write()
        raise


def _checks(args, report, deadline: float, out_dir: Path) -> int:
    """main's work after the report exists: the environment, the suite, the benchmarks."""
    report.data["args"] = {k: v for k, v in vars(args).items() if k != "list"}
    report.data["environment"] = environment()
    report.write()
    import torch

    if not torch.cuda.is_available():
        report.data["error"] = "no CUDA device: nothing was run"
        report.write()
        print(f"gpu_check: no CUDA device; wrote {report.path}", file=sys.stderr)
        return 2
    import moe_ops
    from moe_ops import backends

    try:
        report.data["backends"] = [dataclasses.asdict(s) for s in backends.statuses()]
    except Exception:
        report.data["backends"] = {"error": traceback.format_exc()[-2000:]}
    report.write()
    if not args.no_suite:
        budget = min(args.suite_s, deadline - time.perf_counter() - 60)
        print(f"gpu_check: test suite (up to {budget:.0f} s)", flush=True)
        report.data["suite"] = run_suite(out_dir, budget, args.examples)
        report.write()
        print(f"gpu_check: suite {report.data['suite'].get('status')} {report.data['suite'].get('summary', '')}", flush=True)
    if not args.no_bench:
        results = report.data["benchmarks"] = []
        for case in cases(args.models, args.tokens):
            if time.perf_counter() > deadline - 15:
                report.data.setdefault("not_run", []).append(case)
                continue
            print(f"gpu_check: bench {case}", flush=True)
            try:
                results.append(bench_case(case, variants=args.variants, deadline=deadline - 10))
            except Exception:
                results.append(dict(case, error=traceback.format_exc()[-2000:]))
            if why := _release_cache():
                results[-1].setdefault("error_after", why)
            report.data["goals"] = goals([r for r in results if "impls" in r])
            report.write()
    report.data["complete"] = True
    report.data["kernel_counts"] = moe_ops.kernel_counts()
    report.write()
    print(f"gpu_check: wrote {report.path}")
    suite = report.data.get("suite", {})
    # The op (default or a --variants opt-in) failing its check against the loop, or raising
    # (an illegal address, a compile error; not "not run" for the time budget), fails the run
    # like a failed suite: before, the exit status was 0 and only the JSON said so.
    wrong = [f"{r['model']}@{r['M']} {name}" for r in report.data.get("benchmarks", [])
             for name, e in r.get("impls", {}).items()
             if name.startswith("moe_ops") and (e.get("correct") is False or (
                 "error" in e and not e["error"].startswith("not run")))]
    if wrong:
        print(f"gpu_check: the op failed its check or raised: {', '.join(wrong)}", file=sys.stderr)
    # A suite that could not run (pytest or hypothesis missing; not --no-suite) checked nothing.
    return 1 if suite.get("status") in ("failed", "timeout", "skipped") or wrong else 0


if __name__ == "__main__":
    sys.exit(main())

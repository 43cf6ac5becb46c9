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
Also timed: the per-call pieces of the CUDA path around the launcher (the ``torch.cuda.device``
switch, the output's ``torch.empty``), and the launcher, the op and its forward + backward with
the opt-in launch cache on (gpu_check's variant "launch-cache"; the other rows follow
MOE_OPS_CUDA_LAUNCH_CACHE).
Every piece's host time is also read while a sleep kernel holds the stream
(``host_us_while_gpu_busy``: a call that waits for the GPU shows milliseconds there), and every
piece that runs a kernel gets its device time with the host hidden (``gpu_us``: the calls are
queued behind a sleep kernel, so the events around them time the GPU alone) and gpu_check.py's
benchmark timing (``bench_ms``), so a host-bound benchmark row can be told from a slow kernel.

Where a forward + backward spends its host time: the backward's two calls timed directly
(input gradient: dy @ b[g]^T; weight gradient: a^T @ dy), a dense ``x @ w`` and a Python
``torch.autograd.Function`` around it (the engine's cost with and without Python in the
backward, which runs on the autograd engine's CUDA thread), and, for the op's forward + backward,
the time spent inside ``triton_kernels.grouped_mm`` and ``_contract.check_args`` per call on the
calling thread and on other threads (``inside``).

Writes ``overhead.json``, and ``overhead_profile.txt``: cProfile's 40 most expensive functions
(own time) over 300 forward calls of the op on the Qwen3 problem, and over 300 of its
weight-gradient calls.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import threading
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402

from gpu_check import _time_ms, group_sizes, moe_ops_env, variant  # noqa: E402


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


def gpu_us(fn, n: int = 20, sleep_ms: float = 5.0) -> dict:
    """Device time of one call with the host's cost hidden: a sleep kernel holds the stream
    while n calls are queued behind it, and events around the calls time their execution.
    ``hidden`` says whether queueing them took less than the sleep (else host time leaks in)."""
    fn()
    torch.cuda.synchronize()
    cycles = int(sleep_ms * 1e-3 * 1.98e9)  # H100/H200 boost clock; a lower clock sleeps longer
    sleep_begin, begin, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    sleep_begin.record()
    torch.cuda._sleep(cycles)
    begin.record()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    queued_ms = (time.perf_counter() - t0) * 1e3
    end.record()
    end.synchronize()
    return {"gpu_us": begin.elapsed_time(end) / n * 1e3, "hidden": queued_ms < sleep_begin.elapsed_time(begin)}


def host_us_while_busy(fn, n: int = 10, sleep_ms: float = 20.0) -> float:
    """Host time of one call while a sleep kernel holds the stream: a call that waits for the
    GPU (a synchronizing CUDA operation, a full launch queue) shows up as milliseconds here."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(sleep_ms * 1e-3 * 1.98e9))
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return host / n * 1e6


def _enter_and_exit(context) -> None:
    with context:
        pass


class _Inside:
    """Host time spent inside some functions, per call of a workload, split by thread (the
    calling thread, and any other: the autograd engine's CUDA thread runs the backward)."""

    def __init__(self, targets):
        self.targets, self.totals = targets, {}

    def __enter__(self):
        self.saved = [(mod, name, getattr(mod, name)) for mod, name in self.targets]
        main = threading.get_ident()
        for mod, name, fn in self.saved:
            def timed(*args, _fn=fn, _key=name, **kwargs):
                t0 = time.perf_counter()
                try:
                    return _fn(*args, **kwargs)
                finally:
                    where = "calling thread" if threading.get_ident() == main else "other threads"
                    key = f"{_key} on {where}"
                    total, calls = self.totals.get(key, (0.0, 0))
                    self.totals[key] = (total + time.perf_counter() - t0, calls + 1)
            setattr(mod, name, timed)
        return self

    def __exit__(self, *exc):
        for mod, name, fn in self.saved:
            setattr(mod, name, fn)

    def per_call(self, n: int) -> dict:
        return {k: {"us_per_workload_call": t / n * 1e6, "calls_per_workload_call": c / n}
                for k, (t, c) in self.totals.items()}


class _PythonMM(torch.autograd.Function):
    """x @ w with its backward in Python: the engine's cost of a Python node on the CUDA thread."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad @ w.t(), x.t() @ grad


def _write(doc: dict, out: str) -> None:
    """overhead.json, rewritten after every problem (a later failure keeps the earlier rows)."""
    path = Path(out) / "overhead.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))


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
           "triton": __import__("triton").__version__, "problems": {},
           "moe_ops_env": moe_ops_env()}
    for name, (G, M, K, N) in {"tiny": (4, 128, 64, 64), "qwen3-30b-a3b@4096": (128, 4096, 2048, 768)}.items():
        try:
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
            a_g, b_g = a.detach().requires_grad_(), b.detach().requires_grad_()
            ones = torch.ones(M, N, device="cuda", dtype=torch.bfloat16)
            # The backward's two calls, as the Autograd kernel makes them (2Dx3D forward).
            pieces["input-gradient call"] = lambda: moe_ops.grouped_mm(ones, b.transpose(1, 2), offs)
            pieces["weight-gradient call"] = lambda: moe_ops.grouped_mm(a.t(), ones, offs)
            pieces["torch.cuda.device(...) enter and exit"] = lambda: _enter_and_exit(torch.cuda.device(a.device))
            pieces["torch.empty of the output"] = lambda: torch.empty(M, N, device=a.device, dtype=a.dtype)
            host_only = ("check_args", "select", "torch.cuda.device(...) enter and exit", "torch.empty of the output")
            rows = doc["problems"][name] = {}

            def measure(k, fn):
                try:  # one piece that raises (torch._grouped_mm on sm_100 before torch 2.9, the
                    # never-run launch cache) costs its own row, not the problem's later rows
                    rows[k] = per_call_us(fn)
                    rows[k]["host_us_while_gpu_busy"] = host_us_while_busy(fn)
                    if k not in host_only:
                        rows[k].update(gpu_us(fn), bench_ms=_time_ms(fn, torch.device("cuda"), budget_s=0.2))
                except Exception as e:
                    rows[k] = {"row_error": f"{type(e).__name__}: {e}"[:1000]}

            for k, fn in pieces.items():
                measure(k, fn)
            with variant("launch-cache"):
                for k in ("triton_kernels.grouped_mm", "moe_ops.grouped_mm"):
                    measure(f"{k} (launch cache on)", pieces[k])

            def fwd_bwd(fn, x=a_g, y=b_g, **kw):
                return lambda: torch.autograd.grad(fn(x, y, **kw), (x, y), ones)

            before = _op._Autograd.active
            try:  # the kernel in use restored even when a row fails (the problems after use it)
                for kind in ("cpp", "python"):
                    try:
                        _op.use_autograd(kind)
                    except RuntimeError as e:
                        print(f"{name}: no {kind} Autograd kernel here ({e})", flush=True)
                        continue
                    workload = fwd_bwd(moe_ops.grouped_mm, offs=offs)
                    rows[f"fwd+bwd moe_ops ({kind} autograd)"] = per_call_us(workload, 50)
                    with _Inside([(tk, "grouped_mm"), (_contract, "check_args")]) as inside:
                        for _ in range(50):
                            workload()
                        torch.cuda.synchronize()
                    rows[f"fwd+bwd moe_ops ({kind} autograd)"]["inside"] = inside.per_call(50)
                    with variant("launch-cache"):
                        rows[f"fwd+bwd moe_ops ({kind} autograd, launch cache on)"] = per_call_us(workload, 50)
            finally:
                _op.use_autograd(before)
            try:  # Hopper-only before torch 2.9: not a reason to lose the rows after it
                rows["fwd+bwd torch._grouped_mm"] = per_call_us(fwd_bwd(torch._grouped_mm, offs=offs), 50)
            except Exception as e:
                rows["fwd+bwd torch._grouped_mm"] = {"row_error": f"{type(e).__name__}: {e}"[:1000]}
            # Baselines for the engine: one dense product of the same rows, with C++ and Python nodes.
            x_g = a.detach().requires_grad_()
            w_g = b[0].detach().requires_grad_()
            rows["fwd+bwd dense x @ w"] = per_call_us(fwd_bwd(torch.matmul, x_g, w_g), 50)
            rows["fwd+bwd dense x @ w (Python autograd.Function)"] = per_call_us(fwd_bwd(_PythonMM.apply, x_g, w_g), 50)
            for k, v in rows.items():
                if "row_error" in v:
                    print(f"{name:>20} {k:>46}: {v['row_error']}", flush=True)
                    continue
                extra = f", gpu {v['gpu_us']:8.1f} us{'' if v['hidden'] else ' (host not hidden)'}, bench {v['bench_ms'] * 1e3:8.1f} us" if "gpu_us" in v else ""
                busy = f", host while busy {v['host_us_while_gpu_busy']:8.1f} us" if "host_us_while_gpu_busy" in v else ""
                print(f"{name:>20} {k:>46}: host {v['host_us']:8.1f} us, host+gpu {v['host_and_gpu_us']:8.1f} us{busy}{extra}",
                      flush=True)
                for where, t in v.get("inside", {}).items():
                    print(f"{'':>20} {'inside ' + where:>46}: {t['us_per_workload_call']:8.1f} us in "
                          f"{t['calls_per_workload_call']:.0f} calls", flush=True)
        except Exception:  # a failure (e.g. in the never-run launch cache) costs this problem's
            # remaining rows only: what was measured stays, with the traceback beside it
            doc["problems"].setdefault(name, {})["error"] = traceback.format_exc()[-3000:]
            print(f"{name}: {doc['problems'][name]['error']}", flush=True)
        finally:
            _write(doc, args.out)
    if any("error" in rows for rows in doc["problems"].values()):
        return 1  # the profile below is of the last problem's calls, which did not all run
    text = io.StringIO()
    # The last problem of the loop above: Qwen3 at 4096 rows.
    for title, fn in (("forward", pieces["moe_ops.grouped_mm"]), ("weight-gradient call", pieces["weight-gradient call"])):
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(300):
            fn()
        torch.cuda.synchronize()
        profiler.disable()
        text.write(f"=== {title}: 300 calls\n")
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
    (Path(args.out) / "overhead_profile.txt").write_text(text.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Check moe_ops on a Trainium machine with the Neuron SDK: property suite natively, then benchmarks.

Never run on Trainium by its authors (no Neuron machine was available); it is the script to run
when one is. Usage, from the repository root:

    python benchmarks/neuron_check.py --out neuron_check.json            # Trainium, SDK installed
    python benchmarks/neuron_check.py --device cpu --quick --out x.json   # plumbing check anywhere

Steps, each recorded in the JSON:
1. environment: versions of torch, torch_neuronx, torch_xla, nki, neuronx-cc; the device used
   (TorchNeuron's "neuron" device, else torch-neuronx's XLA device) and which Neuron kernel the op
   reports (``moe_ops.kernel_counts``: "neuron:nki" / "xla:neuron-nki" = the NKI kernels,
   "...blockwise" = the block-wise PyTorch path, "reference" = not served);
2. the shared property cases (tests/strategies.py) run through ``moe_ops.grouped_mm`` on the
   device and compared with the float64 oracle under the one tolerance rule, plus the NKI kernel
   tests on AWS's nki.simulate (``pytest tests/test_neuron_nki.py -m nki_simulate``);
3. forward (2D x 3D), input gradient (2D x 3D, transposed weights) and weight gradient (2D x 2D)
   timed against a dense matmul with the same FLOPs on the same device (medians of --iters runs
   after warm-up); group sizes from a Dirichlet(1) split. Each result is first checked against
   ``moe_ops.reference`` on the device (max error / max |reference| <= 2e-2, not finite fails);
   one that fails is not timed, and is recorded as an error.
The JSON (default $OUT/neuron_check.json when $OUT is set) is rewritten after every step, a step
that raises is recorded there, and the steps are bounded (--cases-s, --simulate-s). The exit status
is 1 when a step raised, a property case failed, the nki.simulate tests failed or timed out,
a timed grouped matmul raised or failed its check (the dense baseline raising is recorded only),
or, on a Neuron device, a timed case was served by anything but a Neuron kernel (NKI or the
block-wise path): then its times are not moe_ops' Neuron kernels' (JSON "not_on_neuron").
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import moe_ops  # noqa: E402
from gpu_check import REL_ERR_LIMIT, _rel_err  # noqa: E402  (device-agnostic, chunked; gpu_tile_sweep.py's too)
from moe_ops import testing  # noqa: E402

SHAPES = [  # (G, M, K, N): the CPU baseline cases of shared/notes/toolchains.md, and a large-expert one
    (8, 4096, 1024, 2048),
    (64, 2048, 512, 512),
    (8, 16384, 4096, 1024),
]


def _version(module: str):
    try:
        return getattr(importlib.import_module(module), "__version__", "unknown")
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        return f"not importable: {type(e).__name__}: {e}"


def pick_device(requested: str | None):
    """TorchNeuron's "neuron" device, else a torch-neuronx XLA device, else what was requested."""
    if requested:
        return torch.device(requested)
    try:
        importlib.import_module("torch_neuronx")
    except Exception:  # noqa: BLE001
        pass
    if torch._C._get_privateuse1_backend_name() == "neuron":
        return torch.device("neuron")
    try:
        xm = importlib.import_module("torch_xla.core.xla_model")
        device = xm.xla_device()
        if xm.xla_device_hw(device).upper() == "NEURON":
            return device
    except Exception:  # noqa: BLE001
        pass
    raise SystemExit("no Neuron device found (TorchNeuron or torch-neuronx); pass --device cpu for a plumbing check")


def synchronize(device, result):
    if device.type == "xla":
        xm = importlib.import_module("torch_xla.core.xla_model")
        # torch_xla.sync() is new (2.5-ish); torch-neuronx's older torch_xla has only mark_step.
        getattr(importlib.import_module("torch_xla"), "sync", xm.mark_step)()
        xm.wait_device_ops()
    elif device.type != "cpu":
        try:
            torch.accelerator.synchronize(device)
        except Exception:  # noqa: BLE001 - fall back to a host read
            result.reshape(-1)[:1].cpu()


def property_cases(device, examples: int, budget_s: float = float("inf")) -> dict:
    from hypothesis import HealthCheck, given, settings

    from oracle import magnitude, oracle
    from strategies import build, cases

    report = {"examples": 0, "failures": [], "kernels": {}, "skipped_for_time": 0}
    # Natively every new shape is a neuronx-cc compile: the cases drawn after budget_s are
    # counted, not run, so that the benchmarks still get their share of the loan.
    deadline = time.perf_counter() + budget_s

    @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(case=cases(dtypes=(torch.float32, torch.bfloat16, torch.float16)))
    def run(case):
        if time.perf_counter() > deadline:
            report["skipped_for_time"] += 1
            return
        a, b, offs, bias, out_dtype = build(case)
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        moe_ops.reset_kernel_counts()
        try:
            out = moe_ops.grouped_mm(move(a), move(b), move(offs), move(bias), out_dtype).cpu()
            testing.assert_close(out, oracle(a, b, offs, bias, out_dtype), oracle(a, b, offs, bias, out_dtype, exact=False),
                                 magnitude(a, b, offs, bias), what=str(case))
        except Exception as e:  # noqa: BLE001 - every failure is recorded
            report["failures"].append(f"{type(e).__name__}: {e}"[:2000])
        for k, v in moe_ops.kernel_counts().items():
            report["kernels"][k] = report["kernels"].get(k, 0) + v
        report["examples"] += 1

    run()
    return report


def nki_simulate_tests(timeout_s: float = 180.0) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", os.path.join(ROOT, "tests", "test_neuron_nki.py"), "-m", "nki_simulate"]
    try:  # bounded: a hung simulator must not eat the rest of the loan (the benchmarks run after it)
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        tail = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return {"command": " ".join(cmd[1:]), "returncode": None, "timed_out_after_s": timeout_s,
                "tail": tail[-3000:]}
    return {"command": " ".join(cmd[1:]), "returncode": done.returncode, "tail": done.stdout[-3000:]}


def _splits(total: int, G: int, gen) -> torch.Tensor:
    w = torch.distributions.Dirichlet(torch.ones(G)).sample()
    sizes = torch.floor(w * total).to(torch.int64)
    sizes[-1] += total - sizes.sum()
    return torch.cumsum(sizes, 0).to(torch.int32)


def _time(fn, device, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        synchronize(device, fn())
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        r = fn()
        synchronize(device, r)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# The kernel_counts names of the Neuron backend's kernels (moe_ops/backends/neuron.py): NKI and
# the block-wise path, on TorchNeuron's device and on torch-neuronx's XLA one.
NEURON_KERNELS = ("neuron:", "xla:neuron-")


def benchmarks(device, shapes, iters: int, dtype=torch.bfloat16) -> list:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for G, M, K, N in shapes:
        torch.manual_seed(0)
        offs = _splits(M, G, gen).to(device)
        x = torch.randn(M, K, dtype=dtype).to(device)
        w = torch.randn(G, K, N, dtype=dtype).to(device)
        dy = torch.randn(M, N, dtype=dtype).to(device)
        dense_a, dense_b = torch.randn(M, K, dtype=dtype).to(device), torch.randn(K, N, dtype=dtype).to(device)
        flops = 2.0 * M * K * N
        cases = {  # name: the op's arguments
            "forward 2d3d": (x, w, offs),
            "input grad 2d3d (w transposed)": (dy, w.transpose(1, 2), offs),
            "weight grad 2d2d": (x.t(), dy, offs),
        }
        try:  # the baseline failing must not cost the grouped rows
            dense = _time(lambda: torch.matmul(dense_a, dense_b), device, iters)
        except Exception as e:  # noqa: BLE001
            dense = None
            rows.append({"case": "dense", "G": G, "M": M, "K": K, "N": N, "error": f"{type(e).__name__}: {e}"})
        for name, args in cases.items():
            def fn(args=args):
                return moe_ops.grouped_mm(*args)

            try:
                # Checked against the reference before it is timed (the property cases check
                # small shapes only): a wrong result at these sizes is a failure, not a time.
                err = _rel_err(fn(), moe_ops.reference.grouped_mm(*args))  # inf if not finite
                if not err <= REL_ERR_LIMIT:  # not '>': NaN must fail
                    raise AssertionError(f"wrong result: max error {err:.2e} of the reference's largest value")
                moe_ops.reset_kernel_counts()
                t = _time(fn, device, iters)
                rows.append({"case": name, "G": G, "M": M, "K": K, "N": N, "dtype": str(dtype), "seconds": t,
                             "dense_seconds": dense, "x_dense": t / dense if dense else None,
                             "tflops": flops / t / 1e12,
                             "kernels": moe_ops.kernel_counts()})
            except Exception as e:  # noqa: BLE001
                rows.append({"case": name, "G": G, "M": M, "K": K, "N": N, "error": f"{type(e).__name__}: {e}",
                             "traceback": traceback.format_exc()[-2000:]})
    return rows


def _step(result: dict, name: str, out: str, fn) -> None:
    """result[name] = fn(), or the traceback if it raised; the JSON is rewritten after every step,
    so a crash or a cut-off loan keeps what the earlier steps measured."""
    try:
        result[name] = fn()
    except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt/SystemExit too: write, then re-raise
        result[name] = {"error": f"{type(e).__name__}: {e}"[:2000], "traceback": traceback.format_exc()[-3000:]}
        if not isinstance(e, Exception):
            _write(result, out)
            raise
    _write(result, out)


def _write(result: dict, out: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=2, default=str)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # $OUT is the folder that comes back from a lent machine; a file in the cwd would not.
    ap.add_argument("--out", default=os.path.join(os.environ["OUT"], "neuron_check.json") if os.environ.get("OUT")
                    else "neuron_check.json")
    ap.add_argument("--device", default=None, help="override the device (e.g. cpu for a plumbing check)")
    ap.add_argument("--examples", type=int, default=60, help="property cases to draw")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--cases-s", type=float, default=240.0, help="no property case starts after this long (s)")
    ap.add_argument("--simulate-s", type=float, default=180.0, help="at most this long for the nki.simulate tests")
    ap.add_argument("--quick", action="store_true", help="tiny shapes and few examples (plumbing check)")
    args = ap.parse_args(argv)
    device = pick_device(args.device)
    shapes = [(4, 512, 128, 256)] if args.quick else SHAPES
    examples, iters = (5, 2) if args.quick else (args.examples, args.iters)
    result = {}

    def environment():
        statuses = [s.detail for s in moe_ops.backends.statuses() if s.name == "neuron"]
        return {"python": platform.python_version(), "machine": platform.machine(), "device": str(device),
                "privateuse1": torch._C._get_privateuse1_backend_name(),
                **{m: _version(m) for m in ("torch", "torch_neuronx", "torch_xla", "nki", "neuronxcc")},
                "moe_ops": moe_ops.__version__, "neuron_status": statuses[0] if statuses else None}

    _step(result, "environment", args.out, environment)
    _step(result, "property_cases", args.out, lambda: property_cases(device, examples, args.cases_s))
    _step(result, "nki_simulate_tests", args.out, lambda: nki_simulate_tests(args.simulate_s))
    _step(result, "benchmarks", args.out, lambda: benchmarks(device, shapes, iters))
    p = result["property_cases"]
    failed = [k for k, v in result.items() if isinstance(v, dict) and "error" in v]
    # Before, these left the exit status 0 (only the JSON said so): the nki.simulate tests
    # failing or timing out (returncode None), and the op raising (or, now checked, being wrong)
    # in a benchmark.
    sim_rc = result["nki_simulate_tests"].get("returncode")
    bench = result["benchmarks"] if isinstance(result["benchmarks"], list) else []
    raised = [f"{r['case']} G={r['G']} M={r['M']} K={r['K']} N={r['N']}" for r in bench
              if r.get("case") != "dense" and "error" in r]
    # A timed case that fell back (to the reference, say) would publish another kernel's times as
    # the Neuron backend's; judged on a Neuron device only (--device cpu is a plumbing check).
    result["not_on_neuron"] = [] if device.type == "cpu" else [
        f"{r['case']} G={r['G']} M={r['M']} K={r['K']} N={r['N']}: {r['kernels']}" for r in bench
        if "seconds" in r and (not r["kernels"] or not all(k.startswith(NEURON_KERNELS) for k in r["kernels"]))]
    _write(result, args.out)
    print(f"{device}: {p.get('examples')} property cases, {len(p.get('failures', []))} failures, kernels "
          f"{p.get('kernels')}; nki.simulate tests rc={sim_rc}; "
          f"steps that raised: {failed}; benchmarks that raised or were wrong: {raised}; "
          f"timed off the Neuron kernels: {result['not_on_neuron']}; wrote {args.out}")
    for r in bench:
        print(f"  {r['case']:32s} G={r['G']} M={r['M']} K={r['K']} N={r['N']}: "
              + (f"{r['seconds'] * 1e3:.2f} ms, x{r['x_dense'] or float('nan'):.2f} dense, "
                 f"{r['kernels']}" if "seconds" in r
                 else r["error"]))
    return 1 if failed or p.get("failures") or sim_rc != 0 or raised or result["not_on_neuron"] else 0


if __name__ == "__main__":
    sys.exit(main())

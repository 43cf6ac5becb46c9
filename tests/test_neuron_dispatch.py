"""The Neuron backend's registrations, exercised on CPU tensors through the dispatcher.

Categories:
* PrivateUse1 renamed "neuron" (TorchNeuron's name; renaming is once per process, so in a
  subprocess): ``redispatch`` at the PrivateUse1 key runs the router and ``privateuse1_impl``,
  which takes the Neuron path (block-wise PyTorch here: no Neuron SDK) for 2D x 3D and 2D x 2D
  and falls back to the reference for what it does not serve;
* XLA: without torch_xla no device is a Neuron device; the XLA router reaches ``xla_impl`` when
  the device is one (forced here), and ``xla_impl``'s Neuron branch computes correctly;
* the package imports no Neuron toolchain and says why the NKI kernels are off.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import moe_ops
from moe_ops import _contract
from moe_ops.backends import neuron
from moe_ops.testing import assert_close
from oracle import magnitude, oracle

pytestmark = pytest.mark.backend_neuron


def _python(code: str, *argv: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *argv], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _cases():
    gen = torch.Generator().manual_seed(5)
    a = torch.randn(70, 24, generator=gen).to(torch.bfloat16)
    w = torch.randn(4, 16, 24, generator=gen).to(torch.bfloat16).transpose(1, 2)  # [G, K, N] view of [G, N, K]
    bias = torch.randn(4, 16, generator=gen).to(torch.bfloat16)
    offs = torch.tensor([10, 10, 45, 60], dtype=torch.int32)
    dy = torch.randn(70, 16, generator=gen).to(torch.bfloat16)
    return {"2d3d": (a, w, offs, bias, torch.float32), "2d2d": (a.t(), dy, offs, None, None)}


PRIVATEUSE1_SCRIPT = """
    import sys, torch
    torch.utils.rename_privateuse1_backend("neuron")
    import moe_ops
    cases = torch.load(sys.argv[1])
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1)
    results = {"has_kernel": torch._C._dispatch_has_kernel_for_dispatch_key("moe::grouped_mm", "PrivateUse1")}
    for name, args in cases.items():
        moe_ops.reset_kernel_counts()
        results[name] = (torch.ops.moe.grouped_mm.default.redispatch(keys, *args), moe_ops.kernel_counts())
    torch.save(results, sys.argv[2])
"""


def test_privateuse1_neuron_takes_the_neuron_path(tmp_path):
    cases = _cases()
    a, w = cases["2d3d"][:2]
    cases["2d3d fp64"] = (a.double(), w.double(), cases["2d3d"][2], None, None)
    cases["3d3d"] = (a[:64].reshape(4, 16, 24), w, None, None, None)
    torch.save(cases, tmp_path / "cases.pt")
    _python(PRIVATEUSE1_SCRIPT, str(tmp_path / "cases.pt"), str(tmp_path / "out.pt"))
    results = torch.load(tmp_path / "out.pt")
    assert results["has_kernel"]
    for name, counts in (("2d3d", {"neuron:blockwise": 1}), ("2d2d", {"neuron:blockwise": 1}),
                         ("2d3d fp64", {"reference": 1}), ("3d3d", {"reference": 1})):
        out, got = results[name]
        assert got == counts, (name, got)  # fp64 and 3d3d are not served on Neuron: the reference runs
        a, b, offs, bias, out_dtype = cases[name]
        assert_close(out, oracle(a, b, offs, bias, out_dtype), oracle(a, b, offs, bias, out_dtype, exact=False),
                     magnitude(a, b, offs, bias), what=name)


def test_privateuse1_under_another_name_is_not_neuron():
    out = _python("""
        import torch
        torch.utils.rename_privateuse1_backend("tpu")
        import moe_ops
        a, b, offs = torch.randn(6, 4), torch.randn(2, 4, 3), torch.tensor([2, 6])
        keys = torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1)
        torch.ops.moe.grouped_mm.default.redispatch(keys, a, b, offs, None, None)
        print(moe_ops.kernel_counts())
    """)
    assert "neuron" not in out and "reference" in out


@pytest.mark.parametrize("layout", ("2d3d", "2d2d"))
def test_xla_router_reaches_the_neuron_branch(layout, monkeypatch):
    a, b, offs, bias, out_dtype = _cases()[layout]
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.XLA)
    op = torch.ops.moe.grouped_mm.default
    moe_ops.reset_kernel_counts()
    op.redispatch(keys, a, b, offs, bias, out_dtype)
    assert moe_ops.kernel_counts() == {"reference": 1}  # a CPU tensor is no Neuron device
    monkeypatch.setattr(neuron, "serves_xla_device", lambda device: True)
    moe_ops.reset_kernel_counts()
    out = op.redispatch(keys, a, b, offs, bias, out_dtype)
    assert moe_ops.kernel_counts() == {"xla:neuron-blockwise": 1}
    assert_close(out, oracle(a, b, offs, bias, out_dtype), oracle(a, b, offs, bias, out_dtype, exact=False),
                 magnitude(a, b, offs, bias), what=layout)


@pytest.mark.parametrize("layout", ("2d3d", "2d2d"))
def test_xla_impl_neuron_branch(layout):
    a, b, offs, bias, out_dtype = _cases()[layout]
    p = _contract.check_args(a, b, offs, bias, out_dtype)
    moe_ops.reset_kernel_counts()
    out = neuron.xla_impl(p, a, b, offs, bias)
    assert_close(out, oracle(a, b, offs, bias, out_dtype), oracle(a, b, offs, bias, out_dtype, exact=False),
                 magnitude(a, b, offs, bias), what=layout)
    with pytest.raises(NotImplementedError, match="float64"):
        neuron.xla_impl(_contract.check_args(a.double(), b.double(), offs), a.double(), b.double(), offs, None)


def test_serves_xla_device_only_for_neuron_xla_devices():
    assert not neuron.serves_xla_device(torch.device("cpu"))
    assert not neuron.serves_xla_device(torch.device("meta"))
    if "torch_xla" not in sys.modules:
        assert not neuron.serves_xla_device(torch.device("xla:0"))  # no torch_xla: no Neuron XLA device
        assert "torch_xla" not in sys.modules  # and asking imported nothing


def test_importing_moe_ops_imports_no_neuron_toolchain():
    out = _python("""
        import sys, moe_ops
        print(sorted(m for m in ("nki", "torch_xla", "torch_neuronx", "neuronxcc") if m in sys.modules))
        from moe_ops import backends
        status = {s.name: s for s in backends.statuses()}["neuron"]
        print(status.mode, "|", status.detail)
    """)
    loaded, mode_detail = out.strip().splitlines()
    assert loaded == "[]"
    assert mode_detail.startswith("emulator | ")
    if not neuron.nki_status()[0]:
        assert neuron.NKI_MISSING in mode_detail and "not AWS's simulator" in mode_detail


def _neuron_check():
    """benchmarks/neuron_check.py, loaded as a module (it is a script, not part of the package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "neuron_check.py"
    spec = importlib.util.spec_from_file_location("neuron_check", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_neuron_check_keeps_what_it_measured_when_a_step_fails(tmp_path, monkeypatch):
    """benchmarks/neuron_check.py runs once on a lent Trainium machine: a step that raises (here
    the benchmarks, standing for a Neuron compile or runtime error) is recorded and the JSON,
    rewritten after every step, keeps the earlier steps. It used to be written only at the end,
    so such a failure lost the whole run. --device cpu --quick: 5 property cases on CPU."""
    import json

    script = _neuron_check()

    def device_failure(*args, **kwargs):
        raise RuntimeError("stand-in for a device failure")

    monkeypatch.setattr(script, "benchmarks", device_failure)
    # The script's own pytest subprocess, not under test here (and slow on a shared CPU).
    monkeypatch.setattr(script, "nki_simulate_tests", lambda *args: {"returncode": 0})
    out = tmp_path / "neuron_check.json"
    assert script.main(["--device", "cpu", "--quick", "--out", str(out)]) == 1
    result = json.loads(out.read_text())
    assert result["property_cases"]["examples"] == 5 and not result["property_cases"]["failures"]
    assert "stand-in for a device failure" in result["benchmarks"]["error"]


def test_neuron_check_exit_status(tmp_path, monkeypatch):
    """main's exit status is 1 when the nki.simulate tests fail or time out (returncode None), a
    timed grouped matmul raises, or a property case fails; the dense baseline raising is only
    recorded. The first two exited 0 (only the JSON said so). The steps are stood in by
    hand-made results; --examples reaches the property cases."""
    script = _neuron_check()
    shape = {"G": 4, "M": 512, "K": 128, "N": 256}
    row = {"case": "forward 2d3d", **shape, "seconds": 1e-3, "x_dense": None, "kernels": {}}
    seen = {}

    def main(prop=(), sim=0, bench=(row,)):
        def cases(device, examples, budget_s):
            seen["examples"] = examples
            return {"examples": examples, "failures": list(prop), "kernels": {},
                    "skipped_for_time": 0}

        monkeypatch.setattr(script, "property_cases", cases)
        monkeypatch.setattr(script, "nki_simulate_tests", lambda *args: {"returncode": sim})
        monkeypatch.setattr(script, "benchmarks", lambda *args: list(bench))
        out = str(tmp_path / "n.json")
        return script.main(["--device", "cpu", "--examples", "3", "--out", out])

    assert main(bench=[{"case": "dense", **shape, "error": "RuntimeError: x"}, row]) == 0
    assert seen["examples"] == 3
    assert main(sim=1) == 1 and main(sim=None) == 1
    assert main(bench=[{"case": "weight grad 2d2d", **shape, "error": "RuntimeError: x"}]) == 1
    assert main(prop=["AssertionError: x"]) == 1


def test_neuron_check_fails_timings_served_off_the_neuron_kernels(tmp_path, monkeypatch):
    """On a Neuron device a timed case whose calls were served by anything but the Neuron
    backend's kernels (the reference after a fallback, or nothing counted) fails the run and is
    listed in the JSON: its times would be published as the backend's. NKI and the block-wise
    path, on either device, pass; with --device cpu (the plumbing check) nothing is judged. The
    steps are stood in; "meta" stands for a Neuron device."""
    import json

    script = _neuron_check()
    shape = {"G": 4, "M": 512, "K": 128, "N": 256}
    monkeypatch.setattr(script, "property_cases", lambda *args: {"examples": 1, "failures": [], "kernels": {}})
    monkeypatch.setattr(script, "nki_simulate_tests", lambda *args: {"returncode": 0})

    def main(device, *kernels):
        rows = [{"case": "forward 2d3d", **shape, "seconds": 1e-3, "x_dense": None, "kernels": k} for k in kernels]
        monkeypatch.setattr(script, "benchmarks", lambda *args: rows)
        out = tmp_path / "n.json"
        rc = script.main(["--device", device, "--out", str(out)])
        return rc, json.loads(out.read_text())["not_on_neuron"]

    for ok in ({"neuron:nki": 23}, {"neuron:blockwise": 23}, {"xla:neuron-nki": 23}, {"xla:neuron-blockwise": 23}):
        assert main("meta", ok) == (0, [])
    rc, listed = main("meta", {"neuron:nki": 23}, {"neuron:nki": 22, "reference": 1})
    assert rc == 1 and len(listed) == 1 and "reference" in listed[0]
    assert main("meta", {})[0] == 1
    assert main("meta", {"cpu:avx2": 23})[0] == 1
    assert main("cpu", {"reference": 23}) == (0, [])


def test_neuron_check_times_medians_after_warm_up(monkeypatch):
    """_time: the median of --iters runs after 3 warm-ups, each run ended by synchronize (on a
    device the op only queues work). Fake clock: the call itself takes no time and the stand-in
    synchronize advances the clock by the call's scripted device time: warm-ups 100 s, then 1,
    5, 2 s (min 1, mean 2.67, median 2; 0 without the synchronize)."""
    import types

    script = _neuron_check()
    durations, clock = iter([100.0] * 3 + [1.0, 5.0, 2.0]), [0.0]
    monkeypatch.setattr(script, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    def synchronize(device, result):
        clock[0] += result

    monkeypatch.setattr(script, "synchronize", synchronize)
    assert script._time(lambda: next(durations), torch.device("cpu"), iters=3) == 2.0


def test_neuron_check_benchmark_rows(monkeypatch):
    """Each benchmark row: 2*M*K*N FLOPs, x_dense = its time / the dense time, the kernels of
    that case's calls only, and the op called on the shapes the case names (forward [M, N],
    input gradient [M, K], weight gradient [G, K, N]; the dense baseline [M, K] @ [K, N]).
    _time is stood in by a recorder that calls once and says 1 ms for dense, then 2, 3, 4 ms.
    G=4, M=512, K=128, N=256, bf16 on CPU; the Dirichlet split covers all M rows."""
    script = _neuron_check()
    results = []

    def recorder(fn, device, iters):
        results.append(fn())
        return (1e-3, 2e-3, 3e-3, 4e-3)[len(results) - 1]

    monkeypatch.setattr(script, "_time", recorder)
    G, M, K, N = 4, 512, 128, 256
    rows = script.benchmarks(torch.device("cpu"), [(G, M, K, N)], iters=1)
    assert [r["case"] for r in rows] == ["forward 2d3d", "input grad 2d3d (w transposed)",
                                         "weight grad 2d2d"]
    assert [tuple(r.shape) for r in results] == [(M, N), (M, N), (M, K), (G, K, N)]
    for row, t in zip(rows, (2e-3, 3e-3, 4e-3)):
        assert row["seconds"] == t and row["dense_seconds"] == 1e-3
        assert row["x_dense"] == pytest.approx(t / 1e-3)
        assert row["tflops"] == pytest.approx(2 * M * K * N / t / 1e12)
        assert sum(row["kernels"].values()) == 1
    offs = script._splits(M, G, None)
    assert offs.shape == (G,) and offs[-1] == M and (offs.diff() >= 0).all()


def test_neuron_check_benchmarks_refuse_a_wrong_result(monkeypatch):
    """A timed case's result is checked against the reference first: an error of 3% of the
    largest value, or a NaN, is recorded as an error and not timed (it fails the run); 1% passes.
    G=4, M=512, K=128, N=256, bf16 on CPU; the op stood in by the reference times a factor."""
    import moe_ops

    script = _neuron_check()
    monkeypatch.setattr(script, "_time", lambda fn, device, iters: 1e-3)
    real = moe_ops.reference.grouped_mm
    for factor, wrong in ((1.01, False), (1.03, True), (float("nan"), True)):
        monkeypatch.setattr(moe_ops, "grouped_mm", lambda *a, f=factor: real(*a) * f)
        rows = script.benchmarks(torch.device("cpu"), [(4, 512, 128, 256)], iters=1)
        grouped = [r for r in rows if r["case"] != "dense"]
        assert len(grouped) == 3
        for row in grouped:
            assert ("seconds" not in row and "wrong result" in row["error"]) == wrong, (factor, row)


def test_neuron_check_property_cases_check_the_op_within_the_budget(monkeypatch):
    """The property cases compare the op with the oracle (a stand-in op returning NaN fails them)
    and none starts after --cases-s (counted as skipped_for_time, not as examples); the
    nki.simulate tests are bounded too (returncode None). Float32/bf16/fp16 cases on CPU."""
    script = _neuron_check()
    cpu = torch.device("cpu")
    assert script.property_cases(cpu, 2, budget_s=-1.0) == {
        "examples": 0, "failures": [], "kernels": {}, "skipped_for_time": 2}
    assert script.nki_simulate_tests(timeout_s=0.01)["returncode"] is None
    op = moe_ops.grouped_mm
    nan = lambda *args: torch.full_like(op(*args), float("nan"))  # noqa: E731
    monkeypatch.setattr(moe_ops, "grouped_mm", nan)
    report = script.property_cases(cpu, 5)
    assert report["examples"] == 5 and report["failures"] and report["skipped_for_time"] == 0

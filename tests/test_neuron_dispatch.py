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


def test_neuron_check_keeps_what_it_measured_when_a_step_fails(tmp_path, monkeypatch):
    """benchmarks/neuron_check.py runs once on a lent Trainium machine: a step that raises (here
    the benchmarks, standing for a Neuron compile or runtime error) is recorded and the JSON,
    rewritten after every step, keeps the earlier steps. It used to be written only at the end,
    so such a failure lost the whole run. --device cpu --quick: 5 property cases on CPU."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "neuron_check.py"
    spec = importlib.util.spec_from_file_location("neuron_check", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

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

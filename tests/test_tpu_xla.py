"""PyTorch/XLA integration of the TPU backend: ``torch.ops.moe.grouped_mm`` on ``xla`` tensors.

Runs in the pinned environment that ``.ci/xla_env.sh`` creates (torch 2.9.1, torch-xla 2.9.0,
jax 0.7.1, torchax 0.0.7) with PJRT_DEVICE=CPU: the XLA device is XLA:CPU, so our Pallas
kernels run in interpret mode inside the XLA graph (``torch_xla.core.xla_builder.call_jax``).
Anywhere else (torch_xla missing, or not importable on this torch) the module is skipped.

Categories:
* the XLA kernel serves every call (kernel_counts names "tpu:pallas-xla", never the reference),
  for all four layouts, fp32 and bf16, bias, out_dtype, empty groups and offs[-1] < M;
* forward and backward match the float64 oracle within the one tolerance rule;
* autocast on xla casts the inputs (the AutocastXLA key) before the XLA kernel;
* vmap on xla: the batching rule's folded calls run on the XLA kernel, and per-sample offs that
  are not a valid partition are clamped on the device (no host read), sample by sample;
* checked mode reads offs on the device and raises like on CPU; outside it offs are clamped;
* new group sizes run the compiled XLA graph again (no new compilation), new shapes compile;
* without torchax (which call_jax needs) the call is declined to the reference, not an error;
* the repository's C++ modules, built against another torch, are not loaded here, and the
  statuses name both versions instead of the dynamic loader's undefined symbol.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

os.environ.setdefault("PJRT_DEVICE", "CPU")
try:
    import torch_xla
    import torch_xla.debug.metrics as met
except ImportError as e:  # not installed, or built for another torch (undefined symbols)
    pytest.skip(f"torch_xla cannot be imported here ({e}); .ci/run runs this file in the pinned "
                "environment of .ci/xla_env.sh", allow_module_level=True)

import moe_ops  # noqa: E402
from moe_ops.testing import assert_close  # noqa: E402
from oracle import magnitude, oracle  # noqa: E402

XLA_KERNEL = "tpu:pallas-xla"


@pytest.fixture(scope="module")
def dev():
    device = torch_xla.device()
    from moe_ops.backends import tpu

    assert tpu.serves_xla_device(device), f"the TPU backend must serve {device}"
    return device


def _on(dev, *ts):
    return [None if t is None else t.to(dev) for t in ts]


def _check(out, a, b, offs, bias, out_dtype, what, shape=None):
    """out against the oracle of grouped_mm(a, b, offs, bias, out_dtype), viewed as ``shape``."""
    refs = [oracle(a, b, offs, bias, out_dtype, exact=True), oracle(a, b, offs, bias, out_dtype, exact=False),
            magnitude(a, b, offs, bias)]
    if shape is not None:
        refs = [r.reshape(shape) for r in refs]
    assert_close(out.cpu(), *refs, what=what)


def _operands(layout, G, M, K, N, dtype, gen):
    rand = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype)  # noqa: E731
    a = rand(M, K) if layout in ("2d3d", "2d2d") else rand(G, M, K)
    b = rand(G, K, N) if layout in ("2d3d", "3d3d") else rand(K, N)
    return a, b


CASES = [
    # layout, G, M, K, N, offs, dtype, bias, out_dtype
    ("2d3d", 4, 40, 24, 20, (5, 5, 23, 33), torch.float32, True, None),  # empty group, offs[-1] < M
    ("2d3d", 3, 37, 16, 8, (0, 20, 37), torch.bfloat16, False, torch.float32),
    ("2d2d", 3, 12, 40, 8, (10, 10, 31), torch.bfloat16, False, None),  # empty group, K past offs[-1]
    ("3d3d", 3, 10, 16, 8, None, torch.float32, True, None),
    ("3d2d", 3, 10, 16, 20, (5, 5, 12), torch.float32, False, None),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{str(c[6])[6:]}" for c in CASES])
def test_forward_runs_our_xla_kernel(dev, case):
    layout, G, M, K, N, offs, dtype, has_bias, out_dtype = case
    gen = torch.Generator().manual_seed(0)
    a, b = _operands(layout, G, M, K, N, dtype, gen)
    offs = None if offs is None else torch.tensor(offs, dtype=torch.int32)
    bias = torch.randn(G, N, generator=gen, dtype=torch.float64).to(dtype) if has_bias else None
    moe_ops.reset_kernel_counts()
    out = torch.ops.moe.grouped_mm(*_on(dev, a, b, offs, bias), out_dtype)
    assert out.device.type == "xla"
    assert moe_ops.kernel_counts() == {XLA_KERNEL: 1}
    _check(out, a, b, offs, bias, out_dtype, f"xla {layout}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_backward_runs_our_xla_kernels(dev, dtype):
    """2d3d forward with bias; its backward is three more calls of the op (d mat_a as 2d3d with
    mat_b transposed, d mat_b and d bias as 2d2d), all served by the XLA kernel."""
    G, M, K, N = 3, 30, 16, 12
    gen = torch.Generator().manual_seed(1)
    a, b = _operands("2d3d", G, M, K, N, dtype, gen)
    bias = torch.randn(G, N, generator=gen, dtype=torch.float64).to(dtype)
    offs = torch.tensor([7, 7, 26], dtype=torch.int32)  # an empty expert, 4 rows in no group
    grad = torch.randn(M, N, generator=gen, dtype=torch.float64).to(dtype)
    xa, xb, xbias = (t.to(dev).requires_grad_() for t in (a, b, bias))
    moe_ops.reset_kernel_counts()
    out = torch.ops.moe.grouped_mm(xa, xb, offs.to(dev), xbias)
    out.backward(grad.to(dev))
    assert moe_ops.kernel_counts() == {XLA_KERNEL: 4}
    _check(out, a, b, offs, bias, None, "forward")
    _check(xa.grad, grad, b.transpose(1, 2), offs, None, None, "d mat_a")
    _check(xb.grad, a.t(), grad, offs, None, None, "d mat_b")
    assert torch.count_nonzero(xb.grad[1].cpu()) == 0, "an empty expert's weight gradient is exactly zero"
    ones = torch.ones(1, M, dtype=dtype)
    _check(xbias.grad, ones, grad, offs, None, None, "d bias", shape=(G, N))


def test_autocast_on_xla(dev):
    """torch.autocast("xla", bfloat16): fp32 activations with bf16 weights are cast and served by
    the XLA kernel, as the same call cast by hand."""
    gen = torch.Generator().manual_seed(3)
    a, b = _operands("2d3d", 3, 20, 16, 12, torch.float32, gen)
    offs = torch.tensor([5, 5, 17], dtype=torch.int32)
    xa, xb, xoffs = _on(dev, a, b.to(torch.bfloat16), offs)
    moe_ops.reset_kernel_counts()
    with torch.autocast("xla", dtype=torch.bfloat16):
        out = torch.ops.moe.grouped_mm(xa, xb, xoffs)
    assert out.dtype == torch.bfloat16 and moe_ops.kernel_counts() == {XLA_KERNEL: 1}
    want = torch.ops.moe.grouped_mm(xa.to(torch.bfloat16), xb, xoffs)
    assert torch.equal(out.cpu(), want.cpu())


def test_vmap_on_xla_clamps_offs_per_sample(dev):
    """A batch of samples with their own weights and routing is one call of the XLA kernel; each
    sample's offs are clamped to cummax(clamp(offs, 0, M)) before the samples are laid end to end
    (an unclamped offs[-1] = M + 3 would reach into the next sample's rows)."""
    gen = torch.Generator().manual_seed(4)
    G, M, K, N = 3, 12, 16, 8
    a = torch.randn(3, M, K, generator=gen)
    b = torch.randn(3, G, K, N, generator=gen)
    rows = torch.tensor([[2, 1, M + 3], [-1, 4, 9], [0, 0, M]], dtype=torch.int32)
    moe_ops.reset_kernel_counts()
    out = torch.vmap(lambda x, w, o: torch.ops.moe.grouped_mm(x, w, o))(*_on(dev, a, b, rows))
    assert moe_ops.kernel_counts() == {XLA_KERNEL: 1}
    clamped = torch.cummax(rows.clamp(0, M), 1).values
    for s in range(3):
        _check(out[s], a[s], b[s], clamped[s], None, None, f"sample {s}")
    moe_ops.reset_kernel_counts()
    shared = torch.vmap(lambda x: torch.ops.moe.grouped_mm(x, b[0].to(dev), rows[1].to(dev)))(a.to(dev))
    routed = torch.vmap(lambda x, o: torch.ops.moe.grouped_mm(x, b[0].to(dev), o))(*_on(dev, a, rows))
    assert moe_ops.kernel_counts() == {XLA_KERNEL: 2}
    for s in range(3):
        _check(shared[s], a[s], b[0], clamped[1], None, None, f"shared weights, sample {s}")
        _check(routed[s], a[s], b[0], clamped[s], None, None, f"shared weights, own routing, sample {s}")


def test_checked_mode_reads_offs_on_xla(dev):
    """Checked mode validates offs values on the device too and raises like on CPU (README, "No
    host sync on accelerators"): decreasing, past the extent and negative offs; valid ones pass.
    Outside it the same calls run, on offs clamped on the device (cummax(clamp(offs, 0, M)))."""
    gen = torch.Generator().manual_seed(6)
    a, b = _operands("2d3d", 3, 12, 8, 8, torch.float32, gen)
    xa, xb = _on(dev, a, b)
    bad = {(5, 3, 12): "non-decreasing", (2, 5, 13): "exceeds the extent", (-1, 4, 12): "non-negative"}
    for offs, message in bad.items():
        xoffs = torch.tensor(offs, dtype=torch.int32).to(dev)
        with moe_ops.checked(), pytest.raises(ValueError, match=message):
            torch.ops.moe.grouped_mm(xa, xb, xoffs)
        clamped = torch.cummax(torch.tensor(offs).clamp(0, 12), 0).values
        _check(torch.ops.moe.grouped_mm(xa, xb, xoffs), a, b, clamped, None, None, f"unchecked {offs}")
    with moe_ops.checked():
        out = torch.ops.moe.grouped_mm(xa, xb, torch.tensor((2, 5, 12), dtype=torch.int32).to(dev))
    _check(out, a, b, torch.tensor((2, 5, 12)), None, None, "checked, valid")


def _compiles() -> int:
    data = met.metric_data("CompileTime")
    return 0 if data is None else data[0]


def test_new_group_sizes_do_not_recompile(dev):
    gen = torch.Generator().manual_seed(2)
    a, b = _operands("2d3d", 4, 48, 16, 8, torch.float32, gen)
    xa, xb = _on(dev, a, b)
    run = lambda offs: torch.ops.moe.grouped_mm(xa, xb, torch.tensor(offs, dtype=torch.int32).to(dev)).cpu()  # noqa: E731
    run((10, 20, 30, 48))
    before = _compiles()
    for offs in ((0, 0, 0, 48), (48, 48, 48, 48), (3, 9, 9, 17)):
        out = run(offs)
        _check(out, a, b, torch.tensor(offs), None, None, f"offs {offs}")
    assert _compiles() == before, "new group sizes must reuse the compiled graph"
    a2, b2 = _operands("2d3d", 4, 56, 16, 8, torch.float32, gen)
    torch.ops.moe.grouped_mm(*_on(dev, a2, b2, torch.tensor((1, 2, 3, 56), dtype=torch.int32))).cpu()
    assert _compiles() > before, "a new shape compiles (the metric is live)"


def test_without_torchax_the_reference_serves():
    """call_jax raises AssertionError on every call when torchax cannot be imported (torch-xla
    2.9.0 ships a torchax whose import needs flax); the kernel must decline to the reference
    instead. sys.modules["torchax"] = None makes its import fail, in a fresh process."""
    code = (
        "import sys; sys.modules['torchax'] = None\n"
        "import torch, torch_xla, moe_ops\n"
        "a, b, offs = torch.randn(6, 4), torch.randn(2, 4, 3), torch.tensor([2, 6])\n"
        "dev = torch_xla.device()\n"
        "out = moe_ops.grouped_mm(a.to(dev), b.to(dev), offs.to(dev)).cpu()\n"
        "print('COUNTS', moe_ops.kernel_counts())\n"
        "torch.testing.assert_close(out, moe_ops.grouped_mm(a, b, offs))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PJRT_DEVICE": "CPU"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "COUNTS {'reference': 1}" in r.stdout, r.stdout


def test_compiled_modules_of_another_torch_name_both_versions():
    """This environment's torch is not the one .ci/run builds the repository's C++ modules against,
    so they do not load here (the dynamic loader stops at a symbol this torch lacks before their
    own version check runs); the CPU backend's status and the autograd status say which torch
    each module needs and which one this is (moe_ops/_native.py)."""
    from moe_ops import _native, _op, backends

    built = {name: _native.built_against(name) for name in ("moe_ops._cpu", "moe_ops._autograd")}
    if None in built.values() or torch.version.__version__ in built.values():
        pytest.skip(f"the C++ modules are not built against another torch here ({built})")
    running = torch.version.__version__
    cpu = [s for s in backends.statuses() if s.name == "cpu"][0]
    assert f"moe_ops._cpu was built against torch {built['moe_ops._cpu']}, this is torch {running}" in cpu.detail
    assert (f"moe_ops._autograd was built against torch {built['moe_ops._autograd']}, this is torch {running}"
            in _op.autograd_status())

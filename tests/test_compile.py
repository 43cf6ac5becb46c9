"""Registration: opcheck per layout and dtype, torch.compile, and the dispatch table.

Categories:
* torch.library.opcheck (schema, fake kernel, autograd registration, AOT dispatch with dynamic
  shapes) for every layout x dtype, with and without grad;
* torch.compile(fullgraph=True), static and dynamic: no graph break, correct forward and
  backward, the AOT forward and backward graphs call moe.grouped_mm (no decomposition), and
  the device kernel registered for CPU is the one that runs;
* compiled autograd (the backward traced by dynamo too);
* torch.export with a dynamic token count, and an AOTInductor package of it;
* which dispatch keys have kernels; the C++ Autograd kernel's module loads only under the torch
  it was built against.

With grad, opcheck and the compile test run against both Autograd kernels of the op.
"""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters

import moe_ops
from moe_ops import _op, backends

pytestmark = pytest.mark.usefixtures("unwritten_outputs_are_nan")
ROOT = pathlib.Path(__file__).resolve().parents[1]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _sample(layout, dtype, requires_grad, bias=False):
    gen = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen).to(dtype).requires_grad_(requires_grad)  # noqa: E731
    G, M, K, N = 3, 10, 8, 6
    if layout == "2d3d":
        return r(M, K), r(G, K, N), torch.tensor([3, 3, 9], dtype=torch.int32), r(G, N) if bias else None
    if layout == "2d2d":
        return r(M, K), r(K, N), torch.tensor([2, 2, 7]), None
    if layout == "3d3d":
        return r(G, M, K), r(G, K, N), None, r(G, N) if bias else None
    return r(G, M, K), r(K, N), torch.tensor([1, 4, 4], dtype=torch.int32), None


def _opcheck(layout, dtype, requires_grad):
    a, b, offs, bias = _sample(layout, dtype, requires_grad, bias=layout in ("2d3d", "3d3d"))
    torch.library.opcheck(torch.ops.moe.grouped_mm.default, (a, b, offs, bias, None))
    if dtype in (torch.bfloat16, torch.float16):
        torch.library.opcheck(torch.ops.moe.grouped_mm.default, (a, b, offs, bias, torch.float32))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["2d3d", "2d2d", "3d3d", "3d2d"])
def test_opcheck(layout, dtype):
    _opcheck(layout, dtype, False)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["2d3d", "2d2d", "3d3d", "3d2d"])
def test_opcheck_with_grad(layout, dtype, autograd_kernel):
    _opcheck(layout, dtype, True)


def _moe_like(x, w, offs, bias):
    h = moe_ops.grouped_mm(x, w, offs, bias)
    return moe_ops.grouped_mm(torch.relu(h), w.transpose(1, 2), offs).sum()


class GraphRecorder:
    """An aot_autograd backend that keeps the forward and backward graphs it was given."""

    def __init__(self):
        self.graphs = []
        self.backend = aot_autograd(fw_compiler=self._keep, bw_compiler=self._keep)

    def _keep(self, gm, example_inputs):
        self.graphs.append(gm)
        return make_boxed_func(gm.forward)

    def targets(self, i):
        return {n.target for n in self.graphs[i].graph.nodes if n.op == "call_function"}


@pytest.fixture
def cpu_kernel():
    """The name of the kernel that serves CPU tensors: the cpu backend's when it is registered,
    else one this test registers on the CPU key for its duration, so the test shows that a
    *device* kernel (not the default one) runs under torch.compile."""
    if torch._C._dispatch_has_kernel_for_dispatch_key("moe::grouped_mm", "CPU"):
        moe_ops.reset_kernel_counts()
        moe_ops.grouped_mm(*_sample("2d3d", torch.float32, False)[:3])
        (name,) = moe_ops.kernel_counts()
        yield name
        return
    with torch.library._scoped_library("moe", "IMPL") as lib:
        lib.impl("grouped_mm", _op.kernel_entry("test:cpu", _op._reference_impl), "CPU")
        yield "test:cpu"


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_compile_fullgraph_calls_the_op_and_the_device_kernel(dynamic, cpu_kernel, autograd_kernel):
    torch._dynamo.reset()
    x = torch.randn(12, 8, requires_grad=True)
    w = torch.randn(3, 8, 8, requires_grad=True)
    bias = torch.randn(3, 8, requires_grad=True)
    offs = torch.tensor([4, 4, 11])
    eager = _moe_like(x, w, offs, bias)
    want = torch.autograd.grad(eager, (x, w, bias))

    rec = GraphRecorder()
    compiled = torch.compile(_moe_like, backend=rec.backend, fullgraph=True, dynamic=dynamic)
    moe_ops.reset_kernel_counts()
    got_out = compiled(x, w, offs, bias)
    got = torch.autograd.grad(got_out, (x, w, bias))

    torch.testing.assert_close(got_out, eager)
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e)
    assert len(rec.graphs) == 2  # one forward, one backward graph: no graph break
    op = torch.ops.moe.grouped_mm.default
    assert op in rec.targets(0) and op in rec.targets(1)
    assert torch.ops.aten.mm.default not in rec.targets(0) | rec.targets(1), "the op was decomposed"
    counts = moe_ops.kernel_counts()
    assert counts.get(cpu_kernel, 0) >= 2 + 4, counts  # 2 forward calls, >= 4 backward calls


def test_compile_inductor_dynamic_shapes():
    """Inductor, dynamic shapes, two sizes. float64, so that inductor's fused and reordered
    elementwise code agrees with eager to ~1e-15 and default tolerances are exact enough."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    compiled = torch.compile(_moe_like, fullgraph=True, dynamic=True)
    for m, offs in ((12, [4, 4, 11]), (20, [0, 13, 20])):
        x, w, bias = r(m, 8).requires_grad_(), r(3, 8, 8).requires_grad_(), r(3, 8)
        offs = torch.tensor(offs)
        got = compiled(x, w, offs, bias)
        torch.testing.assert_close(got, _moe_like(x, w, offs, bias))
        gx, gw = torch.autograd.grad(got, (x, w))
        ex, ew = torch.autograd.grad(_moe_like(x, w, offs, bias), (x, w))
        torch.testing.assert_close(gx, ex)
        torch.testing.assert_close(gw, ew)


def test_compiled_autograd(autograd_kernel):
    """torch.compile with compiled autograd (the backward graph traced too): the gradients of
    eager mode, with either Autograd kernel (the C++ Function runs as an opaque call there)."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(12, 8, generator=gen, requires_grad=True)
    w = torch.randn(3, 8, 8, generator=gen, requires_grad=True)
    offs = torch.tensor([4, 4, 11])
    want = torch.autograd.grad(_moe_like(x, w, offs, None), (x, w))
    compiled = torch.compile(_moe_like, backend="aot_eager", fullgraph=True)
    captures = counters["compiled_autograd"]["captures"]
    with torch._dynamo.compiled_autograd._enable(torch.compile(backend="aot_eager")):
        compiled(x, w, offs, None).backward()
    assert counters["compiled_autograd"]["captures"] == captures + 1  # the backward was traced
    torch.testing.assert_close(x.grad, want[0])
    torch.testing.assert_close(w.grad, want[1])


def test_compiled_autograd_with_forward_mode_tangents(autograd_kernel):
    """Compiled autograd over a backward whose forward had a dual input that requires grad
    (x [12, 8] with a tangent, w [3, 8, 8], float32): the eager gradients and the tangent,
    with either Autograd kernel. The C++ one used to give such calls its hand-built node,
    which has no compiled_args (NotImplementedError)."""
    import torch.autograd.forward_ad as fwAD

    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(12, 8, generator=gen, requires_grad=True)
    w = torch.randn(3, 8, 8, generator=gen, requires_grad=True)
    t = torch.randn(12, 8, generator=gen)
    offs = torch.tensor([4, 4, 11])
    want = torch.autograd.grad(moe_ops.grouped_mm(x, w, offs).sin().sum(), (x, w))
    captures = counters["compiled_autograd"]["captures"]
    # backend "eager": AOTAutograd would trace the dual tensors the backward reads, which it
    # does not support (aten::copy has no forward derivative), whatever the op.
    with torch._dynamo.compiled_autograd._enable(torch.compile(backend="eager")):
        with fwAD.dual_level():
            out = moe_ops.grouped_mm(fwAD.make_dual(x, t), w, offs)
            tangent = fwAD.unpack_dual(out).tangent
            out.sin().sum().backward()
    assert counters["compiled_autograd"]["captures"] == captures + 1  # the backward was traced
    torch.testing.assert_close(tangent, moe_ops.grouped_mm(t, w.detach(), offs))
    torch.testing.assert_close(x.grad, want[0])
    torch.testing.assert_close(w.grad, want[1])


def test_export_and_aot_inductor(cpu_kernel, tmp_path):
    """torch.export of the example MoE layer with a dynamic token count keeps the op (one node
    per call), and an AOTInductor package built from it calls the op's CPU kernel through the
    dispatcher (AOTInductor's proxy executor) for a token count it was not traced with."""
    spec = importlib.util.spec_from_file_location("moe_layer", ROOT / "examples" / "moe_layer.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    torch.manual_seed(0)
    layer = example.MoEFeedForward(d_model=16, d_ff=24, n_experts=4, top_k=2).eval()
    tokens = torch.export.Dim("tokens", min=2, max=4096)
    ep = torch.export.export(layer, (torch.randn(10, 16),), dynamic_shapes=({0: tokens},))
    assert sum(n.target == torch.ops.moe.grouped_mm.default for n in ep.graph.nodes) == 2
    x = torch.randn(33, 16)
    with torch.no_grad():
        want = layer(x)
    torch.testing.assert_close(ep.module()(x), want)
    package = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "moe.pt2"))
    runner = torch._inductor.aoti_load_package(package)
    moe_ops.reset_kernel_counts()
    torch.testing.assert_close(runner(x), want)
    assert moe_ops.kernel_counts() == {cpu_kernel: 2}


def test_dispatch_table():
    has = lambda key: torch._C._dispatch_has_kernel_for_dispatch_key("moe::grouped_mm", key)  # noqa: E731
    assert has("CompositeExplicitAutograd") and has("Autograd") and has("Meta")
    assert not has("CompositeImplicitAutograd"), "an implicit kernel would be decomposed by compile"
    registered = {key for s in backends.statuses() for key in s.keys}
    for key in ("CUDA", "XLA", "PrivateUse1"):
        assert has(key) == (key in registered), key


def test_the_cpp_autograd_module_refuses_another_torch(cpp_autograd):
    # A module built against one torch must not load under another: the op falls back to its
    # Python Autograd kernel and says why.
    code = ("import torch; torch.version.__version__ = '0.0.0'; import moe_ops; from moe_ops import _op; "
            "print(_op.autograd_status())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Python (moe_ops._autograd cannot be loaded (ImportError: moe_ops._autograd was built against torch " \
           f"{torch.__version__}, this is torch 0.0.0))" in out.stdout


def test_a_failing_cpp_registration_leaves_the_python_kernel(cpp_autograd):
    """If the C++ module loads but cannot register its kernel, the op keeps an Autograd kernel
    (the Python one) and says why: never an op without one (gradients would silently be None)."""

    class Refuses:
        @staticmethod
        def register_kernel():
            raise RuntimeError("injected registration failure")

        @staticmethod
        def deregister_kernel():
            pass

    real = _op._Autograd.cpp
    _op.use_autograd("python")
    _op._Autograd.cpp = Refuses
    try:
        with pytest.raises(RuntimeError, match="injected registration failure"):
            _op.use_autograd("cpp")
        assert _op._Autograd.active == "python"
        assert torch._C._dispatch_has_kernel_for_dispatch_key("moe::grouped_mm", "Autograd")
        a, b, offs, _ = _sample("2d3d", torch.float32, True)
        (grad_a,) = torch.autograd.grad(torch.ops.moe.grouped_mm(a, b, offs).sum(), (a,))
        assert grad_a.shape == a.shape
    finally:
        _op._Autograd.cpp = real

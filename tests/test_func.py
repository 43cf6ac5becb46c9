"""Forward-mode AD and torch.func transforms.

Categories:
* forward-mode AD (dual tensors): gradcheck with check_forward_ad and gradgradcheck with
  check_fwd_over_rev in float64 on every layout, for both Autograd kernels; bf16 tangents against
  the float64 oracle's within the shared tolerance;
* torch.func with the C++ Autograd kernel: grad, vjp, jvp (every subset of tangents), jacfwd
  against jacrev, hessian, vmap(grad) per-sample gradients, all against the same transforms of
  the independent oracle (tests/oracle.py, ATen ops only); the gradients under torch.func run on
  the op's own kernels; torch.func.functional_call through the example MoE layer; torch.compile
  over grad, jvp, per-sample gradients and jacfwd (dynamic shapes);
* with the Python Autograd kernel, torch.func's differentiating transforms raise a clear error
  (an autograd.Function cannot take functorch's route from inside the dispatcher), and vmap
  without gradients still works. The batching rule itself: tests/test_vmap.py.
"""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vjp, vmap

import moe_ops
from moe_ops.testing import assert_close
from oracle import oracle
from strategies import small_problem

pytestmark = pytest.mark.usefixtures("unwritten_outputs_are_nan")

f64 = torch.float64
ROOT = pathlib.Path(__file__).resolve().parents[1]

# (layout, bias): every layout; bias where the contract allows it.
CASES = [("2d3d", False), ("2d3d", True), ("2d2d", False), ("3d3d", True), ("3d2d", False)]


def _fns(offs, bias):
    """The op and the oracle as functions of (mat_a, mat_b[, bias])."""
    def op(a, b, *c):
        return moe_ops.grouped_mm(a, b, offs, c[0] if bias else None)

    def ref(a, b, *c):
        return oracle(a, b, offs, c[0] if bias else None)

    return op, ref


def _close(got, want):
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("layout,bias", CASES)
def test_forward_ad_gradcheck(autograd_kernel, layout, bias):
    args, offs = small_problem(layout, bias=bias)
    op, _ = _fns(offs, bias)
    leaves = [t.detach().requires_grad_() for t in args]
    assert torch.autograd.gradcheck(op, leaves, check_forward_ad=True, check_backward_ad=True)


@pytest.mark.parametrize("layout,bias", [("2d3d", True), ("2d2d", False), ("3d2d", False)])
def test_forward_over_reverse_gradgradcheck(autograd_kernel, layout, bias):
    args, offs = small_problem(layout, bias=bias)
    op, _ = _fns(offs, bias)
    leaves = [t.detach().requires_grad_() for t in args]
    assert torch.autograd.gradgradcheck(op, leaves, check_fwd_over_rev=True)


@pytest.mark.parametrize("layout,bias", [("2d3d", True), ("3d3d", True), ("2d2d", False)])
def test_bf16_tangent_within_tolerance(autograd_kernel, layout, bias):
    """bf16 inputs, fp32 output: the tangent against the float64 oracle's, rounded once."""
    args, offs = small_problem(layout, bias=bias, dtype=torch.bfloat16, seed=2)
    tangents, _ = small_problem(layout, bias=bias, dtype=torch.bfloat16, seed=3)
    with fwAD.dual_level():
        duals = [fwAD.make_dual(p, t) for p, t in zip(args, tangents)]
        out = moe_ops.grouped_mm(duals[0], duals[1], offs, duals[2] if bias else None, out_dtype=torch.float32)
        got = fwAD.unpack_dual(out).tangent
    assert got is not None and got.dtype == torch.float32
    _, ref = _fns(offs, bias)
    up = [t.double() for t in args]
    want = jvp(ref, tuple(up), tuple(t.double() for t in tangents))[1]
    magnitude = jvp(ref, tuple(p.abs() for p in up), tuple(t.double().abs() for t in tangents))[1]
    assert_close(got, want, want.float(), magnitude, what="tangent")


def test_tangent_without_grad_mode_and_with_grad(autograd_kernel):
    """A dual input with and without requires_grad: the tangent is the same, and the reverse
    gradient of the dual computation is the plain one."""
    (a, b, c), offs = small_problem("2d3d", bias=True)
    t = torch.randn_like(a)
    op, ref = _fns(offs, True)
    want = jvp(lambda x: ref(x, b, c), (a,), (t,))[1]
    with fwAD.dual_level():
        _close(fwAD.unpack_dual(op(fwAD.make_dual(a, t), b, c)).tangent, want)
        leaf = a.clone().requires_grad_()
        out = op(fwAD.make_dual(leaf, t), b, c)
        _close(fwAD.unpack_dual(out).tangent, want)
        out.pow(2).sum().backward()
    plain = a.clone().requires_grad_()
    op(plain, b, c).pow(2).sum().backward()
    _close(leaf.grad, plain.grad)


def test_use_autograd_refuses_an_unknown_kind():
    """use_autograd("py") is a ValueError and leaves the registered kernel as it was (not the
    Python kernel registered under a name autograd_status does not know)."""
    before = moe_ops._op._Autograd.active
    with pytest.raises(ValueError, match="kind must be 'cpp' or 'python'"):
        moe_ops._op.use_autograd("py")
    assert moe_ops._op._Autograd.active == before


def test_switching_autograd_kernels_replaces_the_registration(cpp_autograd):
    """use_autograd("python") removes the C++ kernel before registering the Python one, and back:
    the op's dispatch table holds one Autograd registration at a time (a kernel left beneath the
    other would come back when that one is removed), and each kernel serves afterwards (the
    Python one refuses torch.func transforms). Shapes: small_problem("2d3d")'s, float64."""
    def autograd_registrations():
        dump = torch._C._dispatch_dump("moe::grouped_mm").splitlines()
        return [line for line in dump if line.startswith("Autograd[alias]")]

    (a, b, c), offs = small_problem("2d3d", bias=True)
    op, _ = _fns(offs, True)
    moe_ops._op.use_autograd("python")  # the fixture registers the one before the test again
    assert len(autograd_registrations()) == 1, autograd_registrations()
    with pytest.raises(NotImplementedError, match="needs the op's C\\+\\+ Autograd kernel"):
        grad(lambda x: op(x, b, c).sum())(a)
    moe_ops._op.use_autograd("cpp")
    assert len(autograd_registrations()) == 1, autograd_registrations()
    grad(lambda x: op(x, b, c).sum())(a)


@pytest.mark.parametrize("layout,bias", CASES)
def test_func_grad_and_vjp(cpp_autograd, layout, bias):
    args, offs = small_problem(layout, bias=bias)
    op, ref = _fns(offs, bias)
    argnums = tuple(range(len(args)))
    loss = lambda f: lambda *x: f(*x).sin().sum()  # noqa: E731
    _close(grad(loss(op), argnums=argnums)(*args), grad(loss(ref), argnums=argnums)(*args))
    cot = torch.randn(op(*args).shape, dtype=f64)
    _close(vjp(op, *args)[1](cot), vjp(ref, *args)[1](cot))


@pytest.mark.parametrize("layout", ["2d3d", "3d3d"])
def test_func_grad_of_each_argument_alone(cpp_autograd, layout):
    """torch.func.grad with respect to mat_a, mat_b or the bias alone (small_problem's float64
    operands, with a bias): only that argument is differentiated, so the node's other inputs
    need no gradient. The bias gradient must not depend on whether mat_b's is wanted (a node
    that asked about the wrong output gave zeros for argnums=2 and passed the all-at-once test
    above)."""
    args, offs = small_problem(layout, bias=True)
    op, ref = _fns(offs, True)
    loss = lambda f: lambda *x: f(*x).sin().sum()  # noqa: E731
    for argnum in range(len(args)):
        _close(grad(loss(op), argnums=argnum)(*args), grad(loss(ref), argnums=argnum)(*args))


@pytest.mark.parametrize("layout,bias", CASES)
def test_func_jvp_every_subset_of_tangents(cpp_autograd, layout, bias):
    args, offs = small_problem(layout, bias=bias)
    tangents, _ = small_problem(layout, bias=bias, seed=1)
    op, ref = _fns(offs, bias)
    for mask in range(1, 2 ** len(args)):
        which = [i for i in range(len(args)) if mask >> i & 1]

        def restrict(f):
            def g(*xs):
                full = list(args)
                for i, x in zip(which, xs):
                    full[i] = x
                return f(*full)
            return g

        primals, tans = tuple(args[i] for i in which), tuple(tangents[i] for i in which)
        out, tangent = jvp(restrict(op), primals, tans)
        want_out, want = jvp(restrict(ref), primals, tans)
        _close((out, tangent), (want_out, want))


@pytest.mark.parametrize("layout,bias", [("2d3d", True), ("2d2d", False), ("3d2d", False)])
def test_func_jacobians_and_hessian(cpp_autograd, layout, bias):
    args, offs = small_problem(layout, bias=bias)
    op, ref = _fns(offs, bias)
    want = jacrev(ref, argnums=1)(*args)
    _close(jacfwd(op, argnums=1)(*args), want)
    _close(jacrev(op, argnums=1)(*args), want)
    quartic = lambda f: lambda x: f(x, *args[1:]).pow(2).sum()  # noqa: E731
    _close(hessian(quartic(op))(args[0]), hessian(quartic(ref))(args[0]))


def test_func_per_sample_gradients(cpp_autograd):
    """vmap(grad): the weight gradient of every sample of a batch at once."""
    (a, b, c), offs = small_problem("2d3d", bias=True)
    batch = torch.randn(4, *a.shape, dtype=f64)
    op, ref = _fns(offs, True)
    loss = lambda f: lambda x, w: f(x, w, c).pow(2).sum()  # noqa: E731
    got = vmap(grad(loss(op), argnums=1), in_dims=(0, None))(batch, b)
    want = torch.stack([grad(loss(ref), argnums=1)(x, b) for x in batch])
    _close(got, want)


def test_func_gradients_run_on_the_op(cpp_autograd):
    """Under torch.func.grad the forward and the three gradients are calls of the op."""
    (a, b, c), offs = small_problem("2d3d", bias=True)
    op, _ = _fns(offs, True)
    moe_ops.reset_kernel_counts()
    grad(lambda *x: op(*x).sum(), argnums=(0, 1, 2))(a, b, c)
    assert sum(moe_ops.kernel_counts().values()) == 4


def test_func_functional_call_through_the_example_layer(cpp_autograd):
    spec = importlib.util.spec_from_file_location("moe_layer", ROOT / "examples" / "moe_layer.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    torch.manual_seed(0)
    layer = example.MoEFeedForward(d_model=16, d_ff=24, n_experts=4, top_k=2).double()
    x = torch.randn(10, 16, dtype=f64)
    params = {k: v.detach() for k, v in layer.named_parameters()}
    got = grad(lambda p: torch.func.functional_call(layer, p, (x,)).pow(2).sum())(params)
    layer.zero_grad()
    layer(x).pow(2).sum().backward()
    for name, p in layer.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-10, atol=1e-10, msg=name)


def test_python_kernel_refuses_func_transforms_clearly():
    """With the Python Autograd kernel, differentiating transforms raise; vmap alone runs."""
    before = moe_ops._op._Autograd.active
    moe_ops._op.use_autograd("python")
    try:
        (a, b, c), offs = small_problem("2d3d", bias=True)
        op, ref = _fns(offs, True)
        with pytest.raises(NotImplementedError, match="needs the op's C\\+\\+ Autograd kernel"):
            grad(lambda x: op(x, b, c).sum())(a)
        with pytest.raises(NotImplementedError, match="needs the op's C\\+\\+ Autograd kernel"):
            jvp(lambda x: op(x, b, c), (a,), (a,))
        batch = torch.randn(3, *a.shape, dtype=f64)
        _close(vmap(lambda x: op(x, b, c))(batch), torch.stack([ref(x, b, c) for x in batch]))
    finally:
        moe_ops._op.use_autograd(before)


@pytest.mark.outside_cpp
def test_compiled_func_grad_and_jvp(cpp_autograd):
    """torch.compile over torch.func.grad and torch.func.jvp of the op."""
    torch._dynamo.reset()
    (a, b), offs = small_problem("2d3d", bias=False)
    op, ref = _fns(offs, False)
    loss = lambda f: lambda *x: f(*x).sin().sum()  # noqa: E731
    got = torch.compile(grad(loss(op), argnums=(0, 1)))(a, b)
    _close(got, grad(loss(ref), argnums=(0, 1))(a, b))
    t = torch.randn_like(a)
    tangent = lambda f: lambda x, w: jvp(lambda y: f(y, w), (x,), (t,))[1]  # noqa: E731
    _close(torch.compile(tangent(op))(a, b), tangent(ref)(a, b))


@pytest.mark.parametrize("layout", ["2d2d", "3d2d"])
@pytest.mark.outside_cpp
def test_compiled_per_sample_gradients(cpp_autograd, layout):
    """torch.compile over vmap(grad) with mat_a and mat_b both per-sample: the backward's 3Dx2D
    call is folded by the batching rule, whose tail zeroing failed to functionalize there (an
    in-place op on a movedim view). 4 samples of float64 (mat_a, mat_b) of small_problem."""
    torch._dynamo.reset()
    (a, b), offs = small_problem(layout)
    gen = torch.Generator().manual_seed(1)
    batch_a = torch.randn(4, *a.shape, generator=gen, dtype=f64)
    batch_b = torch.randn(4, *b.shape, generator=gen, dtype=f64)
    op, ref = _fns(offs, False)
    loss = lambda f: lambda x, w: f(x, w).sin().sum()  # noqa: E731
    per_sample = vmap(grad(loss(op), argnums=(0, 1)))
    got = torch.compile(per_sample, fullgraph=True, backend="aot_eager")(batch_a, batch_b)
    want = [grad(loss(ref), argnums=(0, 1))(x, w) for x, w in zip(batch_a, batch_b)]
    _close(got, tuple(torch.stack(w) for w in zip(*want)))


@pytest.mark.parametrize("layout,bias", CASES)
@pytest.mark.outside_cpp
def test_compiled_jacfwd_with_dynamic_shapes(cpp_autograd, layout, bias):
    """torch.compile(dynamic=True) over jacfwd (a vmap of jvp): the batched tangent came out of
    the batching rule with its batch inside ([M, B, N]), so setting it on the contiguous output
    went through _new_zeros_with_same_feature_meta, whose meta kernel fails on symbolic sizes
    (it raised for every layout; torch.bmm's jacfwd compiles). float64, small_problem made
    contiguous: for a non-contiguous input torch's own _make_dual fails the same way, bmm's too."""
    torch._dynamo.reset()
    args, offs = small_problem(layout, bias=bias)
    args = tuple(t.contiguous() for t in args)
    op, ref = _fns(offs, bias)
    # One argnum at a time: jacfwd with argnums=(0, 1) under dynamic=True returns zeros in
    # torch 2.13 even for x * y (a torch bug, not the op's).
    for argnum in (0, 1):
        compiled = torch.compile(jacfwd(op, argnums=argnum), fullgraph=True, backend="aot_eager",
                                 dynamic=True)
        got = compiled(*args)
        _close(got, jacrev(ref, argnums=argnum)(*args))

"""Autograd: gradients of every layout against finite differences and the float64 oracle.

Categories:
* gradcheck / gradgradcheck in float64 (with bias, empty groups, trailing rows, transposed mat_b);
* gradients equal the oracle's autograd gradients (independent formulation);
* exactly zero gradients for empty groups and for rows / columns outside every group;
* dtypes: bf16 inputs with out_dtype=float32 give bf16 gradients; a stride-0 incoming
  gradient (``y.sum().backward()``, which torch._grouped_mm rejects) works;
* the backward runs the op itself (its kernel calls are counted);
* activation checkpointing (reentrant, non-reentrant, selective with the op saved or recomputed)
  and saved-tensor hooks give the same gradients.

Every test runs against both Autograd kernels of the op, the C++ one and the Python one (the
``autograd_kernel`` fixture of conftest.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import moe_ops
from moe_ops import _op
from oracle import oracle
from strategies import small_problem
from moe_ops.testing import assert_close


pytestmark = pytest.mark.usefixtures("autograd_kernel", "unwritten_outputs_are_nan")

f64 = torch.float64


def _problem(layout, dtype=f64, bias=False, seed=0):
    """strategies.small_problem with leaves that require grad."""
    args, offs = small_problem(layout, dtype, bias, seed)
    return [t.detach().requires_grad_() for t in args], offs


CASES = [("2d3d", False), ("2d3d", True), ("2d2d", False), ("3d3d", False), ("3d3d", True), ("3d2d", False)]


def _fn(offs, has_bias):
    def f(a, b, *bias):
        return moe_ops.grouped_mm(a, b, offs, bias[0] if has_bias else None)
    return f


@pytest.mark.parametrize("layout,bias", CASES)
def test_gradcheck(layout, bias):
    leaves, offs = _problem(layout, bias=bias)
    assert torch.autograd.gradcheck(_fn(offs, bias), leaves)


@pytest.mark.parametrize("layout", ["2d3d", "3d2d"])
def test_the_reference_called_directly_keeps_nan_tails_out_of_gradients(layout):
    """NaN in the rows (2Dx3D) or columns (3Dx2D) past offs[-1], as in padding, reach no
    gradient of moe_ops.reference.grouped_mm: its block formulation's padding slots read the
    last row, which must be masked out, not multiplied by a zero gradient (0 * NaN = NaN in the
    weight gradient). Shapes: mat_a [6, 4] and mat_b [2, 4, 3] (2Dx3D), or mat_a [2, 3, 4] and
    mat_b [4, 6] (3Dx2D), float64, offs [2, 4] int32: indices 4 and 5 are NaN."""
    gen = torch.Generator().manual_seed(0)
    offs = torch.tensor([2, 4], dtype=torch.int32)
    if layout == "2d3d":
        a = torch.randn(6, 4, dtype=f64, generator=gen)
        b = torch.randn(2, 4, 3, dtype=f64, generator=gen)
        a[4:] = float("nan")
    else:
        a = torch.randn(2, 3, 4, dtype=f64, generator=gen)
        b = torch.randn(4, 6, dtype=f64, generator=gen)
        b[:, 4:] = float("nan")
    leaves = [a.requires_grad_(), b.requires_grad_()]
    grads = torch.autograd.grad(moe_ops.reference.grouped_mm(a, b, offs).sum(), leaves)
    want = torch.autograd.grad(moe_ops.grouped_mm(a, b, offs).sum(), leaves)
    for g, w in zip(grads, want):
        assert not g.isnan().any(), "a NaN past offs[-1] reached a gradient"
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layout,bias", CASES)
def test_the_reference_called_directly_is_differentiable(layout, bias):
    """moe_ops.reference.grouped_mm, public and documented with the op's contract, takes inputs
    that require grad (its CPU loop writes into an output's slices, which autograd refuses; the
    block formulation computes such calls), with the op's gradients."""
    leaves, offs = _problem(layout, bias=bias)

    def ref(a, b, *bias_):
        return moe_ops.reference.grouped_mm(a, b, offs, bias_[0] if bias else None)

    assert torch.autograd.gradcheck(ref, leaves)
    grads = torch.autograd.grad(ref(*leaves).square().sum(), leaves)
    want = torch.autograd.grad(_fn(offs, bias)(*leaves).square().sum(), leaves)
    torch.testing.assert_close(grads, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layout,bias", CASES)
def test_the_reference_called_directly_has_forward_mode_ad(layout, bias):
    """moe_ops.reference.grouped_mm on dual tensors that do not require grad (float64, the
    small problems): the tangent is the op's. Its CPU loop multiplies with mm's out= variant,
    which has no forward derivative (2d3d without bias and 2d2d raised NotImplementedError);
    such calls take the block formulation, as calls that require grad do."""
    args, offs = small_problem(layout, f64, bias)
    tangents, _ = small_problem(layout, f64, bias, seed=1)

    def tangent(f):
        with fwAD.dual_level():
            duals = [fwAD.make_dual(p, t) for p, t in zip(args, tangents)]
            return fwAD.unpack_dual(f(duals[0], duals[1], offs, duals[2] if bias else None)).tangent

    got, want = tangent(moe_ops.reference.grouped_mm), tangent(moe_ops.grouped_mm)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layout,bias",
                         [("2d3d", True), ("2d2d", False), ("3d3d", True), ("3d2d", False)])
def test_gradgradcheck(layout, bias):
    leaves, offs = _problem(layout, bias=bias)
    assert torch.autograd.gradgradcheck(_fn(offs, bias), leaves)


@pytest.mark.parametrize("layout,bias", CASES)
def test_gradients_match_oracle(layout, bias):
    leaves, offs = _problem(layout, bias=bias, seed=1)
    grad = torch.randn(_fn(offs, bias)(*leaves).shape, dtype=f64)
    got = torch.autograd.grad(_fn(offs, bias)(*leaves), leaves, grad)
    want = torch.autograd.grad(oracle(*leaves[:2], offs, leaves[2] if bias else None), leaves, grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_empty_groups_get_exactly_zero_gradients():
    (a, b, bias), offs = _problem("2d3d", bias=True)  # group 1 is empty, row 6 is past offs[-1]
    (moe_ops.grouped_mm(a, b, offs, bias) * 1.5).sum().backward()
    assert torch.count_nonzero(b.grad[1]) == 0 and torch.count_nonzero(bias.grad[1]) == 0
    assert torch.count_nonzero(a.grad[6:]) == 0
    assert torch.count_nonzero(b.grad[0]) > 0 and torch.count_nonzero(bias.grad[2]) > 0

    (a, b), offs = _problem("2d2d")  # group 0 is empty, K index 4 is past offs[-1]
    moe_ops.grouped_mm(a, b, offs).pow(2).sum().backward()
    assert torch.count_nonzero(a.grad[:, 4:]) == 0 and torch.count_nonzero(b.grad[4:]) == 0

    (a, b), offs = _problem("3d2d")  # group 1 is empty, column 3 is past offs[-1]
    moe_ops.grouped_mm(a, b, offs).pow(2).sum().backward()
    assert torch.count_nonzero(a.grad[1]) == 0 and torch.count_nonzero(b.grad[:, 3:]) == 0


@pytest.mark.parametrize("layout,bias", [("2d3d", True), ("3d2d", False)])
def test_nan_gradient_of_the_zero_tail_reaches_nothing(layout, bias):
    """The result past offs[-1] (2d3d rows 6+, 3d2d columns 3+) is the constant zero, so the
    incoming gradient there, NaN here, reaches no input: the gradients equal the oracle's with
    that part of the incoming gradient zeroed. float64, small_problem."""
    leaves, offs = _problem(layout, bias=bias, seed=2)
    out = _fn(offs, bias)(*leaves)
    grad = torch.randn(out.shape, dtype=f64)
    tail = (slice(6, None),) if layout == "2d3d" else (slice(None), slice(3, None))
    clean = grad.clone()
    clean[tail] = 0
    grad[tail] = float("nan")
    got = torch.autograd.grad(out, leaves, grad)
    want = torch.autograd.grad(oracle(*leaves[:2], offs, leaves[2] if bias else None), leaves,
                               clean)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def _selective(policy):
    """context_fn for selective activation checkpointing: ``policy`` for the op, recompute for
    everything else."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def choose(ctx, op, *args, **kwargs):
        if op is torch.ops.moe.grouped_mm.default:
            return policy
        return CheckpointPolicy.PREFER_RECOMPUTE

    return lambda: create_selective_checkpoint_contexts(choose)


@pytest.mark.parametrize("layout,bias", [("2d3d", True), ("2d2d", False)])
def test_activation_checkpointing_and_saved_tensor_hooks(layout, bias):
    """What MoE training wraps expert layers in: torch.utils.checkpoint (reentrant, not, and
    selective with the op's result saved or recomputed) and saved_tensors_hooks (offloading
    packs every saved tensor) give the gradients of a plain backward, bit for bit (the same
    kernels on the same values). float64, small_problem, a sin after the op."""
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint

    leaves, offs = _problem(layout, bias=bias, seed=3)

    def f(*xs):
        return _fn(offs, bias)(*[x * 1.5 for x in xs]).sin()

    grad = torch.randn(f(*leaves).shape, dtype=f64)

    def grads(out):  # .backward, not autograd.grad: reentrant checkpointing refuses the latter
        for leaf in leaves:
            leaf.grad = None
        out.backward(grad)
        return [leaf.grad for leaf in leaves]

    want = grads(f(*leaves))
    variants = {
        "reentrant": dict(use_reentrant=True),
        "non-reentrant": dict(use_reentrant=False),
        "selective, op saved": dict(use_reentrant=False,
                                    context_fn=_selective(CheckpointPolicy.MUST_SAVE)),
        "selective, op recomputed": dict(use_reentrant=False,
                                         context_fn=_selective(CheckpointPolicy.PREFER_RECOMPUTE)),
    }
    for name, kwargs in variants.items():
        got = grads(checkpoint(f, *leaves, **kwargs))
        assert all(torch.equal(g, w) for g, w in zip(got, want)), name
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t.shape) or t.clone(),
                                                  lambda t: t):
        out = f(*leaves)
    assert leaves[0].shape in packed and leaves[1].shape in packed, packed  # the op's a and b
    assert all(torch.equal(g, w) for g, w in zip(grads(out), want)), "saved_tensors_hooks"


@pytest.mark.parametrize("layout,bias", CASES)
def test_bf16_with_fp32_output(layout, bias):
    leaves, offs = _problem(layout, dtype=torch.bfloat16, bias=bias)
    out = moe_ops.grouped_mm(*leaves[:2], offs, leaves[2] if bias else None, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    out.sum().backward()  # a stride-0 incoming gradient
    for leaf in leaves:
        assert leaf.grad.dtype == torch.bfloat16 and leaf.grad.shape == leaf.shape
    # The incoming gradient (ones) is exact in bf16, so the plain bf16 computation of each
    # gradient is the float64 one rounded once; magnitudes come from the oracle on |inputs|.
    def oracle_grads(transform):
        xs = [transform(leaf.detach().double()).requires_grad_() for leaf in leaves]
        return torch.autograd.grad(oracle(*xs[:2], offs, xs[2] if bias else None).sum(), xs)

    ref, mag = oracle_grads(lambda x: x), oracle_grads(torch.abs)
    for leaf, r, m in zip(leaves, ref, mag):
        assert_close(leaf.grad, r, r.to(torch.bfloat16), m, what=f"grad of {tuple(leaf.shape)}")


def test_bf16_with_fp32_output_sums_the_bias_gradient_unrounded():
    """README "Autograd": with out_dtype=float32 the incoming gradient is rounded to the inputs'
    dtype for the matmul gradients only; the bias gradient sums it as it comes. Here the sum,
    120.5 + 8 x (1 + 2^-9) = 128.5 + 2^-6, is exact in fp32 in any order and rounds to 129 in
    bf16; summing the bf16-rounded gradient (1 + 2^-9 -> 1) gives the tie 128.5 -> 128. The
    tolerance rule allows that unit, so the check is exact. Shapes: mat_a [9, 2], mat_b
    [2, 2, 1], bias [2, 1] bf16, offs [9, 9] int32; the fp32 incoming gradient [9, 1]."""
    a = torch.ones(9, 2, dtype=torch.bfloat16, requires_grad=True)
    b = torch.ones(2, 2, 1, dtype=torch.bfloat16, requires_grad=True)
    bias = torch.zeros(2, 1, dtype=torch.bfloat16, requires_grad=True)
    offs = torch.tensor([9, 9], dtype=torch.int32)
    out = moe_ops.grouped_mm(a, b, offs, bias, out_dtype=torch.float32)
    grad = torch.full((9, 1), 1.0 + 2.0 ** -9)
    grad[0] = 120.5
    out.backward(grad)
    assert bias.grad.tolist() == [[129.0], [0.0]]


def test_backward_calls_the_op():
    (a, b, bias), offs = _problem("2d3d", bias=True)
    out = moe_ops.grouped_mm(a, b, offs, bias)
    moe_ops.reset_kernel_counts()
    out.sum().backward()
    assert sum(moe_ops.kernel_counts().values()) == 3  # d mat_a, d mat_b and d bias


def test_only_requested_gradients_are_computed():
    (a, b), offs = _problem("2d3d")
    b.requires_grad_(False)
    out = moe_ops.grouped_mm(a, b, offs)
    moe_ops.reset_kernel_counts()
    out.sum().backward()
    assert sum(moe_ops.kernel_counts().values()) == 1 and b.grad is None


def test_the_selected_kernel_is_the_registered_one(autograd_kernel):
    (a, b), offs = _problem("2d3d")
    out = moe_ops.grouped_mm(a, b, offs)
    # The C++ Function's node is a CppFunction; the Python one's is named after _GroupedMM.
    want = "CppFunction" if autograd_kernel == "cpp" else "_GroupedMMBackward"
    assert type(out.grad_fn).__name__ == want
    assert _op.autograd_status().startswith("C++" if autograd_kernel == "cpp" else "Python")


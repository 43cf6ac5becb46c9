"""Autocast: under torch.autocast the op casts its floating inputs to the autocast dtype, as torch
does for mm / bmm / matmul (torch._grouped_mm does not: pytorch/pytorch#174763).

Categories:
* the result is exactly the op on the inputs cast by hand: fp32 inputs, fp32 activations with
  bf16 weights (a dtype error outside autocast), bias, out_dtype=float32, an fp16 autocast dtype;
* float64 inputs are left alone, and autocast(enabled=False) changes nothing;
* gradients reach fp32 leaves in fp32, equal to those of the hand-cast computation, with either
  Autograd kernel;
* torch.compile(fullgraph=True) under autocast gives eager's result.
"""

from __future__ import annotations

import pytest
import torch

import moe_ops

bf16, f32 = torch.bfloat16, torch.float32


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(10, 16, generator=gen)
    b = torch.randn(3, 8, 16, generator=gen).transpose(1, 2)  # [G, K, N] view of [G, N, K] weights
    bias = torch.randn(3, 8, generator=gen)
    return a, b, torch.tensor([3, 3, 9], dtype=torch.int32), bias


@pytest.mark.parametrize("dtype", [bf16, torch.float16], ids=str)
def test_floating_inputs_are_cast_to_the_autocast_dtype(dtype):
    a, b, offs, bias = _inputs()
    with torch.autocast("cpu", dtype=dtype):
        got = moe_ops.grouped_mm(a, b, offs, bias)
        got_f32 = moe_ops.grouped_mm(a, b, offs, bias, out_dtype=f32)
    want = moe_ops.grouped_mm(a.to(dtype), b.to(dtype), offs, bias.to(dtype))
    assert got.dtype == dtype and torch.equal(got, want)
    assert got_f32.dtype == f32
    assert torch.equal(got_f32, moe_ops.grouped_mm(a.to(dtype), b.to(dtype), offs, bias.to(dtype), out_dtype=f32))


def test_fp32_activations_with_bf16_weights():
    a, b, offs, _ = _inputs()
    with pytest.raises(TypeError, match="mat_b must have mat_a's dtype"):
        moe_ops.grouped_mm(a, b.to(bf16), offs)
    with torch.autocast("cpu", dtype=bf16):
        got = moe_ops.grouped_mm(a, b.to(bf16), offs)
    assert torch.equal(got, moe_ops.grouped_mm(a.to(bf16), b.to(bf16), offs))


def test_float64_and_disabled_autocast_are_left_alone():
    a, b, offs, bias = _inputs()
    with torch.autocast("cpu", dtype=bf16):
        got64 = moe_ops.grouped_mm(a.double(), b.double(), offs, bias.double())
    assert got64.dtype == torch.float64
    assert torch.equal(got64, moe_ops.grouped_mm(a.double(), b.double(), offs, bias.double()))
    with torch.autocast("cpu", dtype=bf16, enabled=False):
        got = moe_ops.grouped_mm(a, b, offs)
    assert got.dtype == f32 and torch.equal(got, moe_ops.grouped_mm(a, b, offs))


@pytest.mark.usefixtures("autograd_kernel")
def test_gradients_reach_fp32_leaves():
    a, b, offs, bias = _inputs()
    leaves = [t.detach().requires_grad_() for t in (a, b, bias)]
    with torch.autocast("cpu", dtype=bf16):
        out = moe_ops.grouped_mm(*leaves[:2], offs, leaves[2])
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(bf16)
    got = torch.autograd.grad(out, leaves, grad)
    ref = [t.detach().requires_grad_() for t in (a, b, bias)]
    want = torch.autograd.grad(moe_ops.grouped_mm(ref[0].to(bf16), ref[1].to(bf16), offs, ref[2].to(bf16)), ref, grad)
    for g, w in zip(got, want):
        assert g.dtype == f32 and torch.equal(g, w)


def test_compile_under_autocast():
    torch._dynamo.reset()
    a, b, offs, bias = _inputs()

    def f(a, b, offs, bias):
        with torch.autocast("cpu", dtype=bf16):
            return moe_ops.grouped_mm(a, b, offs, bias)

    got = torch.compile(f, backend="aot_eager", fullgraph=True)(a, b, offs, bias)
    assert got.dtype == bf16 and torch.equal(got, f(a, b, offs, bias))


def test_integer_inputs_are_not_cast():
    """README "Autocast": only floating inputs are cast, so integer matrices are refused under
    autocast as outside it (a cast would silently compute with them). Shapes: mat_a [10, 16],
    mat_b [3, 16, 8] int32, offs [3] int32; also vmapped over a batch of 2 of mat_a."""
    a, b, offs, _ = _inputs()
    ia, ib = a.to(torch.int32), b.to(torch.int32)
    with torch.autocast("cpu", dtype=bf16):
        with pytest.raises(TypeError, match="mat_a has unsupported dtype torch.int32"):
            moe_ops.grouped_mm(ia, ib, offs)
        with pytest.raises(TypeError, match="mat_a has unsupported dtype torch.int32"):
            torch.vmap(moe_ops.grouped_mm, in_dims=(0, None, None))(torch.stack([ia, ia]), ib, offs)

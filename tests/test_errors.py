"""Bad input: one test per error in the contract, asserting the exception type and message.

Each error is raised by moe_ops.grouped_mm on CPU tensors (the real kernel path), by the fake
kernel under FakeTensorMode (what torch.compile sees), and by run_backend for every backend,
because all three call the same checks in moe_ops/_contract.py.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import moe_ops
from moe_ops import _contract
from moe_ops.testing import backend_names, run_backend

f32, bf16 = torch.float32, torch.bfloat16


def t(*shape, dtype=f32):
    return torch.randn(*shape).to(dtype)


def i32(*values):
    return torch.tensor(values, dtype=torch.int32)


# name -> (args, exception type, message fragment); the args are (mat_a, mat_b, offs, bias, out_dtype).
METADATA_ERRORS = {
    "mat_a not a tensor": (([[1.0]], t(1, 1, 1), i32(1)), TypeError, "mat_a must be a torch.Tensor"),
    "offs not a tensor": ((t(4, 8), t(2, 8, 3), [2, 4]), TypeError, "offs must be a torch.Tensor"),
    "mat_a 1-D": ((t(8), t(2, 8, 3), i32(2, 4)), ValueError, "mat_a must be 2-D [M, K] or 3-D"),
    "mat_a 4-D": ((t(1, 2, 4, 8), t(2, 8, 3), i32(2, 4)), ValueError, "mat_a must be 2-D [M, K] or 3-D"),
    "mat_b 1-D": ((t(4, 8), t(8), i32(2, 4)), ValueError, "mat_b must be 2-D [K, N] or 3-D"),
    "K mismatch 2d3d": ((t(4, 8), t(2, 7, 3), i32(2, 4)), ValueError, "K mismatch"),
    "K mismatch 2d2d": ((t(4, 8), t(7, 3), i32(2, 8)), ValueError, "K mismatch"),
    "K mismatch 3d3d": ((t(2, 4, 8), t(2, 7, 3)), ValueError, "K mismatch"),
    "K mismatch 3d2d": ((t(2, 4, 8), t(7, 3), i32(1, 3)), ValueError, "K mismatch"),
    "G mismatch 3d3d": ((t(2, 4, 8), t(3, 8, 3)), ValueError, "same number of groups"),
    "offs missing 2d3d": ((t(4, 8), t(2, 8, 3)), ValueError, "offs is required for the 2d3d layout"),
    "offs missing 2d2d": ((t(4, 8), t(8, 3)), ValueError, "offs is required for the 2d2d layout"),
    "offs missing 3d2d": ((t(2, 4, 8), t(8, 3)), ValueError, "offs is required for the 3d2d layout"),
    "offs given for 3d3d": ((t(2, 4, 8), t(2, 8, 3), i32(1, 2)), ValueError, "offs must be None"),
    "offs float": ((t(4, 8), t(2, 8, 3), torch.tensor([2.0, 4.0])), TypeError, "offs must be int32 or int64"),
    "offs int16": ((t(4, 8), t(2, 8, 3), torch.tensor([2, 4], dtype=torch.int16)), TypeError,
                   "offs must be int32 or int64"),
    "offs 2-D": ((t(4, 8), t(2, 8, 3), i32(2, 4).reshape(1, 2)), ValueError, "offs must be 1-D"),
    "offs too short": ((t(4, 8), t(2, 8, 3), i32(4)), ValueError, "offs must have G = 2 entries"),
    "offs too long 3d2d": ((t(2, 4, 8), t(8, 3), i32(1, 2, 3)), ValueError, "offs must have G = 2 entries"),
    "no groups": ((t(0, 4, 8), t(0, 8, 3)), ValueError, "G must be at least 1"),
    "dtype mismatch": ((t(4, 8), t(2, 8, 3, dtype=bf16), i32(2, 4)), TypeError, "mat_b must have mat_a's dtype"),
    "unsupported dtype int": ((torch.ones(4, 8, dtype=torch.int32), torch.ones(2, 8, 3, dtype=torch.int32),
                               i32(2, 4)), TypeError, "unsupported dtype"),
    "unsupported dtype complex": ((t(4, 8, dtype=torch.complex64), t(2, 8, 3, dtype=torch.complex64), i32(2, 4)),
                                  TypeError, "unsupported dtype"),
    "bias wrong shape": ((t(4, 8), t(2, 8, 3), i32(2, 4), t(2, 4)), ValueError, "bias must be [G, N] = [2, 3]"),
    "bias 1-D": ((t(4, 8), t(2, 8, 3), i32(2, 4), t(3)), ValueError, "bias must be [G, N]"),
    "bias for 2d2d": ((t(4, 8), t(8, 3), i32(2, 8), t(2, 3)), ValueError, "bias is only supported"),
    "bias for 3d2d": ((t(2, 4, 8), t(8, 3), i32(1, 3), t(2, 3)), ValueError, "bias is only supported"),
    "bias dtype": ((t(4, 8), t(2, 8, 3), i32(2, 4), t(2, 3, dtype=bf16)), TypeError, "bias must have the inputs' dtype"),
    "out_dtype fp16 for fp32": ((t(4, 8), t(2, 8, 3), i32(2, 4), None, torch.float16), TypeError,
                                "out_dtype=torch.float16 is not allowed"),
    "out_dtype fp32 for fp64": ((t(4, 8, dtype=torch.float64), t(2, 8, 3, dtype=torch.float64), i32(2, 4), None, f32),
                                TypeError, "out_dtype=torch.float32 is not allowed"),
    "out_dtype bf16 for fp16": ((t(4, 8, dtype=torch.float16), t(2, 8, 3, dtype=torch.float16), i32(2, 4), None, bf16),
                                TypeError, "out_dtype=torch.bfloat16 is not allowed"),
    "out_dtype not a dtype": ((t(4, 8), t(2, 8, 3), i32(2, 4), None, "float32"), TypeError,
                              "out_dtype must be a torch.dtype"),
}

# offs values: raised on CPU (and in checked mode on accelerators).
VALUE_ERRORS = {
    "offs negative": ((t(4, 8), t(2, 8, 3), i32(-1, 4)), "offs must be non-negative, but offs[0] = -1"),
    "offs decreasing": ((t(4, 8), t(3, 8, 3), i32(3, 1, 4)), "non-decreasing, but offs[1] = 1 < offs[0] = 3"),
    "offs beyond M": ((t(4, 8), t(2, 8, 3), i32(2, 5)), "offs[1] = 5 exceeds the extent 4"),
    "offs beyond K 2d2d": ((t(4, 8), t(8, 3), i32(2, 9)), "offs[1] = 9 exceeds the extent 8"),
    "offs beyond N 3d2d": ((t(2, 4, 8), t(8, 3), i32(2, 4)), "offs[1] = 4 exceeds the extent 3"),
}


def _pad(args):
    return tuple(args) + (None,) * (5 - len(args))


@pytest.mark.parametrize("name", list(METADATA_ERRORS))
def test_metadata_error_from_op(name):
    args, exc, fragment = METADATA_ERRORS[name]
    with pytest.raises(exc, match=_re(fragment)):
        moe_ops.grouped_mm(*_pad(args))


@pytest.mark.parametrize("name", [n for n, (_, _, frag) in METADATA_ERRORS.items() if "must be a torch" not in frag])
def test_metadata_error_from_fake_kernel(name):
    """(Python types are checked by the dispatcher's schema before the fake kernel runs.)"""
    args, exc, fragment = METADATA_ERRORS[name]
    mode = FakeTensorMode()
    fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in _pad(args)]
    with mode, pytest.raises(exc, match=_re(fragment)):
        torch.ops.moe.grouped_mm(*fake_args)


@pytest.mark.parametrize("name", list(VALUE_ERRORS))
def test_offs_value_error_on_cpu(name):
    args, fragment = VALUE_ERRORS[name]
    with pytest.raises(ValueError, match=_re(fragment)):
        moe_ops.grouped_mm(*_pad(args))
    with pytest.raises(ValueError, match=_re(fragment)):
        moe_ops.reference.grouped_mm(*_pad(args))


@pytest.mark.parametrize("backend", backend_names())
def test_run_backend_checks_like_the_op(backend):
    """Every backend gets the same checks: they run before its kernel is even looked up."""
    args, exc, fragment = METADATA_ERRORS["K mismatch 2d3d"]
    with pytest.raises(exc, match=fragment):
        run_backend(backend, *_pad(args))
    args, fragment = VALUE_ERRORS["offs decreasing"]
    with pytest.raises(ValueError, match=_re(fragment)):
        run_backend(backend, *_pad(args))


def test_different_devices():
    a = t(4, 8)
    with pytest.raises(ValueError, match="mat_b is on device meta but mat_a is on cpu"):
        _contract.check_args(a, torch.empty(2, 8, 3, device="meta"), i32(2, 4))
    with pytest.raises(ValueError, match="offs is on device meta but mat_a is on cpu"):
        _contract.check_args(a, t(2, 8, 3), torch.empty(2, dtype=torch.int32, device="meta"))
    with pytest.raises(ValueError, match="bias is on device meta"):
        moe_ops.grouped_mm(a, t(2, 8, 3), i32(2, 4), torch.empty(2, 3, device="meta"))


def test_run_backend_needs_cpu_tensors():
    meta = torch.empty(4, 8, device="meta")
    with pytest.raises(ValueError, match="run_backend takes CPU tensors; mat_a is on meta"):
        run_backend("reference", meta, torch.empty(2, 8, 3, device="meta"), torch.empty(2, dtype=torch.int32,
                                                                                          device="meta"))


def test_unknown_backend():
    with pytest.raises(KeyError, match="unknown backend 'nope'"):
        run_backend("nope", t(4, 8), t(2, 8, 3), i32(2, 4))


def test_checked_mode_switch(monkeypatch):
    monkeypatch.delenv("MOE_OPS_CHECKED", raising=False)
    assert not _contract.checked_mode()
    with moe_ops.checked():
        assert _contract.checked_mode()
        with moe_ops.checked(False):
            assert not _contract.checked_mode()
        assert _contract.checked_mode()
    assert not _contract.checked_mode()
    monkeypatch.setenv("MOE_OPS_CHECKED", "1")
    assert _contract.checked_mode()


def test_sanitize_offs_is_identity_on_valid_and_clamps_invalid():
    valid = torch.tensor([0, 3, 3, 7, 10])
    assert torch.equal(_contract.sanitize_offs(valid, 10), valid)
    assert _contract.sanitize_offs(torch.tensor([5, -2, 12, 8], dtype=torch.int32), 10).tolist() == [5, 5, 10, 10]


def _re(fragment: str) -> str:
    import re
    return re.escape(fragment)

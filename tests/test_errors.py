"""Bad input: one test per error in the contract, asserting the exception type and message.

Each error is raised by moe_ops.grouped_mm on CPU tensors (the real kernel path), by the fake
kernel under FakeTensorMode (what torch.compile sees), and by run_backend for every backend,
because all three call the same checks in moe_ops/_contract.py.

And the drop-in claim (README, "Differences from torch._grouped_mm"): every call that
torch._grouped_mm accepts on CPU with at least one group and valid offs is accepted, with its
shape and dtype and values within the tolerance rule; the documented exceptions (no groups,
argument names) behave as documented.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

import moe_ops
from moe_ops import _contract
from moe_ops.testing import assert_close, backend_names, reference_results, run_backend, tolerance
from oracle import group_ids, magnitude, oracle
from strategies import Case, build, partitions, small_problem

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
    for off in ("", "0", "false", "False", "NO", " off "):  # "false" once turned it on
        monkeypatch.setenv("MOE_OPS_CHECKED", off)
        assert not _contract.checked_mode(), off
    for on in ("1", "true", "yes"):
        monkeypatch.setenv("MOE_OPS_CHECKED", on)
        assert _contract.checked_mode(), on


def test_checked_mode_is_restored_after_an_exception_and_is_per_thread(monkeypatch):
    """checked() restores the previous mode when its block raises (a ValueError from the op, say),
    and is per thread (README: autograd runs an accelerator's backward on a thread of its own);
    MOE_OPS_CHECKED covers every thread."""
    import threading

    monkeypatch.delenv("MOE_OPS_CHECKED", raising=False)
    with pytest.raises(ZeroDivisionError):
        with moe_ops.checked():
            1 / 0
    assert not _contract.checked_mode()

    seen = []
    worker = threading.Thread(target=lambda: seen.append(_contract.checked_mode()))
    with moe_ops.checked():
        worker.start()
        worker.join()
        assert _contract.checked_mode()
    monkeypatch.setenv("MOE_OPS_CHECKED", "1")
    worker = threading.Thread(target=lambda: seen.append(_contract.checked_mode()))
    worker.start()
    worker.join()
    assert seen == [False, True]


def test_sanitize_offs_is_identity_on_valid_and_clamps_invalid():
    valid = torch.tensor([0, 3, 3, 7, 10])
    assert torch.equal(_contract.sanitize_offs(valid, 10), valid)
    assert _contract.sanitize_offs(torch.tensor([5, -2, 12, 8], dtype=torch.int32), 10).tolist() == [5, 5, 10, 10]


def _re(fragment: str) -> str:
    import re
    return re.escape(fragment)


@st.composite
def _torch_accepted_cases(draw):
    """Cases torch._grouped_mm's CPU path accepts: its dtypes (float32, bfloat16, float16),
    int32 offs (also as a strided view), no bias, out_dtype None or the inputs' dtype (the only
    one it admits), unit-stride rows or columns 16 bytes apart or more (sizes of 8s; with
    ``pad_a`` / ``pad_b`` the rows of the operand's storage 8 elements longer), a 3-D operand
    expanded from one group (stride 0, ``expand_a`` / ``expand_b``), G >= 1, offs ending at or
    below the extent (empty groups included). Returns (case, layout options for _relaid)."""
    layout = draw(st.sampled_from(("2d3d", "2d2d", "3d3d", "3d2d")))
    G = draw(st.integers(1, 4))
    M, K, N = (draw(st.sampled_from((8, 16, 24, 40))) for _ in range(3))
    extent = {"2d3d": M, "2d2d": K, "3d2d": N, "3d3d": None}[layout]
    dtype = draw(st.sampled_from((torch.float32, torch.bfloat16, torch.float16)))
    return Case(
        layout=layout, G=G, M=M, K=K, N=N, dtype=dtype,
        offs=None if extent is None else draw(partitions(G, extent)), offs_dtype=torch.int32,
        stride_a=draw(st.sampled_from(("contiguous", "transposed"))),
        stride_b=draw(st.sampled_from(("contiguous", "transposed"))),
        bias=False, out_dtype=draw(st.sampled_from((None, dtype))),
        seed=draw(st.integers(0, 2**31 - 1)),
        strided_offs=extent is not None and draw(st.booleans()),
    ), {name: draw(st.booleans()) for name in ("pad_a", "pad_b", "expand_a", "expand_b")}


def _relaid(t, pad: bool, expand: bool):
    """t (2-D or 3-D, its last or second-to-last dimension unit-stride) with the same values where
    ``expand`` is False, laid out as torch._grouped_mm also admits: with ``pad``, in a storage
    whose unit-stride rows are 8 elements longer (16 bytes or more, finite values there); with
    ``expand`` (3-D only), group 0 expanded to every group (stride 0)."""
    if expand and t.dim() == 3:
        t = t[:1].expand(t.shape)
    if not pad:
        return t
    transposed = t.stride(-1) != 1
    rows = t.transpose(-1, -2) if transposed else t
    wide = torch.full((*rows.shape[:-1], rows.shape[-1] + 8), 1e3, dtype=t.dtype)
    wide[..., : rows.shape[-1]] = rows
    out = wide[..., : rows.shape[-1]]
    return out.transpose(-1, -2) if transposed else out


def _defined(out, case: Case, offs):
    """The part of a result torch._grouped_mm defines: it leaves rows (2Dx3D) or columns (3Dx2D)
    past offs[-1] uninitialised."""
    if case.layout == "2d3d":
        return out[: int(offs[-1])]
    if case.layout == "3d2d":
        return out[:, : int(offs[-1])]
    return out


@given(drawn=_torch_accepted_cases())
def test_accepts_what_torch_grouped_mm_accepts(drawn):
    """Shape and dtype equal torch._grouped_mm's; values within the tolerance rule, with
    torch._grouped_mm's result as the plain computation in the inputs' precision."""
    case, lay = drawn
    a, b, offs, _, out_dtype = build(case)
    a, b = _relaid(a, lay["pad_a"], lay["expand_a"]), _relaid(b, lay["pad_b"], lay["expand_b"])
    # Raises if the strategy drew a call it refuses.
    want = torch._grouped_mm(a, b, offs, out_dtype=out_dtype)
    got = moe_ops.grouped_mm(a, b, offs, out_dtype=out_dtype)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert_close(_defined(got, case, offs), _defined(oracle(a, b, offs), case, offs),
                 _defined(want, case, offs), _defined(magnitude(a, b, offs), case, offs),
                 what=f"{case} {lay}")


@pytest.mark.parametrize("layout", ["2d3d", "2d2d", "3d3d", "3d2d"])
def test_no_groups_is_refused_where_torch_grouped_mm_is_not(layout):
    """G = 0: torch._grouped_mm returns a result (uninitialised memory for 2Dx3D and 3Dx2D);
    this op raises, as README's "Differences from torch._grouped_mm" says. Shapes: mat_a
    [8, 8] or [0, 8, 8], mat_b [0, 8, 8] or [8, 8], offs [0] int32 (None for 3Dx3D)."""
    a = t(8, 8) if layout[0] == "2" else t(0, 8, 8)
    b = t(0, 8, 8) if layout[2] == "3" else t(8, 8)
    offs = None if layout == "3d3d" else i32()
    torch._grouped_mm(a, b, offs)
    with pytest.raises(ValueError, match="G must be at least 1"):
        moe_ops.grouped_mm(a, b, offs)


def test_argument_names_are_those_of_functional_grouped_mm():
    """mat_a / mat_b as in torch.nn.functional.grouped_mm; offs, bias and out_dtype by keyword or
    by position, as torch._grouped_mm takes them. Shapes: [8, 8] x [2, 8, 8], offs [2] int32."""
    a, b, offs = t(8, 8), t(2, 8, 8), i32(3, 8)
    # The keyword call torch.nn.functional.grouped_mm documents, and torch._grouped_mm's
    # positional one (the same kernel: the functional one calls torch._grouped_mm).
    functional = torch.nn.functional.grouped_mm(mat_a=a, mat_b=b, offs=offs)
    assert torch.equal(functional, torch._grouped_mm(a, b, offs))
    want = moe_ops.grouped_mm(a, b, offs, None, None)
    got = moe_ops.grouped_mm(mat_a=a, mat_b=b, offs=offs, bias=None, out_dtype=None)
    assert torch.equal(got, want)
    assert torch.equal(torch.ops.moe.grouped_mm(mat_a=a, mat_b=b, offs=offs), want)
    torch._grouped_mm(input=a, mat2=b, offs=offs)  # its own keyword names, which differ
    with pytest.raises(TypeError):
        moe_ops.grouped_mm(input=a, mat2=b, offs=offs)


@pytest.mark.parametrize("layout", ["2d3d", "3d3d"])
def test_tolerance_of_float64_results_is_float64_sized(layout):
    """A float64 result that went through float32 (its accumulation or its output) fails
    assert_close: the rule's accumulation term takes float64's eps for float64 outputs, else
    such a kernel would pass the whole suite. Shapes: strategies.small_problem's, float64,
    with bias."""
    (a, b, bias), offs = small_problem(layout, torch.float64, bias=True)
    refs = (oracle(a, b, offs, bias), oracle(a, b, offs, bias, exact=False),
            magnitude(a, b, offs, bias))
    assert_close(refs[1], *refs)  # the plain computation passes
    with pytest.raises(AssertionError, match="max abs error"):
        assert_close(refs[1].float().double(), *refs)


def test_assert_close_enforces_the_documented_rule():
    """moe_ops.testing.tolerance's rule, 2 x max|ref_same - ref64| + eps(out) x max|ref64| +
    2 x eps(acc) x max magnitude, worked by hand in units u = 2^-23 (float32's eps): 2 x 2u +
    1u + 2 x 1u x 2 = 9u. assert_close passes an error of 9u and fails one of 10u, and
    checks shape and dtype. Shapes: [1, 2] float32 (one output with an error, one without)."""
    u = 2.0 ** -23
    ref64 = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    ref_same = torch.tensor([[1.0 + 2 * u, 0.0]], dtype=torch.float32)
    mag = torch.tensor([[2.0, 0.0]], dtype=torch.float64)
    assert tolerance(ref64, ref_same, mag) == 9 * u
    assert_close(torch.tensor([[1.0 + 9 * u, 0.0]]), ref64, ref_same, mag)
    with pytest.raises(AssertionError, match="max abs error"):
        assert_close(torch.tensor([[1.0 + 10 * u, 0.0]]), ref64, ref_same, mag)
    with pytest.raises(AssertionError, match="dtype"):
        assert_close(ref64.clone(), ref64, ref_same, mag)
    with pytest.raises(AssertionError, match="shape"):
        assert_close(torch.tensor([[1.0]]), ref64, ref_same, mag)


def _exact(a, b, offs, bias) -> torch.Tensor:
    """The problem of tests/oracle.py's ``oracle`` in rational arithmetic (each product and sum
    exact, Fraction), rounded once to float64 at the end: written out element by element, with
    the contract's grouping, sharing no code with the oracle but group_ids."""
    A, B = a.tolist(), b.tolist()
    C = None if bias is None else bias.tolist()

    def dot(row, col, ks):  # (Fraction + float would be a float: every term converted)
        return sum((Fraction(row(k)) * Fraction(col(k)) for k in ks), Fraction(0))

    if a.dim() == 3 and b.dim() == 3:
        out = [[[dot(lambda k: A[g][m][k], lambda k: B[g][k][n], range(a.shape[2])) + Fraction(C[g][n] if C else 0)
                 for n in range(b.shape[2])] for m in range(a.shape[1])] for g in range(a.shape[0])]
    elif a.dim() == 2 and b.dim() == 3:
        gid = group_ids(offs, a.shape[0]).tolist()
        out = [[0 if gid[m] < 0 else dot(lambda k: A[m][k], lambda k: B[gid[m]][k][n], range(a.shape[1]))
                + Fraction(C[gid[m]][n] if C else 0) for n in range(b.shape[2])] for m in range(a.shape[0])]
    elif a.dim() == 2 and b.dim() == 2:
        gid = group_ids(offs, a.shape[1]).tolist()
        out = [[[dot(lambda k: A[m][k], lambda k: B[k][n], [k for k in range(a.shape[1]) if gid[k] == g])
                 for n in range(b.shape[1])] for m in range(a.shape[0])] for g in range(offs.shape[0])]
    else:
        gid = group_ids(offs, b.shape[1]).tolist()
        out = [[0 if gid[n] < 0 else dot(lambda k: A[gid[n]][m][k], lambda k: B[k][n], range(a.shape[2]))
                for n in range(b.shape[1])] for m in range(a.shape[1])]
    return torch.tensor(out, dtype=torch.float64)  # Fraction -> float: rounded to nearest


@pytest.mark.parametrize("layout", ["2d3d", "2d2d", "3d3d", "3d2d"])
def test_float64_ground_truths_are_summed_as_if_in_twice_the_precision(layout):
    """For float64 inputs, oracle(exact=True) and moe_ops.testing.reference_results' ref64 are the
    ground truths of the tolerance rule, so they must be more exact than the float64
    computations they judge: within 2u |exact| + 2^-70 x magnitude of the exact value rounded to
    float64 (u = 2^-53; moe_ops.testing.float64_exactly's compensated sum of exact slice
    products rounds once, its dropped slices lie below 2^-80 of the magnitude, and the exact
    value's own rounding adds u) where the plain float64 einsum (oracle(exact=False)) is not,
    on sums of 40 products whose magnitudes span 2^-40 to 2^40 (with a bias where the layout
    takes one: one more term). Shapes: G=3, M=6, K=40, N=5, an empty group and rows or columns
    past offs[-1] where the layout has offs."""
    gen = torch.Generator().manual_seed(7)
    G, M, K, N = 3, 6, 40, 5

    def r(*shape):  # magnitudes 2^-20 .. 2^20
        scale = 2.0 ** torch.randint(-20, 21, shape, generator=gen)
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale

    a, b, offs, bias = {"2d3d": (r(M, K), r(G, K, N), i32(2, 2, 5), r(G, N)),
                        "2d2d": (r(M, K), r(K, N), i32(15, 15, 36), None),
                        "3d3d": (r(G, M, K), r(G, K, N), None, r(G, N)),
                        "3d2d": (r(G, M, K), r(K, N), i32(1, 1, 4), None)}[layout]
    exact = _exact(a, b, offs, bias)
    bound = 2 * 2.0**-53 * exact.abs() + 2.0**-70 * magnitude(a, b, offs, bias)
    assert ((oracle(a, b, offs, bias) - exact).abs() <= bound).all()
    assert ((reference_results(a, b, offs, bias)[0] - exact).abs() <= bound).all()
    assert ((oracle(a, b, offs, bias, exact=False) - exact).abs() > bound).any()  # the plain sum is not


@pytest.mark.parametrize("layout", ["2d3d", "2d2d", "3d3d", "3d2d"])
def test_reference_results_are_the_three_documented_problems(layout):
    """moe_ops.testing.reference_results gives (the problem in float64, in the inputs' precision
    with out_dtype, in float64 on absolute values with |bias|): what assert_close's rule is
    defined on. A magnitude that dropped |bias| or the absolute values, or a ref_same without
    out_dtype, would still let every kernel test pass, only with a wrong tolerance. Inputs are
    small whole numbers, so every computation is exact and the oracle's results must match bit
    for bit. Shapes: strategies.small_problem's, bfloat16 with a bias [G, N] of magnitude ~100
    where the layout takes one, out_dtype float32."""
    with_bias = layout in ("2d3d", "3d3d")
    args, offs = small_problem(layout, torch.float64, bias=with_bias)
    whole = [(t * 4).round().to(torch.bfloat16) for t in args]  # |values| <= ~16, exact in bf16
    if with_bias:
        whole[2] = whole[2] * 25  # bias dominates the magnitude: dropping it shows
    a, b, bias = (*whole, None)[:3]
    ref64, ref_same, mag = reference_results(a, b, offs, bias, torch.float32)
    assert ref64.dtype == torch.float64 and torch.equal(ref64, oracle(a, b, offs, bias))
    want_same = oracle(a, b, offs, bias, torch.float32, exact=False)
    assert ref_same.dtype == torch.float32 and torch.equal(ref_same, want_same)
    assert mag.dtype == torch.float64 and torch.equal(mag, magnitude(a, b, offs, bias))

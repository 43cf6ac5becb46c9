"""The CUDA backend's Triton kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET).

Categories:
* tile schedule: BM-row blocks straddling group boundaries, several tiles per persistent
  program, partial tiles in every dimension, empty groups, rows past offs[-1];
* every element is written: outputs pre-filled with NaN come back with exact zeros where the
  contract says (tail rows, empty 2Dx2D groups), so ``torch.empty`` outputs are safe;
* layouts and options: transposed mat_b (strides, no copy), 2Dx2D with fp32 output, 3Dx3D with
  strided operands and bias, 3Dx2D through the transposition identity, fp64;
* the opt-in TMA operand copies (tensor descriptors): straddling tiles, tails zero-filled by
  the copies' bounds, transposed mat_b, 3Dx3D, and the operands it declines;
* 64-bit indices: operands whose element offsets pass 2^31, in a sparse memory-mapped file;
* the interpreter-only bf16 upcast flag, and the registered kernel through the dispatcher.

These run the same kernels as a GPU would, with small tiles (TileConfig) where a test needs many
tiles; the interpreter costs ~5 ms per tile operation, so shapes stay small.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import moe_ops
from moe_ops import _contract
from moe_ops.testing import assert_close, reference_results
from oracle import magnitude, oracle
from strategies import long_float64_problem

tk = pytest.importorskip("moe_ops.backends.cuda.triton_kernels", reason="triton is not installed (pip install triton==3.9.0)")

SMALL = tk.TileConfig(16, 16, 16, GROUP_M=2)
SMALL_SPLIT = tk.TileConfig(16, 32, 16, GROUP_M=2, epilogue_split=True)  # the 128x256 epilogue path
HALF = (torch.bfloat16, torch.float16)


def _check(out, a, b, offs=None, bias=None, out_dtype=None, what=""):
    ref64 = oracle(a, b, offs, bias, out_dtype, exact=True)
    ref_same = oracle(a, b, offs, bias, out_dtype, exact=False)
    assert_close(out, ref64, ref_same, magnitude(a, b, offs, bias), what=what)


def _run(a, b, offs=None, bias=None, out_dtype=None, *, config=SMALL, programs=3):
    """The interpreted kernels writing into a NaN-filled output (so unwritten elements show)."""
    p = _contract.check_args(a, b, offs, bias, out_dtype)
    out = torch.full(p.out_shape, float("nan"), dtype=p.out_dtype)
    tk.grouped_mm(p, a, b, offs, bias, interpret=True, config=config, programs=programs, out=out)
    return out


def _randn(*shape, dtype, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("config", [SMALL, SMALL_SPLIT], ids=["whole-epilogue", "split-epilogue"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_straddling_tiles_empty_groups_and_tail(dtype, config):
    # 16-row tiles; group ends 5, 21, 21, 40, 61 cut tiles mid-way; group 2 is empty; rows
    # 61..69 are past offs[-1]. K = 40 is 2.5 K steps, N = 40 is 2.5 (or 1.25) column tiles;
    # 3 programs walk the tiles.
    a = _randn(70, 40, dtype=dtype, seed=1)
    b = _randn(5, 40, 40, dtype=dtype, seed=2)
    offs = torch.tensor([5, 21, 21, 40, 61], dtype=torch.int32)
    out = _run(a, b, offs, config=config)
    _check(out, a, b, offs, what=f"2d3d {dtype}")
    assert torch.count_nonzero(out[61:]) == 0


def test_no_rows_in_any_group_gives_zeros():
    a = _randn(37, 16, dtype=torch.float32, seed=3)
    b = _randn(3, 16, 20, dtype=torch.float32, seed=4)
    out = _run(a, b, torch.zeros(3, dtype=torch.int64))
    assert torch.equal(out, torch.zeros(37, 20))


def test_one_group_takes_every_row():
    a = _randn(50, 32, dtype=torch.float16, seed=5)
    b = _randn(4, 32, 24, dtype=torch.float16, seed=6)
    offs = torch.tensor([0, 0, 50, 50])
    _check(_run(a, b, offs), a, b, offs, what="all rows to group 2")


@pytest.mark.parametrize("dtype", HALF)
def test_transposed_mat_b_with_bias_and_fp32_out(dtype):
    # The input gradient's layout: mat_b is a [G, N, K] tensor viewed as [G, K, N].
    a = _randn(45, 48, dtype=dtype, seed=7)
    b_nk = _randn(3, 24, 48, dtype=dtype, seed=8)
    b = b_nk.transpose(1, 2)
    bias = _randn(3, 24, dtype=dtype, seed=9)
    offs = torch.tensor([10, 10, 41])
    out = _run(a, b, offs, bias, torch.float32, config=SMALL_SPLIT)
    assert out.dtype == torch.float32
    _check(out, a, b, offs, bias, torch.float32, what=f"transposed mat_b {dtype}")
    assert torch.count_nonzero(out[41:]) == 0, "bias must not leak into rows past offs[-1]"


@pytest.mark.parametrize("config", [SMALL, SMALL_SPLIT], ids=["whole-epilogue", "split-epilogue"])
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_2d2d_ragged_k_empty_groups(out_dtype, config):
    # The weight gradient: mat_a = x.t() of a [K, M] activation (column-major), groups over K
    # with empty groups 1 and 3 and K past offs[-1]; their [M, N] slices must be exact zeros.
    # M = 40 is 3 row tiles: the last band of GROUP_M = 2 row tiles is partial (a band height
    # not clamped to it leaves tiles of every group uncomputed: NaN).
    x = _randn(60, 40, dtype=torch.bfloat16, seed=10)
    a = x.t()
    b = _randn(60, 36, dtype=torch.bfloat16, seed=11)
    offs = torch.tensor([17, 17, 50, 50], dtype=torch.int32)
    out = _run(a, b, offs, out_dtype=out_dtype, config=config)
    _check(out, a, b, offs, out_dtype=out_dtype, what="2d2d")
    assert torch.count_nonzero(out[1]) == 0 and torch.count_nonzero(out[3]) == 0


@pytest.mark.parametrize("layout", ["2d3d", "2d2d", "3d2d"])
def test_unsanitized_offs_are_clamped_inside_the_kernels(layout):
    # On a GPU the op hands the kernels offs as the caller passed it (CLAMPS_OFFS): negative,
    # decreasing, past the extent and past 2^32 (an int64 that int32 arithmetic would wrap to 7).
    # Every element must be the result for cummax(clamp(offs, 0, extent)), NaN-free.
    garbage = torch.tensor([-5, 9, 4, (1 << 32) + 7, 3, 1 << 40], dtype=torch.int64)
    dt = torch.float32
    if layout == "2d3d":
        a, b = _randn(40, 24, dtype=dt, seed=30), _randn(6, 24, 20, dtype=dt, seed=31)
    elif layout == "2d2d":
        a, b = _randn(40, 20, dtype=dt, seed=32).t(), _randn(40, 24, dtype=dt, seed=33)
    else:
        a, b = _randn(6, 20, 24, dtype=dt, seed=34), _randn(24, 40, dtype=dt, seed=35)
    sanitized = _contract.sanitize_offs(garbage, 40)
    assert sanitized.tolist() == [0, 9, 9, 40, 40, 40]
    _check(_run(a, b, garbage), a, b, sanitized, what=f"{layout} with unsanitized offs")


@pytest.mark.parametrize("layout", ["2d3d", "3d2d"])
def test_offs_at_the_int64_extremes_are_clamped_inside_the_kernels(layout):
    # -2^63 after a group end past the first row tile: end - start wrapped to a huge size and the
    # tile count to a negative int32, so the later groups' tiles were never computed (NaN here).
    garbage = torch.tensor([20, -(1 << 63), 30, (1 << 63) - 1], dtype=torch.int64)
    dt = torch.float32
    if layout == "2d3d":
        a, b = _randn(40, 24, dtype=dt, seed=36), _randn(4, 24, 20, dtype=dt, seed=37)
    else:
        a, b = _randn(4, 20, 24, dtype=dt, seed=38), _randn(24, 40, dtype=dt, seed=39)
    sanitized = _contract.sanitize_offs(garbage, 40)
    assert sanitized.tolist() == [20, 20, 30, 40]
    _check(_run(a, b, garbage), a, b, sanitized, what=f"{layout} with offs at the int64 extremes")


def test_3d3d_strided_operands_with_bias():
    a = _randn(3, 20, 64, dtype=torch.float32, seed=12)[:, :, ::2]  # [3, 20, 32], K stride 2
    b = _randn(3, 24, 32, dtype=torch.float32, seed=13).transpose(1, 2)  # [3, 32, 24]
    bias = _randn(3, 48, dtype=torch.float32, seed=14)[:, ::2]
    _check(_run(a, b, None, bias), a, b, None, bias, what="3d3d")


def test_3d2d_through_the_transposition_identity():
    a = _randn(4, 18, 32, dtype=torch.float16, seed=15)
    b = _randn(32, 45, dtype=torch.float16, seed=16)
    offs = torch.tensor([7, 7, 30, 38])
    out = _run(a, b, offs)
    _check(out, a, b, offs, what="3d2d")
    assert torch.count_nonzero(out[:, 38:]) == 0


@pytest.mark.parametrize("layout", ["2d3d", "2d3d-nk", "2d2d", "3d3d", "3d2d"])
def test_long_float64_sums_meet_the_rule_against_a_twice_precise_ground_truth(layout):
    """float64 sums of 4096 products (the property suite draws K <= 48) in the GPU's float64 tiles
    (tile_config: 64 x 64 x 16, 256 k steps accumulated in float64) against reference_results,
    which sums as if in twice float64's precision, as tests/test_cpu.py's test of the same name
    does for the CPU kernels (problems: strategies.long_float64_problem). Measured here
    (2026-12-07, 3 seeds): errors at most 0.10 of the tolerance; with the tiles' dots done in
    float32 (a mutant) 5e6-1.2e7 times it. The TPU and Neuron backends send float64 to the
    reference."""
    a, b, offs = long_float64_problem(layout, 4096)
    config = tk.tile_config(90, torch.float64)
    assert (config.BM, config.BN, config.BK) == (64, 64, 16)
    assert_close(_run(a, b, offs, config=config), *reference_results(a, b, offs), what=layout)


def test_out_buffer_must_be_contiguous_with_the_problems_shape_and_dtype():
    """``out=`` (a static buffer for CUDA graphs) is written in place through the layout the
    kernels assume; a wrong shape, dtype or memory order raises before any launch and leaves it
    untouched. a [20, 16] fp32, b [2, 16, 8], out [20, 8]."""
    a = _randn(20, 16, dtype=torch.float32, seed=90)
    b = _randn(2, 16, 8, dtype=torch.float32, seed=91)
    offs = torch.tensor([7, 20])
    p = _contract.check_args(a, b, offs)
    bad = {
        "shape": torch.full((20, 9), float("nan")),
        "dtype": torch.full((20, 8), float("nan"), dtype=torch.float64),
        "memory order": torch.full((8, 20), float("nan")).t(),
    }
    for what, out in bad.items():
        with pytest.raises(ValueError, match="out must be a contiguous"):
            tk.grouped_mm(p, a, b, offs, None, interpret=True, config=SMALL, out=out)
        assert out.isnan().all(), what


def _run_guarded_cases():
    """Every layout with M, K, N cut mid-tile (16-element tiles), each operand, the bias and the
    output ending at a guard page (run in a child process by the test below: a fault kills it).
    Shapes (fp32): 2d3d a [37, 24] b [3, 24, 21] bias [3, 21], rows 33.. past offs[-1]; 3d3d
    a [3, 19, 24] b [3, 24, 21] bias [3, 21]; 2d2d a [19, 37] b [37, 21]; 3d2d a [3, 19, 24]
    b [24, 37]. The interpreter dereferences only the enabled lanes of a masked load or store,
    so a missing mask shows."""
    from guard_pages import guarded  # tests/: the CPU kernels' guard pages, on the path here

    f32 = torch.float32
    cases = {
        "2d3d": ((37, 24), (3, 24, 21), torch.tensor([5, 20, 33]), True),
        "3d3d": ((3, 19, 24), (3, 24, 21), None, True),
        "2d2d": ((19, 37), (37, 21), torch.tensor([5, 20, 37]), False),
        "3d2d": ((3, 19, 24), (24, 37), torch.tensor([5, 20, 37]), False),
    }
    for seed, (layout, (sa, sb, offs, with_bias)) in enumerate(cases.items()):
        a = guarded(_randn(*sa, dtype=f32, seed=60 + seed), at_end=True)
        b = guarded(_randn(*sb, dtype=f32, seed=70 + seed), at_end=True)
        bias = guarded(_randn(3, 21, dtype=f32, seed=80), at_end=True) if with_bias else None
        p = _contract.check_args(a, b, offs, bias)
        out = guarded(torch.full(p.out_shape, float("nan")), at_end=True)
        tk.grouped_mm(p, a, b, offs, bias, interpret=True, config=SMALL, programs=3, out=out)
        _check(out, a, b, offs, bias, what=f"{layout} at a guard page")
        print(layout, "ok", flush=True)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mprotect guard pages (Linux)")
def test_no_access_past_the_operands_or_the_output():
    # A load or store mask along M, N or K that a kernel drops (e.g. the b column mask, which
    # only feeds columns the store drops) changes no value of the result: it reads or writes past
    # the tensors, which is an illegal address on a GPU. Each tensor here ends at a guard page.
    tests = Path(__file__).resolve().parent
    code = (f"import sys; sys.path.insert(0, {str(tests)!r}); "
            "import test_cuda_interpreter as t; t._run_guarded_cases()")
    r = subprocess.run([sys.executable, "-c", code], cwd=tests.parent, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, f"rc {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"
    assert r.stdout.split() == ["2d3d", "ok", "3d3d", "ok", "2d2d", "ok", "3d2d", "ok"], r.stdout


TMA_SMALL = tk.TileConfig(16, 16, 16, GROUP_M=2, tma=True)
TMA_SPLIT = tk.TileConfig(16, 32, 16, GROUP_M=2, epilogue_split=True, tma=True)


@pytest.mark.parametrize("config", [TMA_SMALL, TMA_SPLIT], ids=["whole-epilogue", "split-epilogue"])
@pytest.mark.parametrize("dtype", HALF)
def test_tma_copies_straddling_tiles_empty_groups_and_tail(dtype, config):
    # The opt-in TMA path (MOE_OPS_CUDA_TMA=1 on sm_90+): tiles of 16 rows straddle the group
    # ends 5, 21, 40, 61 (group 2 empty), whole rows of the next group are copied in and must
    # be dropped at the store; K = N = 40 end mid-tile (zero-filled by the copies' bounds); rows
    # 61.. are past offs[-1]; bias and fp32 output.
    a = _randn(70, 40, dtype=dtype, seed=40)
    b = _randn(5, 40, 40, dtype=dtype, seed=41)
    bias = _randn(5, 40, dtype=dtype, seed=42)
    offs = torch.tensor([5, 21, 21, 40, 61], dtype=torch.int32)
    assert tk._tma_descriptors(a, b, False, config) is not None
    out = _run(a, b, offs, bias, torch.float32, config=config)
    _check(out, a, b, offs, bias, torch.float32, what=f"2d3d TMA {dtype}")
    assert torch.count_nonzero(out[61:]) == 0


@pytest.mark.parametrize("dtype", HALF)
def test_tma_copies_transposed_mat_b_and_3d3d(dtype):
    # The input gradient's [G, N, K] storage seen as [G, K, N] (described as [G, N, K], each tile
    # transposed), and 3Dx3D with 21 rows per batch: a 16-row tile's last rows are past its
    # batch and must come in as zeros (the batch's bounds, not the next batch's rows).
    a = _randn(45, 48, dtype=dtype, seed=43)
    b = _randn(3, 24, 48, dtype=dtype, seed=44).transpose(1, 2)
    offs = torch.tensor([10, 10, 41])
    assert tk._tma_descriptors(a, b, False, TMA_SPLIT)[2] is True
    out = _run(a, b, offs, config=TMA_SPLIT)
    _check(out, a, b, offs, what=f"transposed mat_b TMA {dtype}")
    assert torch.count_nonzero(out[41:]) == 0
    a3 = _randn(3, 21, 40, dtype=dtype, seed=45)
    b3 = _randn(3, 40, 24, dtype=dtype, seed=46)
    bias3 = _randn(3, 24, dtype=dtype, seed=47)
    assert tk._tma_descriptors(a3, b3, True, TMA_SMALL) is not None
    _check(_run(a3, b3, None, bias3, config=TMA_SMALL), a3, b3, None, bias3, what=f"3d3d TMA {dtype}")


def test_tma_declined_where_copies_cannot_describe_the_operands():
    # TMA needs a unit innermost stride, a 16-byte aligned base and 16-byte multiples for the
    # other strides: K = 36 bf16 rows are 72 bytes apart; a view one element in is 2-byte
    # aligned; mat_b strided in both inner dimensions has no unit stride; expanded weights have
    # stride 0, which cuTensorMapEncodeTiled does not describe. Those run the pointer loads, with
    # the same results.
    b = _randn(3, 40, 24, dtype=torch.bfloat16, seed=48)
    a = _randn(30, 40, dtype=torch.bfloat16, seed=49)
    offs = torch.tensor([8, 20, 30])
    cases = {
        "K*2 bytes not a multiple of 16": (_randn(30, 36, dtype=torch.bfloat16, seed=50), b[:, :36]),
        "base not 16-byte aligned": (_randn(30 * 40 + 1, dtype=torch.bfloat16, seed=51)[1:].view(30, 40), b),
        "no unit stride in mat_b": (a, _randn(3, 80, 48, dtype=torch.bfloat16, seed=52)[:, ::2, ::2]),
        "one expert's weights expanded (stride 0)": (a, b[:1].expand(3, 40, 24)),
        # cuTensorMapEncodeTiled takes no empty dimension; the interpreter's copies would.
        "K = 0 (empty operands)": (a[:, :0], b[:, :0]),
    }
    for what, (x, w) in cases.items():
        assert tk._tma_descriptors(x, w, False, TMA_SMALL) is None, what
        _check(_run(x, w, offs, config=TMA_SMALL), x, w, offs, what=what)
    assert tk._tma_descriptors(a, b, False, TMA_SMALL) is not None


def test_tma_is_opt_in_and_only_for_16_bit_on_sm90_and_newer(monkeypatch):
    monkeypatch.delenv(tk.TMA_ENV, raising=False)
    assert not tk.tile_config(90, torch.bfloat16).tma
    monkeypatch.setenv(tk.TMA_ENV, "1")
    assert tk.tile_config(90, torch.bfloat16).tma and tk.tile_config(100, torch.float16, 16).tma
    assert not tk.tile_config(80, torch.bfloat16).tma and not tk.tile_config(90, torch.float32).tma


def test_default_interpreter_config():
    a = _randn(100, 40, dtype=torch.bfloat16, seed=17)
    b = _randn(6, 40, 30, dtype=torch.bfloat16, seed=18)
    offs = torch.tensor([3, 3, 40, 70, 70, 90])
    _check(_run(a, b, offs, config=tk.INTERPRETER_CONFIG, programs=tk.INTERPRETER_PROGRAMS), a, b, offs)


def test_bf16_dot_upcast_flag_is_what_makes_the_interpreter_right():
    """Canary: the interpreter's bf16 tl.dot multiplies raw bits (triton-lang/triton#11584), which
    is why interpreted bf16 kernels cast tiles to fp32 (DOT_UPCAST). If this starts failing,
    Triton fixed the bug and the flag can go."""
    a = _randn(16, 16, dtype=torch.bfloat16, seed=19)
    b = _randn(1, 16, 16, dtype=torch.bfloat16, seed=20)
    offs = torch.tensor([16])
    ref = oracle(a, b, offs, exact=True)
    outs = {}
    for upcast in (False, True):
        out = torch.empty(16, 16, dtype=torch.bfloat16)
        tk.interpreted()._rows_kernel[(1,)](
            a, b, out, out, offs, M=16, N=16, K=16, G=1,
            s_ag=0, s_am=16, s_ak=1, s_bg=256, s_bk=16, s_bn=1, s_og=0, s_om=16, s_on=1,
            s_biasg=0, s_biasn=0, NUM_PROGRAMS=1, HAS_OFFS=True, HAS_BIAS=False,
            BM=16, BN=16, BK=16, GROUP_M=1, ACC_DTYPE=tk.tl.float32, PRECISION="ieee", DOT_UPCAST=upcast,
            EPILOGUE_SPLIT=False)
        outs[upcast] = (out.double() - ref).abs().max().item()
    assert outs[True] < 0.1 < outs[False], outs


def test_64bit_element_offsets(tmp_path):
    """Operands whose element offsets pass 2^31 (row / group strides of ~2^31 - 2^20 elements,
    and a K stride that the K loop's step multiplies past 2^31).

    They live in a sparse memory-mapped file: 16 GiB of address space, a few KiB of pages
    touched. 32-bit offset arithmetic would wrap to offsets ~2^32 elements too low; the views
    start 2^32 elements into the mapping, so a wrap reads the mapping's zero pages (a wrong
    result, not a crash).
    """
    dtype = torch.float16
    stride = 2**31 - 2**20
    start = 2**32
    M, K, N, G = 3, 16, 16, 3
    elements = start + 4 * stride + 4096
    path = tmp_path / "sparse.bin"
    with open(path, "wb") as f:
        f.truncate(elements * 2)
    storage = torch.UntypedStorage.from_file(str(path), shared=True, nbytes=elements * 2)
    base = torch.empty(0, dtype=dtype).set_(storage, 0, (elements,), (1,))
    # mat_a [3, 16]: row r at start + r * stride (rows 1 and 2 pass 2^31 past the view's start).
    a = base.as_strided((M, K), (stride, 1), start)
    a.copy_(_randn(M, K, dtype=dtype, seed=21))
    # mat_b [3, 16, 16]: group g at start + 2048 + g * stride.
    b = base.as_strided((G, K, N), (stride, N, 1), start + 2048)
    b.copy_(_randn(G, K, N, dtype=dtype, seed=22))
    offs = torch.tensor([1, 2, 3])
    a_small, b_small = a.clone(), b.clone()
    out = _run(a, b, offs, programs=1)
    _check(out, a_small, b_small, offs, what="64-bit offsets 2d3d")
    # 2d2d with the ragged K dimension strided by ~2^31: out[g] = a2[:, k_g] @ b2[k_g].
    K2 = 4
    a2 = base.as_strided((M, K2), (1, stride), start + 8192)  # K columns ~2^31 apart
    a2.copy_(_randn(M, K2, dtype=dtype, seed=23))
    b2 = base.as_strided((K2, N), (stride, 1), start + 16384)
    b2.copy_(_randn(K2, N, dtype=dtype, seed=24))
    offs2 = torch.tensor([1, 1, 4])
    _check(_run(a2, b2, offs2, programs=1), a2.clone(), b2.clone(), offs2, what="64-bit offsets 2d2d")
    # 2d3d with mat_a's K indices 2^27 elements apart: the K loop's pointer step, BK = 16 times
    # the stride, is 2^31 elements (an int32 product wrapped to -2^31 and read zero pages).
    K3 = 32
    a3 = base.as_strided((M, K3), (1, 2**27), start + 24576)
    a3.copy_(_randn(M, K3, dtype=dtype, seed=25))
    b3 = _randn(G, K3, N, dtype=dtype, seed=26)
    _check(_run(a3, b3, offs, programs=1), a3.clone(), b3, offs, what="64-bit K step 2d3d")
    del a, b, a2, b2, a3, base, storage


def test_fp32_precision_is_ieee_unless_opted_in(monkeypatch):
    monkeypatch.delenv(tk.FP32_PRECISION_ENV, raising=False)
    assert tk.fp32_precision() == "ieee"
    assert tk._precision(torch.float32) == "ieee"
    ieee_cfg = tk.tile_config(90, torch.float32)
    monkeypatch.setenv(tk.FP32_PRECISION_ENV, "tf32")
    assert tk._precision(torch.float32) == "tf32"
    assert tk.tile_config(90, torch.float32) != ieee_cfg  # tf32 runs on tensor cores: 16-bit tile shape
    monkeypatch.setenv(tk.FP32_PRECISION_ENV, "fast")
    with pytest.raises(ValueError, match="MOE_OPS_CUDA_FP32_PRECISION"):
        tk.fp32_precision()


# Shared memory per SM that one program may use (KiB): A100 164, sm_86/89 100, H100 227, B200 227,
# sm_120 100. Triton needs the pipelined operand tiles plus some scratch for the epilogue.
_SMEM_KIB = {80: 163, 86: 99, 89: 99, 90: 227, 100: 227, 120: 99}


@pytest.mark.parametrize("arch", sorted(_SMEM_KIB))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("rows_per_group", [None, 16])
def test_tile_configs_fit_shared_memory(arch, dtype, rows_per_group):
    cfg = tk.tile_config(arch, dtype, rows_per_group)
    element = torch.finfo(dtype).bits // 8
    pipelines = (cfg.BM * cfg.BK + cfg.BK * cfg.BN) * element * cfg.num_stages * cfg.programs_per_sm
    assert pipelines <= _SMEM_KIB[arch] * 1024 * 0.9, (arch, dtype, cfg, pipelines)
    assert cfg.BM >= 16 and cfg.BN >= 16 and cfg.BK >= 16  # tl.dot's minimum
    if rows_per_group is not None and dtype in HALF:
        assert cfg.BM == 64


def _dispatch_cuda_kernel(*args):
    """Run the op's CUDA kernel on CPU tensors (the dispatcher's CUDA entry, skipping device checks)."""
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)
    return torch.ops.moe.grouped_mm.default.redispatch(keys, *args)


def test_registered_cuda_kernel_through_the_dispatcher():
    assert torch._C._dispatch_has_kernel_for_dispatch_key("moe::grouped_mm", "CUDA")
    a = _randn(30, 32, dtype=torch.bfloat16, seed=25)
    b = _randn(3, 32, 20, dtype=torch.bfloat16, seed=26)
    bias = _randn(3, 20, dtype=torch.bfloat16, seed=27)
    offs = torch.tensor([4, 4, 25])
    moe_ops.reset_kernel_counts()
    out = _dispatch_cuda_kernel(a, b, offs, bias, torch.float32)
    assert moe_ops.kernel_counts() == {"cuda:triton-interpreter": 1}
    _check(out, a, b, offs, bias, torch.float32, what="dispatcher")
    with pytest.raises(ValueError, match="non-decreasing"):
        _dispatch_cuda_kernel(a, b, torch.tensor([4, 3, 25]), None, None)  # kernel_entry's checks


def test_without_triton_the_kernel_falls_back_to_the_reference_and_logs_once(monkeypatch, caplog):
    from moe_ops.backends import cuda

    monkeypatch.setattr(cuda, "_toolchains", frozenset())
    a = _randn(12, 8, dtype=torch.float32, seed=28)
    b = _randn(2, 8, 5, dtype=torch.float32, seed=29)
    offs = torch.tensor([5, 12])
    moe_ops.reset_kernel_counts()
    with caplog.at_level(logging.INFO, logger="moe_ops"):
        for _ in range(2):
            out = _dispatch_cuda_kernel(a, b, offs, None, None)
    assert moe_ops.kernel_counts() == {"reference": 2}
    _check(out, a, b, offs)
    reasons = [r.getMessage() for r in caplog.records if "triton is not installed" in r.getMessage()]
    assert len(reasons) == 1, reasons


def test_small_group_tiles_follow_the_row_tiles_of_every_layout():
    # 128 experts and 4096 routed tokens: groups of 32 rows, whichever operand holds them. In 3Dx2D
    # the kernel's rows are out's columns, grouped over N (M is a dense dimension); 3Dx3D batches
    # of 16 rows are as small. They get the 64-row tiles that 2Dx3D gets (half the padding).
    bf = torch.bfloat16
    e = torch.empty
    offs = torch.zeros(128, dtype=torch.int32)
    cases = {
        "2d3d": _contract.check_args(e(4096, 8, dtype=bf), e(128, 8, 8, dtype=bf), offs),
        "3d2d": _contract.check_args(e(128, 8192, 8, dtype=bf), e(8, 4096, dtype=bf), offs),
        "3d3d": _contract.check_args(e(128, 16, 8, dtype=bf), e(128, 8, 8, dtype=bf)),
    }
    for layout, p in cases.items():
        assert tk.tile_config(90, bf, tk.rows_per_group(p)).BM == 64, layout
    large = _contract.check_args(e(8, 8192, 8, dtype=bf), e(8, 4096, dtype=bf), offs[:8])
    assert tk.tile_config(90, bf, tk.rows_per_group(large)).BM == 128  # 512 columns per group
    wgrad = _contract.check_args(e(8, 4096, dtype=bf), e(4096, 8, dtype=bf), offs)
    assert tk.rows_per_group(wgrad) is None  # 2Dx2D tiles span M whatever the groups
    # The boundary: "fewer than 64 rows" per group take the small tiles, 64 rows do not.
    assert tk.tile_config(90, bf, 63).BM == 64 and tk.tile_config(90, bf, 64).BM == 128

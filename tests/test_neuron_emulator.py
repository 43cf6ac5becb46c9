"""Our numpy NKI emulator (NOT AWS's simulator) rejects what Trainium rejects.

Each test runs a tiny kernel written with ``neuron_nki``'s ``nl`` / ``nisa`` (the names the real
kernels use) on the emulator and checks that a hardware or API rule is enforced:
* tile limits: 128 partitions, one 2 KiB PSUM bank per partition, SBUF capacity;
* nc_matmul / nc_transpose memory spaces, operand shapes, dtypes, PSUM accumulation rules;
* DMA: no PSUM, equal element counts, bounds, indirect indices with oob_mode error / skip;
* reads of never-written memory and kernels that leave outputs unwritten;
* tensor_copy_predicated: what it selects, and its dtype / shape / reverse_pred rules;
* bf16 rounding (to nearest even);
* the real kernels fail when their tiling exceeds the hardware (a kernel told pmax = 256).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_ops import _contract
from moe_ops.backends import neuron, neuron_nki, neuron_emulator as emu
from moe_ops.backends.neuron_nki import nl, nisa, use
from moe_ops.testing import assert_close, reference_results

pytestmark = pytest.mark.backend_neuron


def run(kernel, *args):
    return emu.run_kernel(kernel, list(args), activate=use)[0]


def f32(shape, value=1.0):
    return (np.full(shape, value, dtype=np.float32), "float32")


def _sbuf(shape, dtype="float32", value=1.0):
    t = nl.ndarray(shape, dtype=dtype, buffer=nl.sbuf)
    nisa.memset(dst=t, value=value)
    return t


def _store(t):
    out = nl.ndarray(t.shape, dtype=t.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


# ---------------------------------------------------------------- tile limits
def test_partition_dimension_is_at_most_128():
    assert run(lambda: _store(_sbuf((128, 4))))[0].shape == (128, 4)
    with pytest.raises(emu.EmulatorError, match="partition dimension 129 > 128"):
        run(lambda: _sbuf((129, 4)))
    with pytest.raises(emu.EmulatorError, match="partition dimension 129 > 128"):
        run(lambda: nl.ndarray((129, 8), dtype=nl.float32, buffer=nl.psum))


def test_psum_tile_is_one_2kib_bank_per_partition():
    def psum(shape, dtype):
        nl.ndarray(shape, dtype=dtype, buffer=nl.psum)

    run(lambda: psum((128, 512), nl.float32))  # 2048 bytes: fits
    run(lambda: psum((128, 1024), nl.bfloat16))  # 2048 bytes: fits
    with pytest.raises(emu.EmulatorError, match="2052 bytes per partition; the limit is 2048"):
        run(lambda: psum((128, 513), nl.float32))


def test_sbuf_capacity_of_live_tiles():
    def kernel():
        keep = [nl.ndarray((128, 25 * 1024), dtype=nl.float32, buffer=nl.sbuf) for _ in range(2)]  # 200 KiB
        del keep

    with pytest.raises(emu.EmulatorError, match="sbuf over capacity"):
        run(kernel)

    def reuse():  # the same allocations one after the other fit
        for _ in range(4):
            t = nl.ndarray((128, 25 * 1024), dtype=nl.float32, buffer=nl.sbuf)
            del t
        return _store(_sbuf((1, 1)))

    run(reuse)
    with pytest.raises(emu.EmulatorError, match="the limit is 196608"):
        run(lambda: nl.ndarray((1, 49153), dtype=nl.float32, buffer=nl.sbuf))


def test_psum_capacity_of_live_tiles():
    """PSUM holds 8 banks of 2 KiB per partition: 8 live one-bank tiles fit, a ninth does not."""
    def kernel(n):
        keep = [nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum) for _ in range(n)]
        del keep
        return _store(_sbuf((1, 1)))

    run(lambda: kernel(8))
    with pytest.raises(emu.EmulatorError, match="psum over capacity: 16384 bytes per partition"):
        run(lambda: kernel(9))


# ---------------------------------------------------------------- Tensor Engine
def _matmul(stat_buf=emu.SBUF, mov_buf=emu.SBUF, dst_buf=emu.PSUM, k=128, k2=None, m=64, n=32,
            stat_dtype="float32", mov_dtype="float32", dst_dtype="float32", accumulate=False):
    def kernel(hbm):
        def operand(shape, dtype, buf):
            if buf == emu.SHARED_HBM:
                return hbm
            t = nl.ndarray(shape, dtype=dtype, buffer=nl.sbuf)
            nisa.memset(dst=t, value=1.0)
            if buf == emu.PSUM:
                p = nl.ndarray(shape, dtype=dtype, buffer=nl.psum)
                nisa.tensor_copy(dst=p, src=t)
                return p
            return t

        stat = operand((k, m), stat_dtype, stat_buf)
        mov = operand((k2 or k, n), mov_dtype, mov_buf)
        dst = nl.ndarray((m, n), dtype=dst_dtype, buffer=dst_buf)
        nisa.nc_matmul(dst=dst, stationary=stat, moving=mov, accumulate=accumulate)
        res = nl.ndarray((m, n), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=res, src=dst)
        return _store(res)

    return run(kernel, f32((k2 or k, n)))[0]


def test_matmul_contracts_over_partitions():
    out = _matmul(k=100, m=7, n=9)
    assert out.shape == (7, 9) and np.all(out == 100.0)


@pytest.mark.parametrize("where, message", [
    (dict(stat_buf=emu.PSUM), "operands must be in SBUF: stationary in psum"),
    (dict(mov_buf=emu.SHARED_HBM), "operands must be in SBUF: stationary in sbuf, moving in shared_hbm"),
    (dict(dst_buf=emu.SBUF), "nc_matmul writes PSUM, dst is in sbuf"),
])
def test_matmul_memory_spaces(where, message):
    with pytest.raises(emu.EmulatorError, match=message):
        _matmul(**where)


@pytest.mark.parametrize("shape, message", [
    (dict(k=128, k2=64), "contraction .partition. sizes differ"),
    (dict(m=129), "partition dimension 129"),  # the [129, n] PSUM result cannot exist
    (dict(n=513), "the limit is 2048"),  # nor a [m, 513] fp32 result: one bank
])
def test_matmul_operand_shapes(shape, message):
    with pytest.raises(emu.EmulatorError, match=message):
        _matmul(**shape)


@pytest.mark.parametrize("dtypes, message", [
    (dict(stat_dtype="float32", mov_dtype="bfloat16"), "float32 only pairs with float32"),
    (dict(stat_dtype="int32", mov_dtype="int32"), "not a Tensor Engine input dtype"),
    (dict(stat_dtype="bfloat16", mov_dtype="bfloat16", dst_dtype="bfloat16"), "accumulates into a float32"),
])
def test_matmul_dtypes(dtypes, message):
    with pytest.raises(emu.EmulatorError, match=message):
        _matmul(**dtypes)
    _matmul(stat_dtype="bfloat16", mov_dtype="float16")  # 16-bit types mix


def test_matmul_accumulate_needs_a_matmul_initialised_psum():
    with pytest.raises(emu.EmulatorError, match="accumulate=True on PSUM not initialised by a matmul"):
        _matmul(accumulate=True)

    def after_memset():
        dst = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.psum)
        nisa.memset(dst=dst, value=0.0)
        nisa.nc_matmul(dst=dst, stationary=_sbuf((8, 4)), moving=_sbuf((8, 4)), accumulate=True)

    with pytest.raises(emu.EmulatorError, match="not initialised by a matmul"):
        run(after_memset)

    def overwritten(how):
        # A matmul initialises dst, then an engine write replaces it: that location no longer
        # holds a matmul result, so accumulating onto it is again undefined.
        dst = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=dst, stationary=_sbuf((8, 4)), moving=_sbuf((8, 4)), accumulate=False)
        if how == "memset":
            nisa.memset(dst=dst[0:1, 0:2], value=0.0)
        else:
            nisa.tensor_copy(dst=dst, src=_sbuf((4, 4)))
        nisa.nc_matmul(dst=dst, stationary=_sbuf((8, 4)), moving=_sbuf((8, 4)), accumulate=True)

    for how in ("memset", "tensor_copy"):
        with pytest.raises(emu.EmulatorError, match="not initialised by a matmul"):
            run(lambda: overwritten(how))

    def twice():
        dst = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.psum)
        for i in range(3):
            nisa.nc_matmul(dst=dst, stationary=_sbuf((8, 4)), moving=_sbuf((8, 4)), accumulate=(i > 0))
        res = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=res, src=dst)
        return _store(res)

    assert np.all(run(twice)[0] == 24.0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_matmul_sums_16_bit_products_in_fp32_in_partition_order(dtype):
    """The emulator's Tensor Engine sum (see ``_tensor_engine_sum``) for bf16 / fp16 operands.

    stationary [128, 1] of ones, so the result [1, 4] is each moving column's sum over the 128
    partitions; every value is exact in bf16 and fp16 (2^-24 is fp16's smallest subnormal).
    The expected values are worked out by hand: near 1, fp32 values are 2^-23 apart, so
    1 + 2^-24 is a tie and rounds to the even 1. A sum in fp64 (or any order but partitions
    0..127), or running in bf16 / fp16 (1 + 2^-12 rounds to 1 there), gives another value.
    """
    tiny = 2.0 ** -24
    first = np.zeros((128, 4))
    first[:, 0] = [1.0] + [tiny] * 127  # 1, then 127 ties that each round back to 1
    first[:, 1] = [tiny] * 127 + [1.0]  # 127 * 2^-24 (exact), + 1: 1 + 63.5 * 2^-23 -> even 64
    first[0:2, 2] = [1.0, 2.0 ** -12]  # exact in fp32, not in bf16 (2^-7 apart) nor fp16 (2^-10)
    first[0, 3] = 1.0
    # A second matmul with accumulate=True adds its own sum, 128 * 2^-24 = 2^-17 (exact), to the
    # PSUM value 1 once; starting its running sum from the PSUM value would leave 1.
    second = np.zeros((128, 4))
    second[:, 3] = tiny
    storage = np.float32 if dtype == "bfloat16" else np.float16

    def kernel(ones, mov1, mov2):
        def load(x):
            t = nl.ndarray(x.shape, dtype=dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=t, src=x)
            return t

        stat = load(ones)
        dst = nl.ndarray((1, 4), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=dst, stationary=stat, moving=load(mov1), accumulate=False)
        nisa.nc_matmul(dst=dst, stationary=stat, moving=load(mov2), accumulate=True)
        res = nl.ndarray((1, 4), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=res, src=dst)
        return _store(res)

    got = run(kernel, *((a.astype(storage), dtype) for a in (np.ones((128, 1)), first, second)))[0]
    np.testing.assert_array_equal(got, [[1.0, 1 + 2.0 ** -17, 1 + 2.0 ** -12, 1 + 2.0 ** -17]])


def test_transpose_reads_sbuf_writes_psum_same_dtype():
    def kernel(x, dst_buf=emu.PSUM, dst_dtype="float32"):
        t = nl.ndarray((4, 3), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        d = nl.ndarray((3, 4), dtype=dst_dtype, buffer=dst_buf)
        nisa.nc_transpose(dst=d, data=t)
        r = nl.ndarray((3, 4), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=r, src=d)
        return _store(r)

    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    np.testing.assert_array_equal(run(kernel, (x, "float32"))[0], x.T)
    with pytest.raises(emu.EmulatorError, match="reads SBUF and writes PSUM"):
        run(lambda x: kernel(x, dst_buf=emu.SBUF), (x, "float32"))
    with pytest.raises(emu.EmulatorError, match="keeps the dtype"):
        run(lambda x: kernel(x, dst_dtype="bfloat16"), (x, "float32"))


# ---------------------------------------------------------------- DMA and memory safety
def test_dma_never_touches_psum_and_counts_must_match():
    def from_psum():
        p = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.psum)
        nisa.memset(dst=p, value=0.0)
        return _store(p)

    with pytest.raises(emu.EmulatorError, match="cannot access PSUM"):
        run(from_psum)

    def mismatch(x):
        t = nl.ndarray((4, 5), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)

    with pytest.raises(emu.EmulatorError, match="element counts differ"):
        run(mismatch, f32((4, 4)))
    with pytest.raises(emu.EmulatorError, match="element counts differ"):  # nor a larger src
        run(mismatch, f32((4, 6)))


def test_static_slices_are_bounds_checked():
    def kernel(x):
        t = nl.ndarray((128, 8), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t[120:130], src=x[0:10])

    with pytest.raises(emu.EmulatorError, match="out of range for dimension 0 of size 128"):
        run(kernel, f32((16, 8)))


def test_access_patterns_are_bounds_checked_to_the_last_element():
    """An explicit access pattern over x [5, 3] fp32 may end at its last element (14) but not one
    past it (15, where a storage bound off by one would let it through)."""
    x = np.arange(15, dtype=np.float32).reshape(5, 3)

    def kernel(x, offset):
        t = nl.ndarray((1, 3), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x.ap(pattern=[[3, 1], [1, 3]], offset=offset))
        return _store(t)

    np.testing.assert_array_equal(run(lambda x: kernel(x, 12), (x, "float32"))[0], [[12, 13, 14]])
    with pytest.raises(emu.EmulatorError, match="out-of-bounds access: .* element 15 of 15"):
        run(lambda x: kernel(x, 13), (x, "float32"))


def _gather(x, idx_hbm, oob):
    idx = nl.ndarray((4, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=idx, src=idx_hbm)
    rows = _sbuf((4, 3), value=-1.0)
    nisa.dma_copy(dst=rows, src=x.ap(pattern=[[3, 4], [1, 3]], offset=0, vector_offset=idx, indirect_dim=0),
                  oob_mode=oob)
    return _store(rows)


def test_indirect_gather_out_of_bounds_raises_or_skips():
    x = np.arange(15, dtype=np.float32).reshape(5, 3)
    idx = (np.array([4, 5, 0, -1], dtype=np.int32), "int32")
    with pytest.raises(emu.EmulatorError, match="out of bounds"):
        run(lambda x, i: _gather(x, i, nisa.oob_mode.error), (x, "float32"), idx)
    got = run(lambda x, i: _gather(x, i, nisa.oob_mode.skip), (x, "float32"), idx)[0]
    np.testing.assert_array_equal(got, [x[4], [-1, -1, -1], x[0], [-1, -1, -1]])


def test_indirect_index_must_be_an_int_sbuf_tile():
    def kernel(w):
        g = _sbuf((1, 1), dtype=nl.float32, value=0.0)
        return w.select(0, g)

    with pytest.raises(emu.EmulatorError, match="must be an int32 SBUF tensor"):
        run(kernel, f32((2, 3, 4)))


def test_reading_never_written_memory_fails():
    def kernel():
        t = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.sbuf)
        return _store(t)

    with pytest.raises(emu.EmulatorError, match="never-written"):
        run(kernel)


def test_outputs_must_be_fully_written():
    def kernel():
        out = nl.ndarray((8, 4), dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out[0:7], src=_sbuf((7, 4)))
        return out

    with pytest.raises(emu.EmulatorError, match=r"left 4 elements of its output \(8, 4\) unwritten \(first at \(7, 0\)\)"):
        run(kernel)


def test_predicated_copy_selects_and_enforces_its_rules():
    """tensor_copy_predicated copies where the predicate is set (unset, with reverse_pred), leaves
    the rest, passes NaN / inf through unchanged, and rejects what the NKI documentation forbids."""
    def kernel(reverse):
        dst = _sbuf((4, 3), value=float("nan"))
        pred = _sbuf((4, 3), dtype=nl.uint8, value=0)
        nisa.memset(dst=pred[0:2, :], value=1)
        if reverse:
            nisa.tensor_copy_predicated(dst=dst, src=0.0, predicate=pred, reverse_pred=True)
        else:
            nisa.tensor_copy_predicated(dst=dst, src=_sbuf((4, 3), value=float("inf")), predicate=pred)
        return _store(dst)

    got = run(lambda: kernel(False))[0]
    assert np.isinf(got[:2]).all() and np.isnan(got[2:]).all()
    got = run(lambda: kernel(True))[0]
    assert np.isnan(got[:2]).all() and (got[2:] == 0).all()

    def bad(pred_dtype="uint8", pred_shape=(4, 3), src="tile", reverse=False, src_dtype="float32"):
        dst = _sbuf((4, 3))
        pred = _sbuf(pred_shape, dtype=getattr(nl, pred_dtype), value=1)
        source = _sbuf((4, 3), dtype=getattr(nl, src_dtype)) if src == "tile" else src
        nisa.tensor_copy_predicated(dst=dst, src=source, predicate=pred, reverse_pred=reverse)

    with pytest.raises(emu.EmulatorError, match="predicate dtype"):
        run(lambda: bad(pred_dtype="float32"))
    with pytest.raises(emu.EmulatorError, match="predicate .* and dst .* differ"):
        run(lambda: bad(pred_shape=(4, 2)))
    with pytest.raises(emu.EmulatorError, match="reverse_pred needs a scalar src"):
        run(lambda: bad(reverse=True))
    with pytest.raises(emu.EmulatorError, match="dtypes differ"):
        run(lambda: bad(src_dtype="bfloat16"))
    with pytest.raises(emu.EmulatorError, match="does not match dst dtype"):
        run(lambda: bad(src=0))


def test_engine_copies_keep_the_partition_layout():
    """An engine works partition by partition: tensor_copy moves [4, 4] to [4, 4] (also as
    [4, 2, 2]), never to [2, 8] or [8, 2] with the same element count (fp32 tiles)."""
    def kernel(dst_shape):
        dst = nl.ndarray(dst_shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=dst, src=_sbuf((4, 4)))

    run(lambda: kernel((4, 4)))
    run(lambda: kernel((4, 2, 2)))
    for shape in ((2, 8), (8, 2)):
        with pytest.raises(emu.EmulatorError, match="tensor_copy shapes differ per partition"):
            run(lambda: kernel(shape))


def test_vector_engine_reads_at_most_one_psum_operand():
    """scalar_tensor_tensor computes (data op0 operand0) op1 operand1 with a per-partition
    operand0, and reads at most one of data and operand1 from PSUM (2 x 3 tiles, fp32)."""
    def kernel(data_buf, op1_buf):
        def tile(buf, value):
            t = _sbuf((2, 3), value=value)
            if buf == emu.SBUF:
                return t
            p = nl.ndarray((2, 3), dtype=nl.float32, buffer=nl.psum)
            nisa.tensor_copy(dst=p, src=t)
            return p

        col = nl.ndarray((2, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=col[0:1, :], value=10.0)
        nisa.memset(dst=col[1:2, :], value=20.0)
        dst = nl.ndarray((2, 3), dtype=nl.float32, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(dst=dst, data=tile(data_buf, 2.0), op0=nl.multiply, operand0=col,
                                  op1=nl.add, operand1=tile(op1_buf, 1.0))
        return _store(dst)

    for bufs in ((emu.SBUF, emu.SBUF), (emu.PSUM, emu.SBUF), (emu.SBUF, emu.PSUM)):
        np.testing.assert_array_equal(run(lambda: kernel(*bufs))[0], [[21.0] * 3, [41.0] * 3])
    with pytest.raises(emu.EmulatorError, match="cannot both be in PSUM"):
        run(lambda: kernel(emu.PSUM, emu.PSUM))


def test_bf16_rounds_to_nearest_even():
    vals = np.array([[1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, -(1 + 2.0 ** -8 + 2.0 ** -12), 3.0e38]], dtype=np.float32)

    def kernel(x):
        t = nl.ndarray((1, 4), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        b = nl.ndarray((1, 4), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.tensor_copy(dst=b, src=t)
        return _store(b)

    def by_dma(x):  # a DMA between dtypes converts through fp32 with the same rounding
        b = nl.ndarray((1, 4), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=b, src=x)
        return _store(b)

    expected = torch.tensor(vals).to(torch.bfloat16).float().numpy()  # torch rounds to nearest even too
    for k in (kernel, by_dma):
        got = run(k, (vals, "float32"))[0]
        np.testing.assert_array_equal(got, expected)
        np.testing.assert_array_equal(got[0, :3], [1.0, 1 + 2.0 ** -6, -(1 + 2.0 ** -7)])
    with pytest.raises(emu.EmulatorError, match="exactly representable in bf16"):
        run(lambda x: x, (vals, "bfloat16"))


# ---------------------------------------------------------------- the real kernels
def test_kernel_fails_when_told_a_larger_tile_than_the_hardware(monkeypatch):
    """The kernels size tiles from nl.tile_size; with pmax = 256 they build tiles Trainium cannot hold."""
    gen = torch.Generator().manual_seed(0)
    a, b, offs = torch.randn(300, 40, generator=gen), torch.randn(3, 40, 30, generator=gen), torch.tensor([100, 100, 300])
    p = _contract.check_args(a, b, offs)
    neuron.run_on_emulator(p, a, b, offs, None, 256)  # the real sizes pass
    monkeypatch.setattr(emu.language.tile_size, "pmax", 256)
    with pytest.raises(emu.EmulatorError, match="partition dimension 256 > 128"):
        neuron.run_on_emulator(p, a, b, offs, None, 256)


def test_forward_kernel_fits_sbuf_at_large_k_only_with_narrowed_panels():
    """K = 8192 fp32, 256-row blocks: the transposed rows take 64 KiB per partition, so the weight
    panel must narrow to 256 columns (64 KiB); the full 512-column panel (128 KiB) overflows SBUF."""
    gen = torch.Generator().manual_seed(0)
    a, b, offs = torch.randn(256, 8192, generator=gen), torch.randn(2, 8192, 512, generator=gen), torch.tensor([100, 256])
    p = _contract.check_args(a, b, offs)
    assert neuron.panel_width(8192, 4) == 256
    out, _ = neuron.run_on_emulator(p, a, b, offs, None, 256)
    assert_close(out, *reference_results(a, b, offs), what="K = 8192 with 256-column panels")
    with pytest.raises(emu.EmulatorError, match="sbuf over capacity"):
        neuron.run_on_emulator(p, a, b, offs, None, 256, n_panel=512)
    # Wider rows than that budget are declined: K x itemsize <= 64 KiB.
    for K, dtype, fits in ((16384, torch.float32, True), (16385, torch.float32, False),
                           (32768, torch.bfloat16, True), (32769, torch.bfloat16, False)):
        meta = dict(device="meta", dtype=dtype)
        a8, b2 = torch.empty(8, K, **meta), torch.empty(2, K, 16, **meta)
        q = _contract.check_args(a8, b2, offs.to("meta"))
        assert neuron.nki_fits(q) is fits, (K, dtype)


def test_weight_gradient_kernel_declines_more_blocks_than_its_flags_fit():
    """The weight-gradient kernel keeps one fp32 restart flag per block in SBUF: 50000 groups
    (as many blocks) overflow it, so the backend declines them (the op then computes them with the
    reference on CPU, block-wise PyTorch on a device); 16384 blocks, the most it takes, ran on the
    emulator by hand (K = 1, G = 16384: 33 s, right)."""
    a, b = torch.randn(1, 1), torch.randn(1, 1)
    offs = torch.ones(50000, dtype=torch.int64)
    p = _contract.check_args(a, b, offs)
    kernel, args, kwargs = neuron._kernel_call(p, a, b, offs, None)
    with pytest.raises(emu.EmulatorError, match="sbuf"):
        neuron_nki.run_on_emulator(kernel, args, kwargs)
    with pytest.raises(NotImplementedError, match="50000 blocks .* too many for the NKI weight-gradient"):
        neuron.run_on_emulator(p, a, b, offs, None)
    for G, fits in ((16384, True), (16385, False)):
        assert neuron.nki_fits(_contract.check_args(a, b, torch.ones(G, dtype=torch.int64))) is fits

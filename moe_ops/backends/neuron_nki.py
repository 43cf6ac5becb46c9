"""The block-wise grouped matmul as NKI kernels (Trainium), and how to launch them.

Written against the NKI API of Neuron SDK 2.33 (the ``nki.*`` namespace: ``nki.jit``,
``nki.simulate``, ``nisa.dma_copy``, ``nisa.nc_matmul(dst, stationary, moving, accumulate=)``,
indirect DMA through ``.ap(vector_offset=/scalar_offset=)`` and runtime ``.select``). Never
compiled by neuronx-cc nor run on Trainium: on this project's machines it runs on our numpy
emulator (``neuron_emulator``), and on ``nki.simulate`` where the real ``nki`` is installed.

The kernels follow ``neuron_blockwise`` (the PyTorch spec) block for block and read the same
schedule tensors, computed on the device by ``neuron_blockwise.schedule_2d3d`` / ``_2d2d``.

``nl`` and ``nisa`` below are resolved at call time: the real ``nki.language`` / ``nki.isa``
(imported on first use), or the emulator's while ``use(...)`` is active. The kernel function
objects are the same either way; ``nki`` is never imported at module import.

Tiling (Trainium2, NeuronCore-v3): 128 partitions; the Tensor Engine contracts over the
partition dimension with a stationary operand of <= 128 x 128 and a moving operand of
<= 128 x 512, accumulating fp32 in one 2 KiB PSUM bank per partition.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib

_impl: contextvars.ContextVar = contextvars.ContextVar("moe_ops_nki_impl", default=None)
_real = None


def _real_nki():
    global _real
    if _real is None:
        nki = importlib.import_module("nki")
        _real = type("RealNki", (), {"language": importlib.import_module("nki.language"),
                                     "isa": importlib.import_module("nki.isa"), "nki": nki})
    return _real


class _Namespace:
    """``nl`` / ``nisa``: forwards attribute access to the active NKI implementation."""

    def __init__(self, part: str):
        self._part = part

    def __getattr__(self, name):
        impl = _impl.get()
        if impl is None:
            impl = _real_nki()
        return getattr(getattr(impl, self._part), name)


nl = _Namespace("language")
nisa = _Namespace("isa")


@contextlib.contextmanager
def use(impl):
    """Run kernels of this module against ``impl`` (an object with ``language`` and ``isa``)."""
    token = _impl.set(impl)
    try:
        yield
    finally:
        _impl.reset(token)


# Default pass sizes of the weight-gradient kernel: 4 x 128 output rows by 2048 columns, i.e.
# 32 KiB of fp32 accumulators per partition.
WGRAD_M_PASS_TILES, WGRAD_N_PASS = 4, 2048


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _load_index(src, start: int, count: int, shape):
    """An int32 SBUF tile of ``shape`` holding src[start:start + count] (a 1-D HBM int32 tensor)."""
    t = nl.ndarray(shape, dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=src[start:start + count])
    return t


def block_mm_2d3d(x, w, bias, block_group, gather_rows, scatter_rows, zero_rows, row_valid, block: int,
                  w_transposed: bool = False, out_fp32: bool = False, n_panel: int = 512):
    """Block-wise 2D x 3D grouped matmul: out[rows of group g] = x[rows] @ W[g] (+ bias[g]).

    Args (HBM):
        x: [M, K], M >= 1; bf16, fp16 or fp32.
        w: [G, K, N], or its transpose [G, N, K] when ``w_transposed`` (the input gradient's
            weights); x's dtype.
        bias: [G, N] in x's dtype, or None.
        block_group: [NB] int32, each in [0, G): the weights of each block.
        gather_rows: [NB * block] int32: the x row each slot reads; M (out of bounds) = a zero row.
        scatter_rows: [NB * block] int32: the output row each slot of a real group writes; M = no
            write.
        zero_rows: [NB * block] int32: the output row past offs[-1] each slot writes zeros to; M =
            none. (Those slots compute zero rows x W[g], which is NaN where W[g] holds inf or NaN:
            their rows get zeros from a tile of zeros instead.)
        row_valid: [NB * block] in x's dtype, 1 for slots of a real group (they get the bias), 0
            otherwise; None without bias.
        block: rows per block, a multiple of 128. out_fp32: fp32 output for bf16 / fp16 inputs.
        n_panel: output columns per weight panel, a multiple of 128 up to 512 (one PSUM bank of
            fp32); the host narrows it so that a panel, K x n_panel, stays within 64 KiB of SBUF
            per partition (``panel_width``).

    Returns:
        out [M, N] (x's dtype, or fp32), every row written exactly once.

    Per block: gather its rows (128 per tile, rows on partitions, 512 columns per DMA), transpose
    them on the Tensor Engine so K lies on partitions, then per column panel load the block's
    weights once and run K / 128 accumulating matmuls per row tile into one PSUM bank; the bias joins the same
    accumulation as a rank-1 matmul (row_valid^T x bias row), so it is added in fp32 before the
    single rounding to the output dtype. Blocks are independent (disjoint output rows).
    """
    M, K = x.shape
    N = w.shape[1] if w_transposed else w.shape[2]
    NB = block_group.shape[0]
    P = nl.tile_size.pmax
    NT = n_panel
    assert block % P == 0 and gather_rows.shape[0] == NB * block, "block must be a multiple of 128"
    assert NT % P == 0 and NT <= nl.tile_size.gemm_moving_fmax, "n_panel: a multiple of 128 up to 512"
    out_dtype = nl.float32 if out_fp32 else x.dtype
    out = nl.ndarray((M, N), dtype=out_dtype, buffer=nl.shared_hbm)
    n_rt, n_kt, n_nt = block // P, _ceil_div(K, P), _ceil_div(N, NT)
    KC = 4 * P  # columns per row-gather DMA: 1 KiB (bf16) contiguous per row and descriptor
    zeros = nl.ndarray((P, NT), dtype=out_dtype, buffer=nl.sbuf)
    nisa.memset(dst=zeros, value=0)

    for j in nl.affine_range(NB):
        gid = _load_index(block_group, j, 1, (1, 1))
        w_g = w.select(0, gid)  # [K, N] or [N, K]: this block's weights, chosen at run time

        # Rows of the block, transposed: xT[t][kt] is [k <= 128 (partitions), 128 rows].
        xT = []
        for t in nl.affine_range(n_rt):
            idx = _load_index(gather_rows, j * block + t * P, P, (P, 1))
            tiles = []
            for kc in nl.affine_range(_ceil_div(K, KC)):
                c0, csz = kc * KC, min(KC, K - kc * KC)
                rows = nl.ndarray((P, csz), dtype=x.dtype, buffer=nl.sbuf)
                nisa.memset(dst=rows, value=0)  # slots with an out-of-bounds index stay zero
                nisa.dma_copy(dst=rows, src=x.ap(pattern=[[K, P], [1, csz]], offset=c0, vector_offset=idx,
                                                 indirect_dim=0), oob_mode=nisa.oob_mode.skip)
                for kt in nl.affine_range(_ceil_div(csz, P)):
                    k0, ksz = kt * P, min(P, csz - kt * P)
                    tp = nl.ndarray((ksz, P), dtype=x.dtype, buffer=nl.psum)
                    nisa.nc_transpose(dst=tp, data=rows[:, k0:k0 + ksz])
                    xt = nl.ndarray((ksz, P), dtype=x.dtype, buffer=nl.sbuf)
                    nisa.tensor_copy(dst=xt, src=tp)
                    tiles.append(xt)
            xT.append(tiles)

        for nt in nl.affine_range(n_nt):
            n0, nsz = nt * NT, min(NT, N - nt * NT)
            # The block's weight panel W[g][:, n0:n0 + nsz], K on partitions: loaded once per block
            # and panel, reused by every row tile.
            wk = []
            for kt in nl.affine_range(n_kt):
                k0, ksz = kt * P, min(P, K - kt * P)
                wt = nl.ndarray((ksz, nsz), dtype=w.dtype, buffer=nl.sbuf)
                if not w_transposed:
                    nisa.dma_copy(dst=wt, src=w_g[k0:k0 + ksz, n0:n0 + nsz])
                else:
                    # Stored [N, K]: load 128 x ksz pieces with N on partitions, transpose on the PE.
                    for c in nl.affine_range(_ceil_div(nsz, P)):
                        c0, csz = c * P, min(P, nsz - c * P)
                        piece = nl.ndarray((csz, ksz), dtype=w.dtype, buffer=nl.sbuf)
                        nisa.dma_copy(dst=piece, src=w_g[n0 + c0:n0 + c0 + csz, k0:k0 + ksz])
                        tp = nl.ndarray((ksz, csz), dtype=w.dtype, buffer=nl.psum)
                        nisa.nc_transpose(dst=tp, data=piece)
                        nisa.tensor_copy(dst=wt[:, c0:c0 + csz], src=tp)
                wk.append(wt)
            if bias is not None:
                brow = nl.ndarray((1, nsz), dtype=bias.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=brow, src=bias.select(0, gid)[n0:n0 + nsz])

            for t in nl.affine_range(n_rt):
                s0 = j * block + t * P
                acc = nl.ndarray((P, nsz), dtype=nl.float32, buffer=nl.psum)
                for kt in nl.affine_range(n_kt):
                    nisa.nc_matmul(dst=acc, stationary=xT[t][kt], moving=wk[kt], accumulate=(kt > 0))
                if bias is not None:
                    valid = nl.ndarray((1, P), dtype=row_valid.dtype, buffer=nl.sbuf)
                    nisa.dma_copy(dst=valid, src=row_valid[s0:s0 + P])
                    nisa.nc_matmul(dst=acc, stationary=valid, moving=brow, accumulate=(n_kt > 0))
                res = nl.ndarray((P, nsz), dtype=out_dtype, buffer=nl.sbuf)
                if n_kt == 0 and bias is None:
                    nisa.memset(dst=res, value=0)  # K = 0: an empty sum
                else:
                    nisa.tensor_copy(dst=res, src=acc)  # the one rounding to the output dtype
                dest = _load_index(scatter_rows, s0, P, (P, 1))
                nisa.dma_copy(dst=out.ap(pattern=[[N, P], [1, nsz]], offset=n0, vector_offset=dest,
                                         indirect_dim=0),
                              src=res, oob_mode=nisa.oob_mode.skip)
                zdest = _load_index(zero_rows, s0, P, (P, 1))
                nisa.dma_copy(dst=out.ap(pattern=[[N, P], [1, nsz]], offset=n0, vector_offset=zdest,
                                         indirect_dim=0),
                              src=zeros[:, 0:nsz], oob_mode=nisa.oob_mode.skip)
    return out


def block_mm_2d2d(xt, dy, gather_rows, keep, store_group, block: int, n_groups: int,
                  out_fp32: bool = False, m_pass_tiles: int = WGRAD_M_PASS_TILES, n_pass: int = WGRAD_N_PASS):
    """Block-wise 2D x 2D grouped matmul (weight gradient): out[g] = sum over g's K indices of xt[k]^T dy[k].

    Args (HBM):
        xt: [K, M], the ragged dimension first (mat_a transposed); bf16, fp16 or fp32.
        dy: [K, N], xt's dtype.
        gather_rows: [NB * block] int32: the K index each slot reads; K (out of bounds) = zeros.
        keep: [128, NB] fp32 (one row per partition, all rows equal): 1 where block j continues
            the previous block's group, 0 where it starts one.
        store_group: [NB] int32: the group whose slice block j writes, or n_groups (no write).
        block: rows per block, a multiple of 128. n_groups: G. out_fp32: fp32 output.
        m_pass_tiles, n_pass: the output is computed in passes of m_pass_tiles x 128 rows by
            n_pass columns (a multiple of 512) so that the fp32 accumulators (m_pass_tiles x
            n_pass x 4 bytes per partition, 32 KiB by default) and one block's gathered rows fit
            in SBUF.

    Returns:
        out [G, M, N], every [M, N] slice written exactly once.

    Per pass and block (in order: the accumulator is carried from block to block): gather the
    block's rows of xt and dy (contraction index on partitions), compute the [M, N] partial
    product tile by tile in PSUM (block / 128 accumulating matmuls), then on the Vector Engine
    acc = (keep[j] ? acc : 0) + partial (the restart a predicated copy of zeros, so one group's
    inf or NaN stays in it), and store acc to out[store_group[j]] (skipped when out of bounds),
    so each group's slice is written once, at its last block.
    """
    K, M = xt.shape
    N = dy.shape[1]
    NB = store_group.shape[0]
    G = n_groups
    P = nl.tile_size.pmax
    NT = nl.tile_size.gemm_moving_fmax
    assert block % P == 0 and gather_rows.shape[0] == NB * block, "block must be a multiple of 128"
    assert keep.shape[0] == P and keep.shape[1] == NB and n_pass % NT == 0
    out_dtype = nl.float32 if out_fp32 else xt.dtype
    out = nl.ndarray((G, M, N), dtype=out_dtype, buffer=nl.shared_hbm)
    n_rt, n_mt = block // P, _ceil_div(M, P)

    keep_sb = nl.ndarray((P, NB), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=keep_sb, src=keep)
    zeros = nl.ndarray((P, NT), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=zeros, value=0)

    for mp in nl.affine_range(_ceil_div(n_mt, m_pass_tiles)):
        m_lo = mp * m_pass_tiles * P
        m_w = min(m_pass_tiles * P, M - m_lo)
        for npass in nl.affine_range(_ceil_div(N, n_pass)):
            n_lo = npass * n_pass
            n_w = min(n_pass, N - n_lo)
            m_tiles = [(m, min(P, m_w - m)) for m in range(0, m_w, P)]
            n_tiles = [(n, min(NT, n_w - n)) for n in range(0, n_w, NT)]
            acc = []
            for _, msz in m_tiles:
                a = nl.ndarray((msz, n_w), dtype=nl.float32, buffer=nl.sbuf)
                nisa.memset(dst=a, value=0)
                acc.append(a)

            for j in nl.sequential_range(NB):  # carries acc
                sg = _load_index(store_group, j, 1, (1, 1))
                # keep[j] on every element: the predicate of the restart below.
                cont = nl.ndarray((P, NT), dtype=nl.uint8, buffer=nl.sbuf)
                nisa.scalar_tensor_tensor(dst=cont, data=zeros, op0=nl.add, operand0=keep_sb[:, j:j + 1],
                                          op1=nl.add, operand1=zeros)
                xr, dr = [], []
                for t in nl.affine_range(n_rt):
                    idx = _load_index(gather_rows, j * block + t * P, P, (P, 1))
                    xs = nl.ndarray((P, m_w), dtype=xt.dtype, buffer=nl.sbuf)
                    nisa.memset(dst=xs, value=0)  # out-of-bounds slots contribute zeros
                    nisa.dma_copy(dst=xs, src=xt.ap(pattern=[[M, P], [1, m_w]], offset=m_lo, vector_offset=idx,
                                                    indirect_dim=0), oob_mode=nisa.oob_mode.skip)
                    dys = nl.ndarray((P, n_w), dtype=dy.dtype, buffer=nl.sbuf)
                    nisa.memset(dst=dys, value=0)
                    nisa.dma_copy(dst=dys, src=dy.ap(pattern=[[N, P], [1, n_w]], offset=n_lo, vector_offset=idx,
                                                    indirect_dim=0), oob_mode=nisa.oob_mode.skip)
                    xr.append(xs)
                    dr.append(dys)
                for mi, (m0, msz) in enumerate(m_tiles):
                    for n0, nsz in n_tiles:
                        ps = nl.ndarray((msz, nsz), dtype=nl.float32, buffer=nl.psum)
                        for t in nl.affine_range(n_rt):
                            nisa.nc_matmul(dst=ps, stationary=xr[t][:, m0:m0 + msz], moving=dr[t][:, n0:n0 + nsz],
                                           accumulate=(t > 0))
                        cur = acc[mi][:, n0:n0 + nsz]
                        # A group's first block restarts the sum at exactly zero, by a predicated
                        # copy: acc * keep would carry the previous group's inf or NaN into it.
                        nisa.tensor_copy_predicated(dst=cur, src=0.0, predicate=cont[0:msz, 0:nsz], reverse_pred=True)
                        nisa.scalar_tensor_tensor(dst=cur, data=cur, op0=nl.add, operand0=0.0, op1=nl.add, operand1=ps)
                        res = nl.ndarray((msz, nsz), dtype=out_dtype, buffer=nl.sbuf)
                        nisa.tensor_copy(dst=res, src=cur)
                        nisa.dma_copy(dst=out.ap(pattern=[[N, msz], [1, nsz]], offset=(m_lo + m0) * N + n_lo + n0,
                                                 scalar_offset=sg, indirect_dim=0),
                                      src=res, oob_mode=nisa.oob_mode.skip)
    return out


# ---------------------------------------------------------------- launching
def run_on_emulator(kernel, args, kwargs):
    """Run a kernel of this module on moe_ops' numpy emulator (NOT AWS's simulator).

    args: CPU torch tensors (HBM inputs; bf16, fp16, fp32, int32), None, or constants.
    Returns (output tensor, instruction counts).
    """
    import torch

    from . import neuron_emulator as emu

    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16", torch.int32: "int32"}
    dtypes = {v: k for k, v in names.items()}
    packed = []
    for t in args:
        if isinstance(t, torch.Tensor):
            host = t.detach().contiguous()
            packed.append(((host.float() if t.dtype == torch.bfloat16 else host).numpy(), names[t.dtype]))
        else:
            packed.append(t)
    (array, dtype), counts = emu.run_kernel(kernel, packed, kwargs, activate=use)
    return torch.from_numpy(array).to(dtypes[dtype]), counts


def run_on_simulator(kernel, args, kwargs):
    """Run a kernel on AWS's ``nki.simulate`` (needs the real ``nki`` package); args are CPU torch tensors."""
    nki = _real_nki().nki
    return nki.simulate(nki.jit(kernel))(*args, **kwargs)

"""Triton grouped-GEMM kernels of the CUDA backend, and their host launchers.

Two persistent kernels serve all four layouts (the grid is a fixed number of programs, each
walking a tile schedule with a stride of the grid size):

* ``_rows_kernel``: out[rows of group g] = a[rows of group g] @ b[g] (+ bias[g]). Serves 2Dx3D
  (rows grouped by offs), 3Dx3D (every group has M rows; ``HAS_OFFS=False``) and 3Dx2D through
  the transposition identity out.T[cols of g] = b.T[cols of g] @ a[g].T, i.e. 2Dx3D on the
  views b.t() [N, K] and a.transpose(1, 2) [G, K, M], writing through out.t() (strides only, no
  copy of any operand or of the result).
* ``_ragged_k_kernel``: out[g] = a[:, k of g] @ b[k of g]. Serves 2Dx2D (the weight gradient).

Group boundaries are read from ``offs`` inside the kernels, never on the host: no .item(),
no .cpu(), no allocation whose size depends on offs values, so a call is CUDA-graph capturable.
The kernels also apply the contract's clamp for unvalidated offs (cummax(clamp(offs, 0,
extent))) as they read it: a running max per program, so the op launches one kernel per call.

Tile schedule of ``_rows_kernel``: group g owns the rows [offs[g-1], offs[g]) cut into
ceil(size_g / BM) row tiles *starting at the group's first row*, times ceil(N / BN) column
tiles. A BM-row block of the matrix that straddles two groups is therefore visited once per
group, each visit masked to that group's rows, so no load or store crosses a group boundary or
the matrix end. Every program scans the G group ends in order (G scalar loads, once per
program) and takes the tiles whose running index is congruent to its program id. After the
last group, a tail of tiles writes the zeros of the rows past offs[-1], so the result can be
allocated with ``torch.empty`` (no memset of M x N). Within a group, tiles are ordered in bands
of GROUP_M row tiles so that programs running at the same time share columns of b[g] in L2.

Two opt-ins, off until they have run on a GPU: TMA operand copies for the 16-bit 2Dx3D / 3Dx3D
kernel on sm_90+ (``MOE_OPS_CUDA_TMA=1``, ``_k_loop_tma``), and a launch cache that calls a
compiled kernel's launcher directly when a launch's specialization repeats
(``MOE_OPS_CUDA_LAUNCH_CACHE=1``, ``_launch``).

Precision: bf16/fp16 go to tensor cores (mma.sync on sm_80, wgmma on sm_90, tcgen05 on sm_100)
with fp32 accumulation; fp64 accumulates in fp64. fp32 inputs use ``input_precision="ieee"``
(full fp32 accuracy) unless MOE_OPS_CUDA_FP32_PRECISION=tf32 (or tf32x3) opts in.

Index arithmetic: every row, column and K index is widened to int64 before it is multiplied by
a stride, because M*K, M*N and G*K*N pass 2^31 on real MoE shapes (DeepSeek-V3's G*K*N =
256*7168*2048 = 3.8e9 elements). (Measured on the sm_90/sm_100 compiles: int32 offsets inside a
tile plus a 64-bit tile origin did not save registers; it spilled more.)

Interpreter: the same source is loaded a second time with Triton's interpreter switched on
(``interpreted()``), which runs the kernels on CPU tensors. There ``DOT_UPCAST`` casts bf16
tiles to fp32 before ``tl.dot``, because the interpreter's bf16 dot multiplies raw bits
(triton-lang/triton#11584); compiled kernels never set it. The kernels call only core
builtins: the @jit helpers of triton.language.standard (tl.cdiv, tl.zeros, ...) were compiled
when triton was imported and cannot be called from the interpreted copy.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import sys
from typing import Optional

import torch
import triton
import triton.language as tl

from ..._contract import LAYOUT_2D2D, LAYOUT_2D3D, LAYOUT_3D2D, LAYOUT_3D3D, Problem

FP32_PRECISION_ENV = "MOE_OPS_CUDA_FP32_PRECISION"
TMA_ENV = "MOE_OPS_CUDA_TMA"
FP32_PRECISIONS = ("ieee", "tf32", "tf32x3")


@triton.jit
def _rows_kernel(
    a_ptr, b_ptr, out_ptr, bias_ptr, offs_ptr,
    M, N, K, G,
    s_ag, s_am, s_ak,
    s_bg, s_bk, s_bn,
    s_og, s_om, s_on,
    s_biasg, s_biasn,
    NUM_PROGRAMS,
    HAS_OFFS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    ACC_DTYPE: tl.constexpr, PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    EPILOGUE_SPLIT: tl.constexpr, TMA: tl.constexpr = False, B_K_CONTIGUOUS: tl.constexpr = False,
):
    """out[rows_g, :] = a[rows_g, :] @ b[g] (+ bias[g]) for every group g; zeros elsewhere.

    a: rows addressed as a_ptr + g*s_ag + row*s_am + k*s_ak (s_ag = 0 for 2Dx3D, where rows are
    global; rows are local to the group for 3Dx3D). b: [G, K, N]. out: addressed like a with
    (s_og, s_om, s_on). bias: [G, N] or unused. offs: [G] int32/int64 group ends over M (valid
    partition), unused when HAS_OFFS is False (then every group has M rows).
    TMA: a_ptr and b_ptr are tensor descriptors instead (see ``_k_loop_tma``); the a / b
    strides are then unused.
    """
    pid = tl.program_id(0)
    num_n = (N + BN - 1) // BN
    num_k = (K + BK - 1) // BK
    out_ty = out_ptr.dtype.element_ty
    rm0 = tl.arange(0, BM).to(tl.int64)
    rn0 = tl.arange(0, BN).to(tl.int64)
    rk0 = tl.arange(0, BK).to(tl.int64)

    tile = pid  # the next tile (running index over all groups) this program computes
    first = pid * 0  # running index of the current group's first tile (an int32 like tile)
    start = tl.full((), 0, tl.int64)  # first row of the current group
    for g in range(0, G):
        if HAS_OFFS:
            # offs comes unsanitized on GPUs. Ends clamped to M, empty sizes for ends below
            # start, and start as the running max give the rows of cummax(clamp(offs, 0, M))
            # (the contract's sanitize_offs) without two extra launches to sanitize it first.
            # (Clamping end into [start, M] in one expression spilled 72 instead of 64 bytes
            # in the sm_90 bf16 bias fp32-out variant.)
            end = tl.minimum(tl.load(offs_ptr + g).to(tl.int64), M)
        else:  # 3Dx3D: every group is rows [0, M) of its own batch
            start = tl.full((), 0, tl.int64)
            end = start + M
        # Not max(end - start, 0): an int64 offs entry near -2^63 makes that difference wrap to
        # a huge positive size (and num_m negative), and every later group's tiles were skipped.
        size = tl.maximum(end, start) - start
        num_m = ((size + BM - 1) // BM).to(tl.int32)
        group_tiles = num_m * num_n
        while tile < first + group_tiles:
            local = tile - first
            band = GROUP_M * num_n
            first_m = (local // band) * GROUP_M
            band_m = tl.minimum(num_m - first_m, GROUP_M)
            m_tile = first_m + (local % band) % band_m
            n_tile = (local % band) // band_m

            rm = start + m_tile * BM + rm0
            rn = n_tile * BN + rn0
            row_ok = rm < start + size
            col_ok = rn < N
            g64 = tl.cast(g, tl.int64)
            if TMA:
                acc = _k_loop_tma(a_ptr, b_ptr, g, (start + m_tile * BM).to(tl.int32), n_tile * BN, num_k,
                                  not HAS_OFFS, B_K_CONTIGUOUS, BM, BN, BK, ACC_DTYPE, DOT_UPCAST)
            else:
                a_ptrs = a_ptr + g64 * s_ag + rm[:, None] * s_am + rk0[None, :] * s_ak
                b_ptrs = b_ptr + g64 * s_bg + rk0[:, None] * s_bk + rn[None, :] * s_bn
                acc = _k_loop(a_ptrs, b_ptrs, row_ok, col_ok, K, num_k, s_ak, s_bk,
                              BM, BN, BK, ACC_DTYPE, PRECISION, DOT_UPCAST)
            _epilogue(acc, out_ptr, g64 * s_og + rm * s_om, row_ok, n_tile * BN, N, s_on,
                      bias_ptr, g64 * s_biasg, s_biasn, HAS_BIAS, BN, ACC_DTYPE, EPILOGUE_SPLIT)
            tile += NUM_PROGRAMS
        first += group_tiles
        start = tl.maximum(start, end)

    if HAS_OFFS:
        # Rows past offs[-1] belong to no group: exact zeros, written by the same programs.
        size = M - start
        num_m = ((size + BM - 1) // BM).to(tl.int32)
        zeros = tl.full((BM, BN), 0, out_ty)
        while tile < first + num_m * num_n:
            local = tile - first
            rm = start + (local // num_n) * BM + rm0
            rn = (local % num_n) * BN + rn0
            o_ptrs = out_ptr + rm[:, None] * s_om + rn[None, :] * s_on
            tl.store(o_ptrs, zeros, mask=(rm < M)[:, None] & (rn < N)[None, :])
            tile += NUM_PROGRAMS


@triton.jit
def _ragged_k_kernel(
    a_ptr, b_ptr, out_ptr, offs_ptr,
    M, N, K, G,
    s_am, s_ak,
    s_bk, s_bn,
    s_og, s_om, s_on,
    NUM_PROGRAMS,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    ACC_DTYPE: tl.constexpr, PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    EPILOGUE_SPLIT: tl.constexpr,
):
    """out[g] = a[:, offs[g-1]:offs[g]] @ b[offs[g-1]:offs[g], :] for every group g.

    a: [M, K], b: [K, N], out: [G, M, N], offs: [G] int32/int64 group ends over K, any values:
    the kernel computes with cummax(clamp(offs, 0, K)) (the contract's sanitize_offs). An empty
    group runs no K step and stores an exactly zero [M, N] slice.
    """
    pid = tl.program_id(0)
    num_m = (M + BM - 1) // BM
    num_n = (N + BN - 1) // BN
    per_group = num_m * num_n
    rm0 = tl.arange(0, BM).to(tl.int64)
    rn0 = tl.arange(0, BN).to(tl.int64)
    rk0 = tl.arange(0, BK).to(tl.int64)
    # Group g spans [k_start, k_end) of the sanitized partition. A program's tiles come in
    # increasing g, so it folds each offs entry into the running max once (at most G loads).
    seen = pid * 0  # offs entries folded in so far
    k_start = tl.full((), 0, tl.int64)
    k_end = tl.full((), 0, tl.int64)
    for tile in range(pid, G * per_group, NUM_PROGRAMS):
        g = tile // per_group
        while seen <= g:
            k_start = k_end
            k_end = tl.maximum(k_end, tl.minimum(tl.load(offs_ptr + seen).to(tl.int64), K))
            seen += 1
        local = tile % per_group
        band = GROUP_M * num_n
        first_m = (local // band) * GROUP_M
        band_m = tl.minimum(num_m - first_m, GROUP_M)
        m_tile = first_m + (local % band) % band_m
        n_tile = (local % band) // band_m

        k_steps = ((k_end - k_start + BK - 1) // BK).to(tl.int32)

        rm = m_tile * BM + rm0
        rn = n_tile * BN + rn0
        row_ok = rm < M
        col_ok = rn < N
        rk = k_start + rk0
        a_ptrs = a_ptr + rm[:, None] * s_am + rk[None, :] * s_ak
        b_ptrs = b_ptr + rk[:, None] * s_bk + rn[None, :] * s_bn
        acc = _k_loop(a_ptrs, b_ptrs, row_ok, col_ok, k_end - k_start, k_steps, s_ak, s_bk,
                      BM, BN, BK, ACC_DTYPE, PRECISION, DOT_UPCAST)
        _epilogue(acc, out_ptr, tl.cast(g, tl.int64) * s_og + rm * s_om, row_ok, n_tile * BN, N, s_on,
                  out_ptr, 0, 0, False, BN, ACC_DTYPE, EPILOGUE_SPLIT)


@triton.jit
def _k_loop(a_ptrs, b_ptrs, row_ok, col_ok, k_len, k_steps, s_ak, s_bk,
            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ACC_DTYPE: tl.constexpr,
            PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """The [BM, BN] tile sum over k < k_len of a[rows, k] * b[k, cols], BK at a time: a_ptrs /
    b_ptrs point at the first [BM, BK] / [BK, BN] blocks and step by BK * s_ak / BK * s_bk;
    rows, columns and k past their ends are masked to zero."""
    rk0 = tl.arange(0, BK).to(tl.int64)
    acc = tl.full((BM, BN), 0, ACC_DTYPE)
    for kt in range(0, k_steps):
        k_ok = rk0 < k_len - kt * BK
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if DOT_UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION, out_dtype=ACC_DTYPE)
        # In 64 bits: an int32 stride times BK wraps once the stride passes 2^31 / BK elements.
        a_ptrs += BK * tl.cast(s_ak, tl.int64)
        b_ptrs += BK * tl.cast(s_bk, tl.int64)
    return acc


@triton.jit
def _k_loop_tma(a_desc, b_desc, g, row0, col0, k_steps, A_BATCHED: tl.constexpr, B_K_CONTIGUOUS: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ACC_DTYPE: tl.constexpr,
                DOT_UPCAST: tl.constexpr):
    """``_k_loop`` with the operand tiles fetched by tensor-memory-accelerator copies (TMA on
    sm_90+): a_desc over mat_a ([M, K], or [G, M, K] when A_BATCHED), b_desc over mat_b [G, K, N]
    or, when B_K_CONTIGUOUS, over its [G, N, K] storage. A copy zero-fills what lies past a
    descriptor's bounds, so the tails in K, N and past M need no masks. Rows of the next group
    inside a row tile are loaded and multiplied; the epilogue's row mask drops them, as in
    ``_k_loop``. row0 / col0: the tile's first row (global for 2Dx3D, the batch's for 3Dx3D) and
    column."""
    acc = tl.full((BM, BN), 0, ACC_DTYPE)
    for kt in range(0, k_steps):
        k0 = kt * BK
        if A_BATCHED:
            a = tl.reshape(a_desc.load([g, row0, k0]), (BM, BK))
        else:
            a = a_desc.load([row0, k0])
        if B_K_CONTIGUOUS:
            b = tl.trans(tl.reshape(b_desc.load([g, col0, k0]), (BN, BK)))
        else:
            b = tl.reshape(b_desc.load([g, k0, col0]), (BK, BN))
        if DOT_UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, out_dtype=ACC_DTYPE)
    return acc


@triton.jit
def _store_columns(part, out_ptr, row_off, row_ok, cols, N, s_on, bias_ptr, bias_off, s_biasn,
                   HAS_BIAS: tl.constexpr, ACC_DTYPE: tl.constexpr):
    """Add bias (fp32/fp64, before the one cast) and store a [rows, len(cols)] block of out."""
    col_ok = cols < N
    if HAS_BIAS:
        bias = tl.load(bias_ptr + bias_off + cols * s_biasn, mask=col_ok, other=0.0)
        part += bias.to(ACC_DTYPE)[None, :]
    ptrs = out_ptr + row_off[:, None] + cols[None, :] * s_on
    tl.store(ptrs, part.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _epilogue(acc, out_ptr, row_off, row_ok, col0, N, s_on, bias_ptr, bias_off, s_biasn,
              HAS_BIAS: tl.constexpr, BN: tl.constexpr, ACC_DTYPE: tl.constexpr, SPLIT: tl.constexpr):
    """Store a [BM, BN] accumulator tile whose first column is col0 (row_off: int64 [BM] row
    offsets). SPLIT stores it as two [BM, BN/2] halves: with 128x256 fp32 tiles the addresses of
    a whole tile next to its 128 accumulator registers per thread spilled 224-264 bytes per
    thread on sm_90/sm_100; halves spilled 0-56."""
    if SPLIT:
        left, right = tl.split(tl.permute(tl.reshape(acc, (acc.shape[0], 2, BN // 2)), (0, 2, 1)))
        cols = col0 + tl.arange(0, BN // 2).to(tl.int64)
        _store_columns(left, out_ptr, row_off, row_ok, cols, N, s_on, bias_ptr, bias_off, s_biasn,
                       HAS_BIAS, ACC_DTYPE)
        _store_columns(right, out_ptr, row_off, row_ok, cols + BN // 2, N, s_on, bias_ptr, bias_off,
                       s_biasn, HAS_BIAS, ACC_DTYPE)
    else:
        cols = col0 + tl.arange(0, BN).to(tl.int64)
        _store_columns(acc, out_ptr, row_off, row_ok, cols, N, s_on, bias_ptr, bias_off, s_biasn,
                       HAS_BIAS, ACC_DTYPE)


# ----------------------------------------------------------------------------------------------
# Tile configurations


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """One kernel configuration: tile sizes, L2 band height, warps, pipeline stages, and how many
    persistent programs share an SM."""

    BM: int
    BN: int
    BK: int
    GROUP_M: int = 8
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: int = 1
    epilogue_split: bool = False  # store the accumulator as two column halves (see _epilogue)
    tma: bool = False  # 16-bit 2Dx3D / 3Dx3D operand tiles by TMA copies where the operands allow


# Shared memory one program may use, KiB per SM: A100 (sm_80) 163, H100/H200 (sm_90) and
# B200 (sm_100) 227; sm_86/sm_89 and RTX 50 (sm_120) 99.
_SMEM_KIB = {80: 163, 90: 227, 100: 227, 103: 227}
_SMEM_KIB_OTHER = 99


def tile_config(arch: int, dtype: torch.dtype, rows_per_group: Optional[int] = None) -> TileConfig:
    """The tile configuration for a compute capability ``arch`` (e.g. 80, 90, 100) and dtype.

    A small heuristic instead of a per-shape table:
    * tile shape by dtype and architecture:
      - bf16/fp16 (and fp32 with the tf32 opt-in, BK halved for 4-byte elements): 128x256x64
        with 8 warps on sm_90/sm_100 (wgmma / tcgen05 like 128-row tiles and wide N);
        128x128x64 with 8 warps on the mma.sync GPUs (sm_80, sm_86, sm_89, sm_120);
      - when groups average fewer than 64 rows (e.g. 128 experts, 4k routed rows), 64x128x64
        with 4 warps, which halves the padding of each group's last row tile;
      - fp32 with ieee precision runs on FMA units: 64x64x32, 4 warps;
      - fp64: 64x64x16, 4 warps.
    * pipeline stages: as many operand tiles as fit in 3/4 of the architecture's shared memory
      (the rest is left to the epilogue), between 2 and 4. E.g. 128x256x64 bf16 is 48 KiB per
      stage: 3 stages on sm_90 (144 KiB of 227).
    * persistent programs per SM: 2 for 4-warp configurations whose two pipelines fit in shared
      memory with 32 KiB to spare (e.g. 64x128x64 bf16 on sm_90/sm_100: 2 x 4 x 24 KiB), else 1.

    Memoized on what it depends on (building the TileConfig cost 2 us of every call's host time).
    """
    small_groups = rows_per_group is not None and rows_per_group < 64
    return _tile_config(arch, dtype, small_groups, fp32_precision() if dtype == torch.float32 else None,
                        tma_requested())


@functools.lru_cache(maxsize=None)
def _tile_config(arch: int, dtype: torch.dtype, small_groups: bool, precision: Optional[str],
                 tma: bool = False) -> TileConfig:
    tensor_cores = dtype in (torch.bfloat16, torch.float16) or (dtype == torch.float32 and precision != "ieee")
    element = torch.finfo(dtype).bits // 8
    if tensor_cores:
        bk = 64 if element == 2 else 32
        if small_groups:
            BM, BN, BK, warps = 64, 128, bk, 4
        elif arch in (90, 100, 103):
            BM, BN, BK, warps = 128, 256, bk, 8
        else:
            BM, BN, BK, warps = 128, 128, bk, 8
    elif dtype == torch.float64:
        BM, BN, BK, warps = 64, 64, 16, 4
    else:
        BM, BN, BK, warps = 64, 64, 32, 4
    per_stage = (BM * BK + BK * BN) * element
    smem = _SMEM_KIB.get(arch, _SMEM_KIB_OTHER) * 1024
    stages = max(2, min(4, smem * 3 // 4 // per_stage))
    # A second program per SM hides the epilogue of the first when both pipelines fit with 32 KiB
    # left for the epilogues (4-warp configs). H200 (2026-11-29, benchmarks/gpu_tile_sweep.py,
    # Qwen3-30B-A3B, 4096 rows): 64x128x64 with 4 stages took 0.104 / 0.116 ms (forward / input
    # gradient) as one program per SM and 0.092 / 0.095 ms as two; torch._grouped_mm 0.105 / 0.111.
    per_sm = 2 if warps == 4 and 2 * stages * per_stage + (32 << 10) <= smem else 1
    return TileConfig(BM, BN, BK, GROUP_M=8, num_warps=warps, num_stages=stages, programs_per_sm=per_sm,
                      epilogue_split=BN >= 256, tma=tma and arch >= 90 and dtype in (torch.bfloat16, torch.float16))


# The interpreter costs ~5 ms per tile operation whatever the tile size (numpy on whole blocks),
# so it gets large tiles and few programs: G=8, M=1024, K=N=256 took 0.2 s with 128^3 tiles and
# 9.6 s with 32x64x32 ones. Two programs still exercise the persistent walk.
INTERPRETER_CONFIG = TileConfig(64, 64, 64, GROUP_M=4, num_warps=4, num_stages=1, epilogue_split=True)
INTERPRETER_PROGRAMS = 2
INTERPRETER_CONFIG_TMA = dataclasses.replace(INTERPRETER_CONFIG, tma=True)


def launch_options(config: TileConfig) -> dict:
    """Compile options of a launch with ``config`` (also what the ahead-of-time compile tests
    use). enable_fp_fusion is pinned: Triton 3.9 defaults it to on and warns that 3.10 turns the
    default off, which would change the generated code (mul + add instead of fma) of kernels
    that were verified and measured with it on."""
    return dict(num_warps=config.num_warps, num_stages=config.num_stages, enable_fp_fusion=True)


def tma_requested() -> bool:
    """Whether MOE_OPS_CUDA_TMA=1 asks for TMA operand copies on sm_90+ (16-bit inputs, 2Dx3D and
    3Dx3D; read at every call). Off by default until it has been measured on a GPU: it is
    executed in Triton's interpreter and compiled for sm_90 / sm_100 here, not run on hardware."""
    return os.environ.get(TMA_ENV, "0") not in ("", "0")


def fp32_precision() -> str:
    """The tl.dot input precision for fp32 inputs: "ieee" (default, full fp32 accuracy), or the
    opt-in "tf32" / "tf32x3" from MOE_OPS_CUDA_FP32_PRECISION (read at every call)."""
    value = os.environ.get(FP32_PRECISION_ENV, "ieee").strip().lower() or "ieee"
    if value not in FP32_PRECISIONS:
        raise ValueError(f"{FP32_PRECISION_ENV}={value!r}; expected one of {', '.join(FP32_PRECISIONS)}")
    return value


# ----------------------------------------------------------------------------------------------
# The interpreted twin of this module


_interpreted = None


def interpreted():
    """This module's source loaded again with Triton's interpreter on: kernels that run on CPU
    tensors. The interpreter switch is flipped only while the twin's decorators run, so the
    compiled kernels of this module (real GPUs, ahead-of-time compiles) are not affected."""
    global _interpreted
    if _interpreted is None:
        name = __name__ + "_interpreted"
        spec = importlib.util.spec_from_file_location(name, __file__)
        assert spec is not None and spec.loader is not None  # a source file's spec has a loader
        twin = importlib.util.module_from_spec(spec)
        twin.__package__ = __package__
        sys.modules[name] = twin  # dataclasses look their module up while the twin executes
        knobs = getattr(triton, "knobs", None)
        if knobs is not None:  # triton >= 3.4
            previous = knobs.runtime.interpret
            knobs.runtime.interpret = True
            try:
                spec.loader.exec_module(twin)
            finally:
                knobs.runtime.interpret = previous
        else:
            previous = os.environ.get("TRITON_INTERPRET")
            os.environ["TRITON_INTERPRET"] = "1"
            try:
                spec.loader.exec_module(twin)
            finally:
                if previous is None:
                    del os.environ["TRITON_INTERPRET"]
                else:
                    os.environ["TRITON_INTERPRET"] = previous
        _interpreted = twin
    return _interpreted


# ----------------------------------------------------------------------------------------------
# Host launchers

_num_sms: dict = {}


def _programs(device: torch.device, config: TileConfig, tiles_bound: int) -> int:
    """Persistent grid size: ``config.programs_per_sm`` programs per SM, never more than the
    static upper bound on tiles."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _num_sms:
        _num_sms[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return max(1, min(_num_sms[index] * config.programs_per_sm, tiles_bound))


# Launch cache (opt-in, not yet run on a GPU: MOE_OPS_CUDA_LAUNCH_CACHE=1 or use_launch_cache()).
# Triton's ``kernel[grid](...)`` binds and specializes every argument and hashes a cache key on
# every call: 35-47 us of the op's 73-82 us of host time on the H200 of 2026-11-30 (triton 3.6;
# torch._grouped_mm's whole call took 20-24 us). Once Triton has launched a kernel for a
# specialization, the cache calls that compiled kernel's launcher directly for later launches
# with the same specialization_key.
LAUNCH_CACHE_ENV = "MOE_OPS_CUDA_LAUNCH_CACHE"
_compiled: dict = {}
_launch_cache_on = os.environ.get(LAUNCH_CACHE_ENV, "0") not in ("", "0")


def use_launch_cache(enabled: bool = True) -> None:
    """Turn the launch cache on or off (its default comes from MOE_OPS_CUDA_LAUNCH_CACHE)."""
    global _launch_cache_on
    _launch_cache_on = bool(enabled)


def specialization_key(args) -> Optional[tuple]:
    """What Triton specializes a launch on, per runtime argument: a tensor's dtype and 16-byte
    alignment; an int's being 1, its divisibility by 16, and whether it fits int32 / int64.
    Equal keys mean equal Triton specializations (``tests/test_cuda_launch.py`` checks that
    against Triton's own binder). None for any other argument (a TMA descriptor): those
    launches take Triton's path."""
    key: list = []
    for v in args:
        if isinstance(v, int):
            key.append((v == 1, v % 16 == 0, -0x80000000 <= v <= 0x7FFFFFFF, v <= 0x7FFFFFFFFFFFFFFF))
        elif isinstance(v, torch.Tensor):
            key.append((v.dtype, v.data_ptr() % 16 == 0))
        else:
            return None
    return tuple(key)


def launch_arguments(kernel, args: tuple, meta: dict) -> list:
    """Every parameter's value in signature order, as a compiled kernel's launcher takes them
    (what Triton's run passes): the runtime arguments, then the constexprs from meta or their
    defaults."""
    params = kernel.signature.parameters
    return [*args, *(meta[name] if name in meta else params[name].default for name in kernel.arg_names[len(args):])]


def _hooks_set(knobs) -> bool:
    # Triton >= 3.5 keeps each hook as a HookChain (empty: nothing to call), earlier ones None.
    return any(hook is not None and getattr(hook, "calls", True)
               for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook))


def _launch(kernel, grid: int, args: tuple, meta: dict) -> None:
    """``kernel[(grid,)](*args, **meta)`` on the current CUDA device and stream, through the
    launch cache when it is on. args: the runtime arguments in signature order; meta: the
    constexprs (which follow them in the signature) and the compile options (num_warps, ...)."""
    knobs = getattr(triton, "knobs", None)
    key = specialization_key(args) if _launch_cache_on and knobs is not None and not _hooks_set(knobs) else None
    if key is None:
        kernel[(grid,)](*args, **meta)
        return
    device = torch.cuda.current_device()
    cache_key = (kernel, device, tuple(meta.items()), key)
    compiled = _compiled.get(cache_key)
    if compiled is None:
        compiled = kernel[(grid,)](*args, **meta)
        # Cached only as a finished kernel (not a future of an asynchronous compile).
        if hasattr(compiled, "packed_metadata") and not hasattr(compiled, "result"):
            _compiled[cache_key] = compiled
        return
    compiled.run(grid, 1, 1, torch._C._cuda_getCurrentRawStream(device), compiled.function, compiled.packed_metadata,
                 None, None, None, *launch_arguments(kernel, args, meta))


def _interpret_launch(kernel, grid: int, args: tuple, meta: dict) -> None:
    kernel[(grid,)](*args, **meta)


def _cdiv(a: int, b: int) -> int:
    # Not triton.cdiv: a ConstexprFunction in triton 3.9, 1.5 us per call from Python.
    return -(-a // b)


def _tma_descriptors(a, b, batched: bool, config: TileConfig):
    """(a_desc, b_desc, b_k_contiguous) for ``_k_loop_tma``, or None where the operands break a
    rule of TMA copies: a unit innermost stride, a 16-byte aligned base, other strides nonzero
    multiples of 16 bytes, no empty dimension. b: [G, K, N] with contiguous rows, or the
    transposed view of a [G, N, K] tensor (the input gradient's mat_b), described as that
    [G, N, K] storage."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if b.stride(2) == 1:
        b_view, b_block, k_contiguous = b, [1, config.BK, config.BN], False
    elif b.stride(1) == 1:
        b_view, b_block, k_contiguous = b.transpose(1, 2), [1, config.BN, config.BK], True
    else:
        return None
    a_block = [1, config.BM, config.BK] if batched else [config.BM, config.BK]
    for t in (a, b_view):
        if (t.numel() == 0 or t.stride(-1) != 1 or t.data_ptr() % 16
                # Stride 0 (expanded weights) passes the 16-byte rule, but cuTensorMapEncodeTiled's
                # docs build each stride from the dimensions inside it; declined, as the
                # Blackwell path declines broadcast operands (untried on a GPU).
                or any(stride == 0 or stride * t.element_size() % 16
                       for stride in t.stride()[:-1])):
            return None
    return TensorDescriptor.from_tensor(a, a_block), TensorDescriptor.from_tensor(b_view, b_block), k_contiguous


def _acc_dtype(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _precision(dtype: torch.dtype) -> str:
    # input_precision only changes fp32 dots. 16-bit operands get "tf32", the compiler's default,
    # so they compile exactly as a plain tl.dot; fp64 is computed in fp64 either way.
    if dtype == torch.float32:
        return fp32_precision()
    return "ieee" if dtype == torch.float64 else "tf32"


def common_constexprs(config: TileConfig, dtype: torch.dtype, interpret: bool) -> dict:
    """The compile-time arguments both kernels take for inputs of ``dtype`` under ``config``:
    the launches' and the ahead-of-time compile tests' one source. DOT_UPCAST only in the
    interpreter (triton-lang/triton#11584); compiled kernels dot bf16 tiles as they are."""
    return dict(BM=config.BM, BN=config.BN, BK=config.BK, GROUP_M=config.GROUP_M, ACC_DTYPE=_acc_dtype(dtype),
                PRECISION=_precision(dtype), DOT_UPCAST=interpret and dtype == torch.bfloat16,
                EPILOGUE_SPLIT=config.epilogue_split)


def rows_per_group(p: Problem) -> Optional[int]:
    """Average rows per group of the row tiles ``_rows_kernel`` cuts, for ``tile_config``: M / G
    for 2Dx3D, N / G for 3Dx2D (its rows are the columns of out, grouped by offs), M for 3Dx3D
    (each batch); None for 2Dx2D, whose tiles span all M rows of each group's slice."""
    if p.layout == LAYOUT_2D2D:
        return None
    if p.layout == LAYOUT_3D3D:
        return p.M
    assert p.extent is not None  # None only for 2d2d (above)
    return p.extent // max(p.G, 1)


def grouped_mm(p: Problem, mat_a, mat_b, offs, bias, *, interpret: bool = False,
               config: Optional[TileConfig] = None, programs: Optional[int] = None, arch: int = 0,
               out: Optional[torch.Tensor] = None):
    """Run the Triton kernels for one validated problem. offs may hold any values: the kernels
    compute with ``_contract.sanitize_offs(offs, p.extent)``, clamping as they read it.

    Args:
        p: the ``Problem`` of ``moe_ops._contract.check_args``.
        mat_a, mat_b, offs, bias: as in ``moe_ops.grouped_mm``; CUDA tensors, or CPU tensors
            with ``interpret=True``. Any strides: the matrices are never copied; the kernels
            read offs with unit stride, so a non-contiguous offs (a strided view, an expanded
            one) is copied first (G elements).
        interpret: run the interpreted twin (CPU tensors) instead of the compiled kernels.
        config / programs: override the tile configuration / persistent grid size (tests).
        arch: compute capability as an int (e.g. 90) for the tile heuristic.
        out: a contiguous tensor of shape ``p.out_shape`` and dtype ``p.out_dtype`` to write
            into instead of a new one (a static buffer for CUDA graphs; tests pass one filled
            with NaN to show that every element is written).

    Returns:
        ``out``, or a new contiguous tensor of shape ``p.out_shape`` and dtype ``p.out_dtype``.
    """
    kernels = interpreted() if interpret else sys.modules[__name__]
    if offs is not None:
        offs = offs.contiguous()
    if out is None:
        out = torch.empty(p.out_shape, dtype=p.out_dtype, device=mat_a.device)
    elif tuple(out.shape) != tuple(p.out_shape) or out.dtype != p.out_dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {p.out_dtype} tensor of shape {tuple(p.out_shape)}")
    if out.numel() == 0:
        return out
    if config is None:
        if interpret:
            config = INTERPRETER_CONFIG_TMA if tma_requested() else INTERPRETER_CONFIG
        else:
            config = tile_config(arch, p.dtype, rows_per_group(p))
    common = common_constexprs(config, p.dtype, interpret)

    launch = launch_options(config)
    run = _interpret_launch if interpret else _launch

    def grid_size(tiles_bound):
        if programs is not None:
            return programs
        return INTERPRETER_PROGRAMS if interpret else _programs(mat_a.device, config, tiles_bound)

    if p.layout == LAYOUT_2D2D:
        tiles = p.G * _cdiv(p.M, config.BM) * _cdiv(p.N, config.BN)
        nprog = grid_size(tiles)
        args = (mat_a, mat_b, out, offs, p.M, p.N, p.K, p.G,
                mat_a.stride(0), mat_a.stride(1), mat_b.stride(0), mat_b.stride(1),
                out.stride(0), out.stride(1), out.stride(2), nprog)
        run(kernels._ragged_k_kernel, nprog, args, {**common, **launch})
        return out

    if p.layout == LAYOUT_3D2D:
        # out.T [N, M] = 2Dx3D(b.T [N, K], a.mT [G, K, M]) with offs over N: strides only.
        a, b, o = mat_b.t(), mat_a.transpose(1, 2), out.t()
        M, N = p.N, p.M
        s_a = (0, a.stride(0), a.stride(1))
        s_o = (0, o.stride(0), o.stride(1))
    elif p.layout == LAYOUT_2D3D:
        a, b, o, M, N = mat_a, mat_b, out, p.M, p.N
        s_a = (0, a.stride(0), a.stride(1))
        s_o = (0, o.stride(0), o.stride(1))
    else:  # LAYOUT_3D3D: G batches of M rows, no offs
        a, b, o, M, N = mat_a, mat_b, out, p.M, p.N
        s_a = (a.stride(0), a.stride(1), a.stride(2))
        s_o = (o.stride(0), o.stride(1), o.stride(2))
    has_offs = p.layout != LAYOUT_3D3D
    if has_offs:  # each group adds at most one partial row tile, and the zero tail one more
        row_tiles = _cdiv(M, config.BM) + p.G + 1
    else:
        row_tiles = p.G * _cdiv(M, config.BM)
    nprog = grid_size(row_tiles * _cdiv(N, config.BN))
    has_bias = bias is not None
    s_bias = (bias.stride(0), bias.stride(1)) if has_bias else (0, 0)
    s_b = (b.stride(0), b.stride(1), b.stride(2))
    tma = None
    if config.tma and p.dtype in (torch.bfloat16, torch.float16) and p.layout in (LAYOUT_2D3D, LAYOUT_3D3D):
        tma = _tma_descriptors(a, b, not has_offs, config)
    if tma is not None:
        a, b = tma[0], tma[1]
        common.update(TMA=True, B_K_CONTIGUOUS=tma[2])
    args = (a, b, o, bias if has_bias else o, offs if has_offs else o, M, N, p.K, p.G, *s_a, *s_b, *s_o, *s_bias, nprog)
    run(kernels._rows_kernel, nprog, args, dict(HAS_OFFS=has_offs, HAS_BIAS=has_bias, **common, **launch))
    return out

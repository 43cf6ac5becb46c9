"""Trainium's block-wise grouped matmul in plain PyTorch: the executable spec of the NKI kernels.

The algorithm, with static shapes throughout (nothing depends on offs values but tensor contents):

* The ragged dimension is cut into blocks of ``block`` rows (a multiple of 128 on Trainium, 128 to
  1024; any positive size here). Each group's rows fill ceil(size / block) blocks, the last one
  padded. The number of blocks is a static worst case, so the Neuron compiler sees one shape for
  every routing. ``moe_ops.reference.block_schedule`` assigns rows to blocks on the device.
* Each block multiplies its rows by ONE group's weights, chosen at run time through a
  block-to-group array. Padded rows read nothing (they are zero) and write nothing.

Why a loop over blocks (and not the reference's batched form or a loop over groups): the
reference's sync-free path gathers ``b[group]`` for every block at once, an [nb, K, N] copy of
the weights (at B = 512, G = 8, M = 8192 and K = N = 4096 bf16 that is 23 x 32 MiB = 736 MiB);
a loop over groups with row masks would multiply every row by every group's weights (G x the
FLOPs). Looping over the static block count keeps one [K, N] weight slice live at a time and
costs nb x block rows of FLOPs (<= M + G x block rows); every iteration is one dense
[block, K] x [K, N] matmul with static shapes, which is what the Neuron compiler turns into
128-partition tiles on the Tensor Engine, and exactly what the NKI kernels in ``neuron_nki`` do
per block. The price is an unrolled graph of nb matmuls.

2D x 3D (MoE forward; with mat_b transposed, the input gradient): out [M, N]. The G groups are
extended by a pseudo-group G holding the rows past offs[-1]; its blocks read zero rows and write
exact zeros (selected, not multiplied: 0 x inf is NaN), and every output row is written exactly
once (no zero fill of the output). Block count: ceil(M / block) + G.

2D x 2D (weight gradient, groups over K): out [G, M, N]. Blocks of one group are consecutive, so
a running [M, N] accumulator restarts at exactly zero (``keep`` = 0; by selection, so that one
group's inf or NaN stays in it) at each group's first block and is stored
to out[g] at the group's last block only. The unused blocks at the end are given to the empty
groups (there are always enough, see ``schedule_2d2d``) and store their zero accumulator there,
so again every output slice is written exactly once. Block count: ceil(K / block) + G - 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._contract import LAYOUT_2D2D, LAYOUT_2D3D, Problem
from ..reference import block_schedule

# Trainium block sizes (rows per block): AWS's MoE kernels use 128..1024.
MIN_BLOCK, MAX_BLOCK = 128, 1024
# Per-partition SBUF (of 192 KiB) the kernels may spend on one block's gathered rows: block / 128
# row tiles x (K elements in the forward; M and N pass widths in the weight gradient). Leaves room
# for the forward's [K, 512] weight panel or the weight gradient's fp32 accumulators beside them.
ROWS_SBUF_BUDGET = 64 * 1024


def choose_block(p: Problem) -> int:
    """Rows per block for a problem (static: depends on shapes and dtype only).

    Every one of the nb blocks runs, whatever the routing (ceil(extent / block) + G in 2D x 3D,
    whose rows past offs[-1] take one more; ceil(extent / block) + G - 1 in 2D x 2D), so the
    FLOPs are nb x block / extent times the grouped FLOPs. The rule: the largest power of two in
    [128, 1024] whose padding, nb x block - extent rows, is at most a quarter of the extent and
    whose gathered rows fit the kernels' SBUF budget; 128 (the Tensor Engine's row tile) at least,
    whatever it costs. (Until 2026-12-06 the padding was taken as (G - 1) x block, without the
    last block's rounding and the extra 2D x 3D block: G = 1 took 1024-row blocks for 130
    rows.) Larger blocks reload each group's weights less often: a block does 2 x block FLOPs
    per 2-byte weight it loads, and a Trainium2 NeuronCore needs ~230 bf16 FLOPs per HBM byte
    to keep its Tensor Engine busy (~83 TFLOP/s over ~0.36 TB/s), so blocks below ~256 rows are
    bandwidth-bound on weights. Neither number was measured here.
    """
    from .neuron_nki import WGRAD_M_PASS_TILES, WGRAD_N_PASS

    extent = p.extent or 0
    if p.layout == LAYOUT_2D3D:
        width = p.K
    else:
        width = min(p.M, WGRAD_M_PASS_TILES * 128) + min(p.N, WGRAD_N_PASS)
    itemsize = torch.empty((), dtype=p.dtype).element_size()
    extra = p.G if p.layout == LAYOUT_2D3D else p.G - 1

    def padding(b):
        return (-(-extent // b) + extra) * b - extent

    block = MIN_BLOCK
    while (block * 2 <= MAX_BLOCK and 4 * padding(block * 2) <= extent
           and (block * 2 // 128) * max(width, 1) * itemsize <= ROWS_SBUF_BUDGET):
        block *= 2
    return block


@dataclass(frozen=True)
class Schedule2d3d:
    """Block schedule of a 2D x 3D problem; every tensor lives on offs' device.

    nb = ceil(M / block) + G blocks (G real groups plus the pseudo-group of rows past offs[-1]).

    group: [nb] int32 in [0, G): the weights each block uses (blocks of the pseudo-group and
        unused blocks say G - 1; their rows are all zero, so any valid group does).
    gather: [nb * block] int32: the row of mat_a each slot reads, or M (out of bounds: the slot
        reads zeros) for padding and rows past offs[-1].
    scatter: [nb * block] int32: the output row each slot writes, or M (out of bounds: skipped)
        for padding. Rows past offs[-1] are written (with zeros).
    valid: [nb * block] bool: gather < M (the slot belongs to a real group; it gets bias).
    """

    block: int
    group: torch.Tensor
    gather: torch.Tensor
    scatter: torch.Tensor
    valid: torch.Tensor

    @property
    def num_blocks(self) -> int:
        return self.group.shape[0]


def schedule_2d3d(offs: torch.Tensor, M: int, block: int) -> Schedule2d3d:
    """The 2D x 3D schedule for valid (sanitized) offs [G] over M >= 1 rows."""
    G = offs.shape[0]
    ext = torch.cat([offs.to(torch.int64), offs.new_full((1,), M, dtype=torch.int64)])
    group, rows, in_block = block_schedule(ext, M, block)  # group G: rows past offs[-1]; G + 1: unused
    real = in_block & (group < G)[:, None]
    gather = torch.where(real, rows, M)
    scatter = torch.where(in_block, rows, M)
    return Schedule2d3d(block, group.clamp(max=G - 1).to(torch.int32), gather.flatten().to(torch.int32),
                        scatter.flatten().to(torch.int32), real.flatten())


@dataclass(frozen=True)
class Schedule2d2d:
    """Block schedule of a 2D x 2D problem (groups over K); tensors on offs' device.

    nb = ceil(K / block) + G - 1 blocks.

    gather: [nb * block] int32: the K index each slot reads, or K (out of bounds: zeros).
    keep: [nb] float32: 1 where a block continues the previous block's group (the running
        accumulator is kept), 0 where it starts a group (the accumulator restarts).
    store: [nb] int32: the group whose [M, N] slice a block writes after accumulating: its own
        group at the group's last block, an empty group for the unused blocks given to empty
        groups, G (out of bounds: no store) otherwise. Each group appears exactly once.
    """

    block: int
    gather: torch.Tensor
    keep: torch.Tensor
    store: torch.Tensor

    @property
    def num_blocks(self) -> int:
        return self.keep.shape[0]


def schedule_2d2d(offs: torch.Tensor, K: int, block: int) -> Schedule2d2d:
    """The 2D x 2D schedule for valid (sanitized) offs [G] over K >= 1.

    Enough unused blocks for the empty groups: with n >= 1 non-empty groups holding K' <= K
    indices, the used blocks number at most ceil(K' / block) + n - 1 (each group boundary adds
    at most one partial block), so used + (G - n) <= ceil(K / block) + G - 1 = nb; with n = 0
    no block is used and nb >= G because K >= 1.
    """
    G = offs.shape[0]
    group, rows, valid = block_schedule(offs, K, block)  # group G: unused
    nb = group.shape[0]
    ends = offs.to(torch.int64)
    sizes = ends - torch.cat([ends.new_zeros(1), ends[:-1]])
    empty = sizes == 0
    used = group < G
    # The r-th empty group (r counted from 0) takes unused block n_used + r.
    target = torch.where(empty, used.sum() + torch.cumsum(empty.to(torch.int64), 0) - 1, nb)
    given = torch.full((nb + 1,), G, dtype=torch.int64, device=offs.device)
    given = given.scatter(0, target, torch.arange(G, device=offs.device))[:nb]  # slot nb: non-empty groups
    owner = torch.where(used, group, given)  # in [0, G]; G: unused and not given
    sentinel = owner.new_full((1,), G + 1)
    keep = used & (owner == torch.cat([sentinel, owner[:-1]]))
    last = owner != torch.cat([owner[1:], sentinel])
    store = torch.where(last & (owner < G), owner, G)
    gather = torch.where(valid, rows, K)
    return Schedule2d2d(block, gather.flatten().to(torch.int32), keep.to(torch.float32),
                        store.to(torch.int32))


def _block_mm(p: Problem, x, w, bias_row=None):
    """x [rows, k] @ w [k, n] accumulated in p.acc_dtype, bias (already masked) added before the cast."""
    if bias_row is None and p.out_dtype == p.dtype:
        return torch.matmul(x, w)  # ATen (and the Tensor Engine) accumulate bf16/fp16 in fp32
    r = torch.matmul(x.to(p.acc_dtype), w.to(p.acc_dtype))
    if bias_row is not None:
        r = r + bias_row
    return r.to(p.out_dtype)


def grouped_mm_2d3d(p: Problem, a, b, offs, bias, block: int):
    """2D x 3D block-wise: a [M, K], b [G, K, N] (any strides), offs [G] valid, bias [G, N] or None.

    Returns a new contiguous [M, N] in p.out_dtype.
    """
    M, N = p.M, p.N
    if M == 0 or N == 0:
        return a.new_zeros((M, N), dtype=p.out_dtype)
    s = schedule_2d3d(offs, M, block)
    gather = s.gather.to(torch.int64).view(-1, block)
    scatter = s.scatter.to(torch.int64).view(-1, block)
    valid = s.valid.view(-1, block)
    out = a.new_empty((M + 1, N), dtype=p.out_dtype)  # row M absorbs the padding slots' writes
    for j in range(s.num_blocks):
        rows = torch.where(valid[j, :, None], a.index_select(0, gather[j].clamp(max=M - 1)), 0)
        w = b.index_select(0, s.group[j:j + 1]).squeeze(0)  # one [K, N] slice, chosen on the device
        bias_row = None
        if bias is not None:
            bias_row = torch.where(valid[j, :, None], bias.index_select(0, s.group[j:j + 1]).to(p.acc_dtype), 0)
        # Slots of rows past offs[-1] read zero rows, but 0 x W[g] is NaN where W[g] holds inf or
        # NaN: they get exact zeros by selection, not by multiplication.
        out.index_copy_(0, scatter[j], torch.where(valid[j, :, None], _block_mm(p, rows, w, bias_row), 0))
    return out[:M]


def grouped_mm_2d2d(p: Problem, a, b, offs, block: int):
    """2D x 2D block-wise: a [M, K], b [K, N] (any strides), offs [G] valid over K.

    Returns a new contiguous [G, M, N] in p.out_dtype.
    """
    G, M, K, N = p.G, p.M, p.K, p.N
    if K == 0 or M == 0 or N == 0:
        return a.new_zeros((G, M, N), dtype=p.out_dtype)
    s = schedule_2d2d(offs, K, block)
    gather = s.gather.to(torch.int64).view(-1, block)
    store = s.store.to(torch.int64)
    out = a.new_empty((G + 1, M, N), dtype=p.out_dtype)  # slot G absorbs the blocks that store nothing
    acc = a.new_zeros((M, N), dtype=p.acc_dtype)
    for j in range(s.num_blocks):
        valid = gather[j] < K
        idx = gather[j].clamp(max=K - 1)
        xa = torch.where(valid[None, :], a.index_select(1, idx), 0).to(p.acc_dtype)
        xb = torch.where(valid[:, None], b.index_select(0, idx), 0).to(p.acc_dtype)
        # A group's first block restarts the sum at zero by selection: acc * 0 would carry the
        # previous group's inf or NaN into this one.
        acc = torch.where(s.keep[j] > 0, acc, 0) + torch.matmul(xa, xb)
        out.index_copy_(0, store[j:j + 1], acc.to(p.out_dtype).unsqueeze(0))
    return out[:G]


def compute(p: Problem, a, b, offs, bias, block: int | None = None):
    """The block-wise formulation of an already validated problem; NotImplementedError for 3D layouts."""
    if block is None:
        block = choose_block(p)
    if p.layout == LAYOUT_2D3D:
        return grouped_mm_2d3d(p, a, b, offs, bias, block)
    if p.layout == LAYOUT_2D2D:
        return grouped_mm_2d2d(p, a, b, offs, block)
    raise NotImplementedError(f"the Neuron block-wise kernels serve 2d3d and 2d2d, not {p.layout}")

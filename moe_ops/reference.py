"""The reference implementation of ``moe::grouped_mm``: the executable specification.

It is built from ATen ops only, runs on any device, is exact up to rounding in every dtype
(float64 included), and is the op's default kernel (CompositeExplicitAutograd), so a device
without a native kernel still gets the right answer.

Two formulations compute the same function:

* ``grouped_mm`` on CPU tensors: a loop over groups, one matmul per group. offs values are read
  on the host, which is free on CPU. This is the plainest statement of the math.
* on accelerator tensors (and from ``grouped_mm_sync_free`` anywhere): a block formulation with
  static shapes that never reads offs on the host. Each group's rows are split into blocks of
  ``T = ceil(extent / G)`` rows; there are at most ``ceil(extent / T) + G - 1 <= 2G - 1`` blocks,
  so one batched matmul over the blocks costs at most ~2x the grouped FLOPs and ~2x the weight
  memory, whatever the group sizes, and never syncs.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.autograd.forward_ad as _fwAD

from . import _contract
from ._contract import LAYOUT_2D2D, LAYOUT_2D3D, LAYOUT_3D2D, LAYOUT_3D3D, Problem

__all__ = ["grouped_mm", "grouped_mm_sync_free", "block_schedule"]


def grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: Optional[torch.Tensor] = None,
               bias: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Reference grouped matmul; same arguments and contract as ``moe_ops.grouped_mm``.

    Args:
        mat_a: [M, K] or [G, M, K]; float32, bfloat16, float16 or float64.
        mat_b: [G, K, N] or [K, N]; mat_a's dtype. Any strides.
        offs: [G] int32/int64 cumulative group ends over the ragged dimension (M for 2Dx3D,
            K for 2Dx2D, N for 3Dx2D); None for 3Dx3D.
        bias: optional [G, N] in the inputs' dtype (2Dx3D and 3Dx3D only).
        out_dtype: None or the inputs' dtype (the same), or torch.float32 for bf16/fp16 inputs.

    Returns:
        A new contiguous tensor: [M, N] (2Dx3D, 3Dx2D) or [G, M, N] (2Dx2D, 3Dx3D). Rows
        (2Dx3D) or columns (3Dx2D) past offs[-1] and the slices of empty 2Dx2D groups are zero.
        Differentiable in reverse and forward mode: where an input requires grad or carries a
        forward-mode tangent, the block formulation (built from differentiable ops) computes
        it; the CPU loop writes into slices of its output (mm's out=, copy_), which autograd
        cannot differentiate.
    """
    p = _contract.check_args(mat_a, mat_b, offs, bias, out_dtype)
    offs = _contract.prepare_offs(offs, p.extent)
    if differentiated(mat_a, mat_b, bias):
        return _compute_sync_free(p, mat_a, mat_b, offs, bias)
    return compute(p, mat_a, mat_b, offs, bias)


def differentiated(*tensors) -> bool:
    """Whether autograd differentiates a call on these tensors (None entries skipped): reverse
    mode (grad enabled and one requires grad) or forward mode (one carries a tangent at the
    current dual level: dual tensors, torch.func.jvp). Here: mm's out= variant, which the CPU
    loop uses, has no forward derivative and raises; the op's Python Autograd kernel asks too."""
    ts = [t for t in tensors if t is not None]
    if torch.is_grad_enabled() and any(t.requires_grad for t in ts):
        return True
    return _fwAD._current_level >= 0 and any(_fwAD.unpack_dual(t).tangent is not None for t in ts)


def grouped_mm_sync_free(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: Optional[torch.Tensor] = None,
                         bias: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The block formulation on any device (never reads offs values on the host).

    Invalid offs are not rejected: they are clamped as on an accelerator
    (``cummax(clamp(offs, 0, extent))``).
    """
    p = _contract.check_args(mat_a, mat_b, offs, bias, out_dtype)
    if offs is not None and p.extent is not None:  # (check_args: offs exactly where there is an extent)
        offs = _contract.sanitize_offs(offs, p.extent)
    return _compute_sync_free(p, mat_a, mat_b, offs, bias)


def compute(p: Problem, mat_a, mat_b, offs, bias):
    """Compute an already validated problem (offs valid on CPU, sanitized elsewhere)."""
    if mat_a.device.type == "cpu":
        return _compute_loop(p, mat_a, mat_b, offs, bias)
    return _compute_sync_free(p, mat_a, mat_b, offs, bias)


def _rows_apart_copied(x):
    """x [..., m, k], or its contiguous copy where x is bf16 on CPU with rows further apart than k.

    ATen's bf16 matmul on CPUs with AMX (oneDNN, torch 2.13) reads each row of its left operand
    past k when the rows are further apart (measured on an Intel AMX VM, 2026-12-04: k = 3, 7,
    33, 34, 257 read up to the next multiple of 8; k = 2, 6, 66, 130 did not): a NaN or inf
    there (the next group's K indices in a weight gradient, the tokens past offs[-1]) makes the
    group's product NaN, through the zeros the right operand is padded with. A finite value there
    changes no bit. This is oneDNN's issue uxlfoundation/oneDNN#5717 (its AMX brgemm loads A's
    K tail past the row; a fix was merged as #5723 in 2026-08), still in torch 2.13's oneDNN.
    The copy costs m * k elements against the product's m * k * n multiply-adds.
    """
    if x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.dim() >= 2 and x.shape[-2] > 1 \
            and x.stride(-1) == 1 and x.stride(-2) > x.shape[-1]:
        return x.contiguous()
    return x


def _unit_stride_vectors(p: Problem, a, b, sizes):
    """(a, b), with copies where a CPU product of the loop would be a 16-bit vector strided along
    its length: a one-row product whose row of a is not contiguous, or a one-column one whose
    column of b is not.

    torch 2.9.1's CPU mm in bf16 and fp16 (its oneDNN path; with torch.backends.mkldnn off it
    is right) returns wrong values for such vectors: errors of 30-150 on sums of 37-1024
    products (measured on an Intel AMX VM, 2026-12-05, and in bf16 on an AMD Zen 4 VM,
    2026-12-06; torch 2.13.0 and 2.14.1 are right on the same cases, and so are its bmm and 3-D
    matmul; the property suite's named case "one-row groups, mat_a transposed" fails there
    without this). A 2Dx3D one-row group of a transposed mat_a is one, a 3Dx2D one-column group
    another. The loop's outputs are contiguous, so no product writes such a vector. Each copy
    is of one operand, against the multiply-adds of all the products that read it (a 1/N or
    1/M share of them, G/M or G/N where G vectors are copied).
    """
    if a.device.type != "cpu" or p.dtype not in (torch.bfloat16, torch.float16) or p.layout == LAYOUT_3D3D:
        return a, b
    groups = sizes[:-1]
    one_row = 1 in groups if p.layout == LAYOUT_2D3D else a.shape[-2] == 1
    one_col = 1 in groups if p.layout == LAYOUT_3D2D else b.shape[-1] == 1
    if one_row and a.stride(-1) != 1:
        a = a.contiguous()
    k_dim = 0 if b.dim() == 2 else 1  # b's contraction dimension
    if one_col and b.stride(k_dim) != 1:
        b = b.transpose(k_dim, -1).contiguous().transpose(k_dim, -1)
    return a, b


def _group_columns(a, sizes):
    """mat_a's column slices of a 2Dx2D call, one per group (sizes ends with the tail past
    offs[-1], left out): views, or for bf16 on CPU contiguous copies, since their rows lie a's
    row apart (see _rows_apart_copied)."""
    xs = a.split(sizes, dim=1)[:-1]
    if a.dtype == torch.bfloat16 and a.device.type == "cpu":
        return [_rows_apart_copied(x) for x in xs]
    return xs


def _mm(p: Problem, x, y, bias_row=None):
    """x [..., m, k] @ y [..., k, n] accumulated in p.acc_dtype, bias added before the one cast."""
    if bias_row is None and p.out_dtype == p.dtype:
        # ATen's CPU and CUDA matmuls accumulate bf16/fp16 products in fp32 and round once.
        return torch.matmul(x, y)
    r = torch.matmul(x.to(p.acc_dtype), y.to(p.acc_dtype))
    if bias_row is not None:
        r = r + bias_row.to(p.acc_dtype)
    return r.to(p.out_dtype)


def _compute_loop(p: Problem, a, b, offs, bias):
    if p.layout != LAYOUT_2D2D:  # 2Dx2D copies its group columns instead (_group_columns)
        a = _rows_apart_copied(a)  # a view of a wider tensor's columns (padded rows)
    if p.layout == LAYOUT_3D3D:
        out = _mm(p, a, b, None if bias is None else bias.unsqueeze(1))
        return out.contiguous()
    # Group sizes plus the tail past offs[-1]. split/unbind make all per-group views in one call
    # each and only the tail is zero-filled: 10-15% faster at G = 64..256 on CPU than slicing
    # per group into a zeroed output.
    ends = offs.tolist()
    sizes = [e - s for s, e in zip([0] + ends[:-1], ends)] + [p.extent - ends[-1]]
    a, b = _unit_stride_vectors(p, a, b, sizes)
    out = a.new_empty(p.out_shape, dtype=p.out_dtype)
    if p.layout == LAYOUT_2D3D:
        out[ends[-1]:].zero_()
        pieces = zip(out.split(sizes), a.split(sizes), b.unbind(0))
    elif p.layout == LAYOUT_2D2D:
        pieces = zip(out.unbind(0), _group_columns(a, sizes), b.split(sizes, dim=0))
    else:  # LAYOUT_3D2D
        out[:, ends[-1]:].zero_()
        pieces = zip(out.split(sizes, dim=1), a.unbind(0), b.split(sizes, dim=1))
    if bias is None and p.out_dtype == p.dtype and p.layout != LAYOUT_3D2D:
        # Every dst is contiguous, so the matmul writes it in place; an empty group is a 0-row
        # product and an empty 2d2d group (K = 0) comes out zero. Nothing else runs per group:
        # each line of Python here costs several times its own time in the matmuls around it
        # (G=64, M=2048, K=N=512: a loop with one extra call and two checks per group was 3-6%
        # slower than this one, which is 3-6% slower than torch._grouped_mm's C++ loop).
        for dst, x, y in pieces:
            torch.mm(x, y, out=dst)
        return out
    bias_rows = bias.unbind(0) if bias is not None else [None] * p.G
    for (dst, x, y), bias_row in zip(pieces, bias_rows):
        dst.copy_(_mm(p, x, y, bias_row))  # K = 0 gives a zero product here too
    return out


def block_schedule(offs, extent: int, block: int):
    """Assign fixed-size blocks to groups on the device, with static shapes.

    Group g's rows [offs[g-1], offs[g]) are cut into ceil(size_g / block) blocks. The number of
    blocks is the static worst case ``ceil(extent / block) + G - 1``; unused blocks get group
    id G. No value is read on the host.

    Args:
        offs: [G] valid (sanitized) cumulative group ends, int32 or int64.
        extent: the partitioned length (e.g. M).
        block: rows per block, >= 1.

    Returns:
        (group [nb] int64 in [0, G], rows [nb, block] int64 row index per slot, valid [nb, block]
        bool). Invalid slots point at row ``extent`` (one past the end).
    """
    G = offs.shape[0]
    nb = -(-extent // block) + G - 1
    ends = offs.to(torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    per_group = torch.div(ends - starts + block - 1, block, rounding_mode="floor")
    last_block = torch.cumsum(per_group, 0)  # blocks [last_block[g-1], last_block[g]) are g's
    j = torch.arange(nb, device=offs.device)
    group = torch.searchsorted(last_block, j, right=True)  # G where j is past every group
    gc = group.clamp(max=G - 1)
    first = last_block[gc] - per_group[gc]
    row0 = starts[gc] + (j - first) * block
    rows = row0[:, None] + torch.arange(block, device=offs.device)
    valid = (group[:, None] < G) & (rows < ends[gc][:, None])
    rows = torch.where(valid, rows, extent)
    return group, rows, valid


def _compute_sync_free(p: Problem, a, b, offs, bias):
    if p.layout == LAYOUT_3D3D:
        return _compute_loop(p, a, b, offs, bias)  # no offs: one batched matmul, nothing to sync
    if p.layout == LAYOUT_3D2D:
        # out[:, cols_g] = a[g] @ b[:, cols_g]  <=>  out.T = 2d3d(b.T [N, K], a.mT [G, K, M])
        q = Problem(LAYOUT_2D3D, p.G, p.N, p.K, p.M, p.dtype, p.out_dtype, p.acc_dtype, (p.N, p.M), p.N)
        return _compute_sync_free(q, b.t(), a.transpose(1, 2), offs, None).t().contiguous()

    extent = p.extent
    assert extent is not None  # 3Dx3D, the one layout without one, returned above
    if extent == 0:
        return a.new_zeros(p.out_shape, dtype=p.out_dtype)  # no row (or no K) belongs to a group
    block = -(-extent // p.G)
    group, rows, valid = block_schedule(offs, extent, block)
    gc = group.clamp(max=p.G - 1)
    idx = rows.clamp(max=max(extent - 1, 0))
    if p.layout == LAYOUT_2D3D:
        # a_blocks [nb, block, K] @ b[group] [nb, K, N] -> scattered back to rows.
        a_blocks = torch.where(valid[..., None], a[idx], 0)
        bias_rows = None if bias is None else bias[gc].unsqueeze(1)
        out_blocks = _mm(p, a_blocks, b[gc], bias_rows)
        out = a.new_zeros((extent + 1, p.N), dtype=p.out_dtype)  # row `extent` absorbs padding
        out.index_copy_(0, rows.flatten(), out_blocks.flatten(0, 1))
        return out[:extent].contiguous()
    # LAYOUT_2D2D: partial products over each block of K, summed into their group's slice.
    a_blocks = torch.where(valid[:, None, :], a[:, idx].permute(1, 0, 2), 0)  # [nb, M, block]
    b_blocks = torch.where(valid[..., None], b[idx], 0)  # [nb, block, N]
    partial = torch.matmul(a_blocks.to(p.acc_dtype), b_blocks.to(p.acc_dtype))
    out = partial.new_zeros((p.G + 1, p.M, p.N)).index_add_(0, group, partial)
    return out[: p.G].to(p.out_dtype).contiguous()

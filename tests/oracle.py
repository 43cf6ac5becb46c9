"""An oracle for grouped_mm, written independently of moe_ops.reference.

moe_ops.reference loops over groups; this oracle maps every row / column / K index to its group
and evaluates one einsum, so the two share no code and no formulation. ``oracle(...,
exact=True)`` computes in float64 (the ground truth: the products of bf16, fp16 and fp32 values
are exact there), and float64 problems as if in twice float64's precision, rounded once (the
same einsum on Ozaki's splittings, moe_ops.testing.float64_exactly); ``exact=False`` computes
the plain way in the inputs' precision: accumulation in float32 (float64 for float64), bias
added before one rounding to the output dtype, which is what the tolerance rule measures
against.
"""

from __future__ import annotations

import torch

from moe_ops.testing import float64_exactly, float64_exactly_applies


def group_ids(offs, extent: int) -> torch.Tensor:
    """[extent] int64: the group of each index, or -1 for an index in no group.

    Index i belongs to group g if offs[g-1] <= i < offs[g] (offs[-1] read as 0), taking the
    first such g; offs is assumed valid (non-decreasing, within [0, extent]).
    """
    ids = torch.full((extent,), -1, dtype=torch.int64)
    start = 0
    for g, end in enumerate(offs.tolist()):
        ids[start:end] = g
        start = max(start, end)
    return ids


def oracle(mat_a, mat_b, offs=None, bias=None, out_dtype=None, *, exact=True, twice_precise=True):
    """The problem in float64 (``exact``) or the plain way in the inputs' precision (see the
    module docstring). With ``exact``, float64 inputs, all finite, with elements, and
    ``twice_precise`` (off for ``magnitude``, a sum of positive terms), the value is summed as
    if in twice float64's precision; the gradient is the plain einsum's."""
    dtype = mat_a.dtype
    out_dtype = out_dtype or dtype
    acc = torch.float64 if exact or dtype == torch.float64 else torch.float32
    # No detach: the float64 oracle is differentiable, so gradients have an oracle too.
    a, b = mat_a.cpu().to(acc), mat_b.cpu().to(acc)
    bias = None if bias is None else bias.cpu().to(acc)
    out = _einsum(a, b, offs, bias)
    if exact and twice_precise and float64_exactly_applies(mat_a, mat_b, bias):
        a0, b0 = a.detach(), b.detach()
        placed = None if bias is None else _einsum(torch.zeros_like(a0), b0, offs, bias.detach())  # 0 + bias
        value = float64_exactly(lambda x, y: _einsum(x, y, offs, None), a0, b0, placed)
        out = value + (out - out.detach())  # the value, with the einsum's gradient
    return out if exact else out.detach().to(out_dtype)


def _einsum(a, b, offs, bias):
    """The problem on a and b (already in the accumulation dtype) by one einsum per layout."""
    if a.dim() == 3 and b.dim() == 3:
        out = torch.einsum("gmk,gkn->gmn", a, b)
        if bias is not None:
            out = out + bias[:, None, :]
    elif a.dim() == 2 and b.dim() == 3:
        gid = group_ids(offs, a.shape[0])
        member = (gid >= 0)[:, None]
        g = gid.clamp(min=0)
        # Selected, not multiplied by 0/1: a row outside every group is 0 even where the
        # stand-in group's weights hold inf or NaN.
        out = torch.where(member, torch.einsum("mk,mkn->mn", a, b[g]), 0)
        if bias is not None:
            out = out + torch.where(member, bias[g], 0)
    elif a.dim() == 2 and b.dim() == 2:
        gid = group_ids(offs, a.shape[1])
        onehot = gid[None, :] == torch.arange(offs.shape[0])[:, None]  # [G, K]
        # Each group's own K indices selected on both sides (a product with 0 would be NaN next
        # to an inf or NaN of another group).
        a_g = torch.where(onehot[:, None, :], a[None], 0)  # [G, M, K]
        b_g = torch.where(onehot[:, :, None], b[None], 0)  # [G, K, N]
        out = torch.einsum("gmk,gkn->gmn", a_g, b_g)
    else:
        gid = group_ids(offs, b.shape[1])
        member = (gid >= 0)[None, :]
        out = torch.where(member, torch.einsum("nmk,kn->mn", a[gid.clamp(min=0)], b), 0)
    return out


def magnitude(mat_a, mat_b, offs=None, bias=None):
    """The float64 oracle on absolute values: sum of |a_ik * b_kj| (+ |bias_j|) per output."""
    absolute = lambda t: None if t is None else t.detach().cpu().double().abs()  # noqa: E731
    return oracle(absolute(mat_a), absolute(mat_b), offs, absolute(bias), exact=True, twice_precise=False)

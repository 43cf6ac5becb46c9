"""An oracle for grouped_mm, written independently of moe_ops.reference.

moe_ops.reference loops over groups; this oracle maps every row / column / K index to its group
and evaluates one einsum, so the two share no code and no formulation. ``oracle(...,
exact=True)`` computes in float64 (the ground truth: the products of bf16, fp16 and fp32 values
are exact there), and float64 problems as if in twice float64's precision (``dot2``), rounded
once; ``exact=False`` computes the plain way in the inputs' precision: accumulation in float32
(float64 for float64), bias added before one rounding to the output dtype, which is what the
tolerance rule measures against.
"""

from __future__ import annotations

import torch


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


_SPLIT = 2.0**27 + 1  # Veltkamp's splitter for float64's 53-bit significand


def _two_product(x, y):
    """(p, e): p = fl(x * y) and p + e = x * y exactly (Dekker's product; finite values well inside
    float64's range, as the tests draw)."""
    p = x * y
    cx, cy = x * _SPLIT, y * _SPLIT
    xh, yh = cx - (cx - x), cy - (cy - y)
    xl, yl = x - xh, y - yh
    return p, ((xh * yh - p) + xh * yl + xl * yh) + xl * yl


def _two_sum(a, b):
    """(s, e): s = fl(a + b) and s + e = a + b exactly (Knuth's sum)."""
    s = a + b
    z = s - a
    return s, (a - (s - z)) + (b - z)


def dot2(terms, count: int, shape) -> torch.Tensor:
    """float64 [shape]: sum over k < count of x_k * y_k, (x_k, y_k) = terms(k) float64 tensors that
    broadcast to shape, as accurate as if computed in twice float64's precision and then rounded:
    error <= u |sum| + gamma_n^2 sum |x_k y_k| for n = count, u = 2**-53 and gamma_n = n u /
    (1 - n u) (Ogita, Rump and Oishi, "Accurate sum and dot product", SIAM J. Sci. Comput. 26(6),
    2005, Algorithm Dot2). At n = 4096 the second term is ~1e-9 ulp of the magnitude: the sum's
    rounding is one half-ulp, where a float64 einsum's reaches ~1.4 ulps of the magnitude (see
    moe_ops.testing.tolerance)."""
    p = torch.zeros(shape, dtype=torch.float64)
    s = torch.zeros(shape, dtype=torch.float64)
    for k in range(count):
        h, r = _two_product(*terms(k))
        p, q = _two_sum(p, h)
        s = s + (q + r)
    return p + s


def _dot2_problem(a, b, offs, bias, shape) -> torch.Tensor:
    """The problem of ``oracle`` (float64 operands) through ``dot2``, each layout as the einsum
    there reads it (a row in no group is 0 after selection; a bias is one more term, times 1)."""
    one = torch.ones((), dtype=torch.float64)
    if a.dim() == 3 and b.dim() == 3:
        extra = [] if bias is None else [(bias[:, None, :], one)]
        terms = lambda k: (a[:, :, k, None], b[:, None, k, :]) if k < a.shape[2] else extra[0]  # noqa: E731
        return dot2(terms, a.shape[2] + len(extra), shape)
    if a.dim() == 2 and b.dim() == 3:
        gid = group_ids(offs, a.shape[0])
        g = gid.clamp(min=0)
        extra = [] if bias is None else [(bias[g], one)]
        terms = lambda k: (a[:, k, None], b[:, k, :][g]) if k < a.shape[1] else extra[0]  # noqa: E731
        return torch.where((gid >= 0)[:, None], dot2(terms, a.shape[1] + len(extra), shape), 0)
    if a.dim() == 2 and b.dim() == 2:
        gid = group_ids(offs, a.shape[1])
        onehot = gid[None, :] == torch.arange(offs.shape[0])[:, None]  # [G, K]
        terms = lambda k: (torch.where(onehot[:, k, None, None], a[None, :, k, None], 0),  # noqa: E731
                           torch.where(onehot[:, k, None, None], b[None, None, k, :], 0))
        return dot2(terms, a.shape[1], shape)
    gid = group_ids(offs, b.shape[1])
    g = gid.clamp(min=0)
    terms = lambda k: (a[:, :, k][g].T, b[k][None, :])  # noqa: E731
    return torch.where((gid >= 0)[None, :], dot2(terms, a.shape[2], shape), 0)


def oracle(mat_a, mat_b, offs=None, bias=None, out_dtype=None, *, exact=True, twice_precise=True):
    """The problem in float64 (``exact``) or the plain way in the inputs' precision (see the
    module docstring). With ``exact`` and float64 inputs the value is ``dot2``'s where that is
    finite (``twice_precise``; off for ``magnitude``, a sum of positive terms), the einsum's
    elsewhere and for the gradient (an inf or NaN input gives the einsum's inf or NaN)."""
    dtype = mat_a.dtype
    out_dtype = out_dtype or dtype
    acc = torch.float64 if exact or dtype == torch.float64 else torch.float32
    # No detach: the float64 oracle is differentiable, so gradients have an oracle too.
    a, b = mat_a.cpu().to(acc), mat_b.cpu().to(acc)
    bias = None if bias is None else bias.cpu().to(acc)
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
    if exact and twice_precise and dtype == torch.float64:
        precise = _dot2_problem(a.detach(), b.detach(), offs, None if bias is None else bias.detach(), out.shape)
        # value + a zero that carries the einsum's gradient (inf - inf: NaN, hence nan_to_num).
        out = torch.where(precise.isfinite(), precise, out.detach()) + (out - out.detach()).nan_to_num(0.0)
    return out if exact else out.detach().to(out_dtype)


def magnitude(mat_a, mat_b, offs=None, bias=None):
    """The float64 oracle on absolute values: sum of |a_ik * b_kj| (+ |bias_j|) per output."""
    absolute = lambda t: None if t is None else t.detach().cpu().double().abs()  # noqa: E731
    return oracle(absolute(mat_a), absolute(mat_b), offs, absolute(bias), exact=True, twice_precise=False)

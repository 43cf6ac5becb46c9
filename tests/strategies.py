"""Hypothesis strategies for grouped_mm problems, shared by every backend's tests.

A ``Case`` is drawn by hypothesis (layout, sizes, partition, dtype, strides, bias, out_dtype);
its tensors are built from a seed, so shrinking works on the structure and not on float lists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from hypothesis import strategies as st

from oracle import group_ids

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
LAYOUTS = ("2d3d", "2d2d", "3d3d", "3d2d")
# How an operand is laid out in memory: contiguous, a transposed view of the other order (e.g.
# mat_b given as a [G, N, K] tensor viewed as [G, K, N]), every other element of a larger one,
# broadcast: stride 0 in the leading dimension (one expert's weights expanded to all G, or one
# row expanded to all rows), or padded: the first columns of a wider tensor whose other columns
# hold NaN, so rows lie further apart than they are long (ATen's bf16 matmul on AMX CPUs read
# such padding: moe_ops.reference._rows_apart_copied).
STRIDES = ("contiguous", "transposed", "strided", "broadcast", "padded")


@dataclass(frozen=True)
class Case:
    layout: str
    G: int
    M: int
    K: int
    N: int
    dtype: torch.dtype
    offs: Optional[tuple]
    offs_dtype: torch.dtype
    stride_a: str
    stride_b: str
    bias: bool
    out_dtype: Optional[torch.dtype]
    seed: int
    # offs as every other entry of a tensor twice as long (a view with stride 2), the entries
    # between them the extent: a kernel reading offs with unit stride gets other groups.
    strided_offs: bool = False

    @property
    def extent(self):
        return {"2d3d": self.M, "2d2d": self.K, "3d2d": self.N, "3d3d": None}[self.layout]


def _operand(shape, dtype, stride, gen):
    """A tensor of `shape` with values N(0, 1) rounded to dtype, laid out as `stride` says (the
    memory around a padded one's rows holds NaN)."""
    if stride == "transposed" and len(shape) >= 2:
        store = torch.randn(*shape[:-2], shape[-1], shape[-2], generator=gen, dtype=torch.float64)
        return store.to(dtype).transpose(-1, -2)
    if stride == "strided":
        store = torch.randn(*shape[:-1], 2 * shape[-1], generator=gen, dtype=torch.float64)
        return store.to(dtype)[..., ::2]
    if stride == "padded":
        store = torch.randn(*shape[:-1], shape[-1] + 5, generator=gen, dtype=torch.float64)
        store[..., shape[-1]:] = float("nan")
        return store.to(dtype)[..., : shape[-1]]
    if stride == "broadcast":
        store = torch.randn(1, *shape[1:], generator=gen, dtype=torch.float64)
        return store.to(dtype).expand(*shape)
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


def build(case: Case):
    """(mat_a, mat_b, offs, bias, out_dtype) for a case, on CPU."""
    gen = torch.Generator().manual_seed(case.seed)
    G, M, K, N = case.G, case.M, case.K, case.N
    shape_a = (M, K) if case.layout in ("2d3d", "2d2d") else (G, M, K)
    shape_b = (G, K, N) if case.layout in ("2d3d", "3d3d") else (K, N)
    a = _operand(shape_a, case.dtype, case.stride_a, gen)
    b = _operand(shape_b, case.dtype, case.stride_b, gen)
    offs = None if case.offs is None else torch.tensor(case.offs, dtype=case.offs_dtype)
    if offs is not None and case.strided_offs:
        store = torch.full((2 * case.G,), case.extent, dtype=case.offs_dtype)
        store[::2] = offs
        offs = store[::2]
    bias = None
    if case.bias:
        bias = torch.randn(G, N, generator=gen, dtype=torch.float64).to(case.dtype)
    return a, b, offs, bias, case.out_dtype


def empty_groups(offs):
    """[G] bool: the groups with no rows (K indices, columns)."""
    ends = offs.to(torch.int64)
    return torch.diff(ends, prepend=ends.new_zeros(1)) == 0


def check_exact_zeros(out, case: Case, offs):
    """Rows (2Dx3D) or columns (3Dx2D) outside every group, and the slices of empty 2Dx2D
    groups, are exactly zero."""
    if offs is None:
        return
    gid = group_ids(offs, case.extent)
    if case.layout == "2d3d":
        outside = out[gid < 0]
    elif case.layout == "3d2d":
        outside = out[:, gid < 0]
    else:  # 2d2d: the slices of empty groups
        outside = out[empty_groups(offs)]
    assert torch.count_nonzero(outside) == 0, "rows/columns outside every group must be exactly zero"


def poison_outside_groups(case: Case, a, b, bias, offs):
    """Copies of the operands with NaN / inf in every element that belongs to no group: rows
    past offs[-1] (2Dx3D mat_a), K indices past it (2Dx2D, both operands), columns past it (3Dx2D
    mat_b), and the weights (and bias) of empty groups. MoE code hands such memory over as is:
    token buffers padded with torch.empty, uninitialised expert slots."""
    a, b, bias = a.clone(), b.clone(), None if bias is None else bias.clone()
    last = int(offs[-1])
    empty = empty_groups(offs)
    if case.layout == "2d3d":
        a[last:] = float("nan")
        b[empty] = float("inf")
        if bias is not None:
            bias[empty] = float("nan")
    elif case.layout == "2d2d":
        a[:, last:] = float("inf")
        b[last:] = float("nan")
    else:  # 3d2d
        a[empty] = float("nan")
        b[:, last:] = float("-inf")
    return a, b, bias


def poison_other_groups_2d2d(a, b, offs, g: int):
    """Copies of a 2Dx2D problem's operands (mat_a [M, K], mat_b [K, N]) with inf in mat_a and
    NaN in mat_b at every K index outside group g: the other groups' and those past offs[-1]."""
    ends = [0] + [int(e) for e in offs]
    outside = torch.ones(a.shape[1], dtype=torch.bool)
    outside[ends[g]:max(ends[g], ends[g + 1])] = False
    pa, pb = a.clone(), b.clone()
    pa[:, outside] = float("inf")
    pb[outside] = float("nan")
    return pa, pb


@st.composite
def partitions(draw, G: int, extent: int, short: bool = False):
    """G cumulative group ends in [0, extent], drawn with replacement so that empty groups occur;
    the last end is the extent about half of the time and below it otherwise (always below it
    with ``short``, when extent > 0: some of the ragged dimension then belongs to no group)."""
    top = extent - 1 if short and extent > 0 else extent
    ends = sorted(draw(st.lists(st.integers(0, top), min_size=G, max_size=G)))
    if not short and draw(st.booleans()):
        ends[-1] = extent
    return tuple(ends)


@st.composite
def cases(draw, layouts=LAYOUTS, dtypes=DTYPES, max_m=64, max_k=48, max_n=48, max_g=8,
          allow_big_g=True, allow_bias=True, allow_out_dtype=True, short=False):
    """A random valid grouped_mm problem. G is 1..max_g, or 256 now and then; ``short``: offs[-1]
    below the extent (see partitions)."""
    layout = draw(st.sampled_from(layouts))
    g_choices = st.integers(1, max_g)
    G = draw(st.one_of(g_choices, st.just(256)) if allow_big_g else g_choices)
    M = draw(st.integers(0, max_m))
    K = draw(st.integers(0, max_k))
    N = draw(st.integers(1, max_n))
    dtype = draw(st.sampled_from(dtypes))
    extent = {"2d3d": M, "2d2d": K, "3d2d": N, "3d3d": None}[layout]
    offs = None if extent is None else draw(partitions(G, extent, short))
    bias = allow_bias and layout in ("2d3d", "3d3d") and draw(st.booleans())
    out_dtype = None
    if allow_out_dtype and draw(st.booleans()):
        out_dtype = torch.float32 if dtype in (torch.bfloat16, torch.float16, torch.float32) else dtype
    return Case(
        layout=layout, G=G, M=M, K=K, N=N, dtype=dtype, offs=offs,
        offs_dtype=draw(st.sampled_from((torch.int32, torch.int64))),
        stride_a=draw(st.sampled_from(STRIDES)), stride_b=draw(st.sampled_from(STRIDES)),
        bias=bias, out_dtype=out_dtype, seed=draw(st.integers(0, 2**31 - 1)),
        strided_offs=offs is not None and draw(st.booleans()),
    )


def small_problem(layout, dtype=torch.float64, bias=False, seed=0):
    """A fixed small problem per layout for the autograd tests: ((mat_a, mat_b[, bias]), offs)
    with an empty group and an index past offs[-1], mat_b a transposed view for 2d3d."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype)  # noqa: E731
    G, M, K, N = 3, 7, 5, 4
    if layout == "2d3d":
        a, b, offs = r(M, K), r(G, N, K).transpose(1, 2), torch.tensor([2, 2, 6])
    elif layout == "2d2d":
        a, b, offs = r(M, K), r(K, N), torch.tensor([0, 3, 4])
    elif layout == "3d3d":
        a, b, offs = r(G, M, K), r(G, K, N), None
    else:
        a, b, offs = r(G, M, K), r(K, N), torch.tensor([1, 1, 3])
    return ((a, b, r(G, N)) if bias else (a, b)), offs


def long_float64_problem(layout, K, seed=0):
    """(mat_a, mat_b, offs) of float64 sums of K products per output element (2d2d: K cut 1:1:1:1
    into four groups), for the long-sum tests (the property suite draws K <= 48): G=4, N=64;
    2d3d 209 rows in groups of 50 / 50 / 60 / 49 ("2d3d-nk": mat_b a transposed [G, N, K]
    view), 3d3d / 3d2d 60 rows a group."""
    G, M, N = 4, 209, 64
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    a, b, offs = {"2d3d": lambda: (r(M, K), r(G, K, N), [50, 100, 160, M]),
                  "2d3d-nk": lambda: (r(M, K), r(G, N, K).transpose(1, 2), [50, 100, 160, M]),
                  "2d2d": lambda: (r(K, M).t(), r(K, N), [K // 4, K // 2, 3 * K // 4, K]),
                  "3d3d": lambda: (r(G, 60, K), r(G, K, N), None),
                  "3d2d": lambda: (r(G, 60, K), r(K, G * N), [N, 2 * N, 3 * N, 4 * N])}[layout]()
    return a, b, None if offs is None else torch.tensor(offs, dtype=torch.int32)

"""Pallas TPU kernels of moe_ops: grouped matmul with a ragged row dimension (``gmm``) and with a
ragged contraction dimension (``tgmm``), and the tiling policy that sizes them for VMEM.

This module imports jax; ``moe_ops.backends.tpu`` imports it only on first use.

Both kernels take the group structure as cumulative group ends (``offs``) on the device and turn
it, with jnp ops and no host sync, into a *schedule*: one entry per grid step that says which
group the step works for and which tile of the ragged dimension it touches. The schedule is
handed to the kernel by scalar prefetch (``pltpu.PrefetchScalarGridSpec``), so the BlockSpec
index maps read it from SMEM before each step's DMAs are issued. The number of steps is a traced
value (a dynamic grid bound): empty groups cost nothing in ``gmm``, and new group sizes never
recompile; only new shapes (and therefore new tiles) do.

A tile that straddles the boundary between two groups is visited once per group; each visit
masks the rows (gmm) or the contraction indices (tgmm) that are not its group's. No size has
to be a multiple of a tile: edge tiles are partial blocks whose out-of-range part is masked
(contraction) or never stored (rows, columns).

Differences from MegaBlox (jax.experimental.pallas.ops.tpu.megablox), which solved the same
problem first: MegaBlox needs ``m % tm == 0``, expects group sizes that add up to m, and its
tgmm transposes its [k, m] operand in HBM before the kernel. Here rows past ``offs[-1]`` are a
"tail" pseudo-group whose steps only store zeros and re-use the previous step's blocks (no DMA),
tgmm reads mat_a in either orientation, and no dimension has to be a multiple of its tile.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

MiB = 1 << 20


# --------------------------------------------------------------------------------------------
# Tiling policy
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Generation:
    """What the tiling policy needs to know about one TPU generation.

    vmem_limit: the scoped-VMEM limit the kernels are compiled with (``vmem_limit_bytes``);
    budget: the most our buffers (``vmem_bytes``) may take; the rest is left to what Mosaic adds
    (register-allocator spill slots: 1.2-2.5 MiB measured for 512-1024 x 2048 tiles on v4).
    """

    name: str
    vmem_limit: int
    budget: int


# VMEM per TensorCore: v4 16 MiB, v5e 128 MiB, v5p 64 MiB, v6e 128 MiB, v7 64 MiB (jax's
# tpu_info). We ask for 16 MiB on v4 (all of it) and 32 MiB elsewhere (the v6e default scoped
# limit; v5e's default is 16 MiB, so we raise it). The largest tiles the policy picks, 512 x 1024
# x 1024 bf16, take 10 MiB, and bigger ones gain little: such a step does 2*512*1024*1024 FLOPs
# per (512 + 1024)*1024*2 bytes loaded, ~340 FLOPs/byte, past v5e's ridge (197 TFLOP/s / 819
# GB/s = 240) and within 2x of v6e's (918 / 1640 = 560; its MXU is 256 wide, hence multiples of
# 256), while the per-step overhead (~0.35 us) is 6% of the step's 5.4 us on v5e.
GENERATIONS = {
    "v4": Generation("v4", 16 * MiB, 12 * MiB),
    "v5e": Generation("v5e", 32 * MiB, 24 * MiB),
    "v5p": Generation("v5p", 32 * MiB, 24 * MiB),
    "v6e": Generation("v6e", 32 * MiB, 24 * MiB),
    "v7": Generation("v7", 32 * MiB, 24 * MiB),
    # The CPU interpreter has no VMEM; small tiles make small test shapes cross tile and group
    # boundaries (several m tiles for M >= 17), which is what interpret-mode tests are for.
    "interpret": Generation("interpret", 32 * MiB, 24 * MiB),
}


def generation_of(device_kind: str) -> str:
    """Our generation name for a device kind ("TPU v5 lite", "TPU v5e" -> "v5e"; "TPU v5" ->
    "v5p"; TorchTPU's "TPU v7" -> "v7"). Unknown kinds get "v5e", whose limits every
    generation from v5 on meets."""
    m = re.match(r"TPU ?v?(\d+)\s*(\w*)", device_kind)
    if not m:
        return "v5e"
    version, variant = int(m.group(1)), m.group(2)
    if version == 4:
        return "v4"
    if version == 5:
        return "v5p" if variant in ("", "p") else "v5e"
    if version == 6:
        return "v6e"
    return "v7" if version >= 7 else "v5e"


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Block sizes in the problem's own coordinates.

    gmm  (a [M, K] @ b[g] [K, N]):      tm rows of a (ragged), tk of K, tn of N.
    tgmm (a [M, K] @ b [K, N], K ragged): tm rows of a, tk of K (ragged), tn of N.
    """

    tm: int
    tk: int
    tn: int


def _sublanes(itemsize: int) -> int:
    # Rows of one (sublane x lane) VMEM tile: 8 for 32-bit types, 16 for bf16 (packed in pairs).
    return 8 * max(1, 4 // itemsize)


def _buffer(rows: int, cols: int, itemsize: int) -> int:
    """Bytes of a [rows, cols] VMEM buffer, padded to whole (sublanes x 128) tiles."""
    sub = _sublanes(itemsize)
    return (-(-rows // sub) * sub) * (-(-cols // 128) * 128) * itemsize


def vmem_bytes(kind: str, tiles: Tiles, in_itemsize: int, out_itemsize: int, has_bias: bool = False,
               transposed: bool = False) -> int:
    """VMEM that one kernel instance allocates, in bytes, counted as Mosaic counts its scoped
    allocation: every input and output block twice (Pallas double-buffers them to overlap DMA
    with compute) plus the fp32 accumulator, each padded to whole (sublane x 128) tiles.
    ``transposed``: gmm's b block is (tn, tk), tgmm's a block (tk, tm).

    tests/test_tpu_mosaic.py checks this number against the size Mosaic reports when a
    configuration does not fit.
    """
    tm, tk, tn = tiles.tm, tiles.tk, tiles.tn
    a = _buffer(tk, tm, in_itemsize) if kind == "tgmm" and transposed else _buffer(tm, tk, in_itemsize)
    b = _buffer(tn, tk, in_itemsize) if kind == "gmm" and transposed else _buffer(tk, tn, in_itemsize)
    blocks = a + b + _buffer(tm, tn, out_itemsize)
    if kind == "gmm" and has_bias:
        blocks += _buffer(1, tn, in_itemsize)
    return 2 * blocks + _buffer(tm, tn, 4)


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def _fit(dim: int, tile: int) -> int:
    # A block dimension must be a multiple of the (sublane, lane) tile or the whole dimension.
    return dim if dim <= tile else tile


def choose_tiles(kind: str, M: int, K: int, N: int, G: int, dtype, out_dtype, generation: str,
                 has_bias: bool = False) -> Tiles:
    """Tile sizes for one problem; a function of (kind, M, K, N, G, dtype, generation) only.

    kind "gmm": a [M, K] rows split into G groups, times b [G, K, N]. kind "tgmm": a [M, K] @
    b [K, N] with K split into G groups, result [G, M, N].

    Policy:
    1. The ragged tile (tm for gmm, tk for tgmm) follows the average group size, a power of two
       in [128, 512]: every group boundary costs up to one extra tile visit, so tiles much larger
       than a group waste work (DeepSeek-V3-like: 8192 tokens x 8 / 256 experts = 256 rows per
       expert -> 256), while 512 keeps the per-step overhead (~0.35 us) small for big groups.
    2. The other two tiles start at 1024 (a multiple of every MXU width) and step down through
       powers of two, largest first and never below 128, until ``vmem_bytes`` (for either
       orientation of the operand that may be read transposed) fits the generation's budget;
       then the ragged tile is halved if it still does not fit.
    3. A tile not smaller than its dimension becomes the whole dimension (always a legal block).

    For generation "interpret" (CPU tests) the ragged tile is the smallest legal one (16 rows,
    or 128 along a lane dimension) and the others 128, so small shapes cross many boundaries.
    """
    gen = GENERATIONS[generation]
    in_size = jnp.dtype(dtype).itemsize
    out_size = jnp.dtype(out_dtype).itemsize
    extent = M if kind == "gmm" else K
    if generation == "interpret":
        ragged, other = (16 if kind == "gmm" else 128), [128, 128]
    else:
        ragged = min(512, max(128, _pow2_floor(max(1, extent // max(1, G)))))
        other = [1024, 1024]
    dims = (K, N) if kind == "gmm" else (M, N)

    def make(r, o):
        if kind == "gmm":
            return Tiles(_fit(M, r), _fit(K, o[0]), _fit(N, o[1]))
        return Tiles(_fit(M, o[0]), _fit(K, r), _fit(N, o[1]))

    def need(t):  # either orientation of the operand that may be read transposed
        return max(vmem_bytes(kind, t, in_size, out_size, has_bias, tr) for tr in (False, True))

    while need(make(ragged, other)) > gen.budget:
        effective = [min(o, d) for o, d in zip(other, dims)]
        i = max(range(2), key=lambda j: effective[j])
        if effective[i] > 128:
            other[i] = max(128, _pow2_floor(effective[i] - 1))  # the next power of two below
        elif ragged > 128:
            ragged //= 2
        else:
            break
    return make(ragged, other)


def _check_tiles(kind: str, tiles: Tiles, M: int, K: int, N: int, itemsize: int, transposed: bool = False) -> None:
    """Raise ValueError unless every block dimension is legal for Mosaic: the whole dimension, or
    a multiple of 128 along lanes (the last dim of a block) and of 8 (16 for bf16) along sublanes.

    gmm blocks: a (tm, tk), b (tk, tn) or (tn, tk), out (tm, tn). tgmm blocks: a (tm, tk) or
    (tk, tm) when transposed, b (tk, tn), out (tm, tn).
    """
    sub = _sublanes(itemsize)
    lane_m = kind == "tgmm" and transposed
    for name, t, dim, unit in (("tm", tiles.tm, M, 128 if lane_m else sub), ("tk", tiles.tk, K, 128),
                               ("tn", tiles.tn, N, 128)):
        if t < 1 or (t != dim and (t % unit or t > dim)):
            raise ValueError(f"{kind}: {name}={t} must equal the dimension ({dim}) or be a multiple of "
                             f"{unit} below it")


# --------------------------------------------------------------------------------------------
# Schedule: the group metadata, computed on the device
# --------------------------------------------------------------------------------------------


class Schedule(NamedTuple):
    """Per-step group metadata (int32 device arrays), prefetched into SMEM.

    starts / ends [Gs]: each group's range along the ragged dimension (Gs = G, plus the tail
    pseudo-group for gmm). step_group [S + 1]: the group of each step, ``Gs`` past the last
    active step (a sentinel, so step s + 1 can always be read). step_tile [S + 1]: the ragged
    tile the step writes (gmm) or reads (tgmm). fetch_group / fetch_tile [S + 1]: the blocks the
    step's index maps load: its own for a step that computes, the previous computing step's for
    one that does not (tail or empty group), so that such steps issue no DMA at all.
    num_steps: [1], the number of active steps (the dynamic grid bound).
    """

    starts: jax.Array
    ends: jax.Array
    step_group: jax.Array
    step_tile: jax.Array
    fetch_group: jax.Array
    fetch_tile: jax.Array
    num_steps: jax.Array


def make_schedule(ends: jax.Array, extent: int, tile: int, *, tail: bool, visit_empty: bool) -> Schedule:
    """Assign grid steps to (group, tile) pairs, in order, with static shapes.

    Args:
        ends: [G] int32 cumulative group ends, valid (non-decreasing, in [0, extent]).
        extent: length of the ragged dimension, >= 1.
        tile: tile size along it.
        tail: add a pseudo-group [ends[-1], extent) (gmm: its rows are stored as zeros).
        visit_empty: give each empty group one step (tgmm: its output slice must be zeroed).

    A non-empty group [s, e) takes the tiles s // tile .. (e - 1) // tile; a tile shared by two
    groups gets one step for each, consecutively, so an output block is only revisited by the
    step right after. With n_tiles = ceil(extent / tile) and Gs groups there are at most
    n_tiles + Gs - 1 steps (each boundary adds at most one shared tile, an empty group at most
    one step), which is the static length S of the arrays.
    """
    G = ends.shape[0]
    n_tiles = -(-extent // tile)
    if tail:
        ends = jnp.concatenate([ends, jnp.full((1,), extent, jnp.int32)])
    Gs = ends.shape[0]
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    nonempty = ends > starts
    first = jnp.minimum(starts // tile, n_tiles - 1)
    last = jnp.maximum(ends - 1, 0) // tile
    count = jnp.where(nonempty, last - first + 1, 1 if visit_empty else 0)
    S = n_tiles + Gs - 1
    cum = jnp.cumsum(count)
    step = jnp.arange(S + 1, dtype=jnp.int32)
    # The group of step s is the number of groups whose steps all lie before s.
    group = jnp.sum(cum[None, :] <= step[:, None], axis=1).astype(jnp.int32)
    g = jnp.minimum(group, Gs - 1)
    tile_of_step = jnp.where(nonempty[g], first[g] + step - (cum[g] - count[g]), first[g])
    tile_of_step = jnp.clip(tile_of_step, 0, n_tiles - 1)
    computes = (group < Gs) & nonempty[g]
    if tail:
        computes &= group < G
    # Steps that do not compute point their fetches at the last computing step before them.
    src = lax.cummax(jnp.where(computes, step, -1), axis=0)
    src_c = jnp.maximum(src, 0)
    fetch_group = jnp.where(src >= 0, g[src_c], 0)
    fetch_tile = jnp.where(src >= 0, tile_of_step[src_c], 0)
    if tail:
        fetch_group = jnp.minimum(fetch_group, G - 1)
    return Schedule(starts, ends, group, tile_of_step.astype(jnp.int32), fetch_group.astype(jnp.int32),
                    fetch_tile.astype(jnp.int32), cum[-1:].astype(jnp.int32))


def _sanitize(offs: jax.Array, extent: int) -> jax.Array:
    # The contract's cummax(clamp(offs, 0, extent)): the identity for valid offs, and what makes
    # every index map in-bounds for any other values.
    return lax.cummax(jnp.clip(offs.astype(jnp.int32), 0, extent), axis=0)


def _dot(x, y, contract_x: int, contract_y: int):
    # fp32 inputs: full fp32 products (Precision.HIGHEST; the MXU's default would round them to
    # bf16). bf16 inputs: native bf16 products. Both accumulate in fp32.
    precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    return lax.dot_general(x, y, (((contract_x,), (contract_y,)), ((), ())),
                           precision=precision, preferred_element_type=jnp.float32)


def _compiler_params(generation: str, semantics):
    return pltpu.CompilerParams(dimension_semantics=semantics,
                                vmem_limit_bytes=GENERATIONS[generation].vmem_limit)


# --------------------------------------------------------------------------------------------
# gmm: out[rows of group g] = a[rows of group g] @ b[g] (+ bias[g]); rows in no group are zero
# --------------------------------------------------------------------------------------------


def _gmm_kernel(starts, ends, step_group, step_tile, fetch_group, fetch_tile, a_ref, b_ref, *rest,
                G: int, tiles: Tiles, n_k: int, k_rem: int, transpose_b: bool, has_bias: bool):
    if has_bias:
        bias_ref, out_ref, acc_ref = rest
    else:
        (out_ref, acc_ref), bias_ref = rest, None
    s, k = pl.program_id(1), pl.program_id(2)
    g = step_group[s]
    computes = g < G  # g == G is the tail pseudo-group: rows past offs[-1], stored as zeros
    del fetch_group, fetch_tile  # used by the index maps only

    @pl.when(k == 0)
    def _zero():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    def accumulate(edge: bool):
        a, b = a_ref[...], b_ref[...]
        if edge:
            # The last K block runs past K: its extra columns of a and rows of b (or columns of
            # a transposed b) are whatever lies beyond the array; zero both, as 0 * NaN = NaN.
            a = jnp.where(lax.broadcasted_iota(jnp.int32, a.shape, 1) < k_rem, a, 0)
            b = jnp.where(lax.broadcasted_iota(jnp.int32, b.shape, 1 if transpose_b else 0) < k_rem, b, 0)
        acc_ref[...] += _dot(a, b, 1, 1 if transpose_b else 0)

    if k_rem:
        pl.when(computes & (k < n_k - 1))(lambda: accumulate(False))
        pl.when(computes & (k == n_k - 1))(lambda: accumulate(True))
    else:
        pl.when(computes)(lambda: accumulate(False))

    @pl.when(k == n_k - 1)
    def _store():
        # Only this group's rows of the tile are written; the tile's other rows belong to the
        # neighbouring group, whose step comes right before or after (the block stays in VMEM).
        rows = step_tile[s] * tiles.tm + lax.broadcasted_iota(jnp.int32, out_ref.shape, 0)
        mine = (rows >= starts[g]) & (rows < ends[g])
        value = acc_ref[...]
        if has_bias:
            value = value + bias_ref[...].astype(jnp.float32)
        value = jnp.where(computes, value, 0.0)
        out_ref[...] = jnp.where(mine, value.astype(out_ref.dtype), out_ref[...])


@functools.partial(jax.jit, static_argnames=("tiles", "transpose_b", "out_dtype", "interpret", "generation"))
def gmm(a: jax.Array, b: jax.Array, offs: jax.Array, bias: Optional[jax.Array] = None, *,
        tiles: Optional[Tiles] = None, transpose_b: bool = False, out_dtype=None,
        interpret: Union[bool, pltpu.InterpretParams] = False, generation: str = "v5e") -> jax.Array:
    """Grouped matmul with ragged rows: out[r] = a[r] @ b[g(r)] (+ bias[g(r)]).

    Args:
        a: [M, K], float32 or bfloat16.
        b: [G, K, N] in a's dtype, or [G, N, K] if ``transpose_b`` (the weights of a forward
            layer read as their own transpose, e.g. for the input gradient: no copy is made).
        offs: [G] int32/int64 cumulative row ends of the groups; row r belongs to group g if
            offs[g-1] <= r < offs[g]. Sanitized to cummax(clamp(offs, 0, M)).
        bias: optional [G, N] in a's dtype, added in fp32 before the final cast.
        tiles: block sizes; default ``choose_tiles("gmm", ...)`` for ``generation``.
        out_dtype: result dtype (default a's dtype); accumulation is fp32.
        interpret: False (compile with Mosaic), True (jax's HLO interpreter) or a
            ``pltpu.InterpretParams`` (the TPU interpreter that simulates VMEM and DMAs).

    Returns:
        [M, N] in out_dtype; rows past offs[-1] are exactly zero.
    """
    M, K = a.shape
    G = b.shape[0]
    N = b.shape[1] if transpose_b else b.shape[2]
    out_dtype = jnp.dtype(out_dtype or a.dtype)
    ends = _sanitize(offs, M)
    if M == 0 or N == 0:
        return jnp.zeros((M, N), out_dtype)
    if K == 0:
        # Nothing to contract: each row in a group is its group's bias (or zero). No kernel.
        group = jnp.sum(ends[None, :] <= jnp.arange(M)[:, None], axis=1)
        if bias is None:
            return jnp.zeros((M, N), out_dtype)
        rows = bias.astype(jnp.float32)[jnp.minimum(group, G - 1)]
        return jnp.where((group < G)[:, None], rows, 0.0).astype(out_dtype)
    if tiles is None:
        tiles = choose_tiles("gmm", M, K, N, G, a.dtype, out_dtype, generation, bias is not None)
    _check_tiles("gmm", tiles, M, K, N, a.dtype.itemsize, transpose_b)
    tm, tk, tn = tiles.tm, tiles.tk, tiles.tn
    n_k, k_rem = -(-K // tk), K % tk
    n_n = -(-N // tn)
    sched = make_schedule(ends, M, tm, tail=True, visit_empty=False)

    # Grid (n tile, step, k tile). Index maps get the grid indices, then the prefetched refs.
    def a_map(n, s, k, starts, ends, sg, st, fg, ft):
        # Rows of the step's m tile, K block k; a non-computing step keeps the previous block.
        computes = sg[s] < G
        return jnp.where(computes, st[s], ft[s]), jnp.where(computes, k, n_k - 1)

    def b_map(n, s, k, starts, ends, sg, st, fg, ft):
        # The step's group's weights; K block k, N block n (swapped when b is [G, N, K]).
        kk = jnp.where(sg[s] < G, k, n_k - 1)
        return (fg[s], n, kk) if transpose_b else (fg[s], kk, n)

    def bias_map(n, s, k, starts, ends, sg, st, fg, ft):
        return fg[s], 0, n

    def out_map(n, s, k, starts, ends, sg, st, fg, ft):
        # The step's m tile: consecutive steps of a straddled tile share the block.
        return st[s], n

    in_specs = [pl.BlockSpec((tm, tk), a_map),
                pl.BlockSpec((None, tn, tk) if transpose_b else (None, tk, tn), b_map)]
    args = [a, b]
    if bias is not None:
        in_specs.append(pl.BlockSpec((None, 1, tn), bias_map))
        args.append(bias.reshape(G, 1, N))
    kernel = functools.partial(_gmm_kernel, G=G, tiles=tiles, n_k=n_k, k_rem=k_rem,
                               transpose_b=transpose_b, has_bias=bias is not None)
    itemsize = a.dtype.itemsize
    call = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((M, N), out_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=(n_n, sched.num_steps[0], n_k),
            in_specs=in_specs,
            out_specs=pl.BlockSpec((tm, tn), out_map),
            scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
        ),
        compiler_params=_compiler_params(generation, ("parallel", "arbitrary", "arbitrary")),
        interpret=interpret,
        cost_estimate=pl.CostEstimate(
            flops=2 * M * K * N, transcendentals=0,
            bytes_accessed=(M * K * n_n + G * K * N) * itemsize + M * N * out_dtype.itemsize),
    )
    return call(*sched[:6], *args)


# --------------------------------------------------------------------------------------------
# tgmm: out[g] = a[:, K slice of g] @ b[K slice of g, :]; empty groups give exact zeros
# --------------------------------------------------------------------------------------------


def _tgmm_kernel(starts, ends, step_group, step_tile, fetch_group, fetch_tile, a_ref, b_ref, out_ref,
                 acc_ref, *, tiles: Tiles, transpose_a: bool):
    s = pl.program_id(2)
    g = step_group[s]
    first_of_group = (s == 0) | (step_group[jnp.maximum(s - 1, 0)] != g)
    last_of_group = step_group[s + 1] != g  # step_group has a sentinel after the last step
    start, end = starts[g], ends[g]
    k0 = step_tile[s] * tiles.tk
    del fetch_group, fetch_tile

    @pl.when(first_of_group)
    def _zero():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    def accumulate(masked: bool):
        a, b = a_ref[...], b_ref[...]
        ka = 0 if transpose_a else 1
        if masked:
            # K indices of this block outside [start, end): the neighbouring groups' (or past
            # K, where the block holds whatever lies beyond the array). Zero both operands.
            ia = k0 + lax.broadcasted_iota(jnp.int32, a.shape, ka)
            ib = k0 + lax.broadcasted_iota(jnp.int32, b.shape, 0)
            a = jnp.where((ia >= start) & (ia < end), a, 0)
            b = jnp.where((ib >= start) & (ib < end), b, 0)
        acc_ref[...] += _dot(a, b, ka, 0)

    inside = (k0 >= start) & (k0 + tiles.tk <= end)
    pl.when((end > start) & inside)(lambda: accumulate(False))
    pl.when((end > start) & jnp.logical_not(inside))(lambda: accumulate(True))

    @pl.when(last_of_group)
    def _store():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("tiles", "transpose_a", "out_dtype", "interpret", "generation"))
def tgmm(a: jax.Array, b: jax.Array, offs: jax.Array, *, tiles: Optional[Tiles] = None,
         transpose_a: bool = False, out_dtype=None,
         interpret: Union[bool, pltpu.InterpretParams] = False, generation: str = "v5e") -> jax.Array:
    """Grouped matmul with a ragged contraction: out[g] = a[:, k_g] @ b[k_g, :].

    This is the weight gradient of ``gmm``: with x [T, D] the layer input, dy [T, F] the output
    gradient and offs over T, d weights = tgmm(x.T, dy, offs) ([G, D, F]); pass x itself with
    ``transpose_a=True`` instead of materialising x.T.

    Args:
        a: [M, K] (or [K, M] if ``transpose_a``), float32 or bfloat16.
        b: [K, N] in a's dtype.
        offs: [G] int32/int64 cumulative ends over K; group g is k_g = [offs[g-1], offs[g]).
            Sanitized to cummax(clamp(offs, 0, K)).
        tiles, out_dtype, interpret, generation: as for ``gmm``.

    Returns:
        [G, M, N] in out_dtype (fp32 accumulation); an empty group's slice is exactly zero, and
        K indices past offs[-1] belong to no group.
    """
    M, K = (a.shape[1], a.shape[0]) if transpose_a else a.shape
    N = b.shape[1]
    G = offs.shape[0]
    out_dtype = jnp.dtype(out_dtype or a.dtype)
    ends = _sanitize(offs, K)
    if M == 0 or N == 0 or K == 0:
        return jnp.zeros((G, M, N), out_dtype)
    if tiles is None:
        tiles = choose_tiles("tgmm", M, K, N, G, a.dtype, out_dtype, generation)
    _check_tiles("tgmm", tiles, M, K, N, a.dtype.itemsize, transpose_a)
    tm, tk, tn = tiles.tm, tiles.tk, tiles.tn
    sched = make_schedule(ends, K, tk, tail=False, visit_empty=True)

    # Grid (m tile, n tile, step): the steps of one group accumulate into one output block.
    def a_map(i, j, s, starts, ends, sg, st, fg, ft):
        # K block of the step (the previous computing step's for an empty group: no DMA).
        return (ft[s], i) if transpose_a else (i, ft[s])

    def b_map(i, j, s, starts, ends, sg, st, fg, ft):
        return ft[s], j

    def out_map(i, j, s, starts, ends, sg, st, fg, ft):
        # Group g's [M, N] slice; visited by consecutive steps only, written at the group's last.
        return sg[s], i, j

    call = pl.pallas_call(
        functools.partial(_tgmm_kernel, tiles=tiles, transpose_a=transpose_a),
        out_shape=jax.ShapeDtypeStruct((G, M, N), out_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=(-(-M // tm), -(-N // tn), sched.num_steps[0]),
            in_specs=[pl.BlockSpec((tk, tm) if transpose_a else (tm, tk), a_map),
                      pl.BlockSpec((tk, tn), b_map)],
            out_specs=pl.BlockSpec((None, tm, tn), out_map),
            scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
        ),
        compiler_params=_compiler_params(generation, ("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        cost_estimate=pl.CostEstimate(
            flops=2 * M * K * N, transcendentals=0,
            bytes_accessed=(M * K * -(-N // tn) + K * N * -(-M // tm)) * a.dtype.itemsize
            + G * M * N * out_dtype.itemsize),
    )
    return call(*sched[:6], a, b)


# --------------------------------------------------------------------------------------------
# moe::grouped_mm on oriented operands (moe_ops.backends.tpu maps the four layouts here)
# --------------------------------------------------------------------------------------------


def grouped_mm(layout: str, x: jax.Array, y: jax.Array, offs: Optional[jax.Array], bias: Optional[jax.Array],
               *, G: int, M: int, transposed: bool, out_dtype: str,
               interpret: Union[bool, pltpu.InterpretParams], generation: str) -> jax.Array:
    """One call of ``moe::grouped_mm``, with operands as ``moe_ops.backends.tpu._orient`` gives them.

    * "2d3d": x = mat_a [M, K]; y = mat_b [G, K, N] (or [G, N, K] if transposed) -> [M, N].
    * "2d2d": x = mat_a [M, K] (or [K, M] if transposed); y = mat_b [K, N] -> [G, M, N].
    * "3d3d": x = mat_a [G, M, K]; y as for 2d3d; offs None -> [G, M, N].
    * "3d2d": x = mat_b.T [N, K]; y = mat_a [G, M, K] if transposed, else mat_a.mT [G, K, M]
      -> [M, N] (the transpose of gmm's [N, M] result).
    """
    kw = dict(out_dtype=out_dtype, interpret=interpret, generation=generation)
    if layout == "2d3d":
        return gmm(x, y, offs, bias, transpose_b=transposed, **kw)
    if layout == "2d2d":
        return tgmm(x, y, offs, transpose_a=transposed, **kw)
    if layout == "3d3d":
        K, N = x.shape[2], y.shape[1 if transposed else 2]
        ends = jnp.arange(1, G + 1, dtype=jnp.int32) * M
        return gmm(x.reshape(G * M, K), y, ends, bias, transpose_b=transposed, **kw).reshape(G, M, N)
    return gmm(x, y, offs, None, transpose_b=transposed, **kw).T


def torchtpu_entry(x: jax.Array, y: jax.Array, offs: Optional[jax.Array], bias: Optional[jax.Array],
                   layout: str, G: int, M: int, transposed: bool, out_dtype: str, generation: str) -> jax.Array:
    """``grouped_mm`` compiled for the TPU, in the form TorchTPU's ``torch.tpu.pallas.jax_op``
    registers as a torch op: annotated arguments, the non-tensor ones static."""
    return grouped_mm(layout, x, y, offs, bias, G=G, M=M, transposed=transposed, out_dtype=out_dtype,
                      interpret=False, generation=generation)

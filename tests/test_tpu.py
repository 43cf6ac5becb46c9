"""TPU backend: the Pallas kernels in interpret mode on CPU, beyond the shared property suite.

Categories:
* schedule: the on-device group metadata against a plain enumeration (order, straddled tiles
  visited once per group, empty groups skipped in gmm and visited once in tgmm, the static
  step bound), and no-DMA fetch indices for steps that do not compute;
* kernels with explicit tiles against the float64 oracle: groups straddling tiles, several
  groups in one tile, empty groups, offs[-1] < M, shapes that no tile divides (jax's
  interpreter fills the out-of-range part of edge blocks with NaN, so a missing mask shows),
  transposed operands read in place, bias and out_dtype;
* the TPU interpreter (simulated VMEM/DMA, NaN-filled uninitialised memory, race detector);
* MegaBlox gmm/tgmm on the shapes both support (m % tm == 0, groups covering all rows);
* no recompilation for new group sizes (jax's compile events), one per new shape;
* tiling policy: legal blocks within each generation's VMEM budget;
* shared keys: no XLA device claimed without torch_xla, PrivateUse1 "tpu" without TorchTPU
  declined to the reference;
* the package without jax: imports, reports why the backend is off, falls back.
"""

from __future__ import annotations

import dataclasses
import importlib
import subprocess
import sys

import numpy as np
import pytest
import torch

from moe_ops import _contract
from moe_ops.backends import tpu
from moe_ops.testing import assert_close, run_backend
from oracle import magnitude, oracle

jax = pytest.importorskip("jax", reason='jax not installed (pip install "jax[tpu]==0.10.2")')
import jax.numpy as jnp  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

from moe_ops.backends import tpu_pallas as tp  # noqa: E402

Tiles = tp.Tiles


def _rand(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


def _check(out, a, b, offs, bias=None, out_dtype=None, what=""):
    """out (jax or torch) against the oracle of moe_ops.grouped_mm(a, b, offs, bias, out_dtype)."""
    if not isinstance(out, torch.Tensor):
        out = tpu._to_torch(out)
    assert_close(out, oracle(a, b, offs, bias, out_dtype, exact=True),
                 oracle(a, b, offs, bias, out_dtype, exact=False), magnitude(a, b, offs, bias), what=what)


def _j(t):
    return None if t is None else tpu._to_jax(t)


# --- schedule ---------------------------------------------------------------------------------


def _expected_steps(ends, extent, tile, tail, visit_empty):
    """(group, tile) per step, enumerated plainly."""
    ends = list(ends) + ([extent] if tail else [])
    steps, start = [], 0
    for g, end in enumerate(ends):
        if end > start:
            steps += [(g, t) for t in range(start // tile, (end - 1) // tile + 1)]
        elif visit_empty:
            steps.append((g, min(start // tile, -(-extent // tile) - 1)))
        start = end
    return steps


@pytest.mark.parametrize("tail,visit_empty", [(True, False), (False, True)], ids=["gmm", "tgmm"])
@pytest.mark.parametrize("ends,extent,tile", [
    ((5, 5, 33), 40, 16),            # an empty group; 33 < 40 (tail); group 2 straddles 3 tiles
    ((0, 0, 7), 7, 8),               # two empty groups first; one partial tile
    ((16, 32, 48), 48, 16),          # aligned groups: no shared tile
    ((1, 2, 3, 4, 5, 6), 50, 16),    # six groups in one tile
    ((0, 0, 0), 9, 4),               # every row in no group
    ((9, 9, 9), 9, 4),
])
def test_schedule_matches_enumeration(ends, extent, tile, tail, visit_empty):
    make = jax.jit(tp.make_schedule, static_argnums=(1, 2), static_argnames=("tail", "visit_empty"))
    s = make(jnp.asarray(ends, jnp.int32), extent, tile, tail=tail, visit_empty=visit_empty)
    s = tp.Schedule(*(np.asarray(x) for x in s))
    want = _expected_steps(ends, extent, tile, tail, visit_empty)
    n = int(s.num_steps[0])
    assert n == len(want)
    n_groups = len(ends) + tail
    assert s.step_group.shape[0] == -(-extent // tile) + n_groups  # static bound S + 1 sentinel
    got = list(zip(s.step_group[:n].tolist(), s.step_tile[:n].tolist()))
    assert got == want
    assert int(s.step_group[n]) == n_groups, "the entry after the last step is the sentinel"
    # Steps that compute fetch their own blocks; others repeat the previous computing step's.
    real = len(ends)
    last = None
    for i, (g, t) in enumerate(got):
        computes = g < real and s.ends[g] > s.starts[g]
        if computes:
            last = (g, t)
            assert (int(s.fetch_group[i]), int(s.fetch_tile[i])) == (g, t)
        elif last is not None:
            assert (int(s.fetch_group[i]), int(s.fetch_tile[i])) == last


# --- kernels with explicit tiles ---------------------------------------------------------------


GMM_CASES = [
    # M, K, N, offs, tiles
    (40, 20, 24, (5, 5, 33), Tiles(16, 20, 24)),            # straddles, empty group, tail rows
    (50, 16, 8, (1, 2, 3, 4, 5, 6), Tiles(16, 16, 8)),      # six groups in one tile, 44-row tail
    (300, 300, 260, (0, 77, 77, 250), Tiles(64, 128, 128)),  # nothing divides: K, N, M edges
    (33, 8, 8, (0, 0, 0), Tiles(16, 8, 8)),                 # every row in no group: all zeros
    (64, 24, 16, (64,), Tiles(64, 24, 16)),                 # one group, one tile
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", GMM_CASES, ids=lambda c: f"M{c[0]}K{c[1]}N{c[2]}")
def test_gmm_explicit_tiles(case, dtype):
    M, K, N, offs, tiles = case
    gen = torch.Generator().manual_seed(M + K)
    G = len(offs)
    a, b, bias = _rand(gen, M, K, dtype=dtype), _rand(gen, G, K, N, dtype=dtype), _rand(gen, G, N, dtype=dtype)
    offs_t = torch.tensor(offs, dtype=torch.int32)
    out_dtype = torch.float32 if dtype == torch.bfloat16 else None
    jd = "float32" if out_dtype else None
    out = tp.gmm(_j(a), _j(b), _j(offs_t), _j(bias), tiles=tiles, out_dtype=jd, interpret=True)
    _check(out, a, b, offs_t, bias, out_dtype, "gmm")
    assert torch.count_nonzero(tpu._to_torch(out)[offs[-1]:]) == 0
    # The same weights stored as [G, N, K] and read in place.
    bt = b.transpose(1, 2).contiguous()
    out = tp.gmm(_j(a), _j(bt), _j(offs_t), None, tiles=tiles, transpose_b=True, interpret=True)
    _check(out, a, b, offs_t, what="gmm transpose_b")


TGMM_CASES = [
    # M, K (ragged), N, offs, tiles
    (24, 40, 20, (5, 5, 33), Tiles(16, 40, 20)),                # one K block: all groups straddle it
    (20, 300, 260, (0, 77, 77, 250), Tiles(16, 128, 128)),   # K blocks shared by groups; K, N edges
    (16, 9, 8, (0, 0, 0), Tiles(16, 9, 8)),                  # all groups empty: exact zeros
    (16, 256, 8, (128, 128, 256), Tiles(16, 128, 8)),        # aligned groups, an empty one between
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", TGMM_CASES, ids=lambda c: f"M{c[0]}K{c[1]}N{c[2]}")
def test_tgmm_explicit_tiles(case, dtype):
    M, K, N, offs, tiles = case
    gen = torch.Generator().manual_seed(M + K)
    a, b = _rand(gen, M, K, dtype=dtype), _rand(gen, K, N, dtype=dtype)
    offs_t = torch.tensor(offs, dtype=torch.int32)
    out = tp.tgmm(_j(a), _j(b), _j(offs_t), tiles=tiles, interpret=True)
    _check(out, a, b, offs_t, what="tgmm")
    sizes = torch.diff(offs_t, prepend=torch.zeros(1, dtype=torch.int32))
    assert torch.count_nonzero(tpu._to_torch(out)[sizes == 0]) == 0, "empty groups give exact zeros"
    # mat_a as the transposed view of [K, M] storage, read in place; M is then a lane dimension.
    at = a.t().contiguous()
    tiles = dataclasses.replace(tiles, tm=M if tiles.tm % 128 else tiles.tm)
    out = tp.tgmm(_j(at), _j(b), _j(offs_t), tiles=tiles, transpose_a=True, interpret=True)
    _check(out, a, b, offs_t, what="tgmm transpose_a")


def test_run_here_reads_transposed_operands_in_place():
    """The layouts of the backward pass hand transposed views to the op: run_here passes the
    stored orientation (with a flag where the kernel needs one) instead of copying."""
    gen = torch.Generator().manual_seed(3)
    w = _rand(gen, 3, 16, 24)  # [G, K, N] forward weights
    grad = _rand(gen, 30, 24)
    offs = torch.tensor([4, 4, 30])
    p = _contract.check_args(grad, w.transpose(1, 2), offs)
    x, y, transposed = tpu._orient(p, grad, w.transpose(1, 2))
    assert transposed and y.data_ptr() == w.data_ptr()
    _check(run_backend("tpu", grad, w.transpose(1, 2), offs), grad, w.transpose(1, 2), offs, what="d mat_a")
    x_in = _rand(gen, 30, 16)
    p = _contract.check_args(x_in.t(), grad, offs)
    x, y, transposed = tpu._orient(p, x_in.t(), grad)
    assert transposed and x.data_ptr() == x_in.data_ptr()
    _check(run_backend("tpu", x_in.t(), grad, offs), x_in.t(), grad, offs, what="d mat_b")
    # 3d2d with mat_a [G, M, K] a view of [G, K, M] storage: that storage is gmm's plain right
    # operand (no flag). M != K, so reading it in the other orientation has the wrong shape.
    store, b = _rand(gen, 2, 16, 8), _rand(gen, 16, 24)  # mat_a: [2, 8, 16]; mat_b [K=16, N=24]
    offs = torch.tensor([8, 24])
    p = _contract.check_args(store.transpose(1, 2), b, offs)
    x, y, transposed = tpu._orient(p, store.transpose(1, 2), b)
    assert not transposed and y.data_ptr() == store.data_ptr()
    out = run_backend("tpu", store.transpose(1, 2), b, offs)
    _check(out, store.transpose(1, 2), b, offs, what="3d2d, mat_a transposed")


def _races_found() -> bool:
    """The TPU interpreter's race flag (a private module: its path moved between jax 0.7 and 0.10)."""
    for name in ("jax._src.pallas.mosaic.interpret.interpret_pallas_call", "jax._src.pallas.mosaic.interpret"):
        try:
            races = getattr(importlib.import_module(name), "races", None)
        except ImportError:
            continue
        if hasattr(races, "races_found"):
            return races.races_found
    pytest.fail("the TPU interpreter's race detector state was not found")


def test_tpu_interpreter_no_races_and_nan_memory():
    """The TPU interpreter simulates VMEM, DMAs and semaphores, fills uninitialised memory with
    NaN and, with detect_races, checks that no two accesses race."""
    params = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan",
                                   out_of_bounds_reads="uninitialized")
    gen = torch.Generator().manual_seed(4)
    a, b = _rand(gen, 40, 20), _rand(gen, 3, 20, 24)
    offs = torch.tensor([5, 5, 33], dtype=torch.int32)
    out = tp.gmm(_j(a), _j(b), _j(offs), None, tiles=Tiles(16, 20, 24), interpret=params)
    _check(out, a, b, offs, what="gmm, TPU interpreter")
    assert not _races_found()
    a2, b2 = _rand(gen, 24, 150), _rand(gen, 150, 20)
    offs2 = torch.tensor([60, 60, 140], dtype=torch.int32)
    out = tp.tgmm(_j(a2), _j(b2), _j(offs2), tiles=Tiles(8, 128, 20), interpret=params)
    _check(out, a2, b2, offs2, what="tgmm, TPU interpreter")
    assert not _races_found()


def test_tpu_interpreter_reads_no_block_out_of_bounds():
    """gmm's steps for rows past offs[-1] compute nothing and fetch the last computing step's
    blocks, never block G of the weights or of the bias: on a TPU that is a DMA outside the
    array, which the CPU's HLO interpreter clamps silently. The TPU interpreter raises on any
    read out of bounds, partial edge blocks included, so the tiles divide every dimension here:
    a [32, 16], b [3, 16, 8], bias [3, 8], offs (8, 8, 12) (20 tail rows: two tail steps), fp32."""
    params = pltpu.InterpretParams(out_of_bounds_reads="raise")
    gen = torch.Generator().manual_seed(8)
    a, b, bias = _rand(gen, 32, 16), _rand(gen, 3, 16, 8), _rand(gen, 3, 8)
    offs = torch.tensor([8, 8, 12], dtype=torch.int32)
    out = tp.gmm(_j(a), _j(b), _j(offs), _j(bias), tiles=Tiles(16, 16, 8), interpret=params)
    _check(out, a, b, offs, bias, what="gmm, reads in bounds")


# --- MegaBlox ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_agrees_with_megablox(dtype):
    """MegaBlox (jax's Pallas grouped matmul) on shapes both serve: m % tm == 0 and groups that
    cover every row. Both must be within the tolerance of the float64 oracle."""
    mb = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")

    gen = torch.Generator().manual_seed(5)
    M, K, N, tile = 256, 256, 128, (128, 128, 128)
    offs = torch.tensor([0, 100, 100, 200, 256], dtype=torch.int32)  # empty groups, straddles
    G = offs.numel()
    sizes = jnp.asarray(torch.diff(offs, prepend=torch.zeros(1, dtype=torch.int32)).numpy())
    a, b = _rand(gen, M, K, dtype=dtype), _rand(gen, G, K, N, dtype=dtype)
    jd = tpu._to_jax(a).dtype
    ours = tp.gmm(_j(a), _j(b), _j(offs), None, tiles=Tiles(*tile), interpret=True)
    theirs = mb.gmm(_j(a), _j(b), sizes, preferred_element_type=jd, tiling=tile, interpret=True)
    _check(ours, a, b, offs, what="ours gmm")
    _check(theirs, a, b, offs, what="MegaBlox gmm")
    # tgmm: MegaBlox's lhs [k, m] with m grouped is our mat_a [M, K] with K grouped.
    a2, b2 = _rand(gen, K, M, dtype=dtype), _rand(gen, M, N, dtype=dtype)
    ours = tp.tgmm(_j(a2), _j(b2), _j(offs), tiles=Tiles(*tile), interpret=True)
    theirs = mb.tgmm(_j(a2), _j(b2), sizes, preferred_element_type=jd, tiling=tile, interpret=True)
    _check(ours, a2, b2, offs, what="ours tgmm")
    _check(theirs, a2, b2, offs, what="MegaBlox tgmm")


def test_megablox_needs_divisible_m_we_do_not():
    mb = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")

    gen = torch.Generator().manual_seed(6)
    a, b = _rand(gen, 200, 128), _rand(gen, 2, 128, 128)
    offs = torch.tensor([90, 200], dtype=torch.int32)
    with pytest.raises(ValueError, match="divisible"):
        mb.gmm(_j(a), _j(b), jnp.asarray([90, 110], jnp.int32), tiling=(128, 128, 128), interpret=True)
    _check(tp.gmm(_j(a), _j(b), _j(offs), None, tiles=Tiles(128, 128, 128), interpret=True), a, b, offs)


# --- compilation -------------------------------------------------------------------------------


class _CompileCounter:
    """Counts XLA backend compilations (jax's monitoring events) while active."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.count = 0
        self.active = False
        jax.monitoring.register_event_duration_secs_listener(self._on)

    def _on(self, event, duration, **kwargs):
        if self.active and event == self.EVENT:
            self.count += 1


_counter = None


def _compiles():
    global _counter
    if _counter is None:
        _counter = _CompileCounter()
    return _counter


@pytest.mark.parametrize("layout", ["2d3d", "2d2d"])
def test_new_group_sizes_do_not_recompile(layout):
    counter = _compiles()
    gen = torch.Generator().manual_seed(7)
    G, M, K, N = 4, 48, 40, 16
    a = _rand(gen, M, K)
    b = _rand(gen, G, K, N) if layout == "2d3d" else _rand(gen, K, N)
    extent = M if layout == "2d3d" else K
    partitions = [(10, 20, 30, extent), (0, 0, 0, extent), (extent,) * 4, (3, 9, 9, 17), (0, 1, 2, 3)]
    run_backend("tpu", a, b, torch.tensor(partitions[0]))  # compiles this shape
    counter.count, counter.active = 0, True
    try:
        for offs in partitions[1:]:
            offs = torch.tensor(offs)
            _check(run_backend("tpu", a, b, offs), a, b, offs, what=f"offs {offs.tolist()}")
        assert counter.count == 0, f"{counter.count} compilations for new group sizes"
        a2 = _rand(gen, M + 8, K) if layout == "2d3d" else _rand(gen, M, K + 8)
        b2 = b if layout == "2d3d" else _rand(gen, K + 8, N)
        run_backend("tpu", a2, b2, torch.tensor((1, 2, 3, extent + 8)))
        assert counter.count > 0, "a new shape compiles (the counter is live)"
    finally:
        counter.active = False


# --- tiling policy ----------------------------------------------------------------------------


MOE_SHAPES = {
    # name: (tokens x top_k rows, d_model, d_ff, experts)
    "mixtral-8x7b": (4096 * 2, 4096, 14336, 8),
    "deepseek-v3": (4096 * 8, 7168, 2048, 256),
    "qwen3-30b-a3b": (4096 * 8, 2048, 768, 128),
    "small": (1000, 300, 200, 7),
}


@pytest.mark.parametrize("generation", ["v4", "v5e", "v5p", "v6e", "v7"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "fp32"])
def test_tiles_are_legal_and_fit_vmem(generation, dtype):
    gen = tp.GENERATIONS[generation]
    size = jnp.dtype(dtype).itemsize
    for M, D, F, G in MOE_SHAPES.values():
        for kind, (m, k, n) in (("gmm", (M, D, F)), ("gmm", (M, F, D)), ("tgmm", (D, M, F))):
            for has_bias in (False, True):
                t = tp.choose_tiles(kind, m, k, n, G, dtype, dtype, generation, has_bias)
                for transposed in (False, True):
                    tp._check_tiles(kind, t, m, k, n, size, transposed)
                    used = tp.vmem_bytes(kind, t, size, size, has_bias, transposed)
                    assert used <= gen.budget, (kind, m, k, n, t, used)
                ragged, extent = (t.tm, m) if kind == "gmm" else (t.tk, k)
                assert ragged <= max(128, -(-extent // G)), "the ragged tile is at most the mean group size"


def test_ragged_tile_follows_group_size():
    pick = lambda M, G: tp.choose_tiles("gmm", M, 4096, 4096, G, jnp.bfloat16, jnp.bfloat16, "v5e").tm  # noqa: E731
    assert pick(8192, 8) == 512      # 1024 rows per expert: the largest ragged tile
    assert pick(32768, 256) == 128   # 128 rows per expert
    assert pick(8192, 32) == 256
    assert pick(100, 4) == 100       # the whole dimension when it is smaller than a tile


# --- tiling arithmetic that no CPU test reaches otherwise ---------------------------------------


@pytest.mark.parametrize("device_kind,generation", [
    ("TPU v4", "v4"), ("TPU v5 lite", "v5e"), ("TPU v5e", "v5e"), ("TPU v5", "v5p"),
    ("TPU v5p", "v5p"), ("TPU v6 lite", "v6e"), ("TPU v6e", "v6e"), ("TPU7x", "v7"),
    ("TPU v7", "v7"), ("cpu", "v5e"),
])
def test_generation_of_device_kinds(device_kind, generation):
    """jax's device_kind strings (TorchTPU's "TPU v7" too) name the generation whose VMEM limits
    the kernels are compiled with; v4 has a quarter of the others' VMEM, so taking it for a
    later chip would pick tiles that do not fit. Unknown kinds get v5e's limits."""
    assert tp.generation_of(device_kind) == generation


def test_vmem_count_by_hand():
    """vmem_bytes against counts done by hand, for the terms tests/test_tpu_mosaic.py never
    compares with Mosaic (its oversized case has no bias and no transposed operand, and it needs
    libtpu): every block padded to whole (sublanes x 128) tiles, with 16 sublanes for bf16,
    inputs and output double-buffered, plus one fp32 accumulator (tm, tn)."""
    T, MiB = tp.Tiles, tp.MiB
    # gmm bf16 (512, 1024, 1024): a 1 MiB + b 2 MiB + out 1 MiB, twice, + the 2 MiB accumulator.
    assert tp.vmem_bytes("gmm", T(512, 1024, 1024), 2, 2) == 10 * MiB
    # bias [1, tn] in bf16 takes a whole 16 x 1024 block, twice.
    bias = 2 * (16 * 1024 * 2)
    assert tp.vmem_bytes("gmm", T(512, 1024, 1024), 2, 2, has_bias=True) == 10 * MiB + bias
    # tgmm fp32 (tm=16, tk=128, tn=128): a (16, 128); read transposed it is (128, 16), whose 16
    # lanes pad to 128, eight times the bytes.
    acc = 16 * 128 * 4
    b, out = 128 * 128 * 4, 16 * 128 * 4
    assert tp.vmem_bytes("tgmm", T(16, 128, 128), 4, 4) == 2 * (16 * 128 * 4 + b + out) + acc
    a_t = 128 * 128 * 4
    used = tp.vmem_bytes("tgmm", T(16, 128, 128), 4, 4, transposed=True)
    assert used == 2 * (a_t + b + out) + acc


def test_check_tiles_rejects_illegal_blocks():
    """Mosaic's block rule: the whole dimension, or a multiple of 128 along lanes and of the
    sublane count (8 for fp32, 16 for bf16, which packs row pairs) along sublanes, below it."""
    tp._check_tiles("gmm", Tiles(8, 128, 128), 64, 256, 256, 4)
    tp._check_tiles("gmm", Tiles(16, 128, 128), 64, 256, 256, 2)
    with pytest.raises(ValueError, match="tm=8"):
        tp._check_tiles("gmm", Tiles(8, 128, 128), 64, 256, 256, 2)  # bf16: 8 rows is half a tile
    with pytest.raises(ValueError, match="tm=32"):
        tp._check_tiles("gmm", Tiles(32, 128, 128), 20, 256, 256, 4)  # larger than M, not M
    with pytest.raises(ValueError, match="tm=16"):
        # tgmm with mat_a read transposed: M is its lane dimension
        tp._check_tiles("tgmm", Tiles(16, 128, 128), 64, 256, 256, 4, transposed=True)


def test_float16_and_float64_are_declined_to_the_reference():
    """The MXU has no fp16 or fp64 path: run_here (like the device kernels) raises
    NotImplementedError for them, so the op computes such calls with the reference, before
    anything reaches jax. Shapes: mat_a [8, 16], mat_b [2, 16, 8], offs [2] int32."""
    offs = torch.tensor([3, 8], dtype=torch.int32)
    for dtype in (torch.float16, torch.float64):
        a, b = torch.ones(8, 16, dtype=dtype), torch.ones(2, 16, 8, dtype=dtype)
        with pytest.raises(NotImplementedError, match="float32 and bfloat16"):
            run_backend("tpu", a, b, offs)


# --- shared dispatch keys and missing toolchains -----------------------------------------------


def test_shared_keys_decline_without_their_runtime():
    """The XLA router asks serves_xla_device, which never claims a device without torch_xla; a
    PrivateUse1 backend renamed "tpu" without TorchTPU loaded is declined to the reference."""
    assert not tpu.serves_xla_device(torch.device("cpu"))
    if "torch_xla" not in sys.modules:
        assert not tpu.serves_xla_device("xla:0")
    code = (
        "import torch\n"
        "torch.utils.rename_privateuse1_backend('tpu')\n"
        "import moe_ops\n"
        "a, b, offs = torch.randn(6, 4), torch.randn(2, 4, 3), torch.tensor([2, 6])\n"
        "keys = torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1)\n"
        "torch.ops.moe.grouped_mm.default.redispatch(keys, a, b, offs, None, None)\n"
        "print(moe_ops.kernel_counts())\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "{'reference': 1}" in r.stdout


# --- without jax ------------------------------------------------------------------------------


def test_package_imports_and_reports_without_jax():
    code = (
        "import sys; sys.modules['jax'] = None\n"
        "import torch, moe_ops, moe_ops.testing\n"
        "from moe_ops import backends\n"
        "from moe_ops.backends import BackendUnavailable\n"
        "s = {x.name: x for x in backends.statuses()}['tpu']\n"
        "print('MODE', s.mode, '|', s.detail)\n"
        "a, b, offs = torch.randn(6, 4), torch.randn(2, 4, 3), torch.tensor([2, 6])\n"
        "try:\n"
        "    moe_ops.testing.run_backend('tpu', a, b, offs)\n"
        "except BackendUnavailable as e:\n"
        "    print('UNAVAILABLE', e)\n"
        "print('OP', tuple(moe_ops.grouped_mm(a, b, offs).shape))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "MODE None | jax not installed" in r.stdout
    assert "UNAVAILABLE" in r.stdout and "OP (6, 3)" in r.stdout
    r = subprocess.run([sys.executable, "-c", "import sys; sys.modules['jax'] = None\nimport runpy; "
                        "runpy.run_module('moe_ops', run_name='__main__')"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "jax not installed" in r.stdout, r.stdout + r.stderr


def _tpu_check():
    """benchmarks/tpu_check.py, loaded as a module (it is a script, not part of the package)."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "tpu_check.py"
    spec = importlib.util.spec_from_file_location("tpu_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tpu_check_bounds_the_suite(tmp_path):
    """The property suite runs first on a lent TPU and natively compiles every new shape: it gets
    a time limit, recorded as a failed suite with its log kept, so that the benchmarks still run.
    It had none, and a slow or hung suite could take the whole loan."""
    script = _tpu_check()
    report = {}
    script.run_suite(tmp_path, report, timeout_s=0.01)  # too short for pytest to even start
    assert report["suite"]["returncode"] is None and "timed out" in report["suite"]["summary"]
    assert (tmp_path / "pytest.log").exists()


def test_tpu_check_keeps_the_other_cases_when_one_fails(tmp_path, monkeypatch):
    """A case that raises outside the per-implementation guard (on a TPU: running out of HBM
    while making its operands) costs that case only; the smoke case after it is still measured
    and written. It used to abort every later case and the recompile count. Interpreted on CPU:
    G=4, M=512, K=256, N=384, bf16; the failing case has G=0 (no Dirichlet split exists)."""
    import json

    script = _tpu_check()
    smoke = script.cases(True)
    failing = ("no groups", 0, 256, 384, 512)
    monkeypatch.setattr(script, "cases", lambda interpret: [failing] + smoke)
    report = {}
    script.run_benchmarks(tmp_path, report, interpret=True, reps=1)
    written = json.loads((tmp_path / "tpu_check.json").read_text())
    assert "error" in written["benchmarks"][0]
    assert [row["op"] for row in written["benchmarks"][1:]] == ["forward", "d_input", "d_weight"]
    assert written["recompiles_on_new_group_sizes"] == 0
    # The measured rows pass their check; the case that raised fails the run (exit status 1).
    assert all(row[f"{impl}_correct"] is True for row in written["benchmarks"][1:]
               for impl in ("ours", "megablox", "ragged_dot"))
    assert [f.split(": ", 1)[1] for f in script.failures(written)] == ["the case raised"]


def test_tpu_check_times_medians_after_warm_up(monkeypatch):
    """_time's result is the median of the timed runs with the two warm-up runs (on a TPU: the
    Mosaic compile) left out. A fake clock that each call advances by its scripted duration:
    warm-ups 100 s, then 1, 5, 2 s (min 1, mean 2.67, median 2)."""
    import types

    script = _tpu_check()
    durations, clock = iter([100.0, 100.0, 1.0, 5.0, 2.0]), [0.0]
    monkeypatch.setattr(script, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    def fn():
        clock[0] += next(durations)
        return jnp.zeros(())

    assert script._time(fn, (), reps=3) == 2.0


def test_tpu_check_rows_report_flops_ratios_and_the_check(tmp_path, monkeypatch):
    """Each row of the smoke case: 2*M*K*N FLOPs for every op, TFLOP/s from the median time,
    <impl>_vs_dense = <impl>'s time / dense's time, ours run with the tiles the row reports, a
    dense baseline of the same FLOPs (its operands' and result's shapes), and every result
    within REL_DIFF_LIMIT of ragged_dot. _time is stood in by a recorder that says 2, 3, 4 and
    1 ms for ours, MegaBlox, ragged_dot and dense (nothing is timed). Interpreted on CPU: G=4,
    M=512, K=256, N=384, bf16."""
    script = _tpu_check()
    timed = []

    def recorder(fn, args, reps):
        timed.append((fn, args))
        return (2e-3, 3e-3, 4e-3, 1e-3)[(len(timed) - 1) % 4]

    monkeypatch.setattr(script, "_time", recorder)
    monkeypatch.setattr(script, "count_recompiles", lambda interpret, generation: 0)
    report = {}
    script.run_benchmarks(tmp_path, report, interpret=True, reps=1)
    ((_, G, K, N, M),) = script.cases(True)
    rows = report["benchmarks"]
    assert [row["op"] for row in rows] == ["forward", "d_input", "d_weight"]
    flops = 2 * M * K * N
    # (operand shapes, result shape) of the dense baseline: [M, K] @ [K, N] and its transposes.
    dense = {"forward": ([(M, K), (K, N)], (M, N)), "d_input": ([(M, N), (K, N)], (M, K)),
             "d_weight": ([(M, K), (M, N)], (K, N))}
    for i, row in enumerate(rows):
        assert row["gflop"] == flops / 1e9
        for impl, ms in zip(("ours", "megablox", "ragged_dot", "dense"), (2.0, 3.0, 4.0, 1.0)):
            assert row[f"{impl}_ms"] == ms
            assert row[f"{impl}_tflops"] == round(flops / (ms * 1e-3) / 1e12, 3)
            if impl != "dense":
                assert row[f"{impl}_vs_dense"] == ms
                assert row[f"{impl}_correct"] is True
                assert row[f"{impl}_rel_diff"] < script.REL_DIFF_LIMIT
        fn, _ = timed[4 * i]
        assert fn.keywords["tiles"].__dict__ == row["tiles"]
        fn, args = timed[4 * i + 3]
        shapes, out = dense[row["op"]]
        assert [a.shape for a in args] == shapes and fn(*args).shape == out
    assert script.failures(report) == []


def test_tpu_check_fails_when_our_kernel_is_wrong_or_raises(tmp_path, monkeypatch):
    """The exit status is 1 when ours differs from ragged_dot (here the forward scaled by 1.05:
    a difference of ~0.05 > REL_DIFF_LIMIT; the input gradient NaN in one row) or raises (here
    the weight gradient, standing in for a Mosaic error); it was 0, only the JSON had the
    numbers, and the wrong kernel's time read as a result. The JSON stays strict (NaN was
    written bare, which jq rejects). Stand-ins wrap tpu_pallas.gmm / tgmm and _time (nothing is
    timed); the smoke case interpreted on CPU: G=4, M=512, K=256, N=384, bf16."""
    import json

    script = _tpu_check()
    gmm = tp.gmm

    def wrong_forward(*args, **kw):
        out = gmm(*args, **kw)
        return out.at[0].set(jnp.nan) if kw.get("transpose_b") else out * 1.05

    def raising_tgmm(*args, **kw):
        raise RuntimeError("stand-in for a Mosaic error")

    monkeypatch.setattr(tp, "gmm", wrong_forward)
    monkeypatch.setattr(tp, "tgmm", raising_tgmm)
    monkeypatch.setattr(script, "_time", lambda fn, args, reps: 1e-3)
    monkeypatch.setattr(script, "count_recompiles", lambda interpret, generation: 0)
    assert script.main(["--out", str(tmp_path), "--interpret", "--no-suite", "--reps", "1"]) == 1
    text = (tmp_path / "tpu_check.json").read_text()
    written = json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
    rows = {row["op"]: row for row in written["benchmarks"]}
    assert rows["forward"]["ours_correct"] is False and rows["forward"]["ours_rel_diff"] < 0.1
    assert rows["forward"]["megablox_correct"] is True
    assert rows["d_input"]["ours_correct"] is False and rows["d_input"]["ours_rel_diff"] is None
    assert "stand-in for a Mosaic error" in rows["d_weight"]["ours_error"]
    assert len(written["failures"]) == 3


def test_tpu_check_failures_judge_the_whole_run():
    """failures() (the exit status is 1 unless it is empty) on hand-made reports: the suite
    failing or timing out (returncode None), the benchmarks raising, a case raising as a whole,
    new group sizes recompiling, ours timed unchecked because ragged_dot raised (it was timed
    and passed) each fail the run; another peer raising and a case not started for the time
    budget do not."""
    script = _tpu_check()
    case = {"model": "m", "G": 4, "M": 512, "K": 256, "N": 384}
    fine = {**case, "op": "forward", "ours_correct": True, "ours_rel_diff": 0.0,
            "megablox_error": "RuntimeError", "ragged_dot_error": "RuntimeError"}
    assert script.failures({"suite": {"returncode": 0, "summary": "9 passed"}, "benchmarks": [fine],
                            "not_run": [case], "recompiles_on_new_group_sizes": 0}) == []
    for bad in ({"suite": {"returncode": None, "summary": "timed out after 300 s"}},
                {"suite": {"returncode": 1, "summary": "1 failed, 8 passed"}},
                {"benchmark_error": "Traceback"}, {"benchmarks": [{**case, "error": "Traceback"}]},
                {"recompiles_on_new_group_sizes": 2},
                {"benchmarks": [{**case, "op": "d_weight", "ours_ms": 1.0, "ragged_dot_error": "AttributeError"}]}):
        assert len(script.failures({"benchmarks": [fine], **bad})) == 1, bad


def test_tpu_check_rel_diff_is_relative_to_ragged_dot():
    """The check's number is max|got - ragged_dot| / max|ragged_dot|: a result twice the
    reference is 1.0 off (0.5 if divided by the result's own maximum). A result with a NaN row
    is inf off: XLA's fused max reduction dropped the NaN and called it 0.0, exact. [512, 384]
    bf16, the smoke forward's output."""
    script = _tpu_check()
    ref = jnp.ones((512, 384), jnp.bfloat16).at[0, 1].set(-4.0)
    assert float(script._rel_diff_fn()(2 * ref, ref)) == 1.0
    assert float(script._rel_diff_fn()(ref.at[7].set(jnp.nan), ref)) == float("inf")


def test_tpu_check_budget_and_group_sizes(tmp_path, monkeypatch):
    """No case starts once --bench-s has passed, and each is listed in not_run (not dropped);
    the Dirichlet split gives G sizes covering all M rows (else the FLOPs would overstate the
    work)."""
    script = _tpu_check()
    monkeypatch.setattr(script, "count_recompiles", lambda interpret, generation: 0)
    report = {}
    script.run_benchmarks(tmp_path, report, interpret=True, reps=1, budget_s=-1.0)
    assert report["benchmarks"] == []
    names = ("model", "G", "K", "N", "M")
    assert report["not_run"] == [dict(zip(names, c)) for c in script.cases(True)]
    sizes = script._split(512, 4, seed=3)
    assert sizes.shape == (4,) and sizes.sum() == 512 and (sizes >= 0).all()


def test_tpu_check_counts_recompiles(monkeypatch):
    """count_recompiles hears jax's compile events, so the kernels' 0 is a measurement: stand-ins
    for our kernels that compile anew on every call (a fresh jit) give one compilation per call
    after the warm-up, 2 kernels x 4 partitions."""
    script = _tpu_check()
    fresh = lambda a, *args, **kw: jax.jit(lambda v: v + 1)(a)  # noqa: E731
    monkeypatch.setattr(tp, "gmm", fresh)
    monkeypatch.setattr(tp, "tgmm", fresh)
    assert script.count_recompiles(True, "interpret") == 8


def test_tpu_check_suite_runs_natively_and_requires_the_backend():
    """The suite on the TPU compiles the kernels with Mosaic (MOE_OPS_TPU_NATIVE=1; interpreted
    they would say nothing about the chip) and fails if the tpu backend is off
    (MOE_OPS_REQUIRE_BACKENDS=tpu; else every case would pass on the reference)."""
    script = _tpu_check()
    cmd, env = script.suite_command()
    assert env["MOE_OPS_TPU_NATIVE"] == "1" and env["MOE_OPS_REQUIRE_BACKENDS"] == "tpu"
    assert cmd[-4:] == ["tests/test_properties.py", "tests/test_tpu.py", "-k", "tpu"]

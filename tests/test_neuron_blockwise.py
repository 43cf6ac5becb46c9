"""The Neuron backend's block-wise PyTorch formulation (the spec of its NKI kernels), on CPU.

Categories:
* the shared property suite's checks (``test_properties.check_case``: the float64 oracle, the one
  tolerance rule, exact zeros) on the 2D x 3D and 2D x 2D layouts it serves, all dtypes, for
  block sizes that split groups into many blocks (1, 5) and Trainium's smallest (128);
* inf / NaN outside every group are never read, and stay in their group;
* invalid offs are clamped as on an accelerator;
* the schedules' invariants: every row / K index in exactly one slot, every output row and
  every 2D x 2D group slice written exactly once, static block counts;
* no host sync: the whole computation (and the NKI kernels' arguments) runs on meta tensors;
* memory: no per-block weight copies ([nb, K, N]), unlike the reference's sync-free path.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from moe_ops import _contract, reference
from moe_ops.backends import neuron, neuron_blockwise
from oracle import group_ids
from strategies import Case, cases, partitions
import test_properties
from test_properties import check_case

pytestmark = pytest.mark.backend_neuron

BLOCKS = (1, 5, 128)


class BlockwiseImpl:
    """The block-wise formulation as a property-suite implementation (same call convention as conftest.Impl)."""

    cost = "cheap"
    layouts = neuron.LAYOUTS
    dtypes = neuron.DTYPES

    def __init__(self, block: int):
        self.block, self.name = block, f"neuron-blockwise-B{block}"

    def __call__(self, a, b, offs=None, bias=None, out_dtype=None, *, check_offs=True):
        p = _contract.check_args(a, b, offs, bias, out_dtype)
        if check_offs:
            _contract.check_offs_values(offs, p.extent)
        else:
            offs = _contract.sanitize_offs(offs, p.extent)
        return neuron_blockwise.compute(p, a, b, offs, bias, self.block)


@pytest.mark.parametrize("block", BLOCKS)
def test_matches_oracle(block):
    impl = BlockwiseImpl(block)

    @settings(max_examples=max(10, settings().max_examples // 2))
    @given(case=cases(layouts=neuron.LAYOUTS))
    # The CI profile (derandomised) draws no 2D x 3D case with rows past offs[-1] and K > 0:
    # those rows must come out zero (no bias), whatever block holds them.
    @example(case=Case("2d3d", 3, 23, 8, 5, torch.float32, (4, 9, 16), torch.int64, "contiguous",
                       "contiguous", True, None, 7))
    def run(case):
        check_case(impl, case)

    run()


@pytest.mark.parametrize("block", BLOCKS)
def test_non_finite_values_are_isolated(block):
    """The shared suite's isolation properties: inf / NaN outside every group are never read,
    and inside one group they reach no other group's part of the result."""
    impl = BlockwiseImpl(block)
    test_properties.test_values_outside_every_group_are_never_read(impl)
    test_properties.test_non_finite_values_stay_in_their_group(impl)


@pytest.mark.parametrize("block", BLOCKS)
def test_invalid_offs_are_clamped(block):
    impl = BlockwiseImpl(block)

    @settings(max_examples=max(10, settings().max_examples // 4))
    @given(case=cases(layouts=neuron.LAYOUTS, max_g=6, allow_big_g=False), data=st.data())
    def run(case, data):
        garbage = data.draw(st.lists(st.integers(-3, case.extent + 3), min_size=case.G, max_size=case.G))
        check_case(impl, Case(**{**case.__dict__, "offs": tuple(garbage)}), check_offs=False)

    run()


def _named():
    base = dict(offs_dtype=torch.int64, stride_a="contiguous", stride_b="contiguous", bias=True, out_dtype=None,
                seed=3)
    f32, bf16 = torch.float32, torch.bfloat16
    return {
        # groups spanning several blocks, ending on and off block boundaries, with trailing rows
        "2d3d multi-block groups": (Case("2d3d", 4, 61, 12, 7, f32, (10, 10, 35, 50), **base), 5),
        "2d3d group ends on block edges": (Case("2d3d", 3, 40, 8, 5, bf16, (10, 20, 40), **base), 5),
        "2d3d all rows trailing": (Case("2d3d", 3, 17, 8, 5, f32, (0, 0, 0), **base), 4),
        "2d3d transposed weights": (Case("2d3d", 3, 33, 16, 9, bf16, (4, 30, 33), **{**base, "stride_b": "transposed"}), 8),
        "2d2d empty first and last": (Case("2d2d", 5, 6, 47, 7, f32, (0, 12, 12, 47, 47), **{**base, "bias": False}), 5),
        "2d2d only empty groups": (Case("2d2d", 4, 6, 9, 7, f32, (0, 0, 0, 0), **{**base, "bias": False}), 4),
        "2d2d one index per group": (Case("2d2d", 4, 3, 4, 2, bf16, (1, 2, 3, 4), **{**base, "bias": False,
                                                                                  "out_dtype": f32}), 1),
    }


@pytest.mark.parametrize("name", list(_named()))
def test_named_block_cases(name):
    case, block = _named()[name]
    check_case(BlockwiseImpl(block), case)


@settings(max_examples=40)
@given(G=st.integers(1, 9), M=st.integers(1, 80), block=st.integers(1, 20), data=st.data())
def test_schedule_2d3d_covers_every_row_once(G, M, block, data):
    offs = torch.tensor(data.draw(partitions(G, M)))
    s = neuron_blockwise.schedule_2d3d(offs, M, block)
    assert s.num_blocks == -(-M // block) + G  # static: ceil(M / block) + G, whatever offs are
    gid = group_ids(offs, M)
    written = s.scatter[s.scatter < M].to(torch.int64)
    assert torch.equal(written.sort().values, torch.arange(M)), "every output row written exactly once"
    read = s.gather[s.gather < M].to(torch.int64)
    assert torch.equal(read.sort().values, torch.nonzero(gid >= 0).flatten()), "rows of real groups read once"
    slot_group = s.group.to(torch.int64).repeat_interleave(block)
    assert torch.equal(slot_group[s.valid], gid[s.gather[s.valid].to(torch.int64)]), "a block uses its rows' group"
    assert torch.equal(s.gather[s.valid], s.scatter[s.valid]), "real rows are written where they are read"
    assert s.group.min() >= 0 and s.group.max() < G


@settings(max_examples=40)
@given(G=st.integers(1, 9), K=st.integers(1, 80), block=st.integers(1, 20), data=st.data())
def test_schedule_2d2d_stores_every_group_once(G, K, block, data):
    offs = torch.tensor(data.draw(partitions(G, K)))
    s = neuron_blockwise.schedule_2d2d(offs, K, block)
    assert s.num_blocks == -(-K // block) + G - 1
    stored = s.store[s.store < G].to(torch.int64)
    assert torch.equal(stored.sort().values, torch.arange(G)), "each group's slice stored exactly once"
    read = s.gather[s.gather < K].to(torch.int64)
    assert torch.equal(read.sort().values, torch.nonzero(group_ids(offs, K) >= 0).flatten())
    # A group's blocks are consecutive: keep = 0 exactly at the first block of each stored group.
    gid = group_ids(offs, K)
    for j in range(s.num_blocks):
        rows = s.gather[j * block:(j + 1) * block]
        rows = rows[rows < K].to(torch.int64)
        if rows.numel():
            g = gid[rows[0]]
            assert (gid[rows] == g).all()
            prev = s.gather[(j - 1) * block:j * block] if j else torch.empty(0, dtype=torch.int32)
            prev = prev[prev < K].to(torch.int64)
            continues = bool(prev.numel()) and bool(gid[prev[0]] == g)
            assert s.keep[j] == float(continues)


@pytest.mark.parametrize("layout", neuron.LAYOUTS)
def test_no_host_sync_runs_on_meta_tensors(layout):
    """Meta tensors have no values: any .item() / .tolist() / data-dependent shape would fail."""
    meta = dict(device="meta", dtype=torch.bfloat16)
    if layout == "2d3d":
        a, b, bias = torch.empty(300, 64, **meta), torch.empty(4, 64, 32, **meta), torch.empty(4, 32, **meta)
    else:
        a, b, bias = torch.empty(64, 300, **meta), torch.empty(300, 32, **meta), None
    offs = torch.empty(4, dtype=torch.int32, device="meta")
    p = _contract.check_args(a, b, offs, bias, torch.float32)
    out = neuron_blockwise.compute(p, a, b, offs, bias, 128)
    assert out.shape == p.out_shape and out.dtype == torch.float32
    kernel, args, kwargs = neuron._kernel_call(p, a, b, offs, bias)
    assert all(t.device.type == "meta" for t in args if isinstance(t, torch.Tensor))


class _LargestOutput(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_per_block_weight_copies():
    """The reference's sync-free path gathers b[group] per block ([nb, K, N]); this one holds one [K, N]."""
    G, M, K, N, block = 8, 1024, 512, 512, 128
    a, b = torch.empty(M, K, device="meta"), torch.empty(G, K, N, device="meta")
    offs = torch.empty(G, dtype=torch.int64, device="meta")
    p = _contract.check_args(a, b, offs)
    with _LargestOutput() as ours:
        neuron_blockwise.compute(p, a, b, offs, None, block)
    with _LargestOutput() as batched:
        reference.grouped_mm_sync_free(a, b, offs)
    assert ours.largest <= max((M + 1) * N, K * N), f"largest intermediate {ours.largest} elements"
    assert batched.largest >= (2 * G - 1) * K * N  # the reference's [nb, K, N] weight gather


def test_choose_block_is_static_and_in_range():
    for M, G, K, dtype, expected in [(64, 8, 64, torch.bfloat16, 128), (8192, 8, 4096, torch.bfloat16, 256),
                                     (65536, 8, 4096, torch.bfloat16, 1024), (65536, 8, 8192, torch.bfloat16, 512),
                                     (65536, 8, 8192, torch.float32, 256), (8192, 64, 4096, torch.bfloat16, 128)]:
        a, b = torch.empty(M, K, device="meta", dtype=dtype), torch.empty(G, K, 16, device="meta", dtype=dtype)
        p = _contract.check_args(a, b, torch.empty(G, dtype=torch.int64, device="meta"))
        block = neuron_blockwise.choose_block(p)
        assert block == expected, (M, G, K, dtype, block)
        blocks = -(-M // block) + G  # the schedule's static count (test_schedule_2d3d_covers_every_row_once)
        assert block == 128 or blocks * block - M <= M / 4  # at most a quarter of padding rows
    # One group: the padding is the last block's rounding and the block of rows past offs[-1].
    for M, expected in [(130, 128), (1000, 128), (4000, 512), (100000, 1024)]:
        a, b = torch.empty(M, 64, device="meta"), torch.empty(1, 64, 16, device="meta")
        p = _contract.check_args(a, b, torch.empty(1, dtype=torch.int64, device="meta"))
        assert neuron_blockwise.choose_block(p) == expected, (M, neuron_blockwise.choose_block(p))
    # 2D x 2D (groups over K): G - 1 extra blocks, and gathered rows of min(M, 512) + min(N, 2048)
    # elements per 128-row tile. K = 4096 in two groups: padding = block, 1024 rows fit a quarter.
    # fp32 at M = N = 4096: 2560 x 4 bytes per tile, so 6.4 tiles fit the 64 KiB budget: 512.
    for M, G, K, N, dtype, expected in [(64, 2, 4096, 64, torch.bfloat16, 1024),
                                        (4096, 8, 65536, 4096, torch.bfloat16, 1024),
                                        (4096, 8, 65536, 4096, torch.float32, 512)]:
        a = torch.empty(M, K, device="meta", dtype=dtype)
        b = torch.empty(K, N, device="meta", dtype=dtype)
        p = _contract.check_args(a, b, torch.empty(G, dtype=torch.int64, device="meta"))
        block = neuron_blockwise.choose_block(p)
        assert block == expected, (M, G, K, N, dtype, block)

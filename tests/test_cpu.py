"""Tests of what is specific to the native CPU backend (the shared property suite covers the
contract for it, on the best instruction set of this machine).

Categories:
* the extension is built, registered on the CPU key, and serves the op, forward and backward,
  eager and compiled;
* every instruction-set level this machine has (ATen fallback, AVX-512, AVX512-BF16, AMX)
  against the float64 oracle, since the property suite only runs the best one;
* the work split: many tiny and empty groups, results bitwise identical for any thread count,
  a 2Dx3D row's bits independent of its place in its group and of the other rows and groups;
  groups of up to four rows (decode) through dot products along k or streamed rows of W;
* memory: uninitialised outputs and reused scratch never leak into results (NaN poisoning),
  element offsets past 2**31 are computed in 64 bits, and no level reads past an operand that
  ends at an unreadable page (tests/guard_pages.py, in a subprocess);
* the output cache: freed large outputs' blocks are reused, bounded, released on request, seen
  by the memory profiler, safe across fork(), and a reused block (written with non-temporal
  stores) is overwritten completely;
* Python threads calling the op at once get the serial results, bit for bit;
* without the compiled module (or with one built against another torch) the package still
  works, says why, and uses the reference;
* smoke runs of the benchmark scripts (no timing assertions).
"""

from __future__ import annotations

import contextlib
import gc
import importlib.machinery
import itertools
import json
import os
import platform
import random
import re
import subprocess
import sys
import sysconfig
import threading
import time

import pytest
import torch
from hypothesis import given, settings

import moe_ops
from moe_ops import _contract, backends
from moe_ops.testing import assert_close, reference_results, tolerance
from oracle import magnitude, oracle
from strategies import Case, build, cases, long_float64_problem, poison_other_groups_2d2d

cpu_backend = backends.module("cpu")
pytestmark = [pytest.mark.skipif(cpu_backend.status().mode is None,
                                 reason=f"backend cpu cannot run here: {cpu_backend.status().detail}"),
              pytest.mark.usefixtures("unwritten_outputs_are_nan")]

ISA = {"generic": 0, "avx2": 1, "avx512": 2, "avx512_bf16": 3, "amx": 4}
# The kernel levels the tests run: every instruction set, and the three bf16 schemes of
# AVX512-BF16 (the op's bf16_scheme: 0 direct, 1 swapped in 256-bit lanes, 2 swapped in 512-bit
# lanes; the machine picks one, tests force each, on any CPU with AVX512-BF16).
LEVELS = {"generic": ("generic", -1), "avx2": ("avx2", -1), "avx512": ("avx512", -1), "avx512_bf16": ("avx512_bf16", 0),
          "avx512_bf16_swapped": ("avx512_bf16", 1), "avx512_bf16_swapped512": ("avx512_bf16", 2),
          "amx": ("amx", -1)}
SWAPPED = ("avx512_bf16_swapped", "avx512_bf16_swapped512")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def has_level(name) -> bool:
    """Whether this machine has the instruction set of kernel level ``name`` (one of LEVELS)."""
    return ISA[LEVELS[name][0]] <= ISA[torch.ops.moe_cpu.machine()]


def machine_levels(names=tuple(LEVELS)):
    if cpu_backend.status().mode is None:
        return list(names)  # the module is skipped; without the extension there is no machine() to ask
    return [pytest.param(name, marks=[] if has_level(name) else
                         pytest.mark.skip(reason=f"this CPU has no {LEVELS[name][0]} (best: {torch.ops.moe_cpu.machine()})"))
            for name in names]


def served(dtype) -> str:
    """The kernel name the op records for a CPU call in this dtype."""
    isa = torch.ops.moe_cpu.kernel_for(dtype)
    return "cpu:" + ("aten" if isa == "generic" else isa)


def run(case_or_args, level="amx"):
    a, b, offs, bias, out_dtype = case_or_args
    isa, bf16_scheme = LEVELS[level]
    return torch.ops.moe_cpu.grouped_mm(_contract.layout_of(a, b), a, b, offs, bias, out_dtype or a.dtype, ISA[isa],
                                        bf16_scheme)


def check(out, a, b, offs, bias, out_dtype, what=""):
    assert_close(out, oracle(a, b, offs, bias, out_dtype, exact=True), oracle(a, b, offs, bias, out_dtype, exact=False),
                 magnitude(a, b, offs, bias), what=what)


def check_by_reference(out, a, b, offs, bias, out_dtype, what=""):
    """check() with the reference in float64 instead of the einsum oracle, for problems too large
    for the oracle (it takes minutes at K = 8192)."""
    assert_close(out, *reference_results(a, b, offs, bias, out_dtype), what=what)


def run_any_threads(case_or_args, level="amx"):
    """run() on 1, 2 and 3 threads; the results must be bitwise identical (no split-K: each output
    element has one summation order, whatever the cut into items). Returns the first."""
    outs = []
    for threads in (1, 2, 3):
        with num_threads(threads):
            outs.append(run(case_or_args, level))
    for o in outs[1:]:
        assert torch.equal(o, outs[0])
    return outs[0]


@contextlib.contextmanager
def num_threads(n: int):
    """torch's intra-op thread count set to n for the block, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_extension_serves_the_op_forward_and_backward():
    assert torch._C._dispatch_has_kernel_for_dispatch_key("moe::grouped_mm", "CPU")
    a = torch.randn(40, 24, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 24, 16, dtype=torch.float64, requires_grad=True)
    offs = torch.tensor([10, 10, 33], dtype=torch.int32)
    moe_ops.reset_kernel_counts()
    moe_ops.grouped_mm(a, b, offs).square().sum().backward()
    # forward, d mat_a (2d3d), d mat_b (2d2d): all three on the native kernel
    assert moe_ops.kernel_counts() == {served(torch.float64): 3}
    assert torch.count_nonzero(b.grad[1]) == 0  # the empty expert gets an exactly zero gradient


needs_cpuinfo = pytest.mark.skipif(not os.path.exists("/proc/cpuinfo") or platform.machine() not in ("x86_64", "AMD64"),
                                   reason="reads the CPU vendor and family from Linux's /proc/cpuinfo on x86-64")


def first_cpu_info() -> dict:
    """The fields of the first processor in /proc/cpuinfo (vendor_id, cpu family, ...)."""
    with open("/proc/cpuinfo") as f:
        first_cpu = f.read().split("\n\n")[0]
    return {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in first_cpu.splitlines() if ":" in line)}


def amd_cpu() -> bool:
    """Whether this is an AMD x86-64 CPU (Arm CPUs' /proc/cpuinfo has no vendor_id)."""
    return platform.machine() in ("x86_64", "AMD64") and first_cpu_info().get("vendor_id") == "AuthenticAMD"


@needs_cpuinfo
def test_amx_level_is_the_cpus_or_the_emulators_and_is_reported():
    """The AMX level is the machine's only where /proc/cpuinfo lists AMX-BF16 (and the OS grants
    the tiles), except in the test build with MOE_OPS_AMX_EMULATOR (.ci/sanitizers.sh on CPUs with
    AVX512-BF16 and no AMX), where the tiles are emulated and it is the machine's wherever the CPU
    has AVX512-BF16; `python -m moe_ops`'s CPU line names the emulator exactly there."""
    if os.environ.get("MOE_OPS_CPU_ISA"):
        pytest.skip("MOE_OPS_CPU_ISA caps the machine's level")
    flags = set(first_cpu_info().get("flags", "").split())
    machine, emulated = torch.ops.moe_cpu.machine(), torch.ops.moe_cpu.amx_emulated()
    if emulated:
        assert (machine == "amx") == ("avx512_bf16" in flags)
    elif machine == "amx":
        assert "amx_bf16" in flags
    assert ("emulator" in cpu_backend.status().detail) == (emulated and machine == "amx")


@needs_cpuinfo
def test_bf16_scheme_follows_the_cpu_family_and_is_reported():
    """The swapped bf16 scheme in 256-bit lanes is the default exactly on AMD family 25 (0x19, Zen
    4: 512-bit operations as two 256-bit halves), as /proc/cpuinfo names it (the kernel decodes
    CPUID itself), in 512-bit lanes everywhere else, and `python -m moe_ops`'s CPU line says which
    where bf16 runs on AVX512-BF16. There the op's default (bf16_scheme -1) computes what that
    scheme forced does, bit for bit, and not what the other swapped one does (fp32 out: the two
    sum a row's lanes in different orders)."""
    info = first_cpu_info()
    zen4_family = info["vendor_id"] == "AuthenticAMD" and int(info["cpu family"]) == 25
    assert torch.ops.moe_cpu.bf16_scheme() == (1 if zen4_family else 2)
    detail = cpu_backend.status().detail
    if torch.ops.moe_cpu.machine() != "avx512_bf16":
        assert "swapped scheme" not in detail
        return
    assert f"swapped scheme (rows in {256 if zen4_family else 512}-bit lanes" in detail
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(70, 300, generator=gen).bfloat16()
    b = torch.randn(3, 40, 300, generator=gen).bfloat16().transpose(1, 2)
    offs = torch.tensor([9, 30, 70], dtype=torch.int32)
    op = torch.ops.moe_cpu.grouped_mm
    out = {s: op("2d3d", a, b, offs, None, torch.float32, -1, s) for s in (-1, 1, 2)}
    assert torch.equal(out[-1], out[torch.ops.moe_cpu.bf16_scheme()])
    assert not torch.equal(out[1], out[2])


@needs_cpuinfo
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_far_prefetch_follows_the_cpu_vendor_and_never_changes_results(dtype):
    """fma_item's far prefetches for n-contiguous weights (the op's far_prefetch) are the default
    exactly on AMD CPUs; forced on or off, the input and weight gradient layouts give the same
    bits (prefetches move no data into results). The groups (5, 195, 0 and 90 rows) reach both
    the window and the next-slab paths (counted once with a print in each: 48 and 346 times)."""
    assert torch.ops.moe_cpu.far_prefetch() == amd_cpu()
    gen = torch.Generator().manual_seed(5)
    a = torch.randn(300, 70, generator=gen).to(dtype)
    b = torch.randn(4, 70, 96, generator=gen).to(dtype)
    dy = torch.randn(300, 96, generator=gen).to(dtype)
    offs = torch.tensor([5, 200, 200, 290], dtype=torch.int32)
    op = torch.ops.moe_cpu.grouped_mm
    for layout, x, y in (("2d3d", a, b), ("2d2d", a.t(), dy)):
        out = [op(layout, x, y, offs, None, dtype, -1, -1, f) for f in (-1, 0, 1)]
        check(out[0], x, y, offs, None, None, what=layout)
        assert torch.equal(out[0], out[1]) and torch.equal(out[0], out[2])


def test_gradcheck_through_the_native_kernel():
    a = torch.randn(9, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 5, 4, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    offs = torch.tensor([2, 2, 7], dtype=torch.int64)
    assert torch.autograd.gradcheck(lambda x, y, z: moe_ops.grouped_mm(x, y, offs, z), (a, b, bias))


@pytest.mark.outside_cpp
def test_compiled_graph_runs_the_native_kernel():
    a = torch.randn(64, 32, dtype=torch.bfloat16)
    w = torch.randn(4, 48, 32, dtype=torch.bfloat16)
    offs = torch.tensor([5, 30, 30, 60], dtype=torch.int32)
    f = torch.compile(lambda x, y, o: torch.relu(moe_ops.grouped_mm(x, y.transpose(1, 2), o)), fullgraph=True)
    moe_ops.reset_kernel_counts()
    out = f(a, w, offs)
    assert moe_ops.kernel_counts() == {served(torch.bfloat16): 1}
    # relu moves no value further from another (1-Lipschitz), so the op's tolerance holds after it.
    ref64, ref_same, mag = reference_results(a, w.transpose(1, 2), offs)
    assert out.dtype == torch.bfloat16
    assert (out.double() - ref64.relu()).abs().max().item() <= tolerance(ref64, ref_same, mag)


@pytest.mark.parametrize("isa", machine_levels())
def test_every_instruction_set_matches_the_oracle(isa):
    @settings(max_examples=40)
    @given(case=cases())
    def run_case(case):
        args = build(case)
        check(run(args, isa), *args, what=f"{isa} {case}")

    run_case()


@pytest.mark.parametrize("K", [256, 4096])
@pytest.mark.parametrize("layout", ["2d3d", "2d3d-nk", "2d2d", "3d3d", "3d2d"])
def test_long_float64_sums_meet_the_rule_against_a_twice_precise_ground_truth(layout, K):
    """float64 sums of 256 and 4096 products at every float64 kernel level of this machine
    against a ground truth summed as if in twice float64's precision (reference_results: the
    reference on Ozaki's splittings, checked against exact rational sums in
    tests/test_errors.py; the oracle's einsum would gather a [209, 4096, 64] weight per product)
    under the one tolerance rule, whose plain computation is the reference's own (so the
    reference is not checked here: it would pass by construction); the property suite draws
    K <= 48. With the plain
    float64 einsum as the ground truth (until 2026-12-07) the rule had no measure of that
    einsum's own rounding, and long sums failed it: at K = 4096 the kernels were 2.12 eps x
    magnitude off the einsum with [G, N, K] weights ("2d3d-nk") against a tolerance of 2.08 (Zen
    4 VM, 5 seeds). Here the kernels' errors are at most 0.34 of the tolerance, the same sums
    done in float32 1.4e8-2.0e8 times it. Shapes: strategies.long_float64_problem; two seeds."""
    levels = [name for name in ("generic", "avx2", "avx512") if has_level(name)]
    for seed in (0, 1):
        a, b, offs = long_float64_problem(layout, K, seed)
        refs = reference_results(a, b, offs)
        for level in levels:
            assert_close(run((a, b, offs, None, None), level), *refs, what=f"{level} seed {seed}")


def _bf16_rounding_cases(rows: int, seed: int) -> tuple:
    """[rows] pairs (hi, lo) of normal bf16 values whose fp32 sum hi + lo is exact but not a
    bf16: roundings up and down, ties to even, overflow to inf; rows 0 and 1 are zeros."""
    gen = torch.Generator().manual_seed(seed)
    hi = (torch.randn(rows, generator=gen) * 2.0 ** torch.randint(-20, 20, (rows,), generator=gen)).bfloat16()
    frac = torch.randint(-255, 256, (rows,), generator=gen).float() / 256  # multiples of 2^-8
    lo = (hi.float() * 2.0 ** -8 * frac).bfloat16()  # within one bf16 unit of hi, ties included
    top = 3.3895313892515355e38  # the largest bf16, odd: + half a unit rounds to inf
    specials = torch.tensor([[0.0, 0.0], [0.0, 0.0], [top, top * 2.0 ** -8], [1.0, 2.0 ** -8],
                             [1.0 + 2.0 ** -7, 2.0 ** -8], [-(1.0 + 2.0 ** -7), -(2.0 ** -8)]])
    hi[: len(specials)] = specials[:, 0].bfloat16()
    lo[: len(specials)] = specials[:, 1].bfloat16()
    return hi, lo


@pytest.mark.parametrize("isa", machine_levels())
def test_bf16_results_are_rounded_once_to_nearest_even(isa):
    # out[i, j] = hi_i + lo_i (+ bias_j): exact in the fp32 accumulator (b is all ones), then one
    # rounding to bf16 that must equal torch's, bit for bit: round to nearest even, overflow to
    # inf, and denormal results kept (rows 0-1 with denormal biases; the AVX512-BF16 conversion
    # instructions alone would flush them to zero). 40 columns: a full and a partial 32-column
    # block; both AMX schemes (row-major and k-contiguous weights) and the weight gradient.
    hi, lo = _bf16_rounding_cases(300, seed=5)
    exact = hi.float() + lo.float()
    a = torch.stack([hi, lo], dim=1)  # [300, 2]
    ones = torch.ones(2, 2, 40, dtype=torch.bfloat16)
    offs = torch.tensor([120, 300], dtype=torch.int32)
    bias = torch.zeros(2, 40)
    bias[0, 3:9] = torch.tensor([2.0 ** -130, -(2.0 ** -133), 2.0 ** -127, 1.5 * 2.0 ** -128, 2.0 ** -126, 1.0])
    bias = bias.bfloat16()
    with_bias = (exact[:, None] + torch.where(torch.arange(300)[:, None] < 120, bias[0].float(), bias[1].float())).bfloat16()
    assert with_bias[0, 3].item() == 2.0 ** -130  # a denormal result
    results = {
        "weights [G, K, N]": (run((a, ones, offs, bias, None), isa), with_bias),
        "weights [G, N, K] transposed":
            (run((a, ones.transpose(1, 2).contiguous().transpose(1, 2), offs, bias, None), isa), with_bias),
        "weight gradient": (run((a.t().contiguous().t(), torch.ones(2, 40, dtype=torch.bfloat16), torch.tensor([2, 2]),
                                 None, None), isa)[0], exact.bfloat16()[:, None].expand(300, 40)),
    }
    for what, (out, want) in results.items():
        assert out.dtype == torch.bfloat16
        bad = (out.view(torch.int16) != want.view(torch.int16)).nonzero()
        assert bad.numel() == 0, (f"{isa} {what}: {len(bad)} roundings differ, first at {tuple(bad[0].tolist())}: "
                                  f"{out[tuple(bad[0])].item()!r} vs {want[tuple(bad[0])].item()!r}")


@pytest.mark.parametrize("isa", machine_levels(("generic", "avx2", "avx512")))
def test_fp16_results_are_rounded_once_to_nearest_even(isa):
    """fp16 out[i, j] = hi_i + lo_i for mat_a [300, 2] fp16 (hi, lo) and all-ones weights: exact
    in the fp32 accumulator (lo is within one fp16 unit of hi), then one rounding to fp16 that
    must equal torch's bit for bit (nearest even, overflow to inf, subnormal results). The
    shared tolerance (2 units) passes a conversion that truncates; this does not. 40 columns (a
    full and a partial vector), groups of 3 and 297 rows (dot products and the blocked kernel),
    both weight orientations and the weight gradient."""
    gen = torch.Generator().manual_seed(7)
    rows = 300
    scale = 2.0 ** torch.randint(-4, 8, (rows,), generator=gen)
    hi = (torch.randn(rows, generator=gen) * scale).half()
    frac = torch.randint(-15, 16, (rows,), generator=gen).float() / 16
    lo = (hi.float() * 2.0 ** -11 * frac).half()  # within one fp16 unit of hi, ties included
    specials = torch.tensor([[65504.0, 16.0], [1.0, 2.0 ** -11], [1.0 + 2.0 ** -10, 2.0 ** -11],
                             [1.0 + 2.0 ** -10, 2.0 ** -12], [2.0 ** -20, 3 * 2.0 ** -26]])
    hi[: len(specials)], lo[: len(specials)] = specials[:, 0].half(), specials[:, 1].half()
    exact = hi.float() + lo.float()
    assert exact[0].half().item() == float("inf")  # 65504 + half a unit: to even, overflow
    assert exact[4].half().item() == 2.0 ** -20 + 2.0 ** -24  # a subnormal result
    a = torch.stack([hi, lo], dim=1)  # [300, 2]
    ones = torch.ones(2, 2, 40, dtype=torch.float16)
    offs = torch.tensor([3, 300], dtype=torch.int32)
    want = exact.half()[:, None].expand(rows, 40)
    k_contiguous = ones.transpose(1, 2).contiguous().transpose(1, 2)
    x_t = a.t().contiguous().t()  # [300, 2] column-major, as x^T in the weight gradient
    dy = torch.ones(2, 40, dtype=torch.float16)
    results = {
        "weights [G, K, N]": run((a, ones, offs, None, None), isa),
        "weights [G, N, K] transposed": run((a, k_contiguous, offs, None, None), isa),
        "weight gradient": run((x_t, dy, torch.tensor([2, 2]), None, None), isa)[0],
    }
    for what, out in results.items():
        assert out.dtype == torch.float16
        bad = (out.view(torch.int16) != want.view(torch.int16)).nonzero()
        if bad.numel():
            at = tuple(bad[0].tolist())
            raise AssertionError(f"{isa} {what}: {len(bad)} roundings differ, first at {at}: "
                                 f"{out[at].item()!r} vs {want[at].item()!r}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("isa", machine_levels())
def test_bias_of_any_stride(isa, dtype):
    """A bias whose columns are not adjacent ([N, G] transposed, every other column of a wider
    one; the kernels read a contiguous bias as whole vectors) on every kernel that adds one:
    groups of 2 and 3 rows (decode) and larger ones, both weight layouts, 3Dx3D; 70 columns, so
    the last vector is partial."""
    gen = torch.Generator().manual_seed(11)
    G, M, K, N = 4, 150, 48, 70
    offs = torch.tensor([2, 5, 100, 150], dtype=torch.int32)
    a = torch.randn(M, K, generator=gen).to(dtype)
    a3 = torch.randn(G, 20, K, generator=gen).to(dtype)
    w = torch.randn(G, N, K, generator=gen).to(dtype)
    weights = {"[G, N, K] transposed": w.transpose(1, 2),
               "[G, K, N]": w.transpose(1, 2).contiguous()}
    biases = {"transposed": torch.randn(N, G, generator=gen).to(dtype).t(),
              "every other column": torch.randn(G, 2 * N, generator=gen).to(dtype)[:, ::2]}
    out_dtypes = [None, torch.float32] if dtype in (torch.bfloat16, torch.float16) else [None]
    for (bname, bias), (wname, b), out_dtype in itertools.product(biases.items(), weights.items(), out_dtypes):
        assert bias.stride(1) != 1
        what = f"{isa} {dtype} {bname} bias, weights {wname}, out {out_dtype}"
        check(run((a, b, offs, bias, out_dtype), isa), a, b, offs, bias, out_dtype, what=what)
        check(run((a3, b, None, bias, out_dtype), isa), a3, b, None, bias, out_dtype, what=f"3d3d {what}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", machine_levels())
def test_bias_of_items_cut_into_column_chunks(isa, dtype):
    """Groups wide enough to be cut into several items side by side (mat_a [200, 64], mat_b
    [2, 64, 300] in both weight layouts, offs [160, 200], bias [2, 300]: a group of 160 rows is
    up to four items of 64+ columns on 1-3 threads): each item adds the bias of its own columns,
    from its first column on. The other bias tests have at most 70 columns, one item wide, so an
    item that read the bias from column 0 of its group (or from the start of its own slab of
    columns) passed them."""
    gen = torch.Generator().manual_seed(12)
    G, M, K, N = 2, 200, 64, 300
    offs = torch.tensor([160, 200], dtype=torch.int32)
    a = torch.randn(M, K, generator=gen).to(dtype)
    w = torch.randn(G, N, K, generator=gen).to(dtype)
    # Column-dependent, so that a bias read from the wrong columns is far off the tolerance.
    ramp = torch.arange(N, dtype=torch.float64) / 8
    bias = (ramp + torch.randn(G, N, generator=gen, dtype=torch.float64)).to(dtype)
    weights = {"[G, N, K] transposed": w.transpose(1, 2), "[G, K, N]": w.transpose(1, 2).contiguous()}
    # Each thread count against the oracle (not bitwise across them: at the generic level ATen's
    # mm may round otherwise for other cuts); 1 thread alone already cuts the groups.
    for (wname, b), threads in itertools.product(weights.items(), (1, 2, 3)):
        with num_threads(threads):
            out = run((a, b, offs, bias, None), isa)
        check(out, a, b, offs, bias, None, what=f"{isa} {dtype} weights {wname}, {threads} threads")


# Our own kernel levels: every one sums each output element in one order however a call is cut
# into items. The generic level runs ATen's mm on each item, whose result may depend on the
# thread count (README, "Reproducibility").
OWN_LEVELS = tuple(name for name in LEVELS if name != "generic")


@pytest.mark.parametrize("isa", machine_levels(OWN_LEVELS))
def test_many_tiny_groups_bitwise_identical_for_any_thread_count(isa):
    gen = torch.Generator().manual_seed(3)
    G, M, K, N = 600, 700, 40, 72
    sizes = torch.randint(0, 3, (G,), generator=gen)  # groups of 0, 1 or 2 rows
    offs = torch.cumsum(sizes, 0).clamp(max=M).to(torch.int32)
    a = torch.randn(M, K, generator=gen).bfloat16()
    b = torch.randn(G, N, K, generator=gen).bfloat16().transpose(1, 2)
    check(run_any_threads((a, b, offs, None, None), isa), a, b, offs, None, None, what=isa)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("isa", machine_levels(OWN_LEVELS))
def test_groups_cut_into_items_bitwise_identical_for_any_thread_count(isa, dtype):
    """Calls that 1, 2 and 3 threads cut into different items, below the sizes that go to ATen's
    mm with all threads: one 2Dx2D group of 90 rows, K = 482, N = 1 (12-row items for 1 thread,
    6-row ones for 2), a forward with groups of 1 and 13 rows against 561 [G, N, K] columns, one
    with groups of 1-300 rows, and a call of one 1 x 256 x 1 item; the cases a scratch fuzz found
    at the generic level, where ATen's mm gave other bits for other thread counts."""
    gen = torch.Generator().manual_seed(4)
    calls = [(torch.randn(90, 482, generator=gen), torch.randn(482, 1, generator=gen), [482]),
             (torch.randn(14, 334, generator=gen), torch.randn(2, 561, 334, generator=gen).transpose(1, 2), [1, 14]),
             (torch.randn(700, 200, generator=gen), torch.randn(4, 150, 200, generator=gen).transpose(1, 2),
              [1, 300, 420, 700]),
             (torch.randn(1, 256, generator=gen), torch.randn(1, 256, 1, generator=gen), [1])]
    for a, b, ends in calls:
        a, b, offs = a.to(dtype), b.to(dtype), torch.tensor(ends, dtype=torch.int32)
        layout = _contract.layout_of(a, b)
        assert torch.ops.moe_cpu.mm_groups(layout, a, b, offs, None, dtype, ISA[LEVELS[isa][0]]) == [], layout
        check(run_any_threads((a, b, offs, None, None), isa), a, b, offs, None, None, what=f"{isa} {layout} {ends}")


@pytest.mark.parametrize("isa", machine_levels(OWN_LEVELS))
def test_a_rows_result_depends_only_on_its_groups_size(isa):
    """2Dx3D at our own levels: a row's result, bit for bit, does not depend on where it sits in
    its group, on the values of the group's other rows, or on the other groups: the rows of each
    group (and those past offs[-1]) permuted within it give the permuted result, and one group
    called alone (its rows, expert and bias as views, so the same strides) gives its rows of the
    whole call. Only the group's row count may change a row's bits (it picks the kernel: README,
    "Reproducibility"). Groups up to 150 rows and K up to 300 reach the 64-row cut of the swapped
    schemes and the kernels' k blocks."""
    @settings(max_examples=30)
    @given(case=cases(layouts=("2d3d",), max_m=150, max_k=300, max_n=80, allow_big_g=False))
    def run_case(case):
        a, b, offs, bias, out_dtype = build(case)
        out = run((a, b, offs, bias, out_dtype), isa)
        ends = [0, *case.offs, case.M]
        gen = torch.Generator().manual_seed(case.seed)
        perm = torch.cat([lo + torch.randperm(hi - lo, generator=gen) for lo, hi in zip(ends, ends[1:])])
        if case.stride_a != "broadcast":  # (a broadcast mat_a's rows are all one row)
            shuffled = build(case)[0]  # the same strides as mat_a
            shuffled.copy_(a[perm])
            assert torch.equal(run((shuffled, b, offs, bias, out_dtype), isa), out[perm]), f"{isa} {case}"
        for g, (lo, hi) in enumerate(zip(ends, ends[1:-1])):
            if hi > lo:
                alone = (a[lo:hi], b[g:g + 1], offs.new_tensor([hi - lo]), None if bias is None else bias[g:g + 1],
                         out_dtype)
                assert torch.equal(run(alone, isa), out[lo:hi]), f"{isa} group {g} alone, {case}"

    run_case()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("isa", machine_levels(("avx2", "avx512", "avx512_bf16", "amx")))
def test_weight_gradient_x_transposed_is_packed_k_major(isa, dtype):
    """The weight gradient's x^T (column-major A) is packed k-major for items of 24+ rows: the
    sums must be bitwise those of the same values in a row-major copy (packed row by row, the same
    products in the same order), and match the oracle. Output rows around the 24-row cut and past
    one item (240 rows), a column edge, groups that are empty or of odd size (a pair's missing
    half in bf16: the rows past offs[-1], never to be read, hold inf), on 1-3 threads (items end
    at other rows: the next item's prefetch), and a group of more tokens than one k block (300:
    AVX2's 256, the AVX-512 levels' 128 fp32 k or bf16 pairs; its packed A is read from the
    second block on)."""
    gen = torch.Generator().manual_seed(5)
    sizes = torch.tensor([0, 1, 3, 16, 17, 0, 40, 2, 71, 300])
    offs = torch.cumsum(sizes, 0).to(torch.int32)
    M, N = int(offs[-1]) + 5, 70
    for rows in (23, 24, 25, 250, 517):
        x, dy = torch.randn(M, rows, generator=gen).to(dtype), torch.randn(M, N, generator=gen).to(dtype)
        x[offs[-1]:], dy[offs[-1]:] = float("inf"), float("inf")
        out = run_any_threads((x.t(), dy, offs, None, None), isa)
        assert torch.equal(out, run((x.t().contiguous(), dy, offs, None, None), isa)), f"{isa} {dtype} rows {rows}"
        check(out, x.t(), dy, offs, None, None, what=f"{isa} {dtype} rows {rows}")


@pytest.mark.parametrize("K", [1, 31, 127, 128, 257, 515, 1030])
@pytest.mark.parametrize("level", machine_levels(("avx512_bf16",) + SWAPPED))
def test_bf16_kernels_on_row_and_column_edges(level, K):
    """The AVX512-BF16 kernels on both weight layouts. [G, N, K] transposed (k-contiguous): the three
    schemes, with K % 8 of 0, 1, 3, 6 and 7 (the swapped schemes read the last 4 or 8 k of a row of
    W masked). [G, K, N] (n-contiguous): row pairs interleaved in column order (K < 128) or within
    128-bit lanes and restored at the store (K >= 128), K odd (the last pair has no second row).
    Groups of 1-4 rows (the swapped schemes' one vector of 4 rows, but the 256-bit one's vectors of
    2 from 3 rows; the direct one's dot products), of 5-49 rows (the 256-bit swapped scheme's
    vectors of 2 rows, in blocks of 2, 4 and 6 rows, the 512-bit one's of 4 in blocks of 4, 8 and
    12, the direct one's of 6, and remainders), of 67 and 70 rows and one of 300 (cut into several
    items; the swapped schemes' vectors of 4 rows, in blocks of 4, 8 and 12, partial ones), 1-45
    columns (blocks of 8, 16, 32 and 64 columns, partial ones), within one block of k and over it,
    with a bias and both output dtypes. Every row of W is followed by a NaN in memory: a read past
    a row would put NaN into the output."""
    gen = torch.Generator().manual_seed(K)
    sizes = [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 16, 17, 20, 24, 25, 31, 33, 40, 49, 67, 70, 300]
    G, M = len(sizes), sum(sizes)
    offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32)
    a = torch.randn(M, K, generator=gen).bfloat16()
    for N in (1, 7, 9, 16, 33, 45):
        nk = torch.full((G, N, K + 1), float("nan"), dtype=torch.bfloat16)
        nk[:, :, :K] = torch.randn(G, N, K, generator=gen).bfloat16()
        kn = torch.full((G, K, N + 1), float("nan"), dtype=torch.bfloat16)
        kn[:, :, :N] = torch.randn(G, K, N, generator=gen).bfloat16()
        weights = {"[G,N,K]": nk[:, :, :K].transpose(1, 2), "[G,K,N]": kn[:, :, :N]}  # rows K + 1 / N + 1 apart
        bias = torch.randn(G, N, generator=gen).bfloat16()
        for (name, b), out_dtype in itertools.product(weights.items(), (None, torch.float32)):
            out = run((a, b, offs, bias, out_dtype), level)
            check(out, a, b, offs, bias, out_dtype, what=f"{level} {name} K={K} N={N} out {out_dtype}")


@pytest.mark.parametrize("K", [31, 129])
@pytest.mark.parametrize("level", machine_levels(("avx512_bf16",) + SWAPPED))
def test_bf16_pairs_of_an_odd_k_never_read_the_row_past_k(level, K):
    """mat_a [79, K] bf16, mat_b [4, K, 40] bf16 (n-contiguous, a view of [4, K + 1, 40] whose
    row K of every group is NaN), offs [1, 4, 9, 79], bias [4, 40], K odd: the last pair of k has
    no second row, so row K of a group's W is never read; a kernel that read it (times the zero
    high half of A's last pair) would put NaN in the output. K = 31: pairs packed from the rows
    (pair_pack_b_rows); K = 129: built as the block multiplies (vb_raw_kernel, K >= 128); groups
    of 1 and 3 rows (rows of W streamed), 5 and 70 (the blocked kernel), both output dtypes. The
    edges test's NaN follow each row's columns, not a group's last row, and the guard-page test
    has no odd K of 128 or more with these weights: a read of row K passed both."""
    gen = torch.Generator().manual_seed(K)
    G, N = 4, 40
    offs = torch.tensor([1, 4, 9, 79], dtype=torch.int32)
    a = torch.randn(79, K, generator=gen).bfloat16()
    w = torch.full((G, K + 1, N), float("nan"), dtype=torch.bfloat16)
    w[:, :K] = torch.randn(G, K, N, generator=gen).bfloat16()
    b = w[:, :K]
    bias = torch.randn(G, N, generator=gen).bfloat16()
    for out_dtype in (None, torch.float32):
        out = run((a, b, offs, bias, out_dtype), level)
        check(out, a, b, offs, bias, out_dtype, what=f"{level} K={K} out {out_dtype}")


@pytest.mark.parametrize("weights", ["[G,N,K]", "[G,K,N]"])
@pytest.mark.parametrize("dtype,out_dtype", [(torch.float32, None), (torch.float16, None),
                                             (torch.float16, torch.float32), (torch.bfloat16, None)], ids=str)
def test_small_groups_take_dot_products(dtype, out_dtype, weights):
    """Groups of 1-4 rows (decode; more below) on the FMA paths: dot products along k with k-contiguous
    weights ([G, N, K] viewed as [G, K, N]), rows of W streamed with n-contiguous ones ([G, K, N]);
    up to 8 rows in two passes of 4 with AVX2; the AVX-512 FMA path's dot products up to 16 rows
    (fp32, and bf16 at the "avx512" level) or 8 (fp16) in passes of 4; larger groups the blocked
    kernel. A call mixing
    both, with a bias, K not a multiple of 16, columns not a multiple of 4, a strided mat_a and
    empty groups, against the oracle, and bitwise identical for any thread count (the kernel is
    chosen per group, not per item)."""
    if torch.ops.moe_cpu.machine() == "generic":
        pytest.skip("this CPU has neither AVX2 nor AVX-512: the dot-product kernels are x86 code")
    gen = torch.Generator().manual_seed(5)
    G, K, N = 14, 83, 45
    # 0-17 rows: both kernels (every size from 4 to 9 and 15 to 17 once); few groups, so that with
    # more threads the larger ones are cut into items of fewer rows (which must not change their
    # kernel).
    sizes = torch.cat([torch.arange(4, 10), torch.arange(15, 18), torch.randint(0, 18, (G - 9,), generator=gen)])
    offs = torch.cumsum(sizes, 0).to(torch.int32)
    M = int(offs[-1]) + 3  # trailing rows
    a = torch.randn(M, 2 * K, generator=gen).to(dtype)[:, ::2]
    if weights == "[G,N,K]":
        b = torch.randn(G, N, K, generator=gen).to(dtype).transpose(1, 2)
    else:
        b = torch.randn(G, K, N, generator=gen).to(dtype)
    bias = torch.randn(G, N, generator=gen).to(dtype)
    # The AVX2 kernels (groups of up to 8 rows in every dtype) on every machine with AVX2; bf16
    # reaches the AVX-512 ones only below AMX: with plain AVX-512 (fp32 FMA) and with AVX512-BF16
    # (the larger groups on VDPBF16PS), where the machine has them.
    if dtype != torch.bfloat16:
        isas = ["avx2"] + (["amx"] if has_level("avx512") else [])
    else:
        isas = [i for i in ("avx2", "avx512", "avx512_bf16") + SWAPPED if has_level(i)]
    for isa in isas:
        out = run_any_threads((a, b, offs, bias, out_dtype), isa)
        check(out, a, b, offs, bias, out_dtype, what=f"{isa} {dtype} {out_dtype}")


@pytest.mark.parametrize("K", [129, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64], ids=str)
def test_k_contiguous_weights_packed_one_k_block_at_a_time(dtype, K):
    """The FMA kernels with k-contiguous weights ([G, N, K] viewed as [G, K, N]) pack each panel
    of columns one k block at a time into the same buffer. AVX-512: panels of 64 columns, blocks
    of 128 k, so K = 129 and 300 give two and three blocks, the last ragged, and N = 150 three
    panels, the last of 22 columns; AVX2: 16 columns, blocks of 256 k (K = 300: two). Rows of W
    padded (not back to back); groups of 9-40 rows (past the dot-product kernels), empty ones
    and trailing rows, a bias. Against the oracle, bitwise identical for any thread count. (The
    bf16 pair kernels have test_bf16_kernels_on_row_and_column_edges.)"""
    isas = [i for i in ("avx2", "avx512") if has_level(i)]
    if not isas:
        pytest.skip("this CPU has neither AVX2 nor AVX-512: the blocked kernels are x86 code")
    gen = torch.Generator().manual_seed(11)
    G, N = 6, 150
    sizes = torch.tensor([9, 40, 0, 23, 17, 0])
    offs = torch.cumsum(sizes, 0).to(torch.int32)
    M = int(offs[-1]) + 5
    a = torch.randn(M, K, generator=gen).to(dtype)
    b = torch.randn(G, N, K + 3, generator=gen).to(dtype)[:, :, :K].transpose(1, 2)
    bias = torch.randn(G, N, generator=gen).to(dtype)
    for isa in isas:
        out = run_any_threads((a, b, offs, bias, None), isa)
        check(out, a, b, offs, bias, None, what=f"{isa} {dtype} K={K}")


@pytest.mark.parametrize("K", [300, 600])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_n_contiguous_weights_read_in_place_or_packed(dtype, K):
    """The AVX2 kernels read panels of n-contiguous fp32 / fp64 weights ([G, K, N], the input
    gradient's) where they lie when K spans more than one block of 256 k and the rows of W are
    apart by a distance that spreads a panel over the L2's sets (576 or 1152 bytes here, and 592:
    not a multiple of a line, so the vectors are unaligned), and pack them into a slab otherwise
    (2 KiB apart). Same kernel, same order of summation: the results are bitwise identical, and
    against the oracle; groups of 9-40 rows, an empty one, trailing rows, a bias, 1-3 threads."""
    if not has_level("avx2"):
        pytest.skip(f"this CPU has no avx2 (best: {torch.ops.moe_cpu.machine()})")
    gen = torch.Generator().manual_seed(K)
    G, N = 5, 144
    offs = torch.cumsum(torch.tensor([9, 40, 0, 23, 17]), 0).to(torch.int32)
    M = int(offs[-1]) + 5
    a = torch.randn(M, K, generator=gen).to(dtype)
    w = torch.randn(G, K, N, generator=gen).to(dtype)
    bias = torch.randn(G, N, generator=gen).to(dtype)

    def rows_apart(elements):
        padded = torch.full((G, K, elements), float("nan"), dtype=dtype)
        padded[:, :, :N] = w
        return padded[:, :, :N]

    outs = [run_any_threads((a, b, offs, bias, None), "avx2")
            for b in (w, rows_apart(N + 4), rows_apart(2048 // w.element_size()))]
    check(outs[0], a, w, offs, bias, None, what=f"{dtype} K={K}")
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


@pytest.mark.parametrize("level", SWAPPED)
@pytest.mark.parametrize("row_bytes", [4096, 4096 + 64, 2048])
def test_swapped_groups_of_up_to_four_rows_by_weight_row_stride(row_bytes, level):
    """With either swapped bf16 scheme, groups of 1-4 rows run on its own kernel unless the rows of
    W are a multiple of 4 KiB apart (they would share L1 sets): then on the dot products, as the
    direct scheme runs them, bit for bit. Next to larger groups, a bias, both output dtypes,
    against the oracle, and bitwise identical for any thread count."""
    if not has_level(level):
        pytest.skip(f"this CPU has no avx512_bf16 (best: {torch.ops.moe_cpu.machine()})")
    gen = torch.Generator().manual_seed(row_bytes)
    G, N, K = 7, 24, 2048 if row_bytes != 2048 else 1000
    offs = torch.tensor([1, 3, 3, 7, 11, 20, 22], dtype=torch.int32)  # 1, 2, 0, 4, 4, 9 and 2 rows
    a = torch.randn(24, K, generator=gen).bfloat16()
    w = torch.randn(G, N, row_bytes // 2, generator=gen).bfloat16()[:, :, :K]
    b = w.transpose(1, 2)
    bias = torch.randn(G, N, generator=gen).bfloat16()
    sizes = torch.diff(offs, prepend=offs.new_zeros(1))
    tiny = torch.repeat_interleave(sizes <= 4, sizes)
    for out_dtype in (None, torch.float32):
        out = run_any_threads((a, b, offs, bias, out_dtype), level)
        check(out, a, b, offs, bias, out_dtype, what=f"rows of W {row_bytes} B apart, out {out_dtype}")
        direct = run((a, b, offs, bias, out_dtype), "avx512_bf16")
        same = torch.equal(out[:22][tiny], direct[:22][tiny])
        if row_bytes % 4096 == 0:
            assert same, f"rows of W {row_bytes} B apart, out {out_dtype}: not the dot products"
        elif out_dtype == torch.float32:  # (rounded to bf16, the two kernels' sums can agree)
            assert not same, f"rows of W {row_bytes} B apart: the dot products"


@pytest.mark.parametrize("N", [520, 1030])
@pytest.mark.parametrize("level", ("avx512_bf16",) + SWAPPED)
def test_bf16_pairs_take_groups_of_3_and_4_rows_blocked_where_a_row_of_w_fits_a_slab(level, N):
    """AVX512-BF16, n-contiguous weights ([G, K, N]): groups of 3 and 4 rows take the blocked
    kernel (VDPBF16PS on pairs of k) where a row of W fits one of its slabs (N <= 1024), and the
    rows of W streamed into fp32 sums where it does not; groups of 1 and 2 rows always the
    latter. The blocked kernel sums a row in one order whatever its group's size, so there a
    group's rows equal, bit for bit, the same rows at the head of a group of 6 (blocked) with the
    same W and bias; on the streamed kernel they differ (fp32 outputs, 300 products a sum, summed
    in another order). Against the oracle too, on 1-3 threads."""
    if not has_level(level):
        pytest.skip(f"this CPU has no avx512_bf16 (best: {torch.ops.moe_cpu.machine()})")
    gen = torch.Generator().manual_seed(N)
    K = 300
    head = torch.randn(4, K, generator=gen).bfloat16()
    w = torch.randn(K, N, generator=gen).bfloat16()
    bias = torch.randn(N, generator=gen).bfloat16()
    sizes, rows = [], []
    for s in (1, 2, 3, 4):  # a group of s rows, then the same rows and 6 - s others
        sizes += [s, 6]
        rows += [head[:s], head[:s], torch.randn(6 - s, K, generator=gen).bfloat16()]
    a = torch.cat(rows)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    b = w.expand(len(sizes), K, N)
    args = (a, b, offs, bias.expand(len(sizes), N), torch.float32)
    out = run_any_threads(args, level)
    check(out, *args, what=f"{level} N={N}")
    starts = [0, *offs.tolist()]
    for g, s in enumerate((1, 2, 3, 4)):
        alone, in_six = out[starts[2 * g]:starts[2 * g] + s], out[starts[2 * g + 1]:starts[2 * g + 1] + s]
        blocked = s >= 3 and N <= 1024
        assert torch.equal(alone, in_six) == blocked, f"{level} N={N}: a group of {s} rows, blocked expected: {blocked}"


@pytest.mark.parametrize("level", SWAPPED)
@pytest.mark.parametrize("K", [2048, 2045])
def test_swapped_scheme_stages_rows_of_w_4_kib_apart(K, level):
    """With either swapped bf16 scheme, items of 32 rows and more whose rows of W are a multiple of
    4 KiB apart copy each k block of W into the workspace before its row blocks read it: over two
    k blocks, with K % 8 of 0 and 5 (the last quad or octet masked), groups of 31 rows (read in place) and
    32-100, a partial slice of columns, a bias and both output dtypes. Against the oracle, bitwise
    for any thread count, and bitwise equal to the same W with rows 64 bytes further apart (read
    in place: the copy changes no sum)."""
    if not has_level(level):
        pytest.skip(f"this CPU has no avx512_bf16 (best: {torch.ops.moe_cpu.machine()})")
    gen = torch.Generator().manual_seed(K)
    sizes = [31, 32, 45, 5, 100, 64]
    G, N, M = len(sizes), 40, sum(sizes)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    a = torch.randn(M, K, generator=gen).bfloat16()
    values = torch.randn(G, N, K, generator=gen).bfloat16()
    apart = {}
    for row_bytes in (4096, 4096 + 64):
        w = torch.full((G, N, row_bytes // 2), float("nan"), dtype=torch.bfloat16)
        w[:, :, :K] = values
        apart[row_bytes] = w[:, :, :K].transpose(1, 2)
    bias = torch.randn(G, N, generator=gen).bfloat16()
    for out_dtype in (None, torch.float32):
        b = apart[4096]
        out = run_any_threads((a, b, offs, bias, out_dtype), level)
        check(out, a, b, offs, bias, out_dtype, what=f"K={K} out {out_dtype}")
        assert torch.equal(out, run((a, apart[4096 + 64], offs, bias, out_dtype), level))


@pytest.mark.parametrize("weights,K", [("[G,N,K]", 4100), ("[G,K,N]", 300)])
def test_amx_groups_of_up_to_four_rows_take_the_decode_kernels(weights, K):
    """With AMX, groups of 1-4 rows take the dot products from K = 4096 with k-contiguous weights
    (rows of W long enough to stream), and the streamed rows of W at any K with n-contiguous ones;
    next to larger groups on the AMX tiles, against the reference, and bitwise identical for any
    thread count."""
    if torch.ops.moe_cpu.machine() != "amx":
        pytest.skip(f"this CPU has no AMX (best: {torch.ops.moe_cpu.machine()})")
    gen = torch.Generator().manual_seed(6)
    G, N = 6, 40
    offs = torch.tensor([1, 4, 4, 9, 11, 30], dtype=torch.int32)  # 1, 3, 0, 5, 2 and 19 rows
    a = torch.randn(32, K, generator=gen).bfloat16()
    if weights == "[G,N,K]":
        b = torch.randn(G, N, K, generator=gen).bfloat16().transpose(1, 2)
    else:
        b = torch.randn(G, K, N, generator=gen).bfloat16()
    bias = torch.randn(G, N, generator=gen).bfloat16()
    for out_dtype in (None, torch.float32):
        out = run_any_threads((a, b, offs, bias, out_dtype), "amx")
        check_by_reference(out, a, b, offs, bias, out_dtype, what=f"bf16 {out_dtype}")


@pytest.mark.parametrize("isa", machine_levels())
def test_stale_nan_in_scratch_and_output_memory_never_leaks(isa):
    """A call on NaN/Inf inputs leaves NaN in the per-thread scratch and in freed output memory;
    later calls with partial tiles (odd sizes, K % 32 != 0, empty groups, trailing rows, K = 0)
    must not pick any of it up."""
    bad_a = torch.full((300, 200), float("nan")).bfloat16()
    bad_b = torch.full((4, 200, 130), float("inf")).bfloat16()
    run((bad_a, bad_b, torch.tensor([50, 100, 200, 300]), None, None), isa)
    del bad_a, bad_b
    poison = torch.full((1 << 16,), float("nan"))  # freed just before the outputs are allocated
    del poison
    for layout, stride_b in (("2d3d", "contiguous"), ("2d3d", "transposed"), ("2d2d", "contiguous"),
                             ("3d2d", "strided"), ("3d3d", "transposed")):
        for K in (0, 7, 45):
            for dtype, out_dtype in ((torch.bfloat16, None), (torch.bfloat16, torch.float32), (torch.float32, None),
                                     (torch.float16, None), (torch.float64, None)):
                extent = {"2d3d": 61, "2d2d": K, "3d2d": 37, "3d3d": None}[layout]
                offs = None if extent is None else (0, extent // 3, extent // 3, max(0, extent - 5))
                case = Case(layout, 4, 61, K, 37, dtype, offs, torch.int64, "contiguous", stride_b,
                            layout in ("2d3d", "3d3d"), out_dtype, seed=K)
                args = build(case)
                out = run(args, isa)
                assert not out.isnan().any(), f"{isa} {case}"
                check(out, *args, what=f"{isa} {case}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", ["2d3d", "2d3d-nk", "2d2d", "3d2d", "3d3d"])
def test_large_groups_through_aten_mm_next_to_small_ones(layout, dtype):
    """Large groups take ATen's multi-threaded mm (fp32 from 2**26 multiply-adds, and against
    k-contiguous weights at the AVX-512 levels from 384 rows: "2d3d-nk", the transposed view of
    [G, N, K], has a third group of 360 rows and 2**26.5 that stays on the items; except on AMD
    CPUs at the AVX2 and AVX-512 levels, hence the generic level too; bf16 from 2**28 only at the
    generic and AVX-512 levels), the others the items; one call mixes both (and a group with a
    bias or fp32 output never takes the mm path). The best level runs every group on the items
    where the rules say so (AMD fp32, bf16 on AVX2, AVX512-BF16 and AMX). Which groups took the
    mm path is pinned too (moe_cpu.mm_groups), so the shapes cannot drift off what they test."""
    gen = torch.Generator().manual_seed(1)
    big, K, N = 1040, 512, 520  # 1040 * 512 * 520 > 2**28
    shapes = {"2d3d": ((big + 70, K), (3, K, N)), "2d3d-nk": ((big + 370, K), (3, N, K)),
              "2d2d": ((N, big + 70), (big + 70, K)),
              "3d2d": ((3, big, K), (K, 2 * N)), "3d3d": ((2, big, K), (2, K, N))}
    offs = {"2d3d": [10, 10 + big, big + 60], "2d3d-nk": [10, 10 + big, big + 370], "2d2d": [50, 50 + big, big + 60],
            "3d2d": [7, 7, N + 7], "3d3d": None}
    sa, sb = shapes[layout]
    a = torch.randn(*sa, generator=gen).to(dtype)
    b = torch.randn(*sb, generator=gen).to(dtype)
    if layout == "2d2d":  # column-major, as the weight gradient's x^T: ATen's mm gets A's k stride
        a = a.t().contiguous().t()
    if layout == "2d3d-nk":
        b = b.transpose(1, 2)
    o = None if offs[layout] is None else torch.tensor(offs[layout], dtype=torch.int32)
    if torch.ops.moe_cpu.machine() == "generic":
        isas = ["amx"]
    else:
        isas = ["avx512" if dtype == torch.bfloat16 and has_level("avx512") else "generic", "amx"]
    amd = amd_cpu()
    for isa, out_dtype in itertools.product(isas, [None, torch.float32] if dtype == torch.bfloat16 else [None]):
        what = f"{isa} {layout} {dtype} {out_dtype}"
        check_by_reference(run((a, b, o, None, out_dtype), isa), a, b, o, None, out_dtype, what=what)
        level = min(ISA[isa], ISA[torch.ops.moe_cpu.machine()])
        if dtype == torch.float32:
            whole = not amd or level == ISA["generic"]
        else:
            whole = out_dtype is None and level in (ISA["generic"], ISA["avx512"])
        # The big group of each layout; the 360-row one too where k-contiguous weights do not
        # keep it on the items (below the AVX-512 levels).
        want = {"2d3d": [1], "2d3d-nk": [1, 2] if dtype == torch.float32 and level < ISA["avx512"] else [1],
                "2d2d": [1], "3d2d": [2], "3d3d": [0, 1]}[layout] if whole else []
        got = torch.ops.moe_cpu.mm_groups(_contract.layout_of(a, b), a, b, o, None, out_dtype or a.dtype, ISA[isa])
        assert got == want, what
        bias = torch.zeros(b.shape[0], b.shape[-1], dtype=dtype) if layout in ("2d3d", "2d3d-nk", "3d3d") else None
        if bias is not None:
            assert torch.ops.moe_cpu.mm_groups(_contract.layout_of(a, b), a, b, o, bias, out_dtype or a.dtype,
                                               ISA[isa]) == [], what


@pytest.mark.parametrize("isa", machine_levels())
def test_k_indices_next_to_a_weight_gradient_group_are_not_read(isa):
    """A bf16 2Dx2D problem with groups of 257 and 3 K indices (and 4 past offs[-1]), inf / NaN
    at every K index outside one group: that group's result keeps every bit. The 257 one has
    2**28 multiply-adds, so ATen's mm takes it whole at the generic and AVX-512 levels (pinned),
    and ATen's bf16 mm on AMX CPUs reads rows of A past K when they are further apart
    (mm_into in csrc/cpu/grouped_mm.cpp), which these levels meet in this test on such a
    CPU; the others run our items, which read nothing past a group at any level."""
    case = Case("2d2d", 2, 1024, 264, 1024, torch.bfloat16, (257, 260), torch.int32, "contiguous", "contiguous",
                False, None, 3)
    a, b, offs, _, _ = build(case)
    whole = ISA[LEVELS[isa][0]] in (ISA["generic"], ISA["avx512"])
    assert torch.ops.moe_cpu.mm_groups("2d2d", a, b, offs, None, torch.bfloat16, ISA[LEVELS[isa][0]]) == ([0] if whole else [])
    want = run((a, b, offs, None, None), isa)
    check_by_reference(want, a, b, offs, None, None, what=isa)
    for g in range(case.G):
        pa, pb = poison_other_groups_2d2d(a, b, offs, g)
        assert torch.equal(run((pa, pb, offs, None, None), isa)[g], want[g]), f"{isa}: K indices next to group {g} were read"


def test_a_bias_not_g_by_n_is_refused_before_it_is_read():
    """The kernel's own op (behind the contract's checks) refuses a bias that is not [G, N] in the
    inputs' dtype with its message, before any group takes the bias's strides (a 1-D bias used
    to raise ATen's IndexError from there)."""
    a, b, offs = torch.randn(9, 8), torch.randn(3, 8, 5), torch.tensor([2, 5, 9], dtype=torch.int32)
    for bias in (torch.zeros(5), torch.zeros(2, 5), torch.zeros(3, 4), torch.zeros(3, 5, 1),
                 torch.zeros(3, 5, dtype=torch.float64)):
        for layout, mat_a, o in (("2d3d", a, offs), ("3d3d", a.reshape(3, 3, 8), None)):
            with pytest.raises(RuntimeError, match=r"bias must be \[G, N\]"):
                torch.ops.moe_cpu.grouped_mm(layout, mat_a, b, o, bias, torch.float32)
    good = torch.ops.moe_cpu.grouped_mm("2d3d", a, b, offs, torch.ones(3, 5), torch.float32)
    check(good, a, b, offs, torch.ones(3, 5), None)


def test_offs_and_bias_the_contract_refuses_are_refused_by_the_kernels_own_op_too():
    """torch.ops.moe_cpu.grouped_mm is callable without the contract's checks, and every group's
    pointers come from offs: offs that is not a partition of [0, extent] (decreasing, past the
    extent), not [G] long (2Dx3D, 3Dx2D), or missing, and a bias in 2Dx2D or 3Dx2D (where it has
    no place and would be dropped) are refused with the op's own message. fp32, G = 3, extent 9."""
    ok = torch.tensor([2, 5, 9], dtype=torch.int32)
    cases = {  # layout: (mat_a, mat_b), the offs extent being 9 in each
        "2d3d": (torch.randn(9, 8), torch.randn(3, 8, 5)),
        "2d2d": (torch.randn(4, 9), torch.randn(9, 5)),
        "3d2d": (torch.randn(3, 4, 8), torch.randn(8, 9)),
    }
    op = torch.ops.moe_cpu.grouped_mm
    for layout, (a, b) in cases.items():
        for bad in ([5, 2, 9], [2, 5, 10], [-1, 5, 9]):
            with pytest.raises(RuntimeError, match="offs is not a partition"):
                op(layout, a, b, torch.tensor(bad, dtype=torch.int32), None, torch.float32)
        with pytest.raises(RuntimeError, match="offs missing"):
            op(layout, a, b, None, None, torch.float32)
        if layout != "2d2d":  # there G is offs' length
            with pytest.raises(RuntimeError, match=r"offs must be \[3\]"):
                op(layout, a, b, ok[:2], None, torch.float32)
        else:
            with pytest.raises(RuntimeError, match="no bias for 2d2d"):
                op(layout, a, b, ok, torch.zeros(3, 5), torch.float32)
        if layout == "3d2d":
            with pytest.raises(RuntimeError, match="no bias for 3d2d"):
                op(layout, a, b, ok, torch.zeros(3, 9), torch.float32)
        check(op(layout, a, b, ok, None, torch.float32), a, b, ok, None, None, what=layout)


@pytest.mark.parametrize("level", machine_levels(
    ("generic", "avx2", "avx512", "avx512_bf16_swapped", "amx")))
def test_operands_without_elements_may_have_any_strides(level):
    """Operands with no elements (K = 0, or N = 0) can carry any strides (as_strided on an empty
    storage): 2^62 here, which the kernel's group offsets (g * stride, in bytes) overflowed,
    undefined behaviour that .ci/sanitizers.sh's UBSan build aborts on. The results: zeros for
    the empty contraction (plus the bias), an empty [M, 0] or [G, M, 0] for N = 0.
    2Dx3D: mat_a [4, 0], mat_b [3, 0, 4], offs [3]; 3Dx3D: [3, 2, 0] x [3, 0, 0], bias [3, 0]."""
    huge = 2**62
    offs = torch.tensor([1, 2, 4], dtype=torch.int32)
    for dtype in (torch.float32, torch.bfloat16):
        empty = torch.empty(0, dtype=dtype)
        for a, b in ((torch.empty(4, 0, dtype=dtype), empty.as_strided((3, 0, 4), (huge, 1, 1))),
                     (empty.as_strided((4, 0), (huge, 1)), torch.empty(3, 0, 4, dtype=dtype))):
            bias = torch.randn(3, 4).to(dtype)
            assert torch.equal(run((a, b, offs, None, None), level), torch.zeros(4, 4, dtype=dtype))
            want = bias.repeat_interleave(torch.tensor([1, 1, 2]), dim=0)
            assert torch.equal(run((a, b, offs, bias, None), level), want)
        a3, b3 = torch.empty(3, 2, 0, dtype=dtype), empty.as_strided((3, 0, 0), (huge, huge, 1))
        bias3 = empty.as_strided((3, 0), (huge, 1))
        assert run((a3, b3, None, bias3, None), level).shape == (3, 2, 0)


@pytest.mark.parametrize("level", machine_levels(
    ("generic", "avx2", "avx512", "avx512_bf16_swapped", "amx")))
def test_a_k_past_2_to_the_40_is_refused(level):
    """K of 2^55 and more (only stride-0, expanded operands have it) wrapped the kernels'
    workspace sizes (~256 bytes per k) past int64, and the items then wrote past a small
    scratch block (a segfault at the AVX2 and AVX-512 levels, through moe_ops.grouped_mm too):
    K past 2^40 is refused before any allocation. Every layout, M = N = 1, fp32 and bf16."""
    K = 2**55 + 3
    for dtype in (torch.float32, torch.bfloat16):
        one = torch.ones(1, 1, 1, dtype=dtype)
        offs = torch.tensor([1], dtype=torch.int32)
        for a, b, o in ((one[0].expand(1, K), one.expand(1, K, 1), offs),
                        (one[0].expand(1, K), one[0].expand(K, 1), offs),
                        (one.expand(1, 1, K), one.expand(1, K, 1), None),
                        (one.expand(1, 1, K), one[0].expand(K, 1), offs)):
            with pytest.raises(RuntimeError, match=r"K = \d+ is past 2\^40"):
                run((a, b, o, None, None), level)
    with pytest.raises(RuntimeError, match=r"is past 2\^40"):
        moe_ops.grouped_mm(torch.ones(1, 1).expand(1, K), torch.ones(1, 1, 1).expand(1, K, 1),
                           offs=torch.tensor([1], dtype=torch.int32))


@pytest.mark.skipif("libasan" in os.environ.get("LD_PRELOAD", ""),
                    reason="AddressSanitizer aborts on a failed operator new instead of throwing")
@pytest.mark.parametrize("level", machine_levels(("avx2", "avx512", "avx512_bf16_swapped", "amx")))
def test_a_call_after_a_failed_scratch_allocation_gets_new_scratch(level):
    """A thread's scratch was freed before its larger replacement was allocated, and its size
    kept: when the allocation failed (bad_alloc), the thread's next call took the freed block's
    size for its own and packed its operands through a null pointer (a segfault). K = 2^40
    (stride-0 operands, M = N = 1) asks for more scratch than the address space holds, so the
    allocation fails under any overcommit policy. In a subprocess on one thread: a crash must
    not take pytest with it, and one thread makes the failing and the next call share a scratch.
    Then mat_a [64, 64] x mat_b [2, 64, 64] fp32, before and after."""
    isa = ISA[LEVELS[level][0]]
    code = (
        "import torch, moe_ops._cpu\n"
        "from moe_ops.testing import assert_close, reference_results\n"
        "torch.set_num_threads(1)\n"
        "op = torch.ops.moe_cpu.grouped_mm\n"
        "a, b = torch.randn(64, 64), torch.randn(2, 64, 64)\n"
        "offs = torch.tensor([30, 64], dtype=torch.int32)\n"
        "want = reference_results(a, b, offs)\n"
        f"run = lambda: op('2d3d', a, b, offs, None, torch.float32, {isa})\n"
        "assert_close(run(), *want)\n"
        "K = 2**40\n"
        "try:\n"
        "    op('2d3d', torch.ones(1, 1).expand(1, K), torch.ones(1, 1, 1).expand(1, K, 1),\n"
        f"       torch.tensor([1], dtype=torch.int32), None, torch.float32, {isa})\n"
        "    raise SystemExit('the K = 2^40 call did not fail')\n"
        "except (MemoryError, RuntimeError):\n"
        "    pass\n"
        "assert_close(run(), *want)\n"
        "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stdout[-2000:],
                                                             r.stderr[-2000:])


def test_3d3d_without_output_elements_takes_no_memory_per_group():
    """3Dx3D with M = 0 has an empty [G, M, N] output whatever G is, and stride-0 operands make
    any G cheap: G = 2^22 here ([G, 0, 2] x [G, 2, 3], fp32) used to build a task per group
    (~0.6 GiB, and 2^40 groups ran out of memory). In a subprocess, for a clean peak RSS."""
    code = (
        "import resource, torch, moe_ops._cpu\n"
        "G = 2**22\n"
        "a = torch.empty(0).as_strided((G, 0, 2), (0, 0, 0))\n"
        "b = torch.zeros(1).as_strided((G, 2, 3), (0, 0, 0))\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "out = torch.ops.moe_cpu.grouped_mm('3d3d', a, b, None, None, torch.float32)\n"
        "grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before\n"
        "print(tuple(out.shape), grown)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    shape, grown_kib = r.stdout.rsplit(")", 1)
    assert shape + ")" == f"({2**22}, 0, 3)"
    assert int(grown_kib) < 64 * 1024, f"peak RSS grew by {int(grown_kib) // 1024} MiB"


def test_bf16_scheme_is_checked_before_it_is_narrowed():
    """The op's private bf16_scheme is -1 (this CPU's choice) or 0-2: 2^32 + 1 used to pass as 1
    (the check ran on its int32 narrowing), and -5 as -1. mat_a [4, 8] x mat_b [2, 8, 3], bf16."""
    a, b = torch.randn(4, 8).bfloat16(), torch.randn(2, 8, 3).bfloat16()
    offs = torch.tensor([1, 4], dtype=torch.int32)
    for scheme in (2**32 + 1, 2**32, -5, 3, -2**63):
        with pytest.raises(RuntimeError, match="bf16_scheme"):
            torch.ops.moe_cpu.grouped_mm("2d3d", a, b, offs, None, torch.bfloat16, -1, scheme)
    for scheme in (-1, 0, 1, 2):
        check(torch.ops.moe_cpu.grouped_mm("2d3d", a, b, offs, None, torch.bfloat16, -1, scheme),
              a, b, offs, None, None)


def test_far_prefetch_outside_its_three_values_is_refused():
    """The op's private far_prefetch is -1 (this CPU's choice), 0 or 1: any other value (2 would
    silently mean 0) is refused, before its narrowing. mat_a [4, 8] x mat_b [2, 8, 3], fp32."""
    a, b, offs = torch.randn(4, 8), torch.randn(2, 8, 3), torch.tensor([1, 4], dtype=torch.int32)
    for far in (2, -2, 2**32 + 1):
        with pytest.raises(RuntimeError, match="far_prefetch"):
            torch.ops.moe_cpu.grouped_mm("2d3d", a, b, offs, None, torch.float32, -1, -1, far)
    for far in (-1, 0, 1):
        check(torch.ops.moe_cpu.grouped_mm("2d3d", a, b, offs, None, torch.float32, -1, -1, far),
              a, b, offs, None, None)


@pytest.mark.parametrize("K", [8192, 8200])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("layout,bias", [(layout, False) for layout in ("2d3d", "2d3d-kn", "2d2d", "3d2d", "3d3d")]
                         + [(layout, True) for layout in ("2d3d", "2d3d-kn", "3d3d")])
def test_amx_groups_larger_than_l2_stream_rows_past_packed_column_slices(layout, bias, threads, K):
    """AMX items with more rows than fit packed in L2 take amx_item_panels. At K = 8192 that is
    past 32 rows, and a packed column slice holds 64 columns: the items here (67-100 rows, 96 or
    fewer columns, as make_items cuts these shapes for 1 or 2 threads) run 2 slices of 64 + 32
    columns and end in a block of 3-4 rows. K = 8200 gives slices of 32 columns and a last k step
    of one tile with 8 of its 32 k. The weight gradient's items have 300 rows (past 256 at k =
    297-300), and its empty group (k = 0) writes zeros."""
    if torch.ops.moe_cpu.machine() != "amx":
        pytest.skip(f"this CPU has no AMX (best: {torch.ops.moe_cpu.machine()})")
    gen = torch.Generator().manual_seed(2)
    r = lambda *s: torch.randn(*s, generator=gen).bfloat16()  # noqa: E731
    N = 200
    rows = torch.tensor([200, 7, 150], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    if layout == "2d3d":  # mat_b the transposed view of [G, N, K] weights (the swapped scheme)
        a, b, offs = r(357, K), r(3, N, K).transpose(1, 2), rows
    elif layout == "2d3d-kn":  # mat_b stored [G, K, N]
        a, b, offs = r(357, K), r(3, K, N), rows
    elif layout == "2d2d":  # x.t() @ dy per group of rows: 300 output rows, k = the group's rows
        a, b, offs = r(597, 300).t(), r(597, N), torch.tensor([300, 300, 597], dtype=torch.int32)
    elif layout == "3d2d":
        a, b, offs = r(3, 200, K), r(K, 3 * N), torch.tensor([N, N + 9, 3 * N - 5], dtype=torch.int32)
    else:
        a, b, offs = r(2, 200, K), r(2, K, N), None
    G = b.shape[0] if b.dim() == 3 else offs.shape[0]
    bias_t = r(G, N) if bias else None
    with num_threads(threads):
        outs = {out_dtype: run((a, b, offs, bias_t, out_dtype)) for out_dtype in (None, torch.float32)}
    for out_dtype, out in outs.items():
        check_by_reference(out, a, b, offs, bias_t, out_dtype, what=f"{layout} {out_dtype}")


@pytest.mark.parametrize("layout", ["2d3d", "2d3d-kn", "3d3d"])
def test_amx_groups_larger_than_l2_with_k_zero_give_the_bias(layout):
    """K = 0 through amx_item_panels (groups of 600 and 290 rows > 256, one thread, so make_items
    cuts them by columns only): every output is the bias, rounded once."""
    if torch.ops.moe_cpu.machine() != "amx":
        pytest.skip(f"this CPU has no AMX (best: {torch.ops.moe_cpu.machine()})")
    gen = torch.Generator().manual_seed(3)
    N = 512
    ends = torch.tensor([600, 890], dtype=torch.int32)
    if layout == "2d3d":
        a, b, offs = torch.empty(900, 0).bfloat16(), torch.empty(2, N, 0).bfloat16().transpose(1, 2), ends
    elif layout == "2d3d-kn":
        a, b, offs = torch.empty(900, 0).bfloat16(), torch.empty(2, 0, N).bfloat16(), ends
    else:
        a, b, offs = torch.empty(2, 600, 0).bfloat16(), torch.empty(2, 0, N).bfloat16(), None
    bias = torch.randn(2, N, generator=gen).bfloat16()
    busy = torch.randn(900, 64, generator=gen).bfloat16(), torch.randn(2, 64, N, generator=gen).bfloat16()
    outs = {}
    with num_threads(1):
        for out_dtype in (None, torch.float32):
            run((*busy, torch.tensor([600, 900], dtype=torch.int32), None, None))  # sums left in the scratch
            outs[out_dtype] = run((a, b, offs, bias, out_dtype)).float()
    for out_dtype, out in outs.items():
        for g, (s, e) in enumerate([(0, 600), (600, 890)] if a.dim() == 2 else [(0, 600), (0, 600)]):
            got = out[s:e] if a.dim() == 2 else out[g]
            assert torch.equal(got, bias[g].float().expand_as(got)), f"{layout} {out_dtype} group {g}"
        if a.dim() == 2:
            assert torch.equal(out[890:], torch.zeros_like(out[890:])), f"{layout} {out_dtype} trailing rows"


def _run_this_tree(args, timeout):
    """``python *args`` in a child process from the repository root that imports this tree's
    build (REPO first on PYTHONPATH), output captured: for guard pages, where a stray read is a
    SIGSEGV that must not take the test process with it."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env=env)


def test_operands_at_page_ends_and_starts_are_never_read_past():
    """Every level this machine has, on operands that end right before an unreadable page or
    start right after one (tests/guard_pages.py, in a subprocess: a read past either end is a
    SIGSEGV there), in every layout, dtype and weight orientation, with ragged sizes. Masked
    vector loads are what keep the kernels inside their operands at every edge; one lane too
    many in a pack (a mask of cols + 1) passes every other test here and fails this one."""
    levels = [f"{ISA[LEVELS[n][0]]}:{LEVELS[n][1]}" for n in LEVELS if has_level(n)]
    r = _run_this_tree([os.path.join(REPO, "tests", "guard_pages.py"), *levels], timeout=600)
    assert r.returncode == 0, f"exit status {r.returncode}\n{r.stdout}\n{r.stderr}"
    lines = r.stdout.splitlines()
    for level in levels:
        assert any(line.startswith(f"{level}: ") and line.endswith("all match") for line in lines), r.stdout


_STAGED_AT_PAGE_END = """
import sys, torch
sys.path.insert(0, sys.argv[1])
import moe_ops._cpu  # noqa: F401
from guard_pages import guarded
from moe_ops.testing import assert_close, reference_results
torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
K, sizes = 2045, [31, 32, 45, 5, 64, 100]
w = torch.randn(len(sizes), 40, 2048, generator=g).bfloat16()[:, :, :K].transpose(1, 2)
offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
a = torch.randn(int(offs[-1]) + 3, K, generator=g).bfloat16()
for scheme in (1, 2):
    gw = guarded(w, True)
    out = torch.ops.moe_cpu.grouped_mm("2d3d", a, gw, offs, None, torch.bfloat16, 3, scheme)
    assert_close(out, *reference_results(a, w, offs, None, None), what=f"scheme {scheme}")
print("all match")
"""


def test_swapped_scheme_staging_never_reads_past_the_last_row_of_w():
    """mat_a [280, 2045] bf16, mat_b a [6, 2045, 40] view of [6, 40, 2048] bf16 (rows of W 4 KiB
    apart: staged) whose storage ends at the last row's k = K - 1, right before an unreadable page
    (tests/guard_pages.py; in a subprocess, a read past it is a SIGSEGV), on one thread (with two,
    the items that read W's last row were not staged here). Both swapped schemes copy the last
    k block's ragged tail (K % 8 == 5) with a mask; the guard-page test's staged weights have
    K = 4096 (no tail), and the staging test's rows have padding past K to read into."""
    if not has_level("avx512_bf16"):  # asked here: collection must not need the module
        pytest.skip(f"the swapped schemes need avx512_bf16 (best: {torch.ops.moe_cpu.machine()})")
    r = _run_this_tree(["-c", _STAGED_AT_PAGE_END, os.path.join(REPO, "tests")], timeout=120)
    ok = r.returncode == 0 and r.stdout.strip() == "all match"
    assert ok, f"exit status {r.returncode}\n{r.stdout}\n{r.stderr}"


@pytest.mark.parametrize("offs_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("layout", ["2d3d", "2d2d", "3d2d"])
@pytest.mark.parametrize("isa", machine_levels())
def test_offs_read_in_place_through_its_stride(isa, layout, offs_dtype):
    """offs as a strided view (every other element of a larger tensor): the kernel reads int32 and
    int64 values in place, so a wrong stride or element width would pick the wrong group ends."""
    torch.manual_seed(3)
    G, M, K, N = 5, 23, 19, 21
    extent = {"2d3d": M, "2d2d": K, "3d2d": N}[layout]
    ends = torch.tensor([3, 3, 11, 17, extent - 2])
    offs = torch.stack([ends, ends * 0 + 999], 1).to(offs_dtype).reshape(-1)[::2]
    assert offs.stride(0) == 2 and offs.tolist() == ends.tolist()
    a = torch.randn(G, M, K) if layout == "3d2d" else torch.randn(M, K)
    b = torch.randn(K, N) if layout in ("2d2d", "3d2d") else torch.randn(G, K, N)
    check(run((a, b, offs, None, None), isa), a, b, offs, None, None, what=f"{layout} {offs_dtype}")


def cache_limit() -> int:
    return torch.ops.moe_cpu.cache_info()[1] if cpu_backend.status().mode is not None else 0


needs_cache = pytest.mark.skipif(cache_limit() < (64 << 20),
                                 reason="the CPU output cache is off or under 64 MiB (MOE_OPS_CPU_CACHE_MB)")


@needs_cache
@pytest.mark.parametrize("N", [512, 520])
@pytest.mark.parametrize("dtype,out_dtype", [(torch.bfloat16, None), (torch.bfloat16, torch.float32),
                                             (torch.float32, None)])
@pytest.mark.parametrize("layout,stride_b", [("2d2d", "contiguous"), ("2d3d", "contiguous"), ("2d3d", "transposed")])
@pytest.mark.parametrize("isa", machine_levels())
def test_large_output_in_a_reused_block_is_written_completely(isa, layout, stride_b, dtype, out_dtype, N):
    """An output of 8 MiB or more lands in the block the previous one left in the output cache
    (pages mapped: written with non-temporal stores where rows are line-aligned, N=512); that
    block was filled with NaN, and every element must be overwritten: partial row tiles (513
    rows), partial lines (N=520), empty groups, and zeros past offs[-1]; the forward with weights
    [G, K, N] and [G, N, K] (the transposing epilogue)."""
    if layout == "2d2d":  # the weight gradient: x^T (column-major) @ dy, [16, 513, N]
        shape, offs = (16, 513, 200, N), tuple(sorted([0] * 2 + [3 * g for g in range(13)] + [190]))
    else:  # the forward: [M, N] with M * N * 2 bytes >= 8 MiB
        shape, offs = (8, 8200, 40, N), (1000, 1000, 2200, 5000, 5000, 5200, 8000, 8190)
    stride_a = "transposed" if layout == "2d2d" else "contiguous"
    G, M, K, _ = shape
    first, second = (Case(layout, G, M, K, N, dtype, offs, torch.int64, stride_a, stride_b, False, out_dtype, seed)
                     for seed in (1, 2))
    out = run(build(first), isa)
    assert out.nbytes >= 8 << 20
    block = out.data_ptr()
    out.fill_(float("nan"))
    del out
    args = build(second)
    out = run(args, isa)
    assert out.data_ptr() == block, "the output did not reuse the freed block"
    assert not out.isnan().any(), f"{isa} {second}: stale NaN in the output"
    check_by_reference(out, *args, what=f"{isa} {second}")


@needs_cache
@pytest.mark.parametrize("weights", ["nk", "kn"])
def test_amx_rows_keep_their_bits_across_the_item_and_panel_kernels(weights):
    """With AMX, items of more rows than amx_item_rows (256 here) take amx_item_panels, and so do
    streamed outputs (8 MiB and more, in a reused block) with [G, K, N] weights: it streams the
    rows through packed column slices where amx_item packs the item's rows once, but each output
    element gets the same tile operations in the same k order (K = 320: 10 k tiles, past the
    panels' k step of 8), so the same bits. The whole call (fp32 out: 8.2 MiB, streamed), the same
    call with the rows permuted within their groups (its output in a new block: not streamed) and
    each group called alone (groups of up to 256 rows on amx_item) agree bit for bit. Runs where
    the CPU has AMX and on our emulator of the tiles (the sanitizer stage on CPUs without AMX)."""
    if torch.ops.moe_cpu.machine() != "amx":
        pytest.skip(f"this CPU has no AMX (best: {torch.ops.moe_cpu.machine()})")
    gen = torch.Generator().manual_seed(11)
    K, N = 320, 1024
    starts, ends = [0, 300, 303, 503], [300, 303, 503, 2100]  # 300, 3, 200 and 1597 rows
    a = torch.randn(2100, K, generator=gen).bfloat16()
    w = torch.randn(4, N, K, generator=gen).bfloat16()
    b = w.transpose(1, 2) if weights == "nk" else w.transpose(1, 2).contiguous()
    bias, offs = torch.randn(4, N, generator=gen).bfloat16(), torch.tensor(ends, dtype=torch.int32)
    run((a, b, offs, bias, torch.float32))  # its output's block, freed, is the next call's
    out = run((a, b, offs, bias, torch.float32))
    assert out.nbytes >= 8 << 20
    perm = torch.cat([lo + torch.randperm(hi - lo, generator=gen) for lo, hi in zip(starts, ends)])
    assert torch.equal(run((a[perm].contiguous(), b, offs, bias, torch.float32)), out[perm]), weights
    for g, (lo, hi) in enumerate(zip(starts, ends)):
        alone = run((a[lo:hi], b[g:g + 1], offs.new_tensor([hi - lo]), bias[g:g + 1], torch.float32))
        assert torch.equal(alone, out[lo:hi]), f"{weights} group {g} alone"
    # Last: its large temporaries, freed to the output cache, would let the permuted call stream.
    check_by_reference(out, a, b, offs, bias, torch.float32, what=weights)


@needs_cache
@pytest.mark.parametrize("level", SWAPPED)
@pytest.mark.parametrize("K", [512, 1030])
def test_swapped_scheme_sums_to_c_as_through_its_workspace(K, level):
    """With either swapped bf16 scheme the register blocks write their sums to C themselves
    (transposed in registers, plus bias, rounded once); a streamed output (8 MiB or more in a
    block reused from the output cache) still takes them through the workspace (and, with 256-bit
    vectors of 4 rows, the 16 x 16 transposing store). Both must give the same bits: over one and
    two k blocks (K = 1030, with the partial sums of the first added in the second), groups of
    1-4 rows (one vector of 4 rows; 256-bit from 3 rows: vectors of 2), 5-17 (256-bit: vectors of 2)
    and one of 8133 (vectors of 4), N = 520 (a slice of 8 columns: half a 16-column block), a bias
    and both output dtypes. The two paths' agreement with the oracle is tested above (edges, large
    outputs); here the bits."""
    if not has_level(level):
        pytest.skip(f"this CPU has no avx512_bf16 (best: {torch.ops.moe_cpu.machine()})")
    gen = torch.Generator().manual_seed(K)
    sizes = [1, 2, 3, 4, 5, 6, 7, 9, 13, 17, 0, 8133]
    G, N, M = len(sizes), 520, sum(sizes)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    a = torch.randn(M, K, generator=gen).bfloat16()
    b = torch.randn(G, N, K, generator=gen).bfloat16().transpose(1, 2)
    bias = torch.randn(G, N, generator=gen).bfloat16()
    for out_dtype in (None, torch.float32):
        moe_ops.empty_cpu_cache()
        direct = run((a, b, offs, bias, out_dtype), level)  # a new block: not streamed
        assert direct.nbytes >= 8 << 20
        block, want = direct.data_ptr(), direct.clone()
        del direct
        streamed = run((a, b, offs, bias, out_dtype), level)
        assert streamed.data_ptr() == block, "the output did not reuse the freed block"
        assert torch.equal(streamed, want), f"K={K} out {out_dtype}: the two stores differ"


@needs_cache
@pytest.mark.parametrize("nbytes", [64 << 10, 9 << 20], ids=["malloc", "cache block"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_new_outputs_are_nan_under_deterministic_algorithms(dtype, nbytes):
    """The memory grouped_mm writes its output into (torch.ops.moe_cpu.new_output) is NaN under
    torch.use_deterministic_algorithms(True) with fill_uninitialized_memory, as torch.empty is:
    the guard that makes an element a kernel misses fail the tests that run so (fixture
    unwritten_outputs_are_nan) instead of passing with what an earlier output left there. Also
    when the memory comes back from the output cache (9 MiB) holding ones, which without the
    fill (deterministic off, or the fill turned off) the new output still shows, so the block is
    the one written and the NaN is the fill's; outputs of 64 KiB come from torch's allocator
    (malloc), where only the NaN is checked."""
    import torch.utils.deterministic as det

    size = [nbytes // dtype.itemsize]
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    fill = det.fill_uninitialized_memory
    try:
        for deterministic, fills in ((False, True), (True, False), (True, True)):
            torch.use_deterministic_algorithms(deterministic)
            det.fill_uninitialized_memory = fills
            moe_ops.empty_cpu_cache()
            first = torch.ops.moe_cpu.new_output(size, dtype)
            assert first.dtype == dtype and first.shape == tuple(size)
            first.fill_(1.0)
            ptr = first.data_ptr()
            del first
            out = torch.ops.moe_cpu.new_output(size, dtype)
            if deterministic and fills:
                assert out.isnan().all(), f"{dtype}, {nbytes} bytes: not NaN"
            elif nbytes >= 8 << 20:  # (malloc keeps its free lists in the first bytes of a freed chunk)
                assert out.data_ptr() == ptr, "the output cache did not hand the freed block back"
                assert (out == 1).all(), f"{dtype}, {nbytes} bytes: written without the fill asked"
    finally:
        det.fill_uninitialized_memory = fill
        torch.use_deterministic_algorithms(was, warn_only=warn_only)


@needs_cache
def test_output_cache_keeps_freed_blocks_within_its_limit_and_empties():
    """Blocks of freed large outputs are kept (up to the limit) and handed out again (a block
    left full of NaN is overwritten completely, empty groups included); smaller outputs do not
    enter the cache; empty_cpu_cache() releases every free block; an output in a cached block
    is an ordinary resizable tensor."""
    moe_ops.empty_cpu_cache()
    a, b = torch.randn(16, 64), torch.randn(16, 4104)  # out [8, 64, 4104] float32: 8 MiB + 16 KiB
    offs = torch.arange(2, 17, 2)
    out = moe_ops.grouped_mm(a.t(), b, offs)
    block, ptr = (out.nbytes + (2 << 20) - 1) // (2 << 20) * (2 << 20), out.data_ptr()
    out.fill_(float("nan"))
    del out
    assert torch.ops.moe_cpu.cache_info()[0] == block
    small = moe_ops.grouped_mm(a.t(), b[:, :64], offs)  # 128 KiB: the CPU allocator's business
    del small
    assert torch.ops.moe_cpu.cache_info()[0] == block
    sparse = torch.tensor([0, 3, 3, 9, 9, 9, 12, 14])  # empty groups, the last two columns unused
    out = moe_ops.grouped_mm(a.t(), b, sparse)
    assert torch.ops.moe_cpu.cache_info()[0] == 0
    assert out.data_ptr() == ptr
    check(out, a.t(), b, sparse, None, None)
    want = out.clone()
    out.resize_(out.numel() * 2)  # a new storage from the same allocator, the data copied
    assert torch.equal(out[:want.numel()], want.flatten())
    del out
    assert moe_ops.empty_cpu_cache() >= block
    assert torch.ops.moe_cpu.cache_info()[0] == 0


@needs_cache
@pytest.mark.skipif(not os.path.exists("/proc/self/status"),
                    reason="needs Linux's /proc/self/status")
def test_output_cache_returns_emptied_blocks_to_the_os():
    """empty_cpu_cache() returns the free blocks' memory to the OS, also once glibc has raised its
    mmap threshold (it does on the first free of an mmapped chunk, to that chunk's size, up to
    32 MiB): blocks taken with posix_memalign then came from glibc's heap, and free() kept them
    resident. Outputs [8, 64, 512 * m] fp32 (m MiB, m = 8-28), written, freed and emptied."""
    a, offs = torch.randn(16, 64), torch.arange(2, 17, 2)

    def out(mib):  # a [8, 64, 512 * mib] fp32 output: mib MiB, a block of its own size
        return moe_ops.grouped_mm(a.t(), torch.randn(16, 512 * mib), offs)

    moe_ops.empty_cpu_cache()
    first = out(30)  # one block mapped and, emptied, given back: glibc's threshold rises
    del first
    moe_ops.empty_cpu_cache()
    before = _resident_mib()
    outs = [out(mib) for mib in range(8, 30, 2)]  # 11 blocks, 209 MiB, every page written
    held = _resident_mib() - before
    assert held >= 150, f"only {held} MiB resident for 209 MiB of outputs"
    del outs
    moe_ops.empty_cpu_cache()
    kept = _resident_mib() - before
    assert kept < held // 4, f"{kept} of {held} MiB still resident after empty_cpu_cache()"


@needs_cache
def test_output_cache_reports_its_blocks_to_the_memory_profiler():
    """torch.profiler(profile_memory=True) sees an output in a cache block, as it sees c10's CPU
    allocations: the C++ kernel's row carries the block's bytes."""
    from torch.profiler import ProfilerActivity, profile

    a, b, offs = torch.randn(16, 64), torch.randn(16, 4104), torch.arange(2, 17, 2)
    moe_ops.grouped_mm(a.t(), b, offs)  # a block in the cache: the profiled call reuses it
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = moe_ops.grouped_mm(a.t(), b, offs)
    rows = {e.key: e for e in prof.key_averages()}
    assert rows["moe_cpu::grouped_mm"].self_cpu_memory_usage >= out.nbytes


@needs_cache
def test_output_cache_reports_freed_blocks_to_the_memory_profiler(tmp_path):
    """Each block handed out and given back is reported both ways: after three calls whose outputs
    ([8, 64, 4104] fp32, a 10 MiB block) are freed in turn, the profiler's running total of
    allocated bytes is back where it started (a block not subtracted on its way back made the
    total grow by a block a call), and the reserved total stays the same throughout: the block
    moves between use and the cache (it was reported as unreserved while the cache held it)."""
    import json

    from torch.profiler import ProfilerActivity, profile

    a, b, offs = torch.randn(16, 64), torch.randn(16, 4104), torch.arange(2, 17, 2)
    moe_ops.grouped_mm(a.t(), b, offs)  # a block in the cache: the profiled calls reuse it
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(3):
            out = moe_ops.grouped_mm(a.t(), b, offs)
            del out
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    mem = [e["args"] for e in events
           if e.get("name") == "[memory]" and abs(e["args"]["Bytes"]) >= 8 << 20]
    assert [m["Bytes"] for m in mem] == [10 << 20, -(10 << 20)] * 3, mem
    start = mem[0]["Total Allocated"] - (10 << 20)
    assert [m["Total Allocated"] - start for m in mem] == [10 << 20, 0] * 3, mem
    assert len({m["Total Reserved"] for m in mem}) == 1 and mem[0]["Total Reserved"] >= 10 << 20, mem


@needs_cache
def test_output_cache_hands_out_the_most_recently_freed_block():
    """Of two free blocks of one size the most recently freed one is taken (its pages the likeliest
    to be mapped and cached; the older one is the first to idle into MADV_FREE and the first to
    go past the limit). Outputs [8, 64, 4104] fp32: 10 MiB blocks."""
    moe_ops.empty_cpu_cache()
    a, b, offs = torch.randn(16, 64), torch.randn(16, 4104), torch.arange(2, 17, 2)
    first, second = moe_ops.grouped_mm(a.t(), b, offs), moe_ops.grouped_mm(a.t(), b, offs)
    newer = second.data_ptr()
    del first
    del second  # freed last
    out = moe_ops.grouped_mm(a.t(), b, offs)
    assert out.data_ptr() == newer
    check(out, a.t(), b, offs, None, None)
    del out
    moe_ops.empty_cpu_cache()


@needs_cache
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_output_cache_in_a_forked_child():
    """A child forked with a block in the cache (as a DataLoader worker is) takes it and returns
    it: the cache's lock is held across fork() and released on both sides."""
    a, b, offs = torch.randn(16, 64), torch.randn(16, 4104), torch.arange(2, 17, 2)
    out = moe_ops.grouped_mm(a.t(), b, offs)
    want = out.clone()
    del out
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 only if every step works
        ok = False
        try:
            torch.set_num_threads(1)
            got = moe_ops.grouped_mm(a.t(), b, offs)
            ok = torch.equal(got, want) and torch.ops.moe_cpu.cache_info()[0] == 0
            del got
            ok = ok and torch.ops.moe_cpu.cache_info()[0] > 0
        finally:
            os._exit(0 if ok else 1)
    for _ in range(600):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung")
    assert os.waitstatus_to_exitcode(status) == 0
    assert torch.equal(moe_ops.grouped_mm(a.t(), b, offs), want)


def _lazy_free_bytes():
    """Bytes of this process's memory marked MADV_FREE and not yet reclaimed or written again."""
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("LazyFree:"):
                return int(line.split()[1]) << 10
    pytest.skip("/proc/self/smaps_rollup has no LazyFree field")


@needs_cache
@pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"), reason="needs Linux's /proc/self/smaps_rollup")
def test_output_cache_marks_only_idle_blocks_lazy_free():
    """A freed block is not marked MADV_FREE when it goes back to the cache, nor at the next take
    within a second (marking every freed block cost a steady loop ~15%); one left in the cache
    for a second is, at the next take, so the OS may reclaim it; taken again and written, its
    pages are ordinary again."""
    moe_ops.empty_cpu_cache()
    a, b, offs = torch.randn(16, 64), torch.randn(16, 16384), torch.arange(2, 17, 2)
    out = moe_ops.grouped_mm(a.t(), b, offs)  # [8, 64, 16384] fp32: a 32 MiB block
    block = out.nbytes
    base = _lazy_free_bytes()
    del out
    assert _lazy_free_bytes() - base < block // 2, "a freed block was marked MADV_FREE at once"
    other = moe_ops.grouped_mm(a.t(), b[:, :8192], offs)  # 16 MiB: a take of another size
    assert _lazy_free_bytes() - base < block // 2, "a block free for less than a second was marked MADV_FREE"
    time.sleep(1.2)
    third = moe_ops.grouped_mm(a.t(), b[:, :12288], offs)  # 24 MiB: the next take marks the idle block
    idle = _lazy_free_bytes()
    assert idle - base >= block * 9 // 10, "a block idle for a second was not marked MADV_FREE"
    out = moe_ops.grouped_mm(a.t(), b, offs)  # takes it back and writes it
    written = _lazy_free_bytes()
    assert idle - written >= block * 9 // 10, "a block written again still counts as lazily freed"
    check(out, a.t(), b, offs, None, None)
    # Freed again and idle again, the block is marked again at the next take (its mark of the
    # first round must not stay behind with it).
    del out
    time.sleep(1.2)
    del other  # a put marks the idle blocks too
    assert _lazy_free_bytes() - written >= block * 9 // 10, "a block idle again was not marked"
    del third
    moe_ops.empty_cpu_cache()


def test_output_cache_over_its_limit_unmaps_the_oldest_free_block():
    """Past the limit the oldest free blocks go: with MOE_OPS_CPU_CACHE_MB=20, a 10 MiB block and
    then a 12 MiB one freed (22 MiB) leave the 12 MiB one cached. In a subprocess (the limit is
    read once per process); outputs [8, 64, N] fp32."""
    code = ("import torch, moe_ops, moe_ops._cpu\n"
            "a, offs = torch.randn(16, 64), torch.arange(2, 17, 2)\n"
            "x = moe_ops.grouped_mm(a.t(), torch.randn(16, 4104), offs)\n"  # a 10 MiB block
            "y = moe_ops.grouped_mm(a.t(), torch.randn(16, 6144), offs)\n"  # a 12 MiB block
            "del x\n"
            "del y\n"
            "print(list(torch.ops.moe_cpu.cache_info()))")
    env = dict(os.environ, MOE_OPS_CPU_CACHE_MB="20")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split("\n")[-2] == f"[{12 << 20}, {20 << 20}]", res.stdout


def test_output_cache_off_with_a_zero_limit():
    code = ("import torch, moe_ops, moe_ops._cpu\n"
            "out = moe_ops.grouped_mm(torch.randn(16, 64).t(), torch.randn(16, 8200), torch.arange(2, 17, 2))\n"
            "del out\n"
            "print(list(torch.ops.moe_cpu.cache_info()))")
    env = dict(os.environ, MOE_OPS_CPU_CACHE_MB="0")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split("\n")[-2] == "[0, 0]", res.stdout


def _thread_problems():
    """Calls that take every CPU path at once: AMX column-slice items with an output from the
    cache (8 MiB), fp32 FMA items, a weight gradient of 32 MiB (cache, streaming stores), decode
    groups (dot products), fp16 / fp64 items, and a forward + backward through autograd."""
    gen = torch.Generator().manual_seed(7)
    r = lambda *s, dtype=torch.bfloat16: torch.randn(*s, generator=gen).to(dtype)  # noqa: E731
    offs = lambda ends: torch.tensor(ends)  # noqa: E731
    x_grad, w_grad = r(1024, 256, dtype=torch.float32), r(4, 128, 256, dtype=torch.float32)

    def fwd_bwd():
        x, w = x_grad.clone().requires_grad_(), w_grad.clone().requires_grad_()
        y = moe_ops.grouped_mm(x, w.transpose(1, 2), offs([200, 500, 500, 1000]))
        return (y, *torch.autograd.grad(y, (x, w), torch.ones_like(y)))

    calls = {
        "amx": (r(4096, 256), r(4, 1024, 256).transpose(1, 2), offs([1500, 2000, 3900, 4096])),
        "fma": (r(1024, 512, dtype=torch.float32), r(8, 512, 512, dtype=torch.float32).transpose(1, 2),
                offs([128 * (g + 1) for g in range(8)])),
        "wgrad": (r(2048, 512).t(), r(2048, 1024), offs([128 * (g + 1) for g in range(16)]), None, torch.float32),
        "decode": (r(4, 2048), r(4, 1024, 2048).transpose(1, 2), offs([1, 2, 3, 4])),
        "fp16": (r(300, 64, dtype=torch.float16), r(3, 64, 96, dtype=torch.float16), offs([0, 120, 290])),
        "fp64": (r(4, 33, 17, dtype=torch.float64), r(4, 17, 9, dtype=torch.float64)),
    }
    fns = {name: (lambda args=args: (moe_ops.grouped_mm(*args),)) for name, args in calls.items()}
    fns["fwd_bwd"] = fwd_bwd
    return fns


def test_python_threads_calling_at_once_get_the_serial_results():
    """Four Python threads call the op at once (the GIL is released inside the kernel), each its
    own order of the calls, several rounds, keeping their results alive: every result is bit
    for bit the one of a serial call, also once all threads have finished (no block of the
    output cache or scratch memory handed to two callers)."""
    fns = _thread_problems()
    want = {name: fn() for name, fn in fns.items()}
    errors, kept = [], []

    def worker(seed):
        order = list(fns)
        rng = random.Random(seed)
        results = []
        try:
            for _ in range(4):
                rng.shuffle(order)
                for name in order:
                    got = fns[name]()
                    results.append((name, got))
                    if not all(torch.equal(g, w) for g, w in zip(got, want[name])):
                        errors.append(f"thread {seed}: {name} differs from the serial result")
            kept.extend(results[-2 * len(fns):])
        except Exception as e:  # noqa: BLE001 - reported below, with the thread
            errors.append(f"thread {seed}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for name, got in kept:
        assert all(torch.equal(g, w) for g, w in zip(got, want[name])), f"{name} changed after the threads ended"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_element_offsets_past_2_to_the_31(tmp_path, dtype):
    """mat_b's groups 2**31 + 17 elements apart (a sparse file mapped copy-on-write, so only the
    touched pages take memory): every offset is computed in 64 bits, on every level this machine
    has, with row-major and k-contiguous weights (bf16: the pair packs of both)."""
    n = (1 << 31) + 17 + 16 * 24 + 64
    path = tmp_path / "sparse.bin"
    with open(path, "wb") as f:
        f.truncate(n * dtype.itemsize)
    base = torch.from_file(str(path), shared=False, size=n, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(30, 16, generator=gen).to(dtype)
    offs = torch.tensor([11, 30], dtype=torch.int32)
    weights = {"[G,K,N]": lambda: base.as_strided((2, 16, 24), ((1 << 31) + 17, 24, 1)),
               "[G,N,K]": lambda: base.as_strided((2, 24, 16), ((1 << 31) + 17, 16, 1)).transpose(1, 2)}
    levels = [level for level in LEVELS if has_level(level)]
    for name, view in weights.items():
        b = view()  # both views share the file's pages: one at a time
        b.copy_(torch.randn(2, 16, 24, generator=gen).to(dtype))
        for isa in levels:
            check(run((a, b, offs, None, None), isa), a, b, offs, None, None, what=f"{isa} {name}")
        check(moe_ops.grouped_mm(a, b, offs), a, b, offs, None, None, what=f"op {name}")


@pytest.mark.outside_cpp
def test_without_the_compiled_module_the_reference_serves_cpu_calls():
    code = (
        "import sys, logging\n"
        "sys.modules['moe_ops._cpu'] = None  # as if the extension had not been built\n"
        "logging.basicConfig(level=logging.INFO, format='%(message)s')\n"
        "import torch, moe_ops, moe_ops.testing\n"
        "from moe_ops import backends\n"
        "s = [s for s in backends.statuses() if s.name == 'cpu'][0]\n"
        "print('MODE', s.mode)\n"
        "print('DETAIL', s.detail)\n"
        "a = torch.randn(10, 4); b = torch.randn(2, 4, 3); offs = torch.tensor([3, 10])\n"
        "for _ in range(3):\n"
        "    out = moe_ops.grouped_mm(a, b, offs)\n"
        "torch.testing.assert_close(out, moe_ops.reference.grouped_mm(a, b, offs))\n"
        "print('COUNTS', moe_ops.kernel_counts())\n"
        "print('EMPTIED', moe_ops.empty_cpu_cache())\n"
        "try:\n"
        "    moe_ops.testing.run_backend('cpu', a, b, offs)\n"
        "except backends.BackendUnavailable as e:\n"  # the property suite skips on it
        "    print('UNAVAILABLE', e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert "MODE None" in r.stdout and "moe_ops._cpu cannot be loaded" in r.stdout
    assert "and a C++ compiler" in r.stdout  # the status says how to get the kernel
    assert "EMPTIED 0" in r.stdout, r.stdout
    assert "UNAVAILABLE the C++ extension moe_ops._cpu cannot be loaded" in r.stdout, r.stdout
    assert "COUNTS {'reference': 3}" in r.stdout
    assert r.stderr.count("CPU calls use the reference") == 1  # the backend's warning, once
    assert r.stderr.count("does not serve this call") == 1  # kernel_entry's fallback note, once


@pytest.mark.outside_cpp
def test_the_generic_level_and_the_cache_limit_are_reported_as_documented():
    """At MOE_OPS_CPU_ISA=generic the items run ATen's mm: kernel_counts and the status call that
    kernel "cpu:aten" (README), the status names no bf16 scheme, and it gives the cache limit
    MOE_OPS_CPU_CACHE_MB set, in MiB. In a subprocess: both variables are read once per process.
    Shapes: mat_a [10, 4], mat_b [2, 4, 3] float32, offs [2] int64."""
    # The call comes first: importing moe_ops registers the kernel (not a later statuses()).
    code = ("import torch, moe_ops\nfrom moe_ops import backends\n"
            "moe_ops.grouped_mm(torch.randn(10, 4), torch.randn(2, 4, 3), torch.tensor([3, 10]))\n"
            "print('COUNTS', moe_ops.kernel_counts())\n"
            "print('DETAIL', [s for s in backends.statuses() if s.name == 'cpu'][0].detail)\n")
    env = dict(os.environ, MOE_OPS_CPU_ISA="generic", MOE_OPS_CPU_CACHE_MB="64")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       cwd=REPO, env=env)
    assert r.returncode == 0, r.stderr
    assert "COUNTS {'cpu:aten': 1}" in r.stdout, r.stdout
    assert "of 64 MiB" in r.stdout, r.stdout
    for dtype in ("bfloat16", "float32", "float16", "float64"):
        assert f"{dtype}: cpu:aten" in r.stdout, r.stdout
    # bf16_scheme() still describes the CPU; at the generic level no bf16 kernel uses it.
    assert "swapped scheme" not in r.stdout, r.stdout


def test_kernel_counts_credit_each_call_to_its_own_kernel():
    """A kernel that names the concrete kernel it ran (note_kernel) is counted under that name
    for that call only: the next call, by a kernel that names none, is counted under its
    registered name. Shapes: mat_a [10, 4], mat_b [2, 4, 3] float32, offs [2] int64."""
    from moe_ops import _op, reference

    def noting(p, a, b, offs, bias):
        _op.note_kernel("test:concrete")
        return reference.compute(p, a, b, offs, bias)

    a, b, offs = torch.randn(10, 4), torch.randn(2, 4, 3), torch.tensor([3, 10])
    moe_ops.reset_kernel_counts()
    _op.kernel_entry("test:noting", noting)(a, b, offs)
    _op.kernel_entry("test:plain", lambda *args: reference.compute(*args))(a, b, offs)
    assert moe_ops.kernel_counts() == {"test:concrete": 1, "test:plain": 1}


def test_kernel_counts_is_a_snapshot_and_credits_each_thread_its_own_kernel():
    """kernel_counts() returns a copy (later calls do not change it), and the concrete kernel a
    call names with note_kernel is credited to that call even when another thread's call starts
    and ends in between (each thread has its own served name): thread 1's kernel names
    "test:concrete", then waits until thread 2 has run a kernel that names none.
    Shapes: mat_a [10, 4], mat_b [2, 4, 3] float32, offs [2] int64."""
    from moe_ops import _op, reference

    a, b, offs = torch.randn(10, 4), torch.randn(2, 4, 3), torch.tensor([3, 10])
    noted, other_done = threading.Event(), threading.Event()

    def noting(p, a, b, offs, bias):
        _op.note_kernel("test:concrete")
        noted.set()
        assert other_done.wait(60)
        return reference.compute(p, a, b, offs, bias)

    def other():
        assert noted.wait(60)
        _op.kernel_entry("test:plain", lambda *args: reference.compute(*args))(a, b, offs)
        other_done.set()

    moe_ops.reset_kernel_counts()
    before = moe_ops.kernel_counts()
    threads = [threading.Thread(target=_op.kernel_entry("test:noting", noting), args=(a, b, offs)),
               threading.Thread(target=other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert before == {}
    assert moe_ops.kernel_counts() == {"test:concrete": 1, "test:plain": 1}


@pytest.mark.outside_cpp
def test_the_compiled_module_refuses_another_torch():
    """Built against one torch, moe_ops._cpu does not load (nor register anything) under another:
    CPU calls use the reference and the status says why."""
    code = ("import torch; torch.version.__version__ = '0.0.0'\n"
            "import moe_ops\nfrom moe_ops import backends\n"
            "print('DETAIL', [s for s in backends.statuses() if s.name == 'cpu'][0].detail)\n"
            "print('OPS', hasattr(torch.ops.moe_cpu, 'grouped_mm'))\n"
            "moe_ops.grouped_mm(torch.randn(4, 3), torch.randn(2, 3, 5), torch.tensor([1, 4]))\n"
            "print('COUNTS', moe_ops.kernel_counts())\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert f"moe_ops._cpu was built against torch {torch.__version__}, this is torch 0.0.0" in r.stdout
    assert "OPS False" in r.stdout and "COUNTS {'reference': 1}" in r.stdout


def test_the_compiled_modules_carry_the_torch_they_were_built_against():
    """Each compiled module holds its build's torch version behind a marker in its file, which
    moe_ops._native reads without loading the module (for a loader that cannot load it)."""
    from moe_ops import _native

    for name in ("moe_ops._cpu", "moe_ops._autograd"):
        assert _native.built_against(name) == torch.__version__, name
    assert _native.built_against("moe_ops._contract") is None  # a Python module: no marker


@pytest.mark.outside_cpp
def test_a_module_the_loader_rejects_names_both_torch_versions(tmp_path):
    """A module file the dynamic loader rejects (here not even an ELF file; under another torch, an
    undefined symbol) whose marker names another torch: the ImportError names both versions,
    chained to the loader's error. With the running torch's version the loader's error stays."""
    from moe_ops import _native

    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    (tmp_path / "nativepkg").mkdir()
    (tmp_path / "nativepkg" / "__init__.py").write_text("")
    (tmp_path / "nativepkg" / f"other{suffix}").write_bytes(b"junk\0" + _native.MARKER + b"9.9.9\0junk")
    (tmp_path / "nativepkg" / f"same{suffix}").write_bytes(_native.MARKER + torch.__version__.encode() + b"\0")
    sys.path.insert(0, str(tmp_path))
    try:
        assert _native.built_against("nativepkg.other") == "9.9.9"
        with pytest.raises(ImportError) as info:
            _native.import_native("nativepkg.other")
        assert str(info.value) == f"nativepkg.other was built against torch 9.9.9, this is torch {torch.__version__}"
        assert isinstance(info.value.__cause__, (ImportError, OSError))
        with pytest.raises((ImportError, OSError)) as info:
            _native.import_native("nativepkg.same")
        assert "built against" not in str(info.value)
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m == "nativepkg" or m.startswith("nativepkg.")]:
            del sys.modules[name]


@pytest.mark.outside_cpp
def test_a_failed_rebuild_removes_the_modules_an_earlier_build_left(tmp_path):
    """setup.py's C++ modules are optional: a compile error is reported and the install goes on
    with the reference. The earlier build's module must not stay behind then (in the build tree,
    from where it would be copied into the package, or in the package itself for in-place builds),
    or a rebuild after a broken edit would silently go on testing the old kernels. Here the
    compiler is `false`, so both modules fail at once, into a scratch build tree that holds stale
    copies of both."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    stale = [tmp_path / "lib" / "moe_ops" / (name + suffix) for name in ("_cpu", "_autograd")]
    for path in stale:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"an earlier build")
    env = dict(os.environ, CXX="false", CC="false", MAX_JOBS="1")
    r = subprocess.run([sys.executable, "setup.py", "build_ext", "--build-lib", str(tmp_path / "lib"),
                        "--build-temp", str(tmp_path / "temp")],
                       capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for name in ("_cpu", "_autograd"):
        assert f"moe_ops: WARNING: moe_ops.{name} was not built" in r.stderr, r.stderr[-3000:]
    assert [p.exists() for p in stale] == [False, False], r.stderr[-3000:]
    assert r.stderr.count("an earlier build of a module that did not build now") == 2


@pytest.mark.outside_cpp
def test_the_sdist_holds_every_file_the_cpp_modules_include(tmp_path, source_tree):
    """A source distribution builds the C++ modules: every file a source in it includes with
    #include "..." is in it too. (setuptools adds the extensions' .cpp files by itself, not their
    headers; from such an sdist the build failed and pip went on with the reference, the modules
    being optional.) The sdist is made from a copy of the tree, so nothing is written here."""
    import tarfile

    r = subprocess.run([sys.executable, "setup.py", "-q", "sdist", "--dist-dir", str(tmp_path / "dist")],
                       capture_output=True, text=True, timeout=300, cwd=source_tree)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (archive,) = (tmp_path / "dist").iterdir()
    with tarfile.open(archive) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
        sources = {name: tar.extractfile(f"{archive.name[:-len('.tar.gz')]}/{name}").read().decode()
                   for name in names if name.startswith("csrc/") and name.endswith((".cpp", ".h"))}
    assert {"csrc/cpu/grouped_mm.cpp", "csrc/autograd/grouped_mm_autograd.cpp"} <= set(sources), sorted(names)
    missing = []
    for name, text in sources.items():
        for included in re.findall(r'^#include "([^"]+)"', text, flags=re.M):
            path = os.path.normpath(os.path.join(os.path.dirname(name), included))
            if path not in names:
                missing.append(f"{name} includes {included}")
    assert not missing, missing


@pytest.mark.outside_cpp
def test_the_suite_collects_without_the_compiled_module():
    # Found on an H200 machine, where the extension is not built: parametrize arguments computed
    # at import time asked the missing extension and the whole run stopped at collection.
    code = (
        "import sys\n"
        "sys.modules['moe_ops._cpu'] = None\n"
        "import pytest\n"
        "sys.exit(pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', 'tests']))\n"
    )
    # The extension is missing on purpose here, so CI's demand for the cpu backend does not apply.
    env = {k: v for k, v in os.environ.items() if k != "MOE_OPS_REQUIRE_BACKENDS"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


@pytest.mark.outside_cpp
def test_require_backends_refuses_a_typo_and_a_backend_that_cannot_run():
    """MOE_OPS_REQUIRE_BACKENDS (tests/conftest.py, as CI sets it) stops the run at configure time
    when it names a backend this build does not know (a typo must not pass as "nothing
    required") or one that cannot run here (the tpu backend without jax)."""
    env = {k: v for k, v in os.environ.items() if k != "MOE_OPS_REQUIRE_BACKENDS"}
    collect = ("import sys, pytest\nsys.exit(pytest.main(['--collect-only', '-q', '-p', "
               "'no:cacheprovider', 'tests/test_example.py']))\n")
    no_jax = "import sys; sys.modules['jax'] = None\n"
    for required, prelude, message in (("cpu,cdua", "", "cdua (unknown)"),
                                       ("tpu", no_jax, "tpu (jax not installed")):
        r = subprocess.run([sys.executable, "-c", prelude + collect], capture_output=True,
                           text=True, timeout=300, cwd=REPO,
                           env=dict(env, MOE_OPS_REQUIRE_BACKENDS=required))
        output = r.stdout[-2000:] + r.stderr[-2000:]
        assert r.returncode == pytest.ExitCode.USAGE_ERROR, (required, output)
        assert message in r.stderr, (required, r.stderr[-2000:])


@pytest.mark.parametrize("extra", [[], ["--huge-page-weights", "--modes", "fwd,wgrad"]], ids=["plain", "huge-page-weights"])
@pytest.mark.outside_cpp
def test_benchmark_smoke(tmp_path, extra):
    r = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "bench.py"), "--quick", "--devices", "cpu",
                        "--dtypes", "bf16", "--out-dir", str(tmp_path), "--no-plot", *extra],
                       capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads((tmp_path / "cpu.json").read_text())
    assert data["results"], "no results"
    for row in data["results"]:
        op = row["peers"]["moe_ops"]
        assert "median_ms" in op and op["kernel"].startswith("cpu:"), row
        assert "median_ms" in row["peers"]["dense torch.mm"]
        # the weights (not wgrad's activations) are offered to cpu_huge_pages, which reports bytes moved
        assert ("weights_in_huge_pages_bytes" in row) == (bool(extra) and row["mode"] != "wgrad"), row
    assert ("expert weights moved into huge pages" in data["meta"]["device"]) == bool(extra)


def _smaps_field(lo: int, hi: int, field: str) -> int:
    """Bytes of `field` (e.g. AnonHugePages) of the mappings of this process inside [lo, hi)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                a, b = (int(x, 16) for x in head.split("-"))
                inside = lo <= a and b <= hi
            elif inside and head == field + ":":
                total += int(line.split()[1]) << 10
    return total


def test_cpu_huge_pages_moves_weights_in_place():
    """moe_ops.cpu_huge_pages: values, addresses and results unchanged; what it reports as moved
    is the huge-page-aligned part of each storage and is in huge pages afterwards (per /proc).
    The weights live in a private mapping of their own, 4 KiB past its start and before its end,
    so that the aligned part becomes a mapping of its own that /proc can show (in a process that
    has run other tests, torch's memory may share a mapping with memory already in huge pages)."""
    import mmap

    from moe_ops.backends import cpu as cpu_backend

    huge = cpu_backend._huge_page_bytes()
    G, K, N = 3, 512, 2048  # 12 MiB of fp32: at least five aligned 2 MiB pages inside
    region = mmap.mmap(-1, G * K * N * 4 + 2 * 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    w = torch.frombuffer(region, dtype=torch.float32, offset=4096, count=G * K * N).view(G, K, N)
    w.copy_(torch.randn(G, K, N))
    ref, ptr = w.clone(), w.data_ptr()
    x, offs = torch.randn(40, K), torch.tensor([10, 30, 40], dtype=torch.int32)
    before = moe_ops.grouped_mm(x, w, offs)
    start, size = w.untyped_storage().data_ptr(), w.untyped_storage().nbytes()
    lo, hi = -(-start // huge) * huge, (start + size) // huge * huge
    # One storage, counted once; the small tensor in front has no whole huge page to move.
    moved = moe_ops.cpu_huge_pages(torch.randn(1000), w, w[1], w.transpose(1, 2))
    # Read at once: after MADV_HUGEPAGE alone, khugepaged may collapse the range too, ~0.5 s later.
    in_huge = _smaps_field(lo, hi, "AnonHugePages") if moved else 0
    assert moved in (0, hi - lo), (moved, hi - lo)
    assert in_huge == moved
    # Another storage over the same memory (4 KiB further in) adds no page twice: the count
    # is of memory, not of storages.
    w2 = torch.frombuffer(region, dtype=torch.float32, offset=8192, count=G * K * N - 1024)
    again = moe_ops.cpu_huge_pages(w, w2)
    assert again in (0, hi - lo), (again, hi - lo)
    assert torch.equal(w, ref) and w.data_ptr() == ptr
    assert torch.equal(moe_ops.grouped_mm(x, w, offs), before)
    if sys.platform.startswith("linux") and tuple(int(v) for v in re.findall(r"\d+", os.uname().release)[:2]) >= (6, 1):
        thp = cpu_backend.thp_mode()
        assert thp in ("always", "madvise", "never"), thp
        assert moved or thp == "never", f"nothing moved into huge pages (THP: {thp})"
    small = torch.randn(1000)
    assert moe_ops.cpu_huge_pages(small) == 0 and moe_ops.cpu_huge_pages() == 0
    with pytest.raises(TypeError):
        moe_ops.cpu_huge_pages(w, "weights")
    with pytest.raises(ValueError, match="CPU tensors"):
        moe_ops.cpu_huge_pages(torch.empty(4 << 20, device="meta"))
    del w, w2, ref, before
    gc.collect()
    region.close()


@pytest.mark.outside_cpp
def test_benchmarks_say_how_tensors_are_paged(monkeypatch):
    """bench.py and decode.py report whether torch's large CPU tensors (the expert weights) are in
    huge pages: Linux's THP mode, and torch's THP_MEM_ALLOC_ENABLE where the mode is madvise."""
    from moe_ops.backends.cpu import thp_mode

    mode = thp_mode()
    if not mode:
        pytest.skip("no transparent huge pages here (not Linux)")
    monkeypatch.syspath_prepend(os.path.join(REPO, "benchmarks"))
    import devices

    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")
    on = devices.tensor_pages()
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    off = devices.tensor_pages()
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE")
    unset = devices.tensor_pages()
    if mode == "always":
        assert on == off == unset == "tensors in huge pages (THP always)"
    elif mode == "madvise":
        assert on == "tensors in huge pages (THP_MEM_ALLOC_ENABLE=1)"
        assert off == "tensors in 4 KiB pages (THP madvise, THP_MEM_ALLOC_ENABLE=0)"
        assert unset == "tensors in 4 KiB pages (THP madvise, THP_MEM_ALLOC_ENABLE unset)"
    else:
        assert on.startswith("tensors in 4 KiB pages") and unset.startswith("tensors in 4 KiB pages")
    assert unset in devices.Cpu(None).describe()


@pytest.mark.outside_cpp
def test_schemes_benchmark_smoke(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "schemes.py"), "--shapes", "quick",
                        "--rounds", "1", "--flush-mib", "1", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    if torch.ops.moe_cpu.machine() != "avx512_bf16":
        assert "nothing to compare" in r.stdout and not (tmp_path / "schemes.json").exists()
        return
    rows = json.loads((tmp_path / "schemes.json").read_text())["results"]
    assert [row["shape"] for row in rows] == ["quick G4", "quick G32"]
    for row in rows:
        assert set(row["median_ms"]) == {"dense torch.mm", "direct", "swapped", "swapped512"}
        assert set(row["over_direct"]) == {"swapped", "swapped512"} and min(row["over_direct"].values()) > 0


@pytest.mark.outside_cpp
def test_decode_and_host_overhead_benchmarks_smoke(tmp_path):
    """benchmarks/decode.py (small weights, two rounds: every peer's result is checked against
    the loop of torch.mm before it is timed) and benchmarks/host_overhead.py run and write their
    JSON; no timing assertions."""
    r = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "decode.py"), "--weight-budget-mib", "4",
                        "--rounds", "2", "--threads", "2", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads((tmp_path / "decode.json").read_text())["results"]
    assert len(rows) == 20  # 5 models x 2 weight layouts x 2 dtypes
    for row in rows:  # torch._grouped_mm refuses some of the scaled shapes (16-byte strides)
        assert set(row["us"]) | set(row["not_run"]) == {"moe_ops", "torch._grouped_mm", "loop of torch.mm"}
        assert "moe_ops" in row["us"] and "loop of torch.mm" in row["us"], row
    r = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "host_overhead.py"), "--rounds", "2",
                        "--calls", "5", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    timed = json.loads((tmp_path / "host_overhead.json").read_text())["us_per_call"]
    assert len(timed) == 6 and all("torch._grouped_mm" in row for row in timed.values())


@pytest.mark.outside_cpp
def test_decode_benchmark_refuses_to_time_a_nan_result(monkeypatch):
    """decode.py checks every peer against the loop of torch.mm before timing it; a NaN result
    fails that check (it once passed: NaN > tolerance is False). fp32, G=4, 16 routed rows."""
    monkeypatch.syspath_prepend(os.path.join(REPO, "benchmarks"))
    import decode

    monkeypatch.setitem(decode.PEERS, "moe_ops",
                        lambda a, b, offs: torch.full((a.shape[0], b.shape[2]), float("nan")))
    with pytest.raises(RuntimeError, match="moe_ops differs"):
        decode.bench_model("tiny", 4, 2, 64, 64, torch.float32, 8, 1, 1 << 20, "gkn")


def test_env_values_the_cpu_module_would_misread_are_reported():
    """MOE_OPS_CPU_ISA and MOE_OPS_CPU_CACHE_MB are read by the C++ module, which ignores an
    unknown instruction set (no cap) and reads a cache size with atoll ("1g" is 1 MiB, "abc" 0:
    the cache off); _load() logs each of these once instead of the silence there was."""
    from moe_ops.backends.cpu import env_problems

    assert env_problems({}) == []
    for good in ("generic", "avx2", "avx512", "avx512_bf16", "amx"):
        assert env_problems({"MOE_OPS_CPU_ISA": good}) == []
    for good in ("0", "512", " 64 "):
        assert env_problems({"MOE_OPS_CPU_CACHE_MB": good}) == []
    for bad in ("AVX2", "avx512bf16", ""):
        (msg,) = env_problems({"MOE_OPS_CPU_ISA": bad})
        assert "not capped" in msg
    for bad, reads in (("abc", "0 (the output cache off)"), ("1g", "1"), ("-5", "0 (the output"),
                       ("\u00b2", "0 (the"), (" ", "0 (the output cache off)")):
        (msg,) = env_problems({"MOE_OPS_CPU_CACHE_MB": bad})
        assert "reads as " + reads in msg, (bad, msg)
    # ... and logged as a warning once the module loads (a fresh process: read once).
    code = ("import torch, moe_ops\n"
            "moe_ops.grouped_mm(torch.randn(2, 3), torch.randn(1, 3, 4), torch.tensor([2]))\n")
    env = dict(os.environ, MOE_OPS_CPU_ISA="AVX2", MOE_OPS_CPU_CACHE_MB="1g")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       cwd=REPO, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("not capped") == 1 and r.stderr.count("it reads as 1") == 1, r.stderr


@pytest.mark.outside_cpp
def test_benchmark_targets_compare_with_grouped_mm_on_every_shape(monkeypatch):
    """bench.py's targets: the ratio targets for issue #6's shapes, and "never slower than
    torch._grouped_mm" over every case, the models' ones too (it once looked at the issue's
    shapes only). Made-up rows: medians in ms."""
    monkeypatch.syspath_prepend(os.path.join(REPO, "benchmarks"))
    import bench

    def row(source, shape, G, ours, gmm, dense=1.0):
        peers = {bench.DENSE: {"median_ms": dense, "p25_ms": 0.9 * dense, "p75_ms": 1.25 * dense},
                 bench.OP: {"median_ms": ours, "ratio": ours / dense, "p25_ms": ours,
                            "p75_ms": ours},
                 bench.GROUPED_MM: {"median_ms": gmm, "ratio": gmm / dense}}
        return dict(source=source, shape=shape, G=G, mode="fwd", dtype="bf16", peers=peers)

    text = bench.targets([row("issue #6", "G64 M2048 K512 N512", 64, 1.2, 2.0),
                          row("models", "OLMoE /2", 64, 1.5, 1.4)])
    assert "target <= 1.30: met" in text and "OLMoE" not in text.splitlines()[0]
    assert "(p25-p75 x1.20-x1.20; dense's own x0.90-x1.25)" in text.splitlines()[0]  # the host's steadiness
    assert text.splitlines()[-1] == ("never slower than torch._grouped_mm: 1 of 2 cases; "
                                     "SLOWER on OLMoE /2 fwd bf16")


@pytest.mark.outside_cpp
def test_benchmark_memory_floor():
    """The floor is bytes of the G expert matrices / bandwidth, over the dense time, at least 1."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        import bench
    finally:
        sys.path.pop(0)
    row = {"G": 2, "K": 1024, "N": 1024, "dtype": "bf16", "mode": "fwd",
           "peers": {"dense torch.mm": {"median_ms": 0.25}}}
    assert bench.expert_bytes(row) == 4 << 20
    assert bench.expert_bytes({**row, "dtype": "fp32"}) == 8 << 20
    assert bench.floor_ratio(row, 4.194304) == pytest.approx(4.0)  # 4 MiB at 4.19 GB/s: 1 ms
    assert bench.floor_ratio(row, 2.097152) == pytest.approx(8.0)
    assert bench.floor_ratio({**row, "peers": {"dense torch.mm": {"median_ms": 5.0}}}, 4.194304) == 1.0
    # Only that a rate comes back: no lower bound, which is a timing assertion (a reviewer's
    # run under a load of 5.5 took 8-12 ms for 1 MiB, under the 0.1 GB/s this test once asked).
    assert 0 < bench.warm_bandwidth(1 << 20, write=False) < 1e4
    assert 0 < bench.warm_bandwidth(1 << 20, write=True) < 1e4
    # The per-round probe reads (or writes) the next of its buffers at every call, through more
    # than COLD_BYTES in all, so that no pass finds its buffer in the L3 of a machine of this class.
    probe = bench.MemoryProbe(64 << 20, write=True)
    assert len(probe.buffers) * (64 << 20) >= bench.COLD_BYTES and len(probe.buffers) >= 4
    rates = [probe() for _ in range(len(probe.buffers) + 1)]
    assert all(0 < x < 1e4 for x in rates)
    assert all(float(b[0]) == float(b[-1]) == 2.0 for b in probe.buffers)  # each was written
    assert len(bench.MemoryProbe(1 << 20, write=False, cold=False).buffers) == 1


@pytest.mark.outside_cpp
def test_benchmark_summary_is_the_median_and_flops_are_2mkn(monkeypatch):
    """bench.summarize: the published time is the median of the rounds (not their mean or best),
    p25 <= median <= p75 within the rounds, and GFLOP/s is 2*M*K*N over the median, the same count for every mode
    (fwd, dgrad, wgrad all multiply M x K by K x N, or K x M by M x N). Seconds made up."""
    monkeypatch.syspath_prepend(os.path.join(REPO, "benchmarks"))
    import bench
    from cases import Shape, flops

    shape = Shape("t", 2, 64, 32, 16, "test")
    assert flops(shape) == 2 * 64 * 32 * 16
    s = bench.summarize([0.004, 0.001, 0.002, 0.010, 0.003], flops(shape))
    assert (s["median_ms"], s["min_ms"], s["max_ms"], s["rounds"]) == (3.0, 1.0, 10.0, 5)
    assert s["p25_ms"] < s["median_ms"] < s["p75_ms"]
    assert s["gflops"] == pytest.approx(2 * 64 * 32 * 16 / 0.003 / 1e9)
    # Slow peers get few rounds: their quartiles lie between their fastest and slowest round.
    for secs, p25, p75 in (([0.001, 0.002], 1.25, 1.75), ([0.003, 0.001, 0.002], 1.5, 2.5), ([0.005], 5.0, 5.0)):
        s = bench.summarize(secs, flops(shape))
        assert (s["p25_ms"], s["p75_ms"]) == (pytest.approx(p25), pytest.approx(p75)), secs


@pytest.mark.outside_cpp
def test_benchmark_group_sizes_are_dirichlet_and_fresh_per_peer_and_call(monkeypatch):
    """cases.dirichlet_offs: [G] int32 ends of a split of all M rows, uneven as Dirichlet(1) is
    (each expert's share is Beta(1, G-1): about 22% of the experts get under a quarter of the
    mean; an even split or a concentrated Dirichlet(10) gives none). bench._fresh_offs: before
    every call each peer gets a draw of its own (one per (peer, call)), written into the offs
    that the peers read. G=256, M=4096; fp32 fwd tensors of G=4, M=64, K=8, N=8."""
    monkeypatch.syspath_prepend(os.path.join(REPO, "benchmarks"))
    import bench
    from cases import Shape, dirichlet_offs, make_tensors

    offs = dirichlet_offs(256, 4096, seed=0)
    assert offs.dtype == torch.int32 and offs.shape == (256,) and int(offs[-1]) == 4096
    sizes = torch.diff(offs.long(), prepend=offs.new_zeros(1).long())
    assert int(sizes.min()) >= 0
    assert 0.1 < float((sizes < 4096 / 256 / 4).double().mean()) < 0.35
    assert not torch.equal(offs, dirichlet_offs(256, 4096, seed=1))

    shape = Shape("t", 4, 64, 8, 8, "test")
    t = make_tensors(shape, "fwd", torch.float32, "cpu")
    before = bench._fresh_offs(t, shape, ["p", "q"])
    seen = []
    for peer, call in (("p", 0), ("p", 1), ("q", 0), ("q", 1)):
        before(peer, call)
        assert int(t.offs[-1]) == 64 and t.offs.dtype == torch.int32
        seen.append(tuple(t.offs.tolist()))
    assert len(set(seen)) == 4, seen


@pytest.mark.outside_cpp
def test_benchmark_rounds_interleave_the_peers(monkeypatch):
    """bench.run_case: one untimed-order warm-up call per peer, then every round calls every
    peer once in an order of its own (seeded), with before(peer, call) run just before each
    call (call 0: the warm-up), and after_round() after each round; each peer gets one time per
    round, the warm-up not among them.
    Peers that do nothing, so none is slow."""
    monkeypatch.syspath_prepend(os.path.join(REPO, "benchmarks"))
    import bench

    log = []
    # No dense roofline among them: then no peer counts as slow (3 rounds only), whatever the load.
    fns = {n: (lambda n=n: log.append(("call", n))) for n in ("o", "p", "q", "r")}
    times = bench.run_case(fns, lambda: None, 0.0, 6, 6, before=lambda n, c: log.append((n, c)),
                           after_round=lambda: log.append(("round", None)))
    assert {n: len(s) for n, s in times.items()} == dict.fromkeys(fns, 6)
    # after_round once after each timed round's last call (not after the warm-up calls).
    assert [i for i, e in enumerate(log) if e[0] == "round"] == [8 * (r + 2) + r for r in range(6)]
    log[:] = [e for e in log if e[0] != "round"]
    assert len(log) == 2 * 4 * 7
    befores, calls = log[0::2], log[1::2]
    assert all(c == ("call", n) for (n, _), c in zip(befores, calls))
    for n in fns:  # calls 0 (warm-up) to 6, in order
        assert [c for m, c in befores if m == n] == list(range(7))
    orders = {tuple(n for n, _ in befores[4 * i:4 * i + 4]) for i in range(1, 7)}
    assert len(orders) > 1, orders


@pytest.mark.outside_cpp
@pytest.mark.parametrize("mode", ["fwd", "dgrad", "wgrad"])
def test_benchmark_peers_compute_the_case_and_the_roofline_has_its_shape(monkeypatch, mode):
    """Every peer of cases/peers computes the case's result (checked with bench._check against
    moe_ops' reference), the weights have the mode's layout (fwd: k-contiguous [G, K, N] views
    of [G, N, K]; dgrad: n-contiguous), and the dense roofline is one matmul of the same M, K, N
    whose right operand has one expert's layout; the fp32 roofline of a bf16 case runs in fp32.
    G=4, M=64, K=24, N=40, fp32 and bf16 (padded by the Dirichlet draw: some groups empty)."""
    monkeypatch.syspath_prepend(os.path.join(REPO, "benchmarks"))
    import bench
    from cases import Shape, make_tensors
    from peers import DENSE, DENSE_FP32, JAX, REFERENCE, ROOFLINES, peers

    G, M, K, N = 4, 64, 24, 40
    for dtype in (torch.float32, torch.bfloat16):
        t = make_tensors(Shape("t", G, M, K, N, "test"), mode, dtype, "cpu")
        if mode == "wgrad":
            assert t.a.shape == (M, K) and t.b.shape == t.dense_b.shape == (M, N)
        else:
            assert t.b.shape == (G, K, N) and t.dense_b.shape == (K, N)
            assert t.b.stride(1 if mode == "fwd" else 2) == 1
            assert t.dense_b.stride() == t.b[0].stride()
        ps = peers(t, torch.device("cpu"))
        ref = ps[REFERENCE][0]()
        for name, (fn, note) in ps.items():
            if name in ROOFLINES or name == JAX:
                continue
            assert bench._check(fn(), ref, dtype) == "", name
        dense = ps[DENSE][0]()
        assert dense.dtype == dtype and dense.shape == ((K, N) if mode == "wgrad" else (M, N))
        if dtype == torch.bfloat16:
            assert ps[DENSE_FP32][0]().dtype == torch.float32


@pytest.mark.outside_cpp
def test_benchmark_check_refuses_wrong_results(monkeypatch):
    """bench._check: a shape mismatch, NaN, and an error of 1% (fp32) or 5% (bf16) of the largest
    output are all refused; a result within the tolerance passes. [8, 16] fp32 made up."""
    monkeypatch.syspath_prepend(os.path.join(REPO, "benchmarks"))
    import bench
    ref = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    assert bench._check(ref * (1 + 1e-6), ref, torch.float32) == ""
    assert bench._check(ref.bfloat16(), ref, torch.bfloat16) == ""
    assert bench._check(ref * 1.01, ref, torch.float32).startswith("MISMATCH")
    assert bench._check(ref * 1.05, ref, torch.bfloat16).startswith("MISMATCH")
    assert bench._check(ref[:4], ref, torch.float32).startswith("MISMATCH: shape")
    nan = ref.clone()
    nan[3, 3] = float("nan")
    assert bench._check(nan, ref, torch.float32).startswith("MISMATCH")


@pytest.mark.outside_cpp
def test_benchmark_case_rows_publish_ratios_to_the_dense_median(monkeypatch):
    """bench.bench_device on two tiny shapes (G=4 and G=8, M=64, K=32, N=48; fp32 and bf16; fwd
    and wgrad; fresh group sizes): a peer whose result is wrong (twice the right one, or NaN)
    is not timed and says MISMATCH; every timed peer's ratio is its median over the bf16 (the
    case's own dtype) dense median, GFLOP/s is 2*M*K*N over its median, every CPU peer of the
    suite is timed, and --threads is applied. No timing assertions."""
    monkeypatch.syspath_prepend(os.path.join(REPO, "benchmarks"))
    import argparse

    import bench
    import peers as peers_mod
    from cases import Shape

    real = bench.peers

    def with_wrong_ones(t, device, with_jax=False):
        out = real(t, device, with_jax)
        ref = out[peers_mod.REFERENCE][0]
        out["twice"] = (lambda: 2 * ref(), "")
        out["nan"] = (lambda: ref() * float("nan"), "")
        return out

    monkeypatch.setattr(bench, "peers", with_wrong_ones)
    threads = torch.get_num_threads()
    try:
        (dev, ok, _), = bench.pick(["cpu"], 1)
        assert ok and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    args = argparse.Namespace(budget=0.0, min_reps=2, max_reps=2, group_sizes="fresh",
                              max_call_s=60.0, huge_page_weights=False, with_jax=False, quick=False)
    shapes = [Shape("a", 4, 64, 32, 48, "test"), Shape("b", 8, 64, 32, 48, "test")]
    rows = bench.bench_device(dev, shapes, ["fwd", "wgrad"], ["fp32", "bf16"], args)
    assert len(rows) == 8
    for row in rows:
        ps = row["peers"]
        assert ps["twice"]["note"].startswith("MISMATCH") and "median_ms" not in ps["twice"]
        assert ps["nan"]["note"].startswith("MISMATCH") and "median_ms" not in ps["nan"]
        for name in (bench.OP, bench.REFERENCE, peers_mod.LOOP, peers_mod.PADDED):
            assert "median_ms" in ps[name], (name, ps[name])
        assert ps[bench.OP]["kernel"].startswith("cpu:")
        assert len(row["bandwidth_rounds_gbs"]) == 2  # the memory probe after each of the 2 rounds
        dense = ps[bench.DENSE]["median_ms"]
        assert ps[bench.DENSE]["ratio"] == 1.0
        assert (bench.DENSE_FP32 in ps) == (row["dtype"] == "bf16")
        fl = 2 * row["M"] * row["K"] * row["N"]
        for name, p in ps.items():
            if "median_ms" in p:
                assert p["ratio"] == pytest.approx(p["median_ms"] / dense), name
                assert p["gflops"] == pytest.approx(fl / p["median_ms"] / 1e6), name


@pytest.mark.outside_cpp
def test_benchmark_targets_at_the_boundaries(monkeypatch):
    """bench.targets on made-up rows (medians in ms, dense 1 ms): a ratio equal to the target
    meets it; the weight gradient is held to WGRAD_TARGET whatever G; a tie with
    torch._grouped_mm is not slower; and a case in which moe_ops was not timed (its result
    failed the check) is a MISSED target and counts against "never slower" instead of
    vanishing from both."""
    monkeypatch.syspath_prepend(os.path.join(REPO, "benchmarks"))
    import bench

    def row(shape, G, mode, ours, gmm):
        op = ({"note": "MISMATCH: max error 1.00e+00 of the largest output"} if ours is None else
              {"median_ms": ours, "ratio": ours, "p25_ms": ours, "p75_ms": ours})
        peers = {bench.DENSE: {"median_ms": 1.0}, bench.OP: op,
                 bench.GROUPED_MM: {"median_ms": gmm, "ratio": gmm}}
        return dict(source="issue #6", shape=shape, G=G, mode=mode, dtype="bf16", peers=peers)

    lines = bench.targets([row("G64", 64, "fwd", bench.TARGETS[64], bench.TARGETS[64]),
                           row("G8", 8, "wgrad", 1.2, 2.0),
                           row("G256", 256, "fwd", None, 2.0)]).splitlines()
    assert lines[0].startswith("G64") and lines[0].endswith("target <= 1.30: met; "
                                                           "torch._grouped_mm x1.30 (faster)")
    assert lines[1].startswith("G8") and "target <= 1.30: met" in lines[1]
    assert lines[2].startswith("G256") and "MISSED" in lines[2] and "MISMATCH" in lines[2]
    assert lines[3].startswith("never slower than torch._grouped_mm: 2 of 3 cases")
    assert "G256 fwd bf16" in lines[3]


@pytest.mark.outside_cpp
def test_benchmark_report_table_and_json(monkeypatch, tmp_path):
    """report.table: the dense roofline's cell is its median and GFLOP/s, every other peer's its
    ratio and median (plain and markdown); report.write_json keeps every row. One made-up row."""
    monkeypatch.syspath_prepend(os.path.join(REPO, "benchmarks"))
    import report
    from peers import DENSE, GROUPED_MM, OP

    row = dict(shape="s", mode="fwd", dtype="bf16",
               peers={DENSE: {"median_ms": 2.0, "gflops": 50.0, "ratio": 1.0},
                      OP: {"median_ms": 3.0, "ratio": 1.5},
                      GROUPED_MM: {"note": "not here"}})
    for md in (False, True):
        text = report.table([row, {**row, "shape": "t"}], markdown=md)
        assert "2.00 ms (50 GFLOP/s)" in text and "x1.50 (3.00 ms)" in text
        assert GROUPED_MM not in text
    report.write_json(str(tmp_path / "r.json"), {"k": 1}, [row, {**row, "shape": "t"}])
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["meta"] == {"k": 1} and [r["shape"] for r in data["results"]] == ["s", "t"]


@pytest.mark.outside_cpp
def test_benchmark_plot_draws_ratios(monkeypatch, tmp_path):
    """report.bars, what report.plot draws: one panel per (mode, dtype), forward first; per peer
    but the dense roofline, its ratio to the dense median per shape (NaN where it did not run),
    not its time. Made-up rows; the plot itself is drawn where matplotlib is installed."""
    monkeypatch.syspath_prepend(os.path.join(REPO, "benchmarks"))
    import importlib.util
    import math

    import report
    from peers import DENSE, GROUPED_MM, OP

    def row(shape, mode, ours, gmm):
        peers = {DENSE: {"median_ms": 2.0, "ratio": 1.0}, OP: {"median_ms": 2.0 * ours, "ratio": ours},
                 GROUPED_MM: {"median_ms": 2.0 * gmm, "ratio": gmm} if gmm else {"note": "refused"}}
        return dict(shape=shape, mode=mode, dtype="bf16", peers=peers)

    rows = [row("s", "wgrad", 1.5, 3.0), row("s", "fwd", 1.2, None), row("t", "fwd", 1.1, 2.0)]
    panels, peers = report.bars(rows)
    assert peers == [p for p in (OP, GROUPED_MM) if p in peers] and set(peers) == {OP, GROUPED_MM}
    assert list(panels) == [("fwd", "bf16"), ("wgrad", "bf16")]
    shapes, heights = panels[("fwd", "bf16")]
    assert shapes == ["s", "t"] and heights[OP] == [1.2, 1.1]
    assert math.isnan(heights[GROUPED_MM][0]) and heights[GROUPED_MM][1] == 2.0
    assert panels[("wgrad", "bf16")][1] == {OP: [1.5], GROUPED_MM: [3.0]}
    if importlib.util.find_spec("matplotlib") is not None:  # (benchmarks/requirements.txt)
        assert report.plot(str(tmp_path / "p.png"), rows, "title") == ""
        assert (tmp_path / "p.png").stat().st_size > 0


@pytest.mark.outside_cpp
def test_benchmark_model_shapes_fit_the_budget(monkeypatch):
    """cases.model_shapes: M is tokens x top-k; hidden and ffn are divided by the smallest power
    of two that fits the G bf16 expert matrices into the budget (here 8 MiB, 64 tokens)."""
    monkeypatch.syspath_prepend(os.path.join(REPO, "benchmarks"))
    from cases import MODELS, model_shapes
    shapes = model_shapes(64, 8 << 20)
    assert len(shapes) == len(MODELS)
    for s, (name, G, top_k, hidden, ffn) in zip(shapes, MODELS):
        div = int(s.name.split(" /")[1]) if " /" in s.name else 1
        assert s.name.startswith(name) and div & (div - 1) == 0
        assert (s.G, s.M, s.K, s.N) == (G, 64 * top_k, hidden // div, ffn // div)
        assert G * s.K * s.N * 2 <= 8 << 20
        assert div == 1 or G * (hidden // (div // 2)) * (ffn // (div // 2)) * 2 > 8 << 20


@pytest.mark.outside_cpp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_benchmark_jax_peer_computes_in_the_case_dtype(monkeypatch, dtype):
    """The --with-jax peer (jax.lax.ragged_dot on XLA:CPU) of a 16-bit case computes in that
    dtype: its result passes the check and is representable in it (an fp16 case once ran in
    float32, timed beside the fp16 peers). fwd, G=4, M=64, K=32, N=48."""
    jax = pytest.importorskip("jax")
    if jax.default_backend() != "cpu":
        pytest.skip(f"jax's backend here is {jax.default_backend()}, not cpu")
    monkeypatch.syspath_prepend(os.path.join(REPO, "benchmarks"))
    import bench
    from cases import Shape, make_tensors
    from peers import JAX, REFERENCE, peers

    t = make_tensors(Shape("t", 4, 64, 32, 48, "test"), "fwd", dtype, "cpu")
    ps = peers(t, torch.device("cpu"), with_jax=True)
    out = ps[JAX][0]()
    assert bench._check(out, ps[REFERENCE][0](), dtype) == ""
    assert torch.equal(out.to(dtype).float(), out)


def _resident_mib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS"))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux's /proc/self/status")
@pytest.mark.parametrize("level", machine_levels(("avx2", "avx512")))
def test_a_long_weight_gradient_leaves_no_scratch_behind(level):
    """A 2Dx2D call over K = 2^20 tokens packs ~256 bytes per token in each thread's scratch
    (256 MiB): handed back at the end of the call, not kept for the threads' life (stride-0
    operands: the call itself holds no memory). The result is the sum over K in fp32."""
    K = 1 << 20
    a, b = torch.full((1, 1), 0.5).expand(1, K), torch.full((1, 1), 0.25).expand(K, 1)
    before = _resident_mib()
    out = run((a, b, torch.tensor([K]), None, None), level)
    assert _resident_mib() - before < 64, f"{_resident_mib() - before} MiB kept after the call"
    assert out.item() == K / 8  # exact: 2^17, every partial sum a multiple of 1/8 below 2^24


class _Clock:
    """A test's clock for the benchmark scripts: time moves only when a wrapped peer runs, by the
    cost that the test gives that call, so medians and units are exact."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.mark.outside_cpp
def test_decode_benchmark_rows_are_what_they_say(monkeypatch):
    """decode.bench_model on fp32 weights, G=8, top-2, 2 tokens, K=N=64, 5 rounds, both layouts,
    with every peer wrapped: the check call comes first; each timed round routes anew and gives
    every peer the same routing, in alternating order; the [G, N, K] row passes k-contiguous
    weights and the [G, K, N] one n-contiguous; the weights read per call are the distinct
    experts' (4 bytes each); us, GB/s and the ratio to moe_ops are the medians of the calls'
    times (given here by the clock: 1, 2, 6, 1, 2 x the peer's factor)."""
    monkeypatch.syspath_prepend(os.path.join(REPO, "benchmarks"))
    import decode

    clock, seen = _Clock(), []
    factor = {"moe_ops": 1.0, "torch._grouped_mm": 2.0, "loop of torch.mm": 3.0}
    calls = dict.fromkeys(factor, 0)
    for peer, fn in list(decode.PEERS.items()):
        def wrapped(a, b, offs, peer=peer, fn=fn):
            calls[peer] += 1
            if calls[peer] > 1:  # the first call is the check, untimed
                seen.append((peer, offs.clone(), b.stride()))
                clock.t += factor[peer] * (1, 2, 6)[(calls[peer] - 2) % 3] * 1e-6
            return fn(a, b, offs)
        monkeypatch.setitem(decode.PEERS, peer, wrapped)
    for layout in ("gnk", "gkn"):
        seen.clear()
        calls.update(dict.fromkeys(factor, 0))
        row = decode.bench_model("tiny", 8, 2, 64, 64, torch.float32, 2, 5, 1 << 20, layout,
                                 clock=clock)
        assert row["not_run"] == {} and (row["K"], row["N"]) == (64, 64)
        names = list(factor)
        rounds = [seen[i:i + 3] for i in range(0, len(seen), 3)]
        assert len(rounds) == 5
        for r, calls_r in enumerate(rounds):
            assert [c[0] for c in calls_r] == (names if r % 2 == 0 else names[::-1])
            assert all(torch.equal(c[1], calls_r[0][1]) for c in calls_r)  # one routing per round
            assert all(c[2][1 if layout == "gnk" else 2] == 1 for c in calls_r)
        offs = [c[0][1] for c in rounds]
        assert any(not torch.equal(o, offs[0]) for o in offs)  # routed anew, not cache-warm
        distinct = [int((torch.diff(o, prepend=o.new_zeros(1)) > 0).sum()) for o in offs]
        assert all(2 <= d <= 4 for d in distinct) and all(int(o[-1]) == 4 for o in offs)
        read = sum(distinct) / len(distinct) * 64 * 64 * 4
        assert row["expert_bytes_per_call"] == pytest.approx(read)
        # Medians of (1, 2, 6, 1, 2) x factor: 2 x factor us.
        for peer, f in factor.items():
            assert row["us"][peer] == pytest.approx(2 * f)
            assert row["GB_per_s"][peer] == pytest.approx(read / (2 * f * 1e-6) / 1e9)
            assert row["vs_moe_ops"][peer] == pytest.approx(f)


@pytest.mark.outside_cpp
def test_decode_benchmark_scales_to_the_budget_and_refuses_a_wrong_result(monkeypatch):
    """decode.bench_model: a model over --weight-budget-mib (G=8, K=N=64 bf16: 64 KiB, budget
    16 KiB) is timed with hidden and ffn halved; an fp32 peer 1e-3 off the loop of torch.mm
    (beyond the 1e-4 of the check) is refused before anything is timed."""
    monkeypatch.syspath_prepend(os.path.join(REPO, "benchmarks"))
    import decode

    row = decode.bench_model("tiny", 8, 2, 64, 64, torch.bfloat16, 1, 1, 16 << 10, "gnk")
    assert (row["K"], row["N"], row["model"]) == (32, 32, "tiny /2")
    monkeypatch.setitem(decode.PEERS, "moe_ops",
                        lambda a, b, offs: decode._loop(a, b, offs) * (1 + 1e-3))
    with pytest.raises(RuntimeError, match="moe_ops differs"):
        decode.bench_model("tiny", 4, 2, 64, 64, torch.float32, 8, 1, 1 << 20, "gkn")


@pytest.mark.outside_cpp
def test_host_overhead_benchmark_rows_are_what_they_say():
    """host_overhead.measure with the implementations of _impls, each wrapped: the C++ row runs
    with the C++ Autograd kernel and the Python row with the Python one; the order alternates by
    round; each figure is the median over 3 rounds of the mean us per call (the clock gives each
    call 1, 2 or 6 us by round: 2 us); the kernel registered before is registered afterwards.
    _call's modes: no requires_grad, requires_grad, and both gradients. fp32, CPU."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        import host_overhead
    finally:
        sys.path.pop(0)
    from moe_ops import _op

    before = _op._Autograd.active
    clock, log = _Clock(), []

    def wrap(name, fn):
        def call(a, b, offs):
            n = sum(1 for entry in log if entry[0] == name)
            log.append((name, _op._Autograd.active))
            if n % 3:  # 1 warm-up + 2 timed calls per round; 3 rounds per problem and mode
                clock.t += (1, 2, 6)[(n // 3) % 3] * 1e-6
            return fn(a, b, offs=offs)
        return call

    impls = [(name, kind, wrap(name, fn)) for name, kind, fn in host_overhead._impls()]
    assert _op._Autograd.active == before
    res = host_overhead.measure(impls, 3, 2, clock=clock)
    assert _op._Autograd.active == before
    assert len(res) == 6
    for row in res.values():
        assert row == pytest.approx(dict.fromkeys(row, 2.0))
    for name, active in log:
        if "C++" in name:
            assert active == "cpp", name
        elif "Python" in name:
            assert active == "python", name
    order = [name for i, (name, _) in enumerate(log) if i % 3 == 0][:2 * len(impls)]
    names = [name for name, _, _ in impls]
    assert order == names + names[::-1]
    a, b, offs = host_overhead._inputs(2, 8, 16, 8, False)
    a_g, b_g, _ = host_overhead._inputs(2, 8, 16, 8, True)
    got = []

    def rec(x, w, offs):
        got.append((x.requires_grad, w.requires_grad))
        return torch._grouped_mm(x, w, offs=offs)

    for mode in host_overhead.MODES:
        out = host_overhead._call(rec, mode, a, b, offs, a_g, b_g)()
        if mode == "forward + backward":
            assert [g.shape for g in out] == [a.shape, b.shape]
    assert got == [(False, False), (True, True), (True, True)]


@pytest.mark.outside_cpp
def test_host_overhead_benchmark_prints_ratios_to_torch(tmp_path, capsys):
    """host_overhead.main (1 round of 1 call): each printed cell is the JSON's us per call and
    its ratio to torch._grouped_mm's (slower: > 1)."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        import host_overhead
    finally:
        sys.path.pop(0)
    assert host_overhead.main(["--rounds", "1", "--calls", "1", "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    timed = json.loads((tmp_path / "host_overhead.json").read_text())["us_per_call"]
    for key, row in timed.items():
        base = row["torch._grouped_mm"]
        line = next(line for line in text.splitlines() if line.startswith(f"| {key} |"))
        for name, us in row.items():
            cell = f"{us:.1f} us" + ("" if name == "torch._grouped_mm" else f" (x{us / base:.1f})")
            assert cell in line, (name, line)


@pytest.mark.outside_cpp
def test_schemes_benchmark_names_the_schemes_as_the_op_numbers_them(monkeypatch):
    """schemes.py labels each bf16_scheme number as these tests do (LEVELS: 0 direct, 1 swapped
    in 256-bit lanes, 2 in 512-bit lanes; test_bf16_scheme_follows_the_cpu_family_and_is_reported
    ties 1 and 2 to the lane widths the op reports): a swapped pair of labels would publish one
    scheme's times as the other's, with results that agree within the tolerance either way."""
    monkeypatch.syspath_prepend(os.path.join(REPO, "benchmarks"))
    import schemes

    assert schemes.SCHEMES == {"direct": LEVELS["avx512_bf16"][1], "swapped": LEVELS["avx512_bf16_swapped"][1],
                               "swapped512": LEVELS["avx512_bf16_swapped512"][1]}


@pytest.mark.outside_cpp
def test_schemes_benchmark_ratios(monkeypatch):
    """schemes.time_shape on "quick G4" (bf16, G=4, M=96, K=64, N=80), 2 rounds: each scheme's
    ratio to the dense roofline and each swapped scheme's time over the direct one's are the
    quotients of their medians (no timing assertions)."""
    if torch.ops.moe_cpu.machine() != "avx512_bf16":
        pytest.skip(f"the schemes exist only on avx512_bf16 (here: {torch.ops.moe_cpu.machine()})")
    monkeypatch.syspath_prepend(os.path.join(REPO, "benchmarks"))
    import schemes
    from cases import QUICK_SHAPES

    row = schemes.time_shape(QUICK_SHAPES[0], 2, None, False, 0)
    med = row["median_ms"]
    assert set(med) == {schemes.DENSE, *schemes.SCHEMES}
    assert row["ratio"] == {n: med[n] / med[schemes.DENSE] for n in schemes.SCHEMES}
    assert row["over_direct"] == {n: med[n] / med["direct"] for n in ("swapped", "swapped512")}

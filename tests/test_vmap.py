"""torch.vmap over the op: its batching rule (moe_ops/_batching.py).

Categories:
* property: random problems of every layout and dtype, a random subset of the arguments
  batched (mat_a, mat_b, offs, bias) at any position (either sign), per-sample partitions with
  empty groups and tails; NaN / inf in every element outside a sample's groups. Every sample of the
  result matches the float64 oracle of that sample within the shared tolerance, is exactly zero
  outside its groups, and the batch costs one call of the op where the rule folds it (else one
  per sample);
* offs values per sample: checked on CPU with the op's messages; a batch of size 0; autocast;
* jacrev / jacfwd / per-sample gradients are a few calls of the op, not one per basis vector;
* torch.compile over vmap, where offs cannot be read while tracing and are clamped instead.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import grad, jacfwd, jacrev, vmap

import moe_ops
from moe_ops.testing import assert_close
from oracle import magnitude, oracle
from strategies import Case, build, cases, check_exact_zeros, partitions, poison_outside_groups

pytestmark = pytest.mark.usefixtures("unwritten_outputs_are_nan")

ARGS = ("mat_a", "mat_b", "offs", "bias")


def folds(batched, layout) -> bool:
    """Whether the rule computes the batch in one call (see _batching.py)."""
    a, b = "mat_a" in batched, "mat_b" in batched
    if layout == "2d3d" and "offs" in batched:  # rows sorted by group; mat_a repeated
        return (a and "bias" not in batched) or b
    return (a and b) or ("offs" not in batched and ((a and "bias" not in batched) or b))


@st.composite
def batched_problems(draw):
    case = draw(cases(max_m=24, max_k=16, max_n=16, max_g=5, allow_big_g=False))
    present = [n for n, t in zip(ARGS, (1, 1, case.offs, case.bias or None)) if t is not None]
    batched = draw(st.sets(st.sampled_from(present), min_size=1))
    rank = {"mat_a": 2 if case.layout in ("2d3d", "2d2d") else 3, "mat_b": 3 if case.layout in ("2d3d", "3d3d") else 2,
            "offs": 1, "bias": 2}
    dims = {n: draw(st.integers(-rank[n] - 1, rank[n])) for n in batched}  # any position, either sign
    size = draw(st.integers(1, 3))
    offs = [draw(partitions(case.G, case.extent)) for _ in range(size)] if "offs" in batched else None
    return case, dims, size, offs


def _samples(case, dims, size, offs):
    """Per sample: (its case, its clean arguments, the arguments with NaN / inf outside its
    groups). Unbatched arguments are shared; the shared ones are poisoned only where every
    sample's groups leave them unused (offs unbatched)."""
    base = build(case)
    out = []
    for s in range(size):
        cs = replace(case, seed=case.seed + 1 + s, offs=offs[s] if offs else case.offs)
        own = build(cs)
        clean = [own[i] if n in dims else base[i] for i, n in enumerate(ARGS)]
        clean[2] = own[2]  # the sample's offs (the shared ones when offs is unbatched)
        poisoned = list(clean)
        if clean[2] is not None:
            pa, pb, pbias = poison_outside_groups(cs, clean[0], clean[1], clean[3], clean[2])
            for i, p in ((0, pa), (1, pb), (3, pbias)):
                if ARGS[i] in dims or "offs" not in dims:
                    poisoned[i] = p
        out.append((cs, clean, poisoned))
    return out


def check_batch(case, dims, size, offs):
    """vmap over one batch against the oracle of every sample, and its number of op calls."""
    samples = _samples(case, dims, size, offs)
    args = []
    for i, name in enumerate(ARGS):
        if name in dims:
            args.append(torch.stack([p[i] for _, _, p in samples], dims[name]))
        else:
            args.append(samples[0][2][i])
    in_dims = tuple(dims.get(n) if args[i] is not None else None for i, n in enumerate(ARGS))
    moe_ops.reset_kernel_counts()
    got = vmap(lambda a, b, o, c: moe_ops.grouped_mm(a, b, o, c, case.out_dtype), in_dims=in_dims)(*args)
    calls = sum(moe_ops.kernel_counts().values())
    want_calls = 1 if folds(dims, case.layout) else size
    assert calls == want_calls, f"{calls} calls for a batch of {size} ({sorted(dims)} batched)"
    for s, (cs, clean, _) in enumerate(samples):
        a, b, o, c = clean
        what = f"sample {s} of {case} with {dims} batched"
        assert_close(got[s], oracle(a, b, o, c, case.out_dtype), oracle(a, b, o, c, case.out_dtype, exact=False),
                     magnitude(a, b, o, c), what=what)
        check_exact_zeros(got[s], cs, o)


@settings(max_examples=max(60, settings().max_examples))
@given(problem=batched_problems())
def test_vmap_matches_the_oracle_per_sample(problem):
    check_batch(*problem)


def _every_batching():
    """Every layout with every non-empty subset of its arguments batched (at dim 0 or last)."""
    for layout, G, offs, bias in (("2d3d", 3, (2, 2, 5), True), ("2d2d", 3, (1, 1, 3), False),
                                  ("3d3d", 3, None, True), ("3d2d", 3, (0, 3, 4), False)):
        present = [n for n, t in zip(ARGS, (1, 1, offs, bias or None)) if t is not None]
        for mask in range(1, 2 ** len(present)):
            batched = [n for i, n in enumerate(present) if mask >> i & 1]
            yield pytest.param(layout, G, offs, bias, batched, id=f"{layout}-{'+'.join(batched)}")


@pytest.mark.parametrize("layout,G,offs,bias,batched", list(_every_batching()))
def test_every_batching_of_every_layout(layout, G, offs, bias, batched):
    """Each path of the rule with tails and empty groups in every sample but the last (whose
    tail ends the folded problem and would hide a missing one) and NaN / inf outside them."""
    case = Case(layout, G, 7, 5, 6, torch.float64, offs, torch.int64, "contiguous", "transposed", bias, None, 11)
    dims = {n: (0 if i % 2 == 0 else -1) for i, n in enumerate(batched)}
    rows = None
    if "offs" in batched:
        e = case.extent
        rows = [(1, 1, e - 2), (0, e - 1, e - 1), (2, 3, e)]
    check_batch(case, dims, 3, rows)


def _problem(layout, size=3, dtype=torch.float64):
    """A fixed batch: per-sample mat_a [size, ...], shared mat_b and offs (ragged layouts)."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    G, M, K, N = 3, 10, 6, 5
    return {
        "2d3d": (r(size, M, K), r(G, K, N), torch.tensor([2, 2, 7])),
        "2d2d": (r(size, M, K), r(K, N), torch.tensor([1, 1, 4])),
        "3d2d": (r(size, G, M, K), r(K, N), torch.tensor([0, 3, 4])),
    }[layout]


@pytest.mark.parametrize("layout", ["2d3d", "2d2d", "3d2d"])
def test_offs_values_are_checked_per_sample(layout):
    """CPU: each sample's offs are checked as the op checks them, with the sample's values in the
    message, whether the batch is folded (shared offs scaled, samples' offs shifted) or looped."""
    a, b, offs = _problem(layout)
    extent = {"2d3d": 10, "2d2d": 6, "3d2d": 5}[layout]
    bad = offs.clone()
    bad[1] = extent + 1
    with pytest.raises(ValueError, match=rf"offs\[1\] = {extent + 1} exceeds the extent {extent}\b"):
        vmap(lambda x: moe_ops.grouped_mm(x, b, bad))(a)
    rows = torch.stack([offs, bad])
    with pytest.raises(ValueError, match=rf"offs\[1\] = {extent + 1} exceeds the extent {extent} .*\(sample 1 "):
        vmap(lambda x, y, o: moe_ops.grouped_mm(x, y, o))(a[:2], torch.stack([b, b]), rows)  # folded
    with pytest.raises(ValueError, match=rf"offs\[1\] = {extent + 1} exceeds the extent {extent}\b"):
        vmap(lambda x, o: moe_ops.grouped_mm(x, b, o))(a[:2], rows)  # one call per sample


def test_vmap_over_meta_tensors():
    """Shapes only, as a call on meta tensors gives them: the rule asked autocast about device
    type "meta", which it does not know (RuntimeError). mat_a [3, 4, 3] batched, offs [2]."""
    a, b = torch.empty(3, 4, 3, device="meta"), torch.empty(2, 3, 2, device="meta")
    offs = torch.tensor([1, 3], device="meta")
    assert vmap(lambda x: moe_ops.grouped_mm(x, b, offs))(a).shape == (3, 4, 2)


@pytest.mark.parametrize("layout", ["2d3d", "2d2d", "3d2d"])
def test_empty_batch(layout):
    """A batch of size 0: the result's shape, and the checks of a call (devices, shared offs)."""
    a, b, offs = _problem(layout, size=0)
    want = moe_ops.grouped_mm(torch.zeros(a.shape[1:], dtype=a.dtype), b, offs).shape
    assert vmap(lambda x: moe_ops.grouped_mm(x, b, offs))(a).shape == (0, *want)
    bs = b.expand(0, *b.shape)
    assert vmap(lambda x, y: moe_ops.grouped_mm(x, y, offs))(a, bs).shape == (0, *want)
    with pytest.raises(ValueError, match="mat_b is on device meta but mat_a is on cpu"):
        vmap(lambda x: moe_ops.grouped_mm(x, b.to("meta"), offs))(a)
    with pytest.raises(ValueError, match="must be non-decreasing"):
        vmap(lambda x: moe_ops.grouped_mm(x, b, offs.flip(0)))(a)
    # Plain autograd: the empty result is connected to the inputs, as torch.mm's is under vmap
    # (the rule's fresh zeros were not, and backward raised), and their gradients are zeros.
    x, w = a.clone().requires_grad_(), b.clone().requires_grad_()
    vmap(lambda x: moe_ops.grouped_mm(x, w, offs))(x).sum().backward()
    assert x.grad.shape == x.shape and torch.count_nonzero(w.grad) == 0


@pytest.mark.parametrize("layout", ["2d3d", "2d2d", "3d2d"])
def test_gradients_through_a_folded_batch_ignore_the_tails(layout):
    """Both matrices batched (the rule lays the samples end to end, so a sample's tail meets the
    next sample's groups) and NaN past offs[-1] in each: the gradients of plain autograd through
    vmap are those of per-sample calls (finite, exact zeros in the tails), in one call each."""
    a, b, offs = _problem(layout, size=2)
    g = torch.Generator().manual_seed(1)
    b = torch.stack([b, torch.randn(b.shape, generator=g, dtype=b.dtype)])
    last = int(offs[-1])
    if layout == "2d3d":
        a[:, last:] = float("nan")
    elif layout == "3d2d":
        b[:, :, last:] = float("nan")
    else:
        a[:, :, last:] = float("nan")
        b[:, last:] = float("inf")

    def grads(f):
        x, w = a.clone().requires_grad_(), b.clone().requires_grad_()
        f(x, w).square().sum().backward()
        return x.grad, w.grad

    moe_ops.reset_kernel_counts()
    got = grads(lambda x, w: vmap(lambda p, q: moe_ops.grouped_mm(p, q, offs))(x, w))
    assert sum(moe_ops.kernel_counts().values()) == 3  # the forward and the two gradients
    want = grads(lambda x, w: torch.stack([moe_ops.grouped_mm(x[s], w[s], offs) for s in range(2)]))
    assert not want[0].isnan().any() and not want[1].isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # torch.func.grad over the vmap, the weights' gradient only (mat_a does not require grad).
    got_w = grad(lambda w: vmap(lambda p, q: moe_ops.grouped_mm(p, q, offs))(a, w).square().sum())(b)
    torch.testing.assert_close(got_w, want[1], rtol=1e-12, atol=1e-12)


def test_transforms_inside_a_vmap_over_offs():
    """jacrev, jacfwd and vmap inside a vmap over per-sample offs: the inner level sees offs
    still wrapped by the outer one (no values to read there) and calls per sample, leaving offs
    to the outer level's rule; the same as a loop over the samples, and bad offs still raise."""
    a, b, offs = _problem("2d3d")
    rows = torch.stack([offs, torch.tensor([0, 6, 6]), torch.tensor([4, 9, 10])])
    f = lambda x, o: moe_ops.grouped_mm(x, b, o)  # noqa: E731
    for jac in (jacrev, jacfwd):
        got = vmap(jac(f))(a, rows)
        torch.testing.assert_close(got, torch.stack([jac(f)(a[s], rows[s]) for s in range(3)]), rtol=0, atol=0)
    got = vmap(vmap(f, in_dims=(0, None)), in_dims=(None, 0))(a, rows)
    torch.testing.assert_close(got, torch.stack([vmap(f, in_dims=(0, None))(a, o) for o in rows]), rtol=0, atol=0)
    a3, b3, offs3 = _problem("3d2d")
    rows3 = torch.stack([offs3, torch.tensor([1, 1, 5]), torch.tensor([2, 2, 2])])
    h = lambda w, o: moe_ops.grouped_mm(a3[0], w, o)  # noqa: E731
    got = vmap(jacrev(h), in_dims=(None, 0))(b3, rows3)
    torch.testing.assert_close(got, torch.stack([jacrev(h)(b3, o) for o in rows3]), rtol=0, atol=0)
    bad = rows.clone()
    bad[1, 2] = 11
    with pytest.raises(ValueError, match=r"offs\[2\] = 11 exceeds the extent 10"):
        vmap(jacrev(f))(a, bad)


def test_jacobians_and_per_sample_gradients_are_a_few_calls():
    """jacrev maps the backward over M x N cotangents and jacfwd the jvp over the tangents of
    every weight: each mapped op call is one call of the op (torch's fallback made one per
    basis vector: jacrev of a [10, 5] output 50 backward calls); per-sample gradients too, with
    shared or per-sample routing."""
    a, b, offs = _problem("2d3d")
    x = a[0]
    f = lambda x, w: moe_ops.grouped_mm(x, w, offs)  # noqa: E731
    for jac, argnums, most in ((jacrev, 0, 2), (jacfwd, 1, 2)):
        moe_ops.reset_kernel_counts()
        got = jac(f, argnums=argnums)(x, b)
        assert sum(moe_ops.kernel_counts().values()) <= most, (jac.__name__, moe_ops.kernel_counts())
        want = jac(lambda x, w: oracle(x, w, offs), argnums=argnums)(x, b)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)

    def loss(w, x):
        return moe_ops.grouped_mm(x, w, offs).square().sum()

    moe_ops.reset_kernel_counts()
    got = vmap(grad(loss), in_dims=(None, 0))(b, a)
    assert sum(moe_ops.kernel_counts().values()) == 2  # the forward, and the weight gradient
    want = torch.stack([grad(lambda w: oracle(xs, w, offs).square().sum())(b) for xs in a])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)

    # Each sample routed on its own (as a per-sequence MoE layer under vmap is), input gradients
    # too: the forward, d mat_a and d mat_b are one call each.
    rows = torch.stack([offs, torch.tensor([0, 6, 6]), torch.tensor([4, 9, 10])])

    def routed(w, x, o):
        return moe_ops.grouped_mm(x, w, o).square().sum()

    moe_ops.reset_kernel_counts()
    got = vmap(grad(routed, argnums=(0, 1)), in_dims=(None, 0, 0))(b, a, rows)
    assert sum(moe_ops.kernel_counts().values()) == 3
    for s in range(3):
        want = grad(lambda w, x: oracle(x, w, rows[s]).square().sum(), argnums=(0, 1))(b, a[s])
        torch.testing.assert_close((got[0][s], got[1][s]), want, rtol=1e-10, atol=1e-10)


def test_vmap_under_autocast():
    """fp32 activations with bf16 weights under torch.autocast: vmap's layer runs before the
    Autocast kernel, so the rule casts as that kernel would; bit for bit the per-sample calls."""
    a, b, offs = _problem("2d3d", dtype=torch.float32)
    w = b.bfloat16()
    rows = torch.stack([offs, torch.tensor([0, 5, 9]), torch.tensor([10, 10, 10])])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        folded = vmap(lambda x: moe_ops.grouped_mm(x, w, offs))(a)
        looped = vmap(lambda x, o: moe_ops.grouped_mm(x, w, o))(a, rows)
        want = [moe_ops.grouped_mm(x, w, o) for x, o in zip(a, rows)]
        assert torch.equal(folded, torch.stack([moe_ops.grouped_mm(x, w, offs) for x in a]))
    assert folded.dtype == torch.bfloat16
    assert torch.equal(looped, torch.stack(want))


@pytest.mark.outside_cpp
def test_compiled_vmap():
    """torch.compile traces the rule with fake tensors, which have no values: there the offs are
    clamped (cummax(clamp(offs, 0, extent)), as on accelerators) instead of checked."""
    a, b, offs = _problem("2d3d")
    rows = torch.stack([offs, torch.tensor([3, 1, 12]), torch.tensor([0, 0, 10])])
    f = vmap(lambda x, y, o: moe_ops.grouped_mm(x, y, o))
    bs = torch.stack([b, 2 * b, -b])
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(a, bs, torch.stack([offs, offs, offs])), f(a, bs, torch.stack([offs] * 3)))
    got = compiled(a, bs, rows)
    clamped = torch.cummax(rows.clamp(0, 10), 1).values
    torch.testing.assert_close(got, torch.stack([oracle(a[s], bs[s], clamped[s]) for s in range(3)]))


@pytest.mark.outside_cpp
def test_compiled_nested_vmap_over_per_sample_routing():
    """Two vmaps over per-sample routing (2Dx3D, mat_a [2, 3, 10, 6] and offs [2, 3, 3] int64
    batched at both levels, mat_b shared) under torch.compile, where offs values cannot be read:
    the inner level sorts the rows of its samples by group, with an index batched by the outer
    level, which vmap cannot scatter in place into unbatched counts (it raised)."""
    a, b, offs = _problem("2d3d")
    a = torch.stack([a, -a])
    rows = torch.stack([torch.stack([offs, torch.tensor([0, 6, 6]), torch.tensor([4, 9, 10])]),
                        torch.stack([torch.tensor([10, 10, 10]), torch.tensor([0, 0, 0]), offs])])
    f = vmap(vmap(lambda x, o: moe_ops.grouped_mm(x, b, o)))
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(a, rows)
    want = [[oracle(a[i, j], b, rows[i, j]) for j in range(3)] for i in range(2)]
    torch.testing.assert_close(got, torch.stack([torch.stack(w) for w in want]))


@pytest.mark.parametrize("layout", ["2d3d", "2d2d", "3d2d"])
@pytest.mark.outside_cpp
def test_compiled_vmap_with_both_matrices_batched(layout):
    """torch.compile over vmap with mat_a and mat_b both batched (ensembles; per-sample weight
    gradients are such calls): the folded call's tail zeroing must survive functionalization.
    For 3Dx2D it was an in-place masked_fill_ on a movedim view, which AOTAutograd could not
    replay ("Cannot view a tensor ..."). mat_a [3, ...] and mat_b [3, ...] float64, shared offs
    with an empty group and a tail past offs[-1]."""
    torch._dynamo.reset()
    a, b, offs = _problem(layout)
    bs = torch.stack([b, 2 * b, -b])
    f = vmap(lambda x, y: moe_ops.grouped_mm(x, y, offs))
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(a, bs)
    torch.testing.assert_close(got, torch.stack([oracle(a[s], bs[s], offs) for s in range(3)]))


def _vmap_bench():
    import importlib
    import os
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(repo, "benchmarks"))
    try:
        return importlib.import_module("vmap")  # benchmarks/vmap.py
    finally:
        sys.path.pop(0)


@pytest.mark.outside_cpp
def test_vmap_benchmark_times_the_rule_against_the_fallback():
    """benchmarks/vmap.py's compare, 3 rounds on "vmap forward (32 samples)" (fp32, G=8,
    K=N=64): the 'rule' column runs the batching rule (one call of the op against 32), the ways
    alternate by round, each figure is the median of the mean seconds per call in ms (the clock
    here: 1, 2, 6 ms for the rule's rounds, 10, 20, 60 for the fallback's) and the ratio is
    fallback / rule; the rule is registered afterwards. _time divides by the calls."""
    from moe_ops import _op

    bench = _vmap_bench()
    fn = bench._cases()["vmap forward (32 samples)"]
    ways = []
    times = iter((1, 10, 20, 2, 6, 60))  # rounds: rule, fallback | fallback, rule | rule, fallback
    t = [0.0]

    def clock():
        return t[0]

    def timed():
        out = fn()
        ways.append(bool(_op._batching_lib))
        if len(ways) > 2 and len(ways) % 2 == 0:  # after the check's 2 calls, each _time's 2nd call
            t[0] += next(times) * 1e-3
        return out

    row = bench.compare(timed, 3, 0.0, clock=clock)
    assert _op._batching_lib
    assert row["op_calls"] == {"rule": 1, "fallback": 32}
    assert ways[2::2] == [True, False, False, True, True, False]
    assert row["rule_ms"] == pytest.approx(2.0) and row["fallback_ms"] == pytest.approx(20.0)
    assert row["fallback_over_rule"] == pytest.approx(10.0)
    ticks = iter(range(100))
    assert bench._time(lambda: None, 3, clock=lambda: next(ticks)) == 1.0


@pytest.mark.outside_cpp
def test_vmap_benchmark_refuses_a_rule_that_differs(tmp_path):
    """compare checks the rule's result against the fallback's before timing (a NaN under the
    rule fails); main (1 round, no minimum time) writes all six cases, the rule folding each
    into fewer calls of the op than the fallback, and leaves the rule registered."""
    from moe_ops import _op

    bench = _vmap_bench()
    with pytest.raises(RuntimeError, match="differs from torch's fallback"):
        bench.compare(lambda: torch.full((3,), float("nan") if _op._batching_lib else 1.0), 1, 0.0)
    assert _op._batching_lib
    threads = str(torch.get_num_threads())
    bench.main(["--rounds", "1", "--min-s", "0", "--threads", threads, "--out", str(tmp_path)])
    import json

    rows = json.loads((tmp_path / "vmap.json").read_text())["results"]
    assert [r["case"] for r in rows] == list(bench._cases())
    assert all(r["op_calls"]["rule"] < r["op_calls"]["fallback"] for r in rows), rows
    assert _op._batching_lib

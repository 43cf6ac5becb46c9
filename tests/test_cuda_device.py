"""The CUDA backend on a real GPU (skipped without one; benchmarks/gpu_check.py runs these).

Categories:
* no host sync: the op, forward and backward, under torch.cuda.set_sync_debug_mode("error");
* CUDA-graph capture: a captured call follows new offs values written into the same tensor,
  invalid ones included (clamped inside the kernel, one launch per call);
* the kernel that served: "cuda:triton" on sm_80+ (kernel_counts); the opt-in launch cache
  reuses a compiled kernel for its own specialization only;
* autograd on the device against the float64 oracle; autocast casts on the device; repeated
  calls give bitwise identical results;
* results are held to the suite's tolerance rule (``moe_ops.testing.assert_close``);
* vmap (the batching rule): per-sample weights and routing in one call, no host sync, invalid
  per-sample offs clamped sample by sample;
* 64-bit indices for real: results of more than 2^31 elements (2Dx3D [M, N] and 2Dx2D [G, M, N]).
The property suite covers the forward contract on the device (implementations "cuda" and
"op@cuda" in tests/test_properties.py).
"""

from __future__ import annotations

import pytest
import torch

import moe_ops
from moe_ops import _contract
from moe_ops.testing import assert_close, reference_results
from oracle import oracle  # tests/: shares no code with moe_ops.reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _older_than_sm80():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 0)


def _problem(M=300, K=96, N=80, G=5, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(M, K, generator=gen).to(dtype)
    b = torch.randn(G, K, N, generator=gen).to(dtype)
    bias = torch.randn(G, N, generator=gen).to(dtype)
    offs = torch.tensor([40, 40, 170, 260, 290][:G], dtype=torch.int32)
    return a, b, bias, offs


def _check(out, a, b, offs, bias=None, out_dtype=None):
    """out (on the device) against the problem's float64 reference on the CPU, by the suite's
    tolerance rule."""
    cpu = [None if t is None else t.cpu() for t in (a, b, offs, bias)]
    assert_close(out, *reference_results(*cpu, out_dtype=out_dtype))


def test_no_host_sync_forward_and_backward():
    a, b, bias, offs = (t.cuda() for t in _problem())
    a.requires_grad_(True)
    b.requires_grad_(True)
    bias.requires_grad_(True)

    def step():
        out = moe_ops.grouped_mm(a, b, offs, bias, out_dtype=torch.float32)
        torch.autograd.grad(out, (a, b, bias), torch.ones_like(out))  # 2Dx3D, 2Dx2D, bias sum
        moe_ops.grouped_mm(a.detach().t(), out.detach().to(a.dtype), offs)  # 2Dx2D, x.T @ grad

    step()  # compiles the kernels outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_vmap_without_host_sync():
    """Samples with their own weights and offs (one invalid) are one call of the kernel, and so
    are samples with their own offs and shared weights, with no host sync; each sample matches
    the CPU op with its clamped offs."""
    a, b, _, _ = _problem(M=64, K=32, N=16, G=3, dtype=torch.float32)
    xs = torch.stack([a, 2 * a, -a])
    ws = torch.stack([b, -b, 0.5 * b])
    rows = torch.tensor([[10, 10, 70], [-2, 30, 50], [0, 0, 64]], dtype=torch.int32)
    # Copied to the device before the checked region: a copy from host memory is itself a
    # synchronizing operation (the H200 run of 2026-11-30 failed on xs.cuda() there).
    xs_d, ws_d, rows_d, b_d = xs.cuda(), ws.cuda(), rows.cuda(), b.cuda()
    run = torch.vmap(lambda x, w, o: moe_ops.grouped_mm(x, w, o))
    routed = torch.vmap(lambda x, o: moe_ops.grouped_mm(x, b_d, o))  # shared weights: rows sorted
    run(xs_d, ws_d, rows_d)  # compiles the kernels outside the checked region
    routed(xs_d, rows_d)
    torch.cuda.synchronize()
    moe_ops.reset_kernel_counts()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = run(xs_d, ws_d, rows_d)
        shared = routed(xs_d, rows_d)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert sum(moe_ops.kernel_counts().values()) == 2
    clamped = _contract.sanitize_offs(rows, 64)
    for s in range(3):
        _check(out[s], xs[s], ws[s], clamped[s])
        _check(shared[s], xs[s], b, clamped[s])


def test_cuda_graph_follows_offs_on_device():
    a, b, bias, offs = (t.cuda() for t in _problem())
    moe_ops.grouped_mm(a, b, offs, bias)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_ops.grouped_mm(a, b, offs, bias)
    # The last two are not partitions: the kernel clamps them to cummax(clamp(offs, 0, 300)).
    for new in ([10, 100, 100, 200, 300], [0, 0, 0, 0, 0], [300, 300, 300, 300, 300], [5, 6, 7, 8, 9],
                [-4, 120, 60, 2**31 - 1, 7], [250, 20, -1, 290, 280]):
        offs.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        valid = _contract.sanitize_offs(offs.cpu(), a.shape[0])
        _check(out, a, b, valid, bias)
        assert torch.count_nonzero(out[int(valid[-1]):]) == 0


@pytest.mark.skipif(_older_than_sm80(), reason="the Triton kernels need sm_80 or newer")
def test_one_kernel_launch_per_call():
    # The Triton kernels clamp offs themselves (CLAMPS_OFFS): no clamp / cummax launches first.
    a, b, bias, offs = (t.cuda() for t in _problem())
    moe_ops.reset_kernel_counts()
    moe_ops.grouped_mm(a, b, offs, bias)
    torch.cuda.synchronize()
    if moe_ops.kernel_counts() != {"cuda:triton": 1}:
        pytest.skip(f"served by {moe_ops.kernel_counts()}, which gets offs sanitized first")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        moe_ops.grouped_mm(a, b, offs, bias)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not kernels:
        pytest.skip("the profiler recorded no CUDA activity (CUPTI unavailable?)")
    assert len(kernels) == 1, kernels


@pytest.mark.skipif(_older_than_sm80(), reason="the Triton kernels need sm_80 or newer")
def test_launch_cache_reuses_a_kernel_only_for_its_specialization():
    """With the opt-in launch cache on, a call whose arguments Triton would specialize as an
    earlier call's launches the cached compiled kernel (the cache does not grow; the result is
    bit for bit Triton's own launch); mat_a one element off 16-byte alignment is another
    specialization with its own entry."""
    from moe_ops.backends.cuda import triton_kernels as tk

    a, b, bias, offs = (t.cuda() for t in _problem())
    before = tk._launch_cache_on
    tk.use_launch_cache(True)
    try:
        moe_ops.reset_kernel_counts()
        tk._compiled.clear()
        first = moe_ops.grouped_mm(a, b, offs, bias)  # through Triton's launch, then cached
        if moe_ops.kernel_counts() != {"cuda:triton": 1}:
            pytest.skip(f"served by {moe_ops.kernel_counts()}")
        assert len(tk._compiled) == 1
        again = moe_ops.grouped_mm(a, b, offs, bias)  # from the cache
        assert len(tk._compiled) == 1
        assert torch.equal(again, first)
        shifted = torch.empty(a.numel() + 1, dtype=a.dtype, device="cuda")[1:].view_as(a).copy_(a)
        out = moe_ops.grouped_mm(shifted, b, offs, bias)
        assert len(tk._compiled) == 2
        assert torch.equal(moe_ops.grouped_mm(shifted, b, offs, bias), out)
        assert len(tk._compiled) == 2
    finally:
        tk.use_launch_cache(before)
    _check(out, a, b, offs, bias)


@pytest.mark.skipif(_older_than_sm80(), reason="the Triton kernels need sm_80 or newer")
def test_served_by_triton():
    a, b, bias, offs = (t.cuda() for t in _problem())
    moe_ops.reset_kernel_counts()
    moe_ops.grouped_mm(a, b, offs, bias)
    assert moe_ops.kernel_counts() in ({"cuda:triton": 1}, {"cuda:blackwell": 1})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_autograd_on_device(dtype):
    """The device's gradients against the float64 oracle's by the suite's tolerance rule, with the
    CPU op's gradients as the computation in the inputs' precision (fp32 sums, one rounding)."""
    a, b, bias, offs = _problem(dtype=dtype)
    dout = torch.linspace(-1, 1, a.shape[0] * b.shape[2], dtype=dtype).reshape(a.shape[0], -1)
    grads = []
    for device in ("cpu", "cuda"):
        leaves = [t.detach().to(device).requires_grad_(True) for t in (a, b, bias)]
        out = moe_ops.grouped_mm(leaves[0], leaves[1], offs.to(device), leaves[2])
        grads.append(torch.autograd.grad(out, leaves, dout.to(device)))

    def oracle_grads(transform):
        xs = [transform(t.double()).requires_grad_(True) for t in (a, b, bias)]
        return torch.autograd.grad(oracle(xs[0], xs[1], offs, xs[2]), xs, transform(dout.double()))

    for what, cpu_grad, cuda_grad, ref64, mag in zip(("a", "b", "bias"), *grads, oracle_grads(lambda x: x),
                                                     oracle_grads(torch.abs)):
        assert_close(cuda_grad, ref64, cpu_grad, mag, what=f"grad of {what}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_repeated_calls_are_bitwise_identical(dtype):
    """No atomics, no split sums: the forward and both gradients come out the same every time."""
    a, b, bias, offs = (t.cuda() for t in _problem(M=3000, K=512, N=384, dtype=dtype))
    offs = torch.tensor([400, 400, 1700, 2600, 2900], dtype=torch.int32, device="cuda")
    runs = []
    for _ in range(3):
        leaves = [t.detach().requires_grad_(True) for t in (a, b, bias)]
        out = moe_ops.grouped_mm(leaves[0], leaves[1], offs, leaves[2])
        runs.append((out, *torch.autograd.grad(out, leaves, torch.ones_like(out))))
    for run in runs[1:]:
        for x, y in zip(run, runs[0]):
            assert torch.equal(x, y)


@pytest.mark.skipif(_older_than_sm80(), reason="the Triton kernels need sm_80 or newer")
def test_autocast_on_device():
    """fp32 activations with bf16 weights under torch.autocast("cuda", bfloat16): cast to bf16,
    served by the device kernel, the same result as casting by hand."""
    a, b, bias, offs = (t.cuda() for t in _problem(dtype=torch.float32))
    moe_ops.reset_kernel_counts()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = moe_ops.grouped_mm(a, b.to(torch.bfloat16), offs, bias)
    assert got.dtype == torch.bfloat16 and "reference" not in moe_ops.kernel_counts()
    want = moe_ops.grouped_mm(a.to(torch.bfloat16), b.to(torch.bfloat16), offs, bias.to(torch.bfloat16))
    assert torch.equal(got, want)


def _enough_memory(gib):
    free, _ = torch.cuda.mem_get_info()
    return free > gib * 2**30


def test_results_past_2_31_elements():
    if not _enough_memory(16):
        pytest.skip("needs 16 GiB of free GPU memory")
    # 2Dx3D: out [140000, 16384] bf16 = 2.29e9 elements (4.6 GB); the last group ends before M.
    M, K, N = 140_000, 32, 16_384
    gen = torch.Generator(device="cuda").manual_seed(1)
    a = torch.randn(M, K, device="cuda", generator=gen).to(torch.bfloat16)
    b = torch.randn(2, K, N, device="cuda", generator=gen).to(torch.bfloat16)
    offs = torch.tensor([70_000, 139_990], device="cuda")
    out = moe_ops.grouped_mm(a, b, offs)
    for rows, g in ((slice(0, 64), 0), (slice(69_990, 70_000), 0), (slice(70_000, 70_010), 1), (slice(139_900, 139_990), 1)):
        _check(out[rows], a[rows], b[g:g + 1], torch.tensor([rows.stop - rows.start]))
    assert torch.count_nonzero(out[139_990:]) == 0
    del out
    # 2Dx2D: out [2, 33000, 33000] fp32 = 2.18e9 elements (8.7 GB); K groups of 40 and 24.
    a2 = torch.randn(33_000, 64, device="cuda", generator=gen).to(torch.bfloat16)
    b2 = torch.randn(64, 33_000, device="cuda", generator=gen).to(torch.bfloat16)
    out2 = moe_ops.grouped_mm(a2, b2, torch.tensor([40, 64], device="cuda"), out_dtype=torch.float32)
    for rows in (slice(0, 8), slice(32_990, 33_000)):
        _check(out2[1, rows, -512:][None], a2[rows, 40:], b2[40:, -512:], torch.tensor([24]), out_dtype=torch.float32)

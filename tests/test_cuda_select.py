"""Selection and registration of the CUDA backend, on CPU.

Categories:
* ``select``: every compute capability class, toolchains present or not, the Blackwell rule
  (data: ``BLACKWELL.serves``), the reference with its reason;
* registration: a "cuda" kernel in the dispatch table, no triton import at registration;
* status: how the backend runs here and what ``python -m moe_ops`` prints.
The registered kernel itself runs through the dispatcher in test_cuda_interpreter.py.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from moe_ops import _contract
from moe_ops.backends import cuda
from moe_ops.backends.cuda import select

BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
LAYOUTS = ("2d3d", "2d2d", "3d3d", "3d2d")
ALL = {"triton", "cutlass"}


@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (10, 3), (12, 0)])
@pytest.mark.parametrize("dtype", [BF16, FP16, FP32, FP64])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_sm80_and_newer_run_triton_unless_blackwell_serves(capability, dtype, layout):
    choice = select(capability, ALL, dtype, layout)
    blackwell = capability[0] == 10 and layout in ("2d3d", "3d3d") and dtype in (BF16, FP16)
    assert choice.kernel == ("blackwell" if blackwell else "triton"), choice
    assert f"sm_{capability[0]}{capability[1]}" in choice.reason


@pytest.mark.parametrize("capability", [(7, 0), (7, 5), (6, 1)])
def test_older_gpus_use_the_reference_and_say_why(capability):
    choice = select(capability, ALL, BF16, "2d3d")
    assert choice.kernel == "reference"
    assert f"sm_{capability[0]}{capability[1]}" in choice.reason and "sm_80" in choice.reason


def test_without_triton_the_reference_says_what_to_install():
    for capability in [(9, 0), None]:
        choice = select(capability, set(), BF16, "2d3d")
        assert choice.kernel == "reference" and "pip install triton" in choice.reason


def test_cpu_tensors_run_the_interpreter():
    choice = select(None, {"triton"}, FP32, "2d2d")
    assert choice.kernel == "triton" and "interpreter" in choice.reason


def test_blackwell_rule():
    """BLACKWELL.serves (data) routes sm_100-family calls to the CuTe DSL kernel."""
    assert cuda.BLACKWELL.serves == frozenset({("2d3d", BF16), ("2d3d", FP16), ("3d3d", BF16), ("3d3d", FP16)})
    assert select((10, 0), ALL, BF16, "2d3d").kernel == "blackwell"
    assert select((10, 3), ALL, FP16, "3d3d").kernel == "blackwell"
    assert select((10, 0), ALL, BF16, "2d2d").kernel == "triton"  # layout it does not serve
    assert select((10, 0), ALL, FP32, "2d3d").kernel == "triton"  # dtype it does not serve
    assert select((10, 0), {"triton"}, BF16, "2d3d").kernel == "triton"  # cutlass DSL missing
    assert select((9, 0), ALL, BF16, "2d3d").kernel == "triton"  # Hopper has no tcgen05
    assert select((12, 0), ALL, BF16, "2d3d").kernel == "triton"  # nor has RTX 50 (sm_120)


def test_toolchains_are_found_without_importing_them():
    found = cuda.toolchains()
    assert "triton" in found
    code = "import sys, moe_ops; moe_ops.backends.cuda.toolchains(); print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False", "registering the cuda backend must not import triton"


def test_cuda_kernel_is_registered():
    assert torch._C._dispatch_has_kernel_for_dispatch_key("moe::grouped_mm", "CUDA")


@pytest.mark.skipif(torch.cuda.is_available(), reason="describes a machine without a CUDA device")
def test_status_without_a_gpu():
    s = cuda.status()
    assert (s.name, s.keys, s.mode) == ("cuda", ("CUDA",), "interpreter")
    assert "interpreter" in s.detail and "sm_80+ -> triton" in s.detail


def test_python_m_moe_ops_reports_the_backend():
    out = subprocess.run([sys.executable, "-m", "moe_ops"], capture_output=True, text=True, check=True).stdout
    line = next(line for line in out.splitlines() if line.startswith("cuda "))
    assert cuda.status().mode in line


def test_a_declined_blackwell_call_without_triton_goes_to_the_reference(monkeypatch):
    """On a Blackwell GPU with the DSL but not triton, a call the Blackwell kernel declines must
    reach the reference (NotImplementedError to kernel_entry), not fail importing triton."""
    monkeypatch.setattr(cuda, "_capability", lambda device: (10, 0))
    monkeypatch.setattr(cuda, "_toolchains", frozenset({"cutlass"}))
    a, w = torch.randn(16, 16, dtype=torch.bfloat16), torch.randn(2, 16, 12, dtype=torch.bfloat16)  # N % 8: declined
    offs = torch.tensor([8, 16], dtype=torch.int32)
    p = _contract.check_args(a, w, offs)
    assert select((10, 0), {"cutlass"}, p.dtype, p.layout).kernel == "blackwell"
    with pytest.raises(NotImplementedError, match="cuda:blackwell does not serve this call .* triton is not installed"):
        cuda._run(p, a, w, offs, None)


def test_the_blackwell_kernel_gets_offs_sanitized(monkeypatch):
    """The registered kernel gets unsanitized offs on a GPU (CLAMPS_OFFS: the Triton kernels
    clamp them as they read them); the Blackwell kernel does not clamp, so _run hands it
    cummax(clamp(offs, 0, M)). Its grouped_mm is replaced by a recorder that declines.
    a: [16, 16] bf16, b: [3, 16, 16] bf16, offs [5, 3, 99] (decreasing, past M)."""
    from moe_ops.backends.cuda import blackwell

    monkeypatch.setattr(cuda, "_capability", lambda device: (10, 0))
    monkeypatch.setattr(cuda, "_toolchains", frozenset({"cutlass"}))
    seen = []

    def record(p, mat_a, mat_b, offs, bias):
        seen.append(offs)
        raise NotImplementedError("recorded")

    monkeypatch.setattr(blackwell, "grouped_mm", record)
    a, w = torch.randn(16, 16, dtype=BF16), torch.randn(3, 16, 16, dtype=BF16)
    offs = torch.tensor([5, 3, 99], dtype=torch.int32)
    p = _contract.check_args(a, w, offs)
    with pytest.raises(NotImplementedError, match="recorded"):
        cuda._run(p, a, w, offs, None)
    assert [o.tolist() for o in seen] == [[5, 5, 16]]


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="relies on Triton's launch failing without CUDA")
def test_a_blackwell_decline_is_logged_once_per_reason(monkeypatch, caplog):
    """A call the Blackwell kernel declines goes to Triton with one INFO line per distinct
    reason, not one per call (a training loop would log every step). Here the Triton launch
    after the decline fails (no CUDA), which does not matter: the line comes before it.
    a: [16, 16] bf16, b: [2, 16, 16] bf16."""
    import logging

    from moe_ops.backends.cuda import blackwell

    monkeypatch.setattr(cuda, "_capability", lambda device: (10, 0))
    monkeypatch.setattr(cuda, "_toolchains", frozenset({"triton", "cutlass"}))
    monkeypatch.setattr(cuda, "_declined", set())
    reasons = iter(["first reason", "first reason", "first reason", "second reason"])

    def decline(*args):
        raise NotImplementedError(next(reasons))

    monkeypatch.setattr(blackwell, "grouped_mm", decline)
    a, w = torch.randn(16, 16, dtype=BF16), torch.randn(2, 16, 16, dtype=BF16)
    offs = torch.tensor([8, 16], dtype=torch.int32)
    p = _contract.check_args(a, w, offs)
    with caplog.at_level(logging.INFO, logger="moe_ops"):
        for _ in range(4):
            with pytest.raises((AssertionError, RuntimeError)):  # torch without CUDA / no driver
                cuda._run(p, a, w, offs, None)
    lines = [r.getMessage() for r in caplog.records
             if "cuda:blackwell does not serve" in r.getMessage()]
    assert len(lines) == 2 and "first reason" in lines[0] and "second reason" in lines[1], lines


def test_without_triton_run_here_and_status_say_what_to_install(monkeypatch):
    """Without triton, run_here raises BackendUnavailable (the property suite then skips the
    backend) and status names the install command, whatever _run's cached toolchains say.
    find_spec (stdlib) reports triton missing; a: [16, 16] bf16, b: [2, 16, 16] bf16."""
    from importlib import util

    from moe_ops.backends import BackendUnavailable

    real = util.find_spec
    monkeypatch.setattr(util, "find_spec",
                        lambda name, *a: None if name == "triton" else real(name, *a))
    a, w = torch.randn(16, 16, dtype=BF16), torch.randn(2, 16, 16, dtype=BF16)
    offs = torch.tensor([8, 16], dtype=torch.int32)
    with pytest.raises(BackendUnavailable, match="pip install triton"):
        cuda.run_here(_contract.check_args(a, w, offs), a, w, offs, None)
    assert cuda.status().mode is None and "pip install triton" in cuda.status().detail

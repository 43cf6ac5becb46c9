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

"""CUDA backend of ``moe::grouped_mm``: one registration for the "cuda" device, three kernels.

Per call, ``select`` picks from (compute capability, toolchains installed, dtype, layout):

* "blackwell": the sm_100-family CuTe DSL kernel (``blackwell.py`` beside this file) for the
  (layout, dtype) pairs in ``BLACKWELL.serves``: bf16/fp16 2Dx3D (forward and input gradient)
  and 3Dx3D. When it raises NotImplementedError for a call (e.g. strides its TMA loads cannot
  take, N or K not a multiple of 8), Triton computes the call.
* "triton": the persistent Triton kernels of ``triton_kernels.py``, sm_80 and newer, every
  layout and dtype.
* "reference": older GPUs, or triton missing. The kernel raises NotImplementedError with the
  reason, so ``kernel_entry`` computes the call with the sync-free reference and logs the
  reason once.

Nothing here imports triton at registration; ``triton_kernels`` is imported on the first call.
Without a CUDA device (as in CI) ``run_here``, and the registered kernel when it is handed CPU
tensors through the dispatcher, run the same Triton kernels in Triton's interpreter.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
from dataclasses import dataclass
from typing import Optional

import torch

from ... import _contract, _op
from .. import BackendUnavailable, Status

NAME = "cuda"

# The Triton kernels clamp offs into cummax(clamp(offs, 0, extent)) as they read it, which saves
# the two launches (clamp, cummax) of sanitizing it first; the Blackwell kernel gets offs
# sanitized (it reads int32, and casting unsanitized int64 values would wrap them).
CLAMPS_OFFS = True

log = logging.getLogger("moe_ops")

TRITON_MIN_CAPABILITY = (8, 0)
TRITON_INSTALL_HINT = "pip install triton==3.9.0"


@dataclass(frozen=True)
class NativeKernel:
    """A CUDA kernel that replaces Triton where it applies.

    name: its module beside this file and its kernel name ("cuda:<name>"). majors: compute
    capability majors it runs on. toolchain: the importable package it needs. serves: the
    (layout, dtype) pairs it computes.
    """

    name: str
    majors: tuple
    toolchain: str
    serves: frozenset


# The sm_100 family (B200/GB200 = 10.0, B300 = 10.3) with tcgen05 MMA; not sm_120 (RTX 50),
# which has no tcgen05. nvidia-cutlass-dsl installs the package ``cutlass``.
BLACKWELL = NativeKernel(
    "blackwell", majors=(10,), toolchain="cutlass",
    serves=frozenset((layout, dtype) for layout in ("2d3d", "3d3d") for dtype in (torch.bfloat16, torch.float16)),
)


@dataclass(frozen=True)
class Selection:
    """Which kernel serves a call ("blackwell", "triton" or "reference") and why."""

    kernel: str
    reason: str


def select(capability: Optional[tuple], toolchains, dtype: torch.dtype, layout: str) -> Selection:
    """Pick the kernel for one call; a pure function of its arguments.

    Args:
        capability: the CUDA device's (major, minor), or None for CPU tensors (then the Triton
            kernels run in Triton's interpreter).
        toolchains: names of the importable packages, e.g. {"triton", "cutlass"}.
        dtype: the inputs' dtype. layout: "2d3d", "2d2d", "3d3d" or "3d2d".
    """
    toolchains = frozenset(toolchains)
    if capability is None:
        if "triton" not in toolchains:
            return Selection("reference", f"triton is not installed ({TRITON_INSTALL_HINT})")
        return Selection("triton", "no CUDA device: Triton kernels in Triton's interpreter on CPU tensors")
    arch = f"sm_{capability[0]}{capability[1]}"
    if (capability[0] in BLACKWELL.majors and (layout, dtype) in BLACKWELL.serves
            and BLACKWELL.toolchain in toolchains):
        return Selection("blackwell", f"{arch}: tcgen05 CuTe DSL kernel")
    if tuple(capability) < TRITON_MIN_CAPABILITY:
        return Selection("reference", f"{arch} is older than sm_80, the oldest GPU the Triton kernels target")
    if "triton" not in toolchains:
        return Selection("reference", f"triton is not installed ({TRITON_INSTALL_HINT})")
    return Selection("triton", f"{arch}: persistent Triton grouped GEMM")


def toolchains() -> frozenset:
    """The kernel toolchains importable here, found without importing them."""
    return frozenset(name for name in ("triton", BLACKWELL.toolchain) if importlib.util.find_spec(name) is not None)


_capabilities: dict = {}


def _capability_of(index: int) -> tuple:
    """(major, minor) of CUDA device ``index``, asked once per process."""
    if index not in _capabilities:
        _capabilities[index] = tuple(torch.cuda.get_device_capability(index))
    return _capabilities[index]


def _capability(device: torch.device) -> Optional[tuple]:
    if device.type != "cuda":
        return None
    return _capability_of(device.index if device.index is not None else torch.cuda.current_device())


_toolchains: Optional[frozenset] = None
_declined: set = set()


def _run(p, mat_a, mat_b, offs, bias) -> torch.Tensor:
    """The registered CUDA kernel (behind ``kernel_entry``): select, then run. offs: checked
    values, or unsanitized ones on a GPU (see CLAMPS_OFFS)."""
    global _toolchains
    if _toolchains is None:
        _toolchains = toolchains()
    capability = _capability(mat_a.device)
    choice = select(capability, _toolchains, p.dtype, p.layout)
    if choice.kernel == "reference":
        raise NotImplementedError(choice.reason)
    if choice.kernel != "triton":
        try:
            _op.note_kernel(f"cuda:{choice.kernel}")
            native_offs = None if offs is None else _contract.sanitize_offs(offs, p.extent)
            return importlib.import_module(f"{__name__}.{choice.kernel}").grouped_mm(p, mat_a, mat_b, native_offs, bias)
        except NotImplementedError as e:  # e.g. strides its TMA loads cannot take: Triton serves it
            if "triton" not in _toolchains:  # then the reference does (kernel_entry)
                raise NotImplementedError(f"cuda:{choice.kernel} does not serve this call ({e}) and triton "
                                          f"is not installed ({TRITON_INSTALL_HINT})") from None
            if (choice.kernel, str(e)) not in _declined:
                _declined.add((choice.kernel, str(e)))
                log.info("moe_ops: cuda:%s does not serve this call (%s); using triton", choice.kernel, e)
    from . import triton_kernels

    if capability is None:
        _op.note_kernel("cuda:triton-interpreter")
        return triton_kernels.grouped_mm(p, mat_a, mat_b, offs, bias, interpret=True)
    _op.note_kernel("cuda:triton")
    arch = 10 * capability[0] + capability[1]
    # Triton launches on the current device; the switch is skipped when it is already the
    # operands' (the usual case), which saves the context manager's host time per call.
    if mat_a.device.index == torch.cuda.current_device():
        return triton_kernels.grouped_mm(p, mat_a, mat_b, offs, bias, arch=arch)
    with torch.cuda.device(mat_a.device):
        return triton_kernels.grouped_mm(p, mat_a, mat_b, offs, bias, arch=arch)


def register() -> None:
    _op.register_device_kernel("cuda", "cuda", _run, clamps_offs=CLAMPS_OFFS)


def _triton_version() -> Optional[str]:
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None


def _native_here() -> bool:
    return torch.cuda.is_available() and _capability_of(0) >= TRITON_MIN_CAPABILITY


def status() -> Status:
    version = _triton_version()
    if version is None or importlib.util.find_spec("triton") is None:
        return Status(NAME, ("CUDA",), None, f"triton is not installed ({TRITON_INSTALL_HINT}); "
                      "CUDA tensors use the reference")
    found = toolchains()
    if not torch.cuda.is_available():
        return Status(NAME, ("CUDA",), "interpreter",
                      f"no CUDA device: triton {version} kernels run in Triton's interpreter on CPU tensors; "
                      "on a GPU: sm_80+ -> triton, older -> reference, sm_100 -> blackwell for "
                      f"{_describe(BLACKWELL.serves)}")
    lines = []
    for i in range(torch.cuda.device_count()):
        cap = _capability_of(i)
        picks = {select(cap, found, torch.bfloat16, layout).kernel for layout in ("2d3d", "2d2d", "3d3d", "3d2d")}
        reason = select(cap, found, torch.bfloat16, "2d3d").reason
        lines.append(f"cuda:{i} {torch.cuda.get_device_name(i)} sm_{cap[0]}{cap[1]} -> {'/'.join(sorted(picks))} ({reason})")
    mode = "native" if _native_here() else "interpreter"
    return Status(NAME, ("CUDA",), mode, f"triton {version}; " + "; ".join(lines))


def _describe(pairs) -> str:
    if not pairs:
        return "nothing yet (not wired in)"
    return ", ".join(sorted(f"{layout}/{str(dtype).replace('torch.', '')}" for layout, dtype in pairs))


def run_here(problem, mat_a, mat_b, offs, bias) -> torch.Tensor:
    """The backend's kernel on CPU tensors: natively on the first CUDA GPU (sm_80+) when there
    is one, otherwise the Triton kernels in Triton's interpreter."""
    if importlib.util.find_spec("triton") is None:
        raise BackendUnavailable(f"triton is not installed ({TRITON_INSTALL_HINT})")
    if _native_here():
        device = torch.device("cuda", 0)
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        out = _run(problem, move(mat_a), move(mat_b), move(offs), move(bias))
        return out.cpu()
    return _run(problem, mat_a, mat_b, offs, bias)

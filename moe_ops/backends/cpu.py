"""The native CPU backend: a C++ kernel (csrc/cpu, built as ``moe_ops._cpu``) on the CPU key.

The kernel registered here is ``torch.ops.moe_cpu.grouped_mm``, wrapped by ``kernel_entry``
(which checks the call against the contract and validates offs values once, in Python). It
splits the groups into (group, row block, column block) items that the threads of one
at::parallel_for region share, and computes each item with:

* "amx": bf16 on CPUs with AMX (tile matmuls, fp32 accumulation);
* "avx512_bf16": bf16 on CPUs with AVX512-BF16 but no AMX, e.g. AMD Zen 4 and Zen 5 (VDPBF16PS
  dot products of bf16 pairs, fp32 accumulation; with k-contiguous weights C^T = W @ A^T, the
  rows of A in 256-bit lanes on Zen 4 and 512-bit ones on Zen 5);
* "avx512": fp32 / fp16 / fp64, and bf16 on other AVX-512 CPUs (AVX-512 FMA, fp32 or fp64
  accumulation);
* "avx2": every dtype on x86-64 CPUs with AVX2 and FMA but no AVX-512, e.g. AMD Zen 1-3 and
  Intel Haswell to the client chips (256-bit FMA; bf16 and fp16 converted to fp32 as they are
  packed, fp32 accumulation; fp64 in fp64). ATen has no fast bf16 matmul there (oneDNN reached
  1.1-6.5 GFLOP/s on one Zen 2 core, against 48-65 in fp32), so this is what makes bf16 usable on them;
* "aten": ATen's mm on the item's views (any other CPU, or ``MOE_OPS_CPU_ISA=generic``).

Groups of one to four rows (decode: one row per chosen expert; on the "avx2" level up to eight,
with k-contiguous weights on the AVX-512 FMA path up to sixteen in fp32 and bf16, eight in
fp16) take kernels made for them: dot products along k with k-contiguous weights (with AMX only
from K = 4096), the rows of W streamed with n-contiguous ones.

Groups of at least 2**28 multiply-adds in bf16 (only on the "avx512" and "aten" levels), 2**26
in fp32 (not on AMD CPUs at the "avx2" and "avx512" levels, where the items are faster; no bias,
output in the input dtype) are computed whole by ATen's mm with all threads (oneDNN/MKL), before
the items.

Outputs of 8 MiB and more come from a per-process cache of mapped memory (csrc/cpu/
output_cache.cpp): a freed output's block is kept (marked MADV_FREE after a second unused, so
the OS may then reclaim it under memory pressure) and handed to the next output of the same
size, whose pages are then already mapped; outputs written into such a block use non-temporal stores.
``MOE_OPS_CPU_CACHE_MB`` bounds the free blocks kept (read once; default 1/16 of the memory, at
most 1024; 0 turns the cache off); ``moe_ops.empty_cpu_cache()`` releases them.

``huge_pages`` (``moe_ops.cpu_huge_pages``) moves tensors, the expert weights, into transparent
huge pages in place: the kernels stream the weights on every call, and from 4 KiB pages a core
streams them slower (a page walk per page; README, "Huge pages for the weights").

``MOE_OPS_CPU_ISA=generic|avx2|avx512|avx512_bf16`` caps the instruction set (read once per process). The
compiled module is optional: when it is missing (no compiler at install time, a build with
MOE_OPS_NO_EXTENSION=1) or was built against another torch (it checks before registering
anything), ``status()`` says why and the op computes CPU calls with the
reference, logged once.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from typing import Any

import torch

from .. import _native
from .._op import note_kernel, register_device_kernel
from . import BackendUnavailable, Status

NAME = "cpu"

log = logging.getLogger("moe_ops")

_loaded: bool | None = None
_why_not = ""
_kernel_names: dict = {}
_kernel: Any = None  # torch.ops.moe_cpu.grouped_mm.default once loaded (the overload: no resolution per call)


_ISA_NAMES = ("generic", "avx2", "avx512", "avx512_bf16", "amx")  # machine_isa() in grouped_mm.cpp


def env_problems(environ=os.environ) -> list:
    """The CPU backend's environment variables that the C++ module would silently misread: an
    ``MOE_OPS_CPU_ISA`` it does not know caps nothing, an ``MOE_OPS_CPU_CACHE_MB`` that is not a
    whole number of MiB reads as its leading digits (atoll; none: 0, the cache off). One message per
    problem."""
    problems = []
    isa = environ.get("MOE_OPS_CPU_ISA")
    if isa is not None and isa not in _ISA_NAMES:
        problems.append(f"MOE_OPS_CPU_ISA={isa!r} is not one of {', '.join(_ISA_NAMES)} (lower "
                        "case): the instruction set is not capped")
    mb = environ.get("MOE_OPS_CPU_CACHE_MB")
    if mb and not re.fullmatch(r"\s*\d+\s*", mb, re.ASCII):
        digits = re.findall(r"\A\s*([+-]?\d*)", mb, re.ASCII)[0]  # what atoll reads (matches any string once)
        value = max(0, int(digits)) if digits.lstrip("+-") else 0
        problems.append(f"MOE_OPS_CPU_CACHE_MB={mb!r} is not a whole number of MiB: it reads as "
                        f"{value}" + (" (the output cache off)" if value == 0 else ""))
    return problems


def _load() -> bool:
    """Import moe_ops._cpu once (it registers torch.ops.moe_cpu); False, with a reason, if absent."""
    global _loaded, _why_not, _kernel
    if _loaded is None:
        try:
            _native.import_native("moe_ops._cpu")
            _kernel = torch.ops.moe_cpu.grouped_mm.default
            _loaded = True
            for problem in env_problems():
                log.warning("moe_ops: %s", problem)
        except (ImportError, OSError) as e:
            _loaded = False
            _why_not = (f"the C++ extension moe_ops._cpu cannot be loaded ({type(e).__name__}: {e}); "
                        "reinstall with `pip install --no-build-isolation -e .` and a C++ compiler")
            log.warning("moe_ops: %s; CPU calls use the reference", _why_not)
    return _loaded


def _kernel_name(dtype: torch.dtype) -> str:
    name = _kernel_names.get(dtype)
    if name is None:
        isa = torch.ops.moe_cpu.kernel_for(dtype)
        name = _kernel_names[dtype] = "cpu:" + ("aten" if isa == "generic" else isa)
    return name


def _run(p, mat_a, mat_b, offs, bias):
    note_kernel(_kernel_name(p.dtype))
    return _kernel(p.layout, mat_a, mat_b, offs, bias, p.out_dtype)


def _impl(p, mat_a, mat_b, offs, bias):
    if not _load():
        raise NotImplementedError(_why_not)  # kernel_entry computes the call with the reference
    return _run(p, mat_a, mat_b, offs, bias)


def register() -> None:
    register_device_kernel("cpu", "cpu", _impl)


def run_here(p, mat_a, mat_b, offs, bias):
    """The native kernel on CPU tensors (already validated, as from kernel_entry)."""
    if not _load():
        raise BackendUnavailable(_why_not)
    return _run(p, mat_a, mat_b, offs, bias)


def empty_cache() -> int:
    """Returns the free blocks of the CPU output cache to the OS; the bytes released (0 without
    the compiled module). Outputs still alive are not affected: their blocks come back to the
    cache when they are freed."""
    return int(torch.ops.moe_cpu.empty_cache()) if _load() else 0


_MADV_HUGEPAGE, _MADV_COLLAPSE = 14, 25  # linux/mman.h; MADV_COLLAPSE since Linux 6.1
_THP = "/sys/kernel/mm/transparent_hugepage"


def _huge_page_bytes() -> int:
    """The size of a transparent huge page: 2 MiB on x86-64 (and arm64 with 4 KiB pages)."""
    try:
        with open(f"{_THP}/hpage_pmd_size") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 2 << 20


def thp_mode() -> str:
    """Linux's transparent huge page mode ("always", "madvise" or "never"), "" where there is none."""
    try:
        with open(f"{_THP}/enabled") as f:
            text = f.read()
    except OSError:
        return ""
    return text[text.find("[") + 1:text.find("]")] if "[" in text else text.strip()


def huge_pages(tensors) -> int:
    """Moves the memory of CPU tensors (expert weights) into transparent huge pages in place;
    returns the bytes now backed by them. See ``moe_ops.cpu_huge_pages``."""
    import ctypes
    import ctypes.util

    tensors = list(tensors)
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"cpu_huge_pages: expected tensors, got {type(t).__name__}")
        if t.device.type != "cpu":
            raise ValueError(f"cpu_huge_pages: expected CPU tensors, got one on {t.device}")
    if not sys.platform.startswith("linux"):
        return 0
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    # counted: the huge pages already counted, so that storages over the same memory (numpy
    # views, frombuffer at two offsets) do not count a page twice.
    huge, done, seen, counted = _huge_page_bytes(), 0, set(), set()
    for t in tensors:
        storage = t.untyped_storage()
        start, size = storage.data_ptr(), storage.nbytes()
        if start in seen or size == 0:
            continue
        seen.add(start)
        # Only the huge pages that lie wholly inside the storage: the memory around it (other
        # tensors, the allocator's) keeps its pages, and nothing outside is faulted in.
        lo, hi = -(-start // huge) * huge, (start + size) // huge * huge
        if hi <= lo:
            continue
        # MADV_HUGEPAGE first: where the system's THP mode is "madvise", it lets the range hold
        # huge pages at all (and khugepaged collapse it later if MADV_COLLAPSE cannot now).
        if libc.madvise(lo, hi - lo, _MADV_HUGEPAGE) != 0:
            log.info("moe_ops.cpu_huge_pages: madvise(MADV_HUGEPAGE) failed: %s", os.strerror(ctypes.get_errno()))
            continue
        # One huge page at a time: a call over the whole range fails as a whole when any one of
        # them cannot be collapsed (e.g. a 2 MiB region with no page touched yet), and the count
        # should say which did.
        errors = set()
        for page in range(lo, hi, huge):
            if page in counted:
                continue
            if libc.madvise(page, huge, _MADV_COLLAPSE) == 0:
                done += huge
                counted.add(page)
            else:
                errors.add(os.strerror(ctypes.get_errno()))
        if errors:
            log.info("moe_ops.cpu_huge_pages: madvise(MADV_COLLAPSE) failed on some pages: %s", ", ".join(sorted(errors)))
    return done


def status() -> Status:
    if not _load():
        return Status(NAME, ("CPU",), None, _why_not)
    kernels = ", ".join(f"{d}: {_kernel_name(getattr(torch, d))}" for d in ("bfloat16", "float32", "float16", "float64"))
    cached, limit = torch.ops.moe_cpu.cache_info()
    machine = torch.ops.moe_cpu.machine()
    lanes = {1: "256-bit lanes: this CPU runs 512-bit operations as two halves",
             2: "512-bit lanes"}.get(torch.ops.moe_cpu.bf16_scheme())
    swapped = (f"bf16 with k-contiguous weights in the swapped scheme (rows in {lanes}); "
               if machine == "avx512_bf16" and lanes else "")
    if machine == "amx" and torch.ops.moe_cpu.amx_emulated():
        machine = "amx (a test build: the tiles on moe_ops' emulator, csrc/cpu/amx_emulator.h)"
    return Status(NAME, ("CPU",), "native",
                  f"C++ kernel, {torch.get_num_threads()} threads, {machine} CPU ({kernels}); {swapped}"
                  f"output cache {cached >> 20} of {limit >> 20} MiB")

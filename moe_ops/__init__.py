"""moe_ops: one grouped-matmul operator for Mixture-of-Experts layers, a native kernel per device.

``moe_ops.grouped_mm`` is ``torch.ops.moe.grouped_mm``; see its docstring for the contract.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _contract, reference
from ._contract import checked
from ._op import kernel_counts, reset_kernel_counts
from .backends import load_all as _load_backends

__all__ = ["grouped_mm", "reference", "checked", "kernel_counts", "reset_kernel_counts", "empty_cpu_cache",
           "cpu_huge_pages"]
__version__ = "0.1.0"


def grouped_mm(
    mat_a: Tensor,
    mat_b: Tensor,
    offs: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> Tensor:
    """Grouped matrix multiply, a drop-in for ``torch._grouped_mm`` (same layouts and argument
    order; named as in ``torch.nn.functional.grouped_mm``; README "Differences from
    torch._grouped_mm").

    Layouts (G groups; offs[g] is the end of group g, offs[-1] of the previous group read as 0):

    * 2D x 3D: mat_a [M, K], mat_b [G, K, N], offs [G] over M -> [M, N]; rows
      offs[g-1]:offs[g] of mat_a use mat_b[g]. The MoE forward, and with mat_b transposed
      ([G, N, K] viewed as [G, K, N]) the input gradient.
    * 2D x 2D: mat_a [M, K], mat_b [K, N], offs [G] over K -> [G, M, N]; group g contracts over
      its slice of K. The weight gradient.
    * 3D x 3D: mat_a [G, M, K], mat_b [G, K, N], offs None -> [G, M, N].
    * 3D x 2D: mat_a [G, M, K], mat_b [K, N], offs [G] over N -> [M, N]; columns
      offs[g-1]:offs[g] use mat_a[g].

    Contract:

    * offs: int32 or int64, non-decreasing, 0 <= offs[g] <= the ragged extent; offs[-1] may be
      below the extent. Rows (2Dx3D) or columns (3Dx2D) past offs[-1] are exactly zero; an empty
      group gives zero rows, and in 2Dx2D an exactly zero [M, N] slice.
    * dtypes: float32, bfloat16, float16, float64; mat_a and mat_b share one. Accumulation is in
      float32 (float64 for float64 inputs). out_dtype is None or the input dtype (the same), or
      float32 for bfloat16/float16 inputs.
    * bias: optional [G, N] in the inputs' dtype, for 2Dx3D and 3Dx3D, added in the
      accumulation precision before the final cast.
    * Any strides; no alignment requirement. The result is a new contiguous tensor.
    * Bad metadata raises TypeError (types, dtypes, out_dtype) or ValueError (ranks, shapes,
      offs/bias presence, devices) naming the argument. On CPU, offs values are checked too
      (negative, decreasing, beyond the extent: ValueError). On accelerators values are never
      read on the host: kernels compute with ``cummax(clamp(offs, 0, extent))``, which is the
      identity for valid offs and memory-safe for any others; ``with moe_ops.checked():`` (or
      MOE_OPS_CHECKED=1) validates there as well, at the cost of one host sync per call.
    * Differentiable in mat_a, mat_b and bias; the backward calls this op, so it runs on the
      same native kernels. Works under torch.compile (fullgraph, dynamic) and torch.export.
    * Under torch.autocast, floating inputs other than float64 are cast to the autocast dtype
      first (as torch does for mm); out_dtype keeps its meaning.

    Args:
        mat_a: [M, K] or [G, M, K].
        mat_b: [G, K, N] or [K, N], mat_a's dtype.
        offs: [G] cumulative group ends, or None for 3D x 3D.
        bias: [G, N] or None.
        out_dtype: None, mat_a's dtype, or torch.float32 for bfloat16/float16 inputs.

    Returns:
        [M, N] for 2Dx3D and 3Dx2D, [G, M, N] for 2Dx2D and 3Dx3D, in out_dtype.
    """
    _contract.check_types(mat_a, mat_b, offs, bias, out_dtype)
    return torch.ops.moe.grouped_mm(mat_a, mat_b, offs, bias, out_dtype)


def empty_cpu_cache() -> int:
    """Returns to the OS the memory the CPU kernel keeps for reuse by later outputs (outputs of
    8 MiB and more; see moe_ops/backends/cpu.py and ``MOE_OPS_CPU_CACHE_MB``); the bytes released."""
    from .backends import cpu

    return cpu.empty_cache()


def cpu_huge_pages(*tensors: Tensor) -> int:
    """Moves the memory of the given CPU tensors into transparent huge pages (2 MiB on x86-64) in place
    (Linux 6.1+: ``madvise(MADV_HUGEPAGE)`` then ``MADV_COLLAPSE``); returns the bytes of their
    memory in huge pages after the call, those already there included (0 where the OS cannot or
    will not: other systems, older kernels, THP off, no free huge pages). Values,
    addresses and strides do not change. Only the huge-page-aligned part of each tensor's storage
    is moved, so small tensors are left alone; each call copies what it moves once.

    For expert weights on CPU: the kernel streams them from memory on every call, and a core
    streams from 4 KiB pages much slower than from huge pages where every new page costs a page
    walk (README, "Huge pages for the weights"). Call it once after loading a model, e.g.
    ``moe_ops.cpu_huge_pages(*model.parameters())``; ``THP_MEM_ALLOC_ENABLE=1`` in the
    environment makes torch allocate such tensors in huge pages in the first place.

    Args:
        tensors: CPU tensors (views are fine: their whole storage is considered).

    Returns:
        Bytes of the tensors' memory in huge pages, a multiple of the huge page size.
    """
    from .backends import cpu

    return cpu.huge_pages(tensors)


_load_backends()

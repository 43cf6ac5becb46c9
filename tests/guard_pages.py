"""Every CPU kernel level on operands that end where readable memory ends (the next page is
PROT_NONE) or begin right after an unreadable page: any read past either end, a full vector
where a masked one was meant, say, kills the process with SIGSEGV. Run by test_cpu.py in a
subprocess (``python tests/guard_pages.py ISA:SCHEME...``), which checks the exit status and that
every result matches the reference; prints one line per level."""

from __future__ import annotations

import ctypes
import mmap
import sys

import torch

from moe_ops import _contract
from moe_ops.testing import assert_close, reference_results

PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_keep = []  # the mappings stay alive (and unmapped never) while tensors view them


def guarded(t: torch.Tensor, at_end: bool) -> torch.Tensor:
    """A copy of t with t's strides whose storage ends at the end of a readable page followed by
    an unreadable one (at_end) or starts at the start of a page after an unreadable one."""
    span = (1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))) * t.element_size() if t.numel() else 0
    pages = -(-span // PAGE) + 2
    m = mmap.mmap(-1, pages * PAGE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    for page in (0, pages - 1):
        if _libc.mprotect(ctypes.c_void_p(base + page * PAGE), PAGE, 0) != 0:
            raise OSError(ctypes.get_errno(), "mprotect")
    start = (pages - 1) * PAGE - span if at_end else PAGE
    raw = torch.frombuffer(m, dtype=torch.uint8, count=max(span, t.element_size()), offset=start)
    out = raw.view(t.dtype).as_strided(t.shape, t.stride())
    out.copy_(t)
    _keep.append(m)
    return out


def problems(dtype):
    """(name, mat_a, mat_b, offs, bias) per layout and weight orientation: K and N off every
    vector and tile width, an empty group, groups of 2-4 rows (decode kernels, with K >= 4096
    too), one larger than an AMX item's share of L2 (301 rows), and trailing rows. In bf16 also
    two groups of 640 + 600 or 668 + 668 rows at K = 4096, the last one ending where A ends:
    make_items cuts them (2 threads) into items of 72 rows (the last of 64), 75, and 84 (the
    last of 80), past the 64 rows of an AMX item in L2 at that K, so amx_item_panels reads their
    full 32-row panels of A as tiles in place and copies the 8, 11 or 20 rows left, except that
    the last 16 rows, up to the end of A, are read in place too (1 thread: items of 120-167)."""
    g = torch.Generator().manual_seed(0)

    def r(*size):
        return torch.randn(*size, generator=g, dtype=torch.float64).to(dtype)

    for K, N in ((37, 33), (160, 48), (7, 1), (4100, 20)):
        offs = torch.tensor([3, 3, 5, 9, 310, 330], dtype=torch.int32)  # 3, 0, 2, 4, 301, 20 rows
        G, M = offs.numel(), 333  # offs[-1] = 330: three trailing rows
        yield "2d3d [G, K, N]", r(M, K), r(G, K, N), offs, r(G, N)
        yield "2d3d [G, N, K]^T", r(M, K), r(G, N, K).transpose(1, 2), offs, r(G, N)
        # The last group up to A's last row (35 rows: vectors of 2 rows in the 256-bit swapped
        # scheme, of 4 in the 512-bit one; K % 8 == 5 at K = 37): the swapped schemes pack A by
        # 2 or 4 rows x 8 k, masked at the item's last row and at K.
        yield "2d3d [G, N, K]^T, the last group to its end", r(M, K), r(4, N, K).transpose(1, 2), \
            torch.tensor([3, 9, M - 35, M], dtype=torch.int32), None
        yield "2d2d x^T", r(M, K).t(), r(M, N), offs, None
        # The last group up to A's last column: x^T's column-major packings (fma_pack_a,
        # pack_a_kmajor, pair_pack_a) read each k's rows with a mask of the item's rows; one
        # unmasked vector reads up to 15 elements past the last column here, not above.
        to_end = torch.tensor([3, 9, M], dtype=torch.int32)
        yield "2d2d x^T, the last group to its end", r(M, K).t(), r(M, N), to_end, None
        yield "2d2d [K, M]", r(K, M), r(M, N), offs, None
        yield "3d3d", r(G, 5, K), r(G, K, N), None, r(G, N)
        yield "3d2d", r(G, 5, K), r(K, N + 30), torch.tensor([0, 2, 2, 9, 20, N + 29], dtype=torch.int32), None
    if dtype == torch.bfloat16:
        K, N = 4096, 40
        for sizes in ((640, 600), (668, 668)):
            offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32)
            yield f"2d3d [G, K, N] groups of {sizes}", r(sum(sizes), K), r(2, K, N), offs, r(2, N)
            yield f"2d3d [G, N, K]^T groups of {sizes}", r(sum(sizes), K), r(2, N, K).transpose(1, 2), offs, None


def main(levels):
    """levels: "isa:bf16_scheme" pairs, the op's private arguments (isa 0 generic .. 4 AMX)."""
    calls = dict.fromkeys(levels, 0)
    for dtype in (torch.bfloat16, torch.float32, torch.float16, torch.float64):
        for what, a, b, offs, bias in problems(dtype):
            placed = [[None if x is None else guarded(x, at_end) for x in (a, b, offs, bias)] for at_end in (True, False)]
            for out_dtype in {dtype, torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype}:
                refs = reference_results(a, b, offs, bias, out_dtype)
                for level in levels:
                    isa, scheme = (int(v) for v in level.split(":"))
                    for ga, gb, go, gbias in placed:
                        out = torch.ops.moe_cpu.grouped_mm(_contract.layout_of(a, b), ga, gb, go, gbias, out_dtype,
                                                           isa, scheme)
                        assert_close(out, *refs, what=f"{level} {dtype} {what} -> {out_dtype}")
                        calls[level] += 1
    for level, n in calls.items():
        print(f"{level}: {n} calls, operands at page ends and starts, all match", flush=True)


if __name__ == "__main__":
    import moe_ops._cpu  # noqa: F401  (registers torch.ops.moe_cpu)

    main(sys.argv[1:])

"""The contract of ``moe::grouped_mm``: every argument check lives here, once.

``check_args`` validates shapes, ranks and dtypes without reading tensor values, so the fake
kernel, the reference and every device kernel call it (also under torch.compile, where sizes may
be symbolic). ``check_offs_values`` reads offs values and raises on a bad partition; it runs for
CPU tensors and, on accelerators, only in checked mode because reading values there is a host
sync. ``sanitize_offs`` is what accelerator kernels see instead: a device-side clamp that turns
any offs into a valid partition, so no kernel can index out of bounds whatever the values are.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Callable, Iterator, NamedTuple, Optional

import torch

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
OFFS_DTYPES = (torch.int32, torch.int64)

# The four layouts, named by the ranks of (mat_a, mat_b).
LAYOUT_2D3D = "2d3d"  # mat_a [M, K] rows grouped by offs, mat_b [G, K, N] -> [M, N]
LAYOUT_2D2D = "2d2d"  # mat_a [M, K], mat_b [K, N], K grouped by offs -> [G, M, N]
LAYOUT_3D3D = "3d3d"  # mat_a [G, M, K], mat_b [G, K, N], no offs -> [G, M, N]
LAYOUT_3D2D = "3d2d"  # mat_a [G, M, K], mat_b [K, N] columns grouped by offs -> [M, N]
LAYOUTS = (LAYOUT_2D3D, LAYOUT_2D2D, LAYOUT_3D3D, LAYOUT_3D2D)


class Problem(NamedTuple):
    """What ``check_args`` learned about one call.

    ``extent`` is the length of the dimension that ``offs`` partitions (M for 2d3d, K for 2d2d,
    N for 3d2d; None for 3d3d). Sizes may be SymInts when called from the fake kernel.
    A NamedTuple rather than a frozen dataclass: built on every call, it costs 0.3 us instead
    of 1.3 us (ten fields set through object.__setattr__).
    """

    layout: str
    G: int
    M: int
    K: int
    N: int
    dtype: torch.dtype
    out_dtype: torch.dtype
    acc_dtype: torch.dtype
    out_shape: tuple
    extent: Optional[int]


def _fail_unless(cond, error_type, message: Callable[[], str]) -> None:
    # torch._check_with accepts SymBools: under dynamic shapes it records a runtime assert
    # instead of specialising on the symbol. Plain bools (eager calls) skip it: it costs ~2 us a
    # check, a third of check_args on CPU. The message is built only on failure (formatting
    # the shapes of every call cost another ~2 us).
    if cond is True:
        return
    if cond is False:
        raise error_type(message())
    torch._check_with(error_type, cond, message)


def _describe(t: torch.Tensor) -> str:
    return f"{t.dim()}-D tensor of shape {tuple(t.shape)}"


def check_types(mat_a, mat_b, offs=None, bias=None, out_dtype=None) -> None:
    """TypeError unless the arguments have the schema's Python types.

    The dispatcher already rejects these for ``torch.ops.moe.grouped_mm`` (with a RuntimeError);
    ``moe_ops.grouped_mm`` calls this first so Python callers get a TypeError naming the argument.
    """
    for name, t in (("mat_a", mat_a), ("mat_b", mat_b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if offs is not None and not isinstance(offs, torch.Tensor):
        raise TypeError(f"offs must be a torch.Tensor or None, got {type(offs).__name__}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
    if out_dtype is not None and not isinstance(out_dtype, torch.dtype):
        raise TypeError(f"out_dtype must be a torch.dtype or None, got {out_dtype!r}")


_LAYOUT_BY_RANKS = {(2, 3): LAYOUT_2D3D, (2, 2): LAYOUT_2D2D, (3, 3): LAYOUT_3D3D, (3, 2): LAYOUT_3D2D}


def layout_of(mat_a, mat_b) -> str:
    """The layout named by the ranks of mat_a and mat_b (both 2-D or 3-D, as check_args checks)."""
    return _LAYOUT_BY_RANKS[mat_a.dim(), mat_b.dim()]


def check_args(mat_a, mat_b, offs=None, bias=None, out_dtype=None) -> Problem:
    """Validate one call's metadata (never its values) and describe the problem.

    Raises TypeError for wrong types and dtypes, ValueError for wrong ranks, shapes, missing or
    forbidden arguments and mismatched devices. Every message names the argument.
    """
    check_types(mat_a, mat_b, offs, bias, out_dtype)
    if mat_a.dim() not in (2, 3):
        raise ValueError(f"mat_a must be 2-D [M, K] or 3-D [G, M, K], got a {_describe(mat_a)}")
    if mat_b.dim() not in (2, 3):
        raise ValueError(f"mat_b must be 2-D [K, N] or 3-D [G, K, N], got a {_describe(mat_b)}")

    dtype = mat_a.dtype
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"mat_a has unsupported dtype {dtype}; expected one of "
            "torch.float32, torch.bfloat16, torch.float16, torch.float64"
        )
    if mat_b.dtype != dtype:
        raise TypeError(f"mat_b must have mat_a's dtype {dtype}, got {mat_b.dtype}")

    device = mat_a.device
    for name, t in (("mat_b", mat_b), ("offs", offs), ("bias", bias)):
        if t is not None and t.device != device:
            raise ValueError(
                f"{name} is on device {t.device} but mat_a is on {device}; all tensors must be on one device"
            )

    if out_dtype is None:
        out_dtype = dtype
    elif out_dtype != dtype and not (
        out_dtype == torch.float32 and dtype in (torch.bfloat16, torch.float16)
    ):
        raise TypeError(
            f"out_dtype={out_dtype} is not allowed for {dtype} inputs; expected None, "
            f"{dtype}, or torch.float32 for bfloat16/float16 inputs"
        )
    acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32

    layout = layout_of(mat_a, mat_b)
    out_shape: tuple[int, ...]
    if layout == LAYOUT_2D3D:
        M, K = mat_a.shape
        G, Kb, N = mat_b.shape
        out_shape, extent = (M, N), M
        a_dims, b_dims = "[M, K]", "[G, K, N]"
    elif layout == LAYOUT_2D2D:
        M, K = mat_a.shape
        Kb, N = mat_b.shape
        G = offs.shape[0] if offs is not None and offs.dim() == 1 else 1
        out_shape, extent = (G, M, N), K
        a_dims, b_dims = "[M, K]", "[K, N]"
    elif layout == LAYOUT_3D3D:
        G, M, K = mat_a.shape
        Gb, Kb, N = mat_b.shape
        _fail_unless(
            G == Gb, ValueError,
            lambda: f"mat_a and mat_b must have the same number of groups G: mat_a is [G, M, K] = "
            f"{tuple(mat_a.shape)}, mat_b is [G, K, N] = {tuple(mat_b.shape)}",
        )
        out_shape, extent = (G, M, N), None
        a_dims, b_dims = "[G, M, K]", "[G, K, N]"
    else:  # LAYOUT_3D2D
        G, M, K = mat_a.shape
        Kb, N = mat_b.shape
        out_shape, extent = (M, N), N
        a_dims, b_dims = "[G, M, K]", "[K, N]"
    _fail_unless(
        K == Kb, ValueError,
        lambda: f"K mismatch: mat_a is {a_dims} = {tuple(mat_a.shape)} and mat_b is {b_dims} = {tuple(mat_b.shape)}",
    )

    if layout == LAYOUT_3D3D:
        if offs is not None:
            raise ValueError("offs must be None when mat_a and mat_b are both 3-D (3d x 3d has no ragged dimension)")
    else:
        if offs is None:
            ragged = {LAYOUT_2D3D: "M (rows of mat_a)", LAYOUT_2D2D: "K", LAYOUT_3D2D: "N (columns of mat_b)"}[layout]
            raise ValueError(f"offs is required for the {layout} layout: cumulative group ends over {ragged}")
        if offs.dtype not in OFFS_DTYPES:
            raise TypeError(f"offs must be int32 or int64, got {offs.dtype}")
        if offs.dim() != 1:
            raise ValueError(f"offs must be 1-D [G], got a {_describe(offs)}")
        _fail_unless(
            offs.shape[0] == G, ValueError,
            lambda: f"offs must have G = {G} entries (one per group), got {offs.shape[0]}",
        )
    _fail_unless(G >= 1, ValueError, lambda: "the number of groups G must be at least 1")

    if bias is not None:
        if layout not in (LAYOUT_2D3D, LAYOUT_3D3D):
            raise ValueError(f"bias is only supported for the 2d3d and 3d3d layouts, not {layout}")
        if bias.dtype != dtype:
            raise TypeError(f"bias must have the inputs' dtype {dtype}, got {bias.dtype}")
        _fail_unless(
            bias.dim() == 2 and bias.shape[0] == G and bias.shape[1] == N, ValueError,
            lambda: f"bias must be [G, N] = [{G}, {N}], got a {_describe(bias)}",
        )

    return Problem(layout, G, M, K, N, dtype, out_dtype, acc_dtype, tuple(out_shape), extent)


def autocast_cast(t, dtype):
    """The autocast rule for one argument (README, "Autocast"): a floating tensor other than
    float64 is cast to the autocast dtype ``dtype``; anything else is returned as it is."""
    if t is None or not t.is_floating_point() or t.dtype in (dtype, torch.float64):
        return t
    return t.to(dtype)


def check_offs_values(offs: torch.Tensor, extent: int) -> None:
    """Raise ValueError unless 0 <= offs[0] <= offs[1] <= ... <= extent. Reads values (host sync)."""
    check_offs_list(offs.tolist(), extent)


def check_offs_list(values: list, extent: int) -> None:
    """``check_offs_values`` on offs already read into a list."""
    # Valid offs (every call but a failing one) are checked at C speed: sorted, first >= 0,
    # last <= extent. At G=256 that is 4 us instead of 10 us for the loop below, which finds
    # the offending entry for the message.
    if not values or (values[0] >= 0 and values[-1] <= extent and values == sorted(values)):
        return
    prev = 0
    for g, v in enumerate(values):
        if v < 0:
            raise ValueError(f"offs must be non-negative, but offs[{g}] = {v}")
        if v > extent:
            raise ValueError(f"offs[{g}] = {v} exceeds the extent {extent} of the dimension offs partitions")
        if v < prev:
            raise ValueError(f"offs must be non-decreasing, but offs[{g}] = {v} < offs[{g - 1}] = {prev}")
        prev = v


def sanitize_offs(offs: torch.Tensor, extent: int) -> torch.Tensor:
    """The partition an accelerator kernel computes for arbitrary offs, without a host sync.

    Returns cummax(clamp(offs, 0, extent)): values past the extent are clamped to it, negative
    ones to 0, and a group whose end lies below an earlier end is empty. For valid offs this is
    the identity.
    """
    return torch.cummax(offs.clamp(0, extent), dim=-1).values


def prepare_offs(offs, extent, kernel_clamps: bool = False):
    """The offs a kernel computes with: validated where reading values is free (CPU) or asked
    for (checked mode), else sanitized on the device, unless ``kernel_clamps`` says the kernel
    applies ``sanitize_offs``'s clamp itself (then offs is handed over as it is). None stays
    None."""
    if offs is None:
        return None
    if offs.device.type == "cpu" or checked_mode():
        check_offs_values(offs, extent)
        return offs
    return offs if kernel_clamps else sanitize_offs(offs, extent)


_checked = threading.local()
_OFF = ("", "0", "false", "no", "off")  # MOE_OPS_CHECKED values that leave checked mode off


def checked_mode() -> bool:
    """True when offs values are validated on accelerators too (costs one host sync per call)."""
    flag = getattr(_checked, "on", None)
    if flag is None:
        return os.environ.get("MOE_OPS_CHECKED", "").strip().lower() not in _OFF
    return flag


@contextlib.contextmanager
def checked(enabled: bool = True) -> Iterator[None]:
    """Context manager: validate offs values on every device (raises like on CPU, syncs the host).

    The environment variable MOE_OPS_CHECKED=1 turns it on for a whole process (any value but
    an empty one, 0, false, no or off, in any case).
    """
    prev = getattr(_checked, "on", None)
    _checked.on = enabled
    try:
        yield
    finally:
        _checked.on = prev

"""Test utilities: run any backend's kernel on CPU tensors, and the one tolerance rule.

``run_backend`` is what the property suite runs for every backend, and what a user porting a
model can call to check a backend on their own shapes without the hardware.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from . import _contract, backends, reference
from .backends import BackendUnavailable

__all__ = ["backend_names", "run_backend", "tolerance", "assert_close", "reference_results", "float64_exactly",
           "float64_exactly_applies", "BackendUnavailable"]


def backend_names() -> list[str]:
    """The backends this build knows, "reference" first."""
    return ["reference", *backends.BACKEND_MODULES]


def run_backend(name: str, mat_a: torch.Tensor, mat_b: torch.Tensor, offs: Optional[torch.Tensor] = None,
                bias: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None, *,
                check_offs: bool = True) -> torch.Tensor:
    """Run backend ``name``'s kernel directly on CPU tensors.

    The kernel runs natively, in its vendor's interpreter or simulator, or on our emulator,
    whichever is how that backend is verified on this machine (``python -m moe_ops`` says
    which). Arguments and result follow ``moe_ops.grouped_mm``.

    check_offs=True validates offs values as the op does on CPU; check_offs=False behaves as
    on an accelerator: values are not checked but clamped to ``cummax(clamp(offs, 0, extent))``
    (by the kernel itself for a backend with ``CLAMPS_OFFS``).

    Raises:
        BackendUnavailable: the backend cannot run here (the message names what is missing).
        NotImplementedError: the backend does not serve this layout or dtype (the op would use
            the reference for such a call).
    """
    p = _contract.check_args(mat_a, mat_b, offs, bias, out_dtype)
    for arg, t in (("mat_a", mat_a), ("mat_b", mat_b), ("offs", offs), ("bias", bias)):
        if t is not None and t.device.type != "cpu":
            raise ValueError(f"run_backend takes CPU tensors; {arg} is on {t.device}")
    # (check_args: offs exactly where there is an extent)
    if offs is not None and p.extent is not None and check_offs:
        _contract.check_offs_values(offs, p.extent)
    if name == "reference":
        module = None
    elif name in backends.BACKEND_MODULES:
        module = backends.module(name)
    else:
        raise KeyError(f"unknown backend {name!r}; known: {backend_names()}")
    if offs is not None and p.extent is not None and not check_offs and not getattr(module, "CLAMPS_OFFS", False):
        offs = _contract.sanitize_offs(offs, p.extent)
    if module is None:
        return reference.compute(p, mat_a, mat_b, offs, bias)
    return module.run_here(p, mat_a, mat_b, offs, bias)


def tolerance(ref64: torch.Tensor, ref_same: torch.Tensor, magnitude: torch.Tensor) -> float:
    """The largest absolute error any implementation may have against ``ref64``.

    Rule (as in flash-attention and quack): 2 x the error of the same computation done the
    plain way in the inputs' precision (``ref_same``: fp32/fp64 accumulation, one rounding to
    the output dtype), plus the rounding that a different but equally valid accumulation order
    may add: one unit of the output dtype on the largest output, and two units of the
    accumulation dtype on ``magnitude``, the largest sum of |a_ik * b_kj| (+ |bias_j|), i.e. the
    same computation on absolute values in float64. The second term matters where the plain
    computation is lucky, e.g. a single output element whose dot product cancels.

    For float64 inputs ``ref64`` must be more exact than float64: the tests' oracle
    (tests/oracle.py) and ``reference_results`` sum float64 problems as if in twice the precision
    (``float64_exactly``: their own formulation on Ozaki's error-free splittings), so the first
    term measures the plain float64 sum's rounding. With a plain float64 ``ref64`` that term is
    zero and long sums fail the rule: measured on the Zen 4 VM (2026-12-06, M=209, N=64, G=4, 20
    seeds, the CPU kernels at the generic and AVX-512 levels), at K = 256 / 1024 / 4096 the
    largest error against a float64 einsum was 2.29 / 2.13 / 2.55 eps x max magnitude against
    tolerances of 2.27-2.41 / 2.16-2.18 / 2.09-2.11 (K = 4096 failed 11 of 40 calls), the einsum
    itself up to 1.36 off an 80-bit sum; against a value summed as if in twice the precision
    (2026-12-07, 5 seeds, five layouts, the plain einsum as ``ref_same``) at most 1.80 / 2.16 /
    2.60 against tolerances of at least 3.78 / 3.89 / 3.99, and within 0.34 of the tolerance
    with reference_results' three (tests/test_cpu.py, test_long_float64_sums_...).
    """
    if ref64.numel() == 0:
        return 0.0
    ref64 = ref64.double()
    acc_eps = torch.finfo(torch.float64 if ref_same.dtype == torch.float64 else torch.float32).eps
    same_err = (ref_same.double() - ref64).abs().max().item()
    out_ulp = torch.finfo(ref_same.dtype).eps * ref64.abs().max().item()
    return 2.0 * same_err + out_ulp + 2.0 * acc_eps * magnitude.double().abs().max().item()


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """float64 2**exponent, exactly (built from its bits), for int64 exponents in [-1022, 1023]."""
    return ((exponent.to(torch.int64) + 1023) << 52).view(torch.float64)


def _slices(x: torch.Tensor, dim: int, bits: int, count: int) -> list:
    """x (float64, finite) as ``count`` tensors of at most ``bits`` + 1 significant bits each on a
    grid shared along ``dim`` (slice i: multiples of 2**(e - bits * (i + 1)), |slice i| <=
    2**(e - bits * i), e the exponent of the line's largest |x|), whose sum is x up to
    2**(e - bits * count) (Ozaki's error-free splitting). Each slice is x's remainder rounded
    to its grid by adding and subtracting 1.5 * 2**(52 + grid exponent)."""
    e = torch.frexp(x.abs().amax(dim=dim, keepdim=True)).exponent.to(torch.int64)
    out, rest = [], x
    for i in range(count):
        sigma = 1.5 * _pow2(e - bits * (i + 1) + 52)
        part = (rest + sigma) - sigma
        out.append(part)
        rest = rest - part
    return out


def float64_exactly_applies(mat_a: torch.Tensor, mat_b: torch.Tensor, bias: Optional[torch.Tensor] = None) -> bool:
    """Whether ``float64_exactly`` serves this problem: float64 operands with elements, all
    values finite (an inf or NaN makes the splitting's grid meaningless)."""
    return (mat_a.dtype == torch.float64 and mat_a.numel() > 0 and mat_b.numel() > 0
            and all(t is None or bool(t.isfinite().all()) for t in (mat_a, mat_b, bias)))


def float64_exactly(bilinear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], mat_a: torch.Tensor,
                    mat_b: torch.Tensor, extra: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``bilinear(mat_a, mat_b)`` (+ ``extra``) as if summed in twice float64's precision, then
    rounded: for a float64 function bilinear in A and B that contracts A's last dimension with
    B's next to last (each layout of grouped_mm) and sums its products in float64 in any order.
    A and B are split along those dimensions into slices of at most ``bits`` + 1 bits on a grid
    per line (Ozaki's error-free splitting, ``_slices``), so that bilinear sums every product of
    two slices exactly (K products of at most 2 * bits bits, < 2**52 units of their grid); the
    products for which i + j < count (the rest lie below 2**-80 of the largest |a| |b|) and
    ``extra`` (an exact term, e.g. the bias as placed by bilinear's problem) are summed with
    compensation (Knuth's two-sum). Operands as ``float64_exactly_applies`` takes them, well
    inside float64's normal range (a grid below 2**-1022, lines of values near 1e-300, would not
    be exact)."""
    K = mat_a.shape[-1]
    bits = (52 - K.bit_length()) // 2
    count = -(-80 // bits)
    As, Bs = _slices(mat_a, -1, bits, count), _slices(mat_b, -2, bits, count)
    terms = [bilinear(As[i], Bs[j]) for i in range(count) for j in range(count - i)]
    total, carry = torch.zeros_like(terms[0]), torch.zeros_like(terms[0])
    for t in terms + ([] if extra is None else [extra]):
        s = total + t
        z = s - total
        carry = carry + ((total - (s - z)) + (t - z))
        total = s
    return total + carry


def reference_results(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: Optional[torch.Tensor] = None,
                      bias: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ref64, ref_same, magnitude) for ``assert_close``, from ``moe_ops.reference``: the problem
    in float64 (float64 problems with elements, all finite, as if in twice float64's precision:
    ``float64_exactly`` on the reference, see ``tolerance``), in the inputs' precision with
    ``out_dtype``, and in float64 on absolute values. For problems too large for an einsum
    oracle (tests compare small ones against one that shares no code with the reference)."""
    b64 = None if bias is None else bias.double()
    if float64_exactly_applies(mat_a, mat_b, bias):
        placed = None if bias is None else reference.grouped_mm(torch.zeros_like(mat_a), mat_b, offs, b64)  # 0 + bias
        ref64 = float64_exactly(lambda x, y: reference.grouped_mm(x, y, offs), mat_a, mat_b, placed)
    else:
        ref64 = reference.grouped_mm(mat_a.double(), mat_b.double(), offs, b64)
    ref_same = reference.grouped_mm(mat_a, mat_b, offs, bias, out_dtype=out_dtype)
    mag = reference.grouped_mm(mat_a.double().abs(), mat_b.double().abs(), offs, None if b64 is None else b64.abs())
    return ref64, ref_same, mag


def assert_close(out: torch.Tensor, ref64: torch.Tensor, ref_same: torch.Tensor, magnitude: torch.Tensor,
                 what: str = "") -> None:
    """Assert out matches the float64 reference within ``tolerance``; shape and dtype exactly."""
    prefix = f"{what}: " if what else ""
    assert out.shape == ref64.shape, f"{prefix}shape {tuple(out.shape)} != {tuple(ref64.shape)}"
    assert out.dtype == ref_same.dtype, f"{prefix}dtype {out.dtype} != {ref_same.dtype}"
    out64 = out.detach().cpu().double()
    assert not out64.isnan().any(), f"{prefix}NaN in output"
    if out64.numel() == 0:
        return
    err = (out64 - ref64.double()).abs().max().item()
    tol = tolerance(ref64, ref_same, magnitude)
    assert err <= tol, f"{prefix}max abs error {err:.3e} > tolerance {tol:.3e}"

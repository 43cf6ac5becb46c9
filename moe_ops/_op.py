"""``torch.ops.moe.grouped_mm``: the op, its fake kernel, its autograd formula and the kernel entry.

Registration (measured on torch 2.13, see README "Design"), all through one
``torch.library.Library("moe", "DEF")``:
* the reference is the CompositeExplicitAutograd kernel, so every device without a native
  kernel gets a correct, sync-free result;
* ``register_fake`` derives shapes and dtypes from metadata only;
* the Autograd kernel writes both gradients as calls of the op itself, so the backward runs on
  the same native kernels as the forward. It is the C++ one of ``moe_ops._autograd``
  (csrc/autograd) when that module loads, else ``_autograd_kernel`` below (an
  ``autograd.Function``) with the same formulas; ``use_autograd`` switches, the tests run both.
  Both set the forward-mode tangent (dual tensors); torch.func transforms need the C++ one;
* an Autocast kernel per autocast key casts the floating inputs to the autocast dtype, as torch
  does for its matmuls;
* a batching rule (``_batching.py``, ``use_batching_rule``) computes a vmapped call, and the
  jacobians and per-sample gradients built on vmap, in one call of the op where it can;
* device kernels are added per dispatch key through ``register_device_kernel`` (one file per
  backend under ``moe_ops/backends``), wrapped by ``kernel_entry`` which does the contract checks.
"""

from __future__ import annotations

import collections
import logging
import threading
import types
from typing import Callable

import torch

from . import _batching, _contract, _native, reference
from ._contract import LAYOUT_2D2D, LAYOUT_2D3D, LAYOUT_3D2D, LAYOUT_3D3D

log = logging.getLogger("moe_ops")

OP_NAME = "moe::grouped_mm"

_counts_lock = threading.Lock()
_counts: collections.Counter = collections.Counter()
_fallback_logged: set = set()


def kernel_counts() -> dict[str, int]:
    """How many calls each kernel served in this process, e.g. {"cpu:avx512_bf16": 12, "reference": 1}."""
    with _counts_lock:
        return dict(_counts)


def reset_kernel_counts() -> None:
    """Forgets the counts ``kernel_counts`` reports (for all threads of the process)."""
    with _counts_lock:
        _counts.clear()


def _record(name: str) -> None:
    with _counts_lock:
        _counts[name] += 1


_served = threading.local()


def note_kernel(name: str) -> None:
    """Called by a kernel impl to name the concrete kernel that served the call (e.g.
    "cuda:triton" vs "cuda:blackwell"); otherwise the registered name is recorded."""
    _served.name = name


def kernel_entry(name: str, impl: Callable, clamps_offs: bool = False) -> Callable:
    """Wrap a device kernel with the contract: metadata checks, offs values, reference fallback.

    ``impl(problem, mat_a, mat_b, offs, bias)`` receives validated arguments; on CPU tensors (or
    in checked mode) offs values were checked, otherwise offs was sanitized on the device, or,
    with ``clamps_offs``, handed over unsanitized for a kernel that applies
    ``_contract.sanitize_offs``'s clamp itself. It may raise NotImplementedError for a layout or
    dtype it does not serve: the reference then computes the call and the reason is logged once.
    """

    def kernel(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
        p = _contract.check_args(mat_a, mat_b, offs, bias, out_dtype)
        offs = _contract.prepare_offs(offs, p.extent, kernel_clamps=clamps_offs)
        _served.name = None
        try:
            out = impl(p, mat_a, mat_b, offs, bias)
        except NotImplementedError as e:
            key = (name, str(e))
            if key not in _fallback_logged:
                _fallback_logged.add(key)
                log.info("moe_ops: %s does not serve this call (%s); using the reference", name, e)
            _record("reference")
            if clamps_offs and offs is not None:
                assert p.extent is not None  # None only for 3d3d, which has no offs
                offs = _contract.sanitize_offs(offs, p.extent)
            return reference.compute(p, mat_a, mat_b, offs, bias)
        _record(_served.name or name)
        return out

    kernel.__name__ = f"grouped_mm_{name.replace(':', '_')}"
    return kernel


def _reference_impl(p, mat_a, mat_b, offs, bias):
    return reference.compute(p, mat_a, mat_b, offs, bias)


_default_kernel = kernel_entry("reference", _reference_impl)

# The op is defined with torch.library directly rather than with ``torch.library.custom_op``:
# custom_op's Autograd kernel (a generic autograd.Function that rebuilds the arguments from the
# schema and wraps them in a dataclass on every call) cost more than the kernel it wrapped.
# Measured on torch 2.13 (CPU, 1 thread, an 8 x 16 x 8 problem, best of 7 x 4000 calls, three
# alternating runs): custom_op 41-45 us per call without grad, 83-86 us with it, 274 us for a
# forward + backward; this registration 34-36 / 59-63 / 231-240 us.
# The registration is the one custom_op makes (CompositeExplicitAutograd reference, fake
# kernel, Autograd kernel, the pt2_compliant tag), so torch.compile and opcheck see the same op.
_lib = torch.library.Library("moe", "DEF")
_lib.define(
    "grouped_mm(Tensor mat_a, Tensor mat_b, Tensor? offs=None, Tensor? bias=None, ScalarType? out_dtype=None) -> Tensor",
    tags=(torch.Tag.pt2_compliant_tag,),
)
_lib.impl("grouped_mm", _default_kernel, "CompositeExplicitAutograd")
_OP = torch.ops.moe.grouped_mm.default
_AFTER_AUTOGRAD = torch._C._after_autograd_keyset


@torch.library.register_fake(OP_NAME, lib=_lib)
def _fake(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    p = _contract.check_args(mat_a, mat_b, offs, bias, out_dtype)
    return mat_a.new_empty(p.out_shape, dtype=p.out_dtype)


# Autocast: the rule torch applies to its matmuls (mm, bmm, matmul: "lower precision"): under
# torch.autocast, floating inputs other than float64 are cast to the autocast dtype of their device
# before the op runs, and the op runs with autocast off. torch._grouped_mm has no such rule
# (pytorch/pytorch#174763: fp32 activations with bf16 expert weights fail there under autocast),
# so MoE code casts by hand around it. Casts are ordinary differentiable ops: fp32 leaves get fp32
# gradients. out_dtype is kept (None: the autocast dtype; float32: fp32 accumulation and output).
#
# The autocast dispatch keys and the device type whose autocast dtype each one applies (the
# tensor's own device type can differ: XLA tensors on a GPU reach AutocastCUDA). Registered by
# name: the Python DispatchKey enum lacks some of them (AutocastXLA), which the dispatcher has.
_AUTOCAST_DEVICE_TYPES = {
    "AutocastCPU": "cpu", "AutocastCUDA": "cuda", "AutocastXLA": "xla", "AutocastXPU": "xpu",
    "AutocastMPS": "mps", "AutocastHPU": "hpu", "AutocastMTIA": "mtia", "AutocastMAIA": "maia",
    "AutocastIPU": "ipu", "AutocastPrivateUse1": None,  # None: PrivateUse1's name when called
}


def _autocast_kernel(device_type):
    def kernel(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
        dtype = torch.get_autocast_dtype(device_type or torch._C._get_privateuse1_backend_name())
        cast = _contract.autocast_cast
        with torch._C._DisableAutocast():  # every autocast key excluded: the call below runs as is
            return _OP(cast(mat_a, dtype), cast(mat_b, dtype), offs, cast(bias, dtype), out_dtype)

    return kernel


for _key, _device_type in _AUTOCAST_DEVICE_TYPES.items():
    try:
        _lib.impl("grouped_mm", _autocast_kernel(_device_type), _key)
    except RuntimeError:  # a torch without this key
        pass


def register_device_kernel(device_type: str, name: str, impl: Callable, *, clamps_offs: bool = False) -> None:
    """Register ``impl`` (see ``kernel_entry``) as the kernel for one device type.

    device_type is a torch.library device name ("cpu", "cuda", "xla", "privateuseone");
    name is what ``kernel_counts`` and ``python -m moe_ops`` call it; clamps_offs: see
    ``kernel_entry``.
    """
    # The device-name -> dispatch-key mapping custom_op.register_kernel uses. Kernels go straight
    # into the dispatch table rather than through custom_op.register_kernel, whose wrapper adds a
    # torch._dynamo disable context and an aliasing check to every call: measured on torch 2.13
    # (CPU), 12.6 -> 7.9 us per call of a trivial op. Our kernels always return a new tensor.
    _lib.impl("grouped_mm", kernel_entry(name, impl, clamps_offs), torch._C._dispatch_key_for_device(device_type))


def _backward(ctx, grad):
    mat_a, mat_b, offs = ctx.saved_tensors
    need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_bias = ctx.has_bias and ctx.needs_input_grad[3]
    # With out_dtype=float32 the incoming gradient is fp32; the gradients of bf16/fp16 inputs are
    # computed from it rounded to the input dtype, with fp32 accumulation inside the op. The bias
    # gradient is a plain sum and keeps the incoming precision.
    grad_out, grad = grad, grad.to(ctx.dtype)
    op = torch.ops.moe.grouped_mm
    d_a = d_b = d_bias = None
    if ctx.layout == LAYOUT_2D3D:
        # out[rows_g] = a[rows_g] @ b[g]:  da[rows_g] = grad[rows_g] @ b[g].T,
        # db[g] = a[rows_g].T @ grad[rows_g] (2d2d over M),  dbias[g] = sum of grad[rows_g].
        if need_a:
            d_a = op(grad, mat_b.transpose(1, 2), offs)
        if need_b:
            d_b = op(mat_a.t(), grad, offs)
        if need_bias:
            ones = grad_out.new_ones((1, grad_out.shape[0]))
            d_bias = op(ones, grad_out, offs).squeeze(1)
    elif ctx.layout == LAYOUT_3D3D:
        if need_a:
            d_a = op(grad, mat_b.transpose(1, 2))
        if need_b:
            d_b = op(mat_a.transpose(1, 2), grad)
        if need_bias:
            d_bias = grad_out.sum(dim=1, dtype=torch.float64 if ctx.dtype == torch.float64 else torch.float32)
    elif ctx.layout == LAYOUT_2D2D:
        # out[g] = a[:, k_g] @ b[k_g]:  da[:, k_g] = grad[g] @ b[k_g].T (3d2d over K),
        # db[k_g] = a[:, k_g].T @ grad[g] (2d3d over K).
        if need_a:
            d_a = op(grad, mat_b.t(), offs)
        if need_b:
            d_b = op(mat_a.t(), grad, offs)
    else:  # LAYOUT_3D2D
        # out[:, n_g] = a[g] @ b[:, n_g]:  da[g] = grad[:, n_g] @ b[:, n_g].T (2d2d over N),
        # db[:, n_g] = a[g].T @ grad[:, n_g] (3d2d over N).
        if need_a:
            d_a = op(grad, mat_b.t(), offs)
        if need_b:
            d_b = op(mat_a.transpose(1, 2), grad, offs)
    if d_bias is not None:
        d_bias = d_bias.to(ctx.bias_dtype)
    return d_a, d_b, None, d_bias, None


def _below_autograd(keyset, mat_a, mat_b, offs, bias, out_dtype):
    """The op continued below Autograd: the kernel ``keyset`` reaches without the autograd keys."""
    with torch._C._AutoDispatchBelowAutograd():
        return _OP.redispatch(keyset & _AFTER_AUTOGRAD, mat_a, mat_b, offs, bias, out_dtype)


class _GroupedMM(torch.autograd.Function):
    """The op's autograd node. ``keyset`` (last, so needs_input_grad[i] is argument i) is the
    dispatch key set the Autograd kernel was called with; the forward continues below Autograd."""

    @staticmethod
    def forward(mat_a, mat_b, offs, bias, out_dtype, keyset):
        return _below_autograd(keyset, mat_a, mat_b, offs, bias, out_dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        mat_a, mat_b, offs, bias, out_dtype, _ = inputs
        ctx.layout = _contract.layout_of(mat_a, mat_b)  # the op has checked the arguments
        ctx.has_bias = bias is not None
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.dtype = mat_a.dtype
        ctx.out_dtype = out_dtype
        # Only what the requested gradients read: d mat_a needs mat_b, d mat_b needs mat_a.
        need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.save_for_backward(mat_a if need_b else None, mat_b if need_a else None, offs)
        ctx.save_for_forward(mat_a, mat_b, offs)

    @staticmethod
    def backward(ctx, grad):
        return (*_backward(ctx, grad), None)

    @staticmethod
    def jvp(ctx, t_a, t_b, _offs, t_bias, _out_dtype, _keyset):
        return _jvp(ctx, t_a, t_b, t_bias)


def _jvp(ctx, t_a, t_b, t_bias):
    """The tangent of the output, given those of mat_a, mat_b and bias (None: zero). The op is
    bilinear in (mat_a, mat_b) and adds bias per group, so the tangent is
    op(t_a, b, bias=t_bias) + op(a, t_b): the bias tangent lands on exactly the rows the bias
    does. bf16/fp16 sum the two terms in fp32 and round once."""
    mat_a, mat_b, offs = ctx.saved_tensors
    op = torch.ops.moe.grouped_mm
    out_dtype = ctx.out_dtype or ctx.dtype
    acc = torch.float32 if ctx.dtype in (torch.bfloat16, torch.float16) else None
    if t_a is None and t_bias is not None:
        t_a = torch.zeros_like(mat_a)
    terms = []
    if t_a is not None:
        terms.append(op(t_a, mat_b, offs, t_bias, acc))
    if t_b is not None:
        terms.append(op(mat_a, t_b, offs, None, acc))
    tangent = terms[0] if len(terms) == 1 else terms[0] + terms[1]
    return tangent.to(out_dtype)


def _autograd_kernel(keyset, mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    if reference.differentiated(mat_a, mat_b, bias):
        if torch._C._are_functorch_transforms_active():
            # Reached from inside the dispatcher, an autograd.Function cannot take functorch's
            # route for it (custom_function_call has no kernel at the Autograd keys).
            raise NotImplementedError(
                "moe::grouped_mm under torch.func transforms (grad, vjp, jvp, jacrev, ...) needs the "
                f"op's C++ Autograd kernel, and the Python one is registered: {autograd_status()}"
            )
        return _GroupedMM.apply(mat_a, mat_b, offs, bias, out_dtype, keyset)
    return _below_autograd(keyset, mat_a, mat_b, offs, bias, out_dtype)


class _Autograd:
    """Which Autograd kernel is registered: "cpp" or "python"."""

    active: str | None = None
    lib: torch.library.Library | None = None  # holds the Python kernel's registration
    cpp: types.ModuleType | None = None  # the moe_ops._autograd module once loaded
    why_not_cpp = ""


def use_autograd(kind: str) -> None:
    """Registers the op's Autograd kernel: "cpp" (moe_ops._autograd; RuntimeError saying why if
    it cannot load) or "python" (``_autograd_kernel``), removing the other one."""
    if kind not in ("cpp", "python"):
        raise ValueError(f"kind must be 'cpp' or 'python', got {kind!r}")
    if kind == _Autograd.active:
        return
    if kind == "cpp":
        try:
            module = _Autograd.cpp or _native.import_native("moe_ops._autograd")
        except (ImportError, OSError) as e:
            _Autograd.why_not_cpp = f"moe_ops._autograd cannot be loaded ({type(e).__name__}: {e})"
            raise RuntimeError(_Autograd.why_not_cpp) from e
        _Autograd.cpp = module
        if _Autograd.lib is not None:
            _Autograd.lib._destroy()
            _Autograd.lib = None
        try:
            module.register_kernel()
        except RuntimeError as e:  # never leave the op without an Autograd kernel
            _Autograd.why_not_cpp = f"moe_ops._autograd could not register its kernel ({e})"
            _Autograd.active = None
            use_autograd("python")
            raise RuntimeError(_Autograd.why_not_cpp) from e
    else:
        if _Autograd.cpp is not None:
            _Autograd.cpp.deregister_kernel()
        _Autograd.lib = torch.library.Library("moe", "IMPL")
        _Autograd.lib.impl("grouped_mm", _autograd_kernel, "Autograd", with_keyset=True)
    _Autograd.active = kind


def autograd_status() -> str:
    """Which Autograd kernel the op has, what it supports, and why not the C++ one when it has
    the Python one."""
    if _Autograd.active == "cpp":
        return "C++ (moe_ops._autograd): reverse and forward mode, torch.func transforms"
    why = _Autograd.why_not_cpp or "selected with use_autograd"
    return f"Python ({why}): reverse and forward mode, no torch.func transforms"


try:
    use_autograd("cpp")
except RuntimeError:
    log.info("moe_ops: %s; the op uses its Python Autograd kernel", _Autograd.why_not_cpp)
    use_autograd("python")


_batching_lib: list = []


def use_batching_rule(enabled: bool = True) -> None:
    """Registers (or removes) the op's batching rule (_batching.py): vmap, and the transforms that
    map over a batch (jacrev, jacfwd, hessian, per-sample gradients), fold a batch into one call
    of the op. Without it torch calls the op once per batch element (and warns); the benchmark
    (benchmarks/vmap.py) and the tests compare the two."""
    if enabled and not _batching_lib:
        lib = torch.library.Library("moe", "IMPL")
        torch.library.register_vmap(OP_NAME, _batching.grouped_mm_vmap, lib=lib)
        _batching_lib.append(lib)
    elif not enabled and _batching_lib:
        _batching_lib.pop()._destroy()


use_batching_rule()

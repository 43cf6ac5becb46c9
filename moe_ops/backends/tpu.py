"""TPU backend: our Pallas grouped-matmul kernels (``tpu_pallas.gmm`` / ``tgmm``) behind the XLA
key (PyTorch/XLA on TPU, or on XLA:CPU with the kernels in interpret mode) and the PrivateUse1
key when TorchTPU renamed it "tpu".

How each layout maps onto the two kernels (the operand that may be read in either orientation
is passed as stored, with a flag, instead of being copied):

* 2d3d: ``gmm(mat_a, mat_b)``; a transposed mat_b ([G, N, K] storage viewed as [G, K, N], the
  input gradient of a forward layer) is read as [G, N, K] with ``transpose_b``.
* 2d2d: ``tgmm(mat_a, mat_b)``; a transposed mat_a ([K, M] storage, the ``x.T`` of a weight
  gradient) is read as [K, M] with ``transpose_a``.
* 3d3d: ``gmm`` on mat_a viewed as [G*M, K] with offs = M, 2M, ..., G*M (made on the device).
* 3d2d: ``out.T = gmm(mat_b.T [N, K], mat_a read as [G, M, K] = transposed [G, K, M])``: one
  copy of mat_b.T (unless mat_b is a transposed view) and one transpose of the result.

float16 and float64 raise NotImplementedError (the op then uses the reference): the MXU has no
fp16 or fp64 path, and emulating them would be slower than the reference.

Three ways to run the same jax function ``tpu_pallas.grouped_mm``:
* ``run_here`` (CPU tensors, this machine): jax's Pallas interpreter (``interpret=True``); with
  MOE_OPS_TPU_NATIVE=1 on a TPU host, compiled by Mosaic on jax's TPU device instead
  (``benchmarks/tpu_check.py`` runs the property suite that way).
* XLA key: ``torch_xla.core.xla_builder.call_jax`` splices the kernel's HLO into the lazy graph;
  compiled by Mosaic on a TPU, interpreted when the XLA device is the CPU.
* PrivateUse1 "tpu": TorchTPU's Pallas bridge ``torch.tpu.pallas.jax_op``, which registers the
  jax function as a torch custom op compiled for the TPU.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import sys

import torch

from . import BackendUnavailable, Status
from .._contract import LAYOUT_2D2D, LAYOUT_2D3D, LAYOUT_3D2D, LAYOUT_3D3D
from .._op import note_kernel

NAME = "tpu"
PRIVATEUSE1_NAME = "tpu"
LAYOUTS = (LAYOUT_2D3D, LAYOUT_2D2D, LAYOUT_3D3D, LAYOUT_3D2D)
DTYPES = (torch.float32, torch.bfloat16)

_JAX_PIN = 'pip install "jax[tpu]==0.10.2"'


def register() -> None:
    """Nothing to register here: the XLA and PrivateUse1 kernels are the routers in
    ``moe_ops.backends``, which call ``xla_impl`` / ``privateuse1_impl`` of this module."""


def _version(dist: str):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _native() -> bool:
    """run_here compiles for jax's TPU instead of interpreting (MOE_OPS_TPU_NATIVE=1)."""
    return os.environ.get("MOE_OPS_TPU_NATIVE", "0") not in ("", "0")


def status() -> Status:
    keys = ("XLA", "PrivateUse1")
    jax_version = _version("jax")
    if jax_version is None or importlib.util.find_spec("jax") is None:
        return Status(NAME, keys, None, f"jax not installed ({_JAX_PIN})")
    xla = _version("torch_xla") or _version("torch-xla")
    torchtpu = _version("torch_tpu") or _version("torch-tpu")
    how = "compiled by Mosaic on jax's TPU (MOE_OPS_TPU_NATIVE=1)" if _native() else "interpret mode"
    return Status(
        NAME, keys, "native" if _native() else "interpreter",
        f"Pallas kernels gmm/tgmm in jax {jax_version} {how}; XLA key: "
        + (f"torch_xla {xla}" if xla else "torch_xla not installed")
        + "; PrivateUse1 'tpu': " + (f"torch-tpu {torchtpu}" if torchtpu else "TorchTPU not installed"),
    )


def _pallas():
    """The kernel module (imports jax); BackendUnavailable when jax cannot be imported."""
    try:
        from . import tpu_pallas
    except ImportError as e:
        raise BackendUnavailable(f"jax with Pallas cannot be imported ({e}); {_JAX_PIN}") from e
    return tpu_pallas


def _pallas_or_decline():
    """The kernel module for a device kernel; without jax the call is declined
    (NotImplementedError), so the op computes it with the reference and logs why once."""
    try:
        return _pallas()
    except BackendUnavailable as e:
        raise NotImplementedError(str(e)) from e


def _check_dtype(p) -> None:
    if p.dtype not in DTYPES:
        raise NotImplementedError(f"the TPU kernels serve float32 and bfloat16 inputs, not {p.dtype}")


def _is_transposed_view(t: torch.Tensor) -> bool:
    """True when t's last two dims are a transposed view of contiguous storage (not contiguous
    itself). XLA tensors always report contiguous strides, so this is False for them."""
    return not t.is_contiguous() and t.transpose(-1, -2).is_contiguous()


def _orient(p, mat_a, mat_b):
    """(x, y, transposed): the operands as the kernels read them (see the module docstring)."""
    if p.layout in (LAYOUT_2D3D, LAYOUT_3D3D):
        if _is_transposed_view(mat_b):
            return mat_a.contiguous(), mat_b.transpose(1, 2), True
        return mat_a.contiguous(), mat_b.contiguous(), False
    if p.layout == LAYOUT_2D2D:
        if _is_transposed_view(mat_a):
            return mat_a.t(), mat_b.contiguous(), True
        return mat_a.contiguous(), mat_b.contiguous(), False
    # 3d2d: the rows of out.T are grouped; mat_a [G, M, K] is the [G, N', K] (transposed) form of
    # gmm's right operand, mat_a.mT [G, K, M] its plain form.
    x = mat_b.t().contiguous()
    if _is_transposed_view(mat_a):
        return x, mat_a.transpose(1, 2), False
    return x, mat_a.contiguous(), True


def _args(p, mat_a, mat_b, offs, bias):
    x, y, transposed = _orient(p, mat_a, mat_b)
    args = [x, y]
    if offs is not None:
        args.append(offs.to(torch.int32))  # offs <= extent < 2**31
    if bias is not None:
        args.append(bias.contiguous())
    return args, transposed


def _out_dtype_name(p) -> str:
    return {torch.float32: "float32", torch.bfloat16: "bfloat16"}[p.out_dtype]


def _jax_fn(p, has_offs: bool, has_bias: bool, transposed: bool, interpret: bool, generation: str):
    """A jax function of the positional operands from ``_args`` (see ``_jax_fn_cached``)."""
    G, M = (p.G, p.M) if p.layout == LAYOUT_3D3D else (0, 0)  # only 3d3d needs them
    return _jax_fn_cached(p.layout, G, M, has_offs, has_bias, transposed, _out_dtype_name(p), interpret,
                          generation)


@functools.lru_cache(maxsize=None)
def _jax_fn_cached(layout: str, G: int, M: int, has_offs: bool, has_bias: bool, transposed: bool,
                   out_dtype: str, interpret: bool, generation: str):
    """One function object per configuration: torch_xla's call_jax caches its traced
    computation by the function's identity."""
    tp = _pallas()

    def fn(x, y, *rest):
        offs = rest[0] if has_offs else None
        bias = rest[-1] if has_bias else None
        return tp.grouped_mm(layout, x, y, offs, bias, G=G, M=M, transposed=transposed,
                             out_dtype=out_dtype, interpret=interpret, generation=generation)

    return fn


# --- run_here: CPU tensors through jax's Pallas interpreter ----------------------------------


def _to_jax(t: torch.Tensor):
    import jax.numpy as jnp
    import ml_dtypes

    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: move the bits, typed by ml_dtypes
        return jnp.asarray(t.view(torch.int16).numpy().view(ml_dtypes.bfloat16))
    return jnp.asarray(t.numpy())


def _to_torch(x) -> torch.Tensor:
    import ml_dtypes
    import numpy as np

    host = np.array(x)  # a writable copy, so torch owns its memory
    if host.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(host.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(host)


def _jax_tpu_generation() -> str:
    import jax

    tp = _pallas()
    device = jax.devices()[0]
    if device.platform != "tpu":
        raise BackendUnavailable(f"MOE_OPS_TPU_NATIVE=1 but jax's device is {device.platform}, not a TPU")
    return tp.generation_of(device.device_kind)


def run_here(p, mat_a, mat_b, offs, bias):
    """Both kernels on CPU tensors, in jax's Pallas interpreter (``interpret=True``), with the
    "interpret" tiling (small tiles, so small shapes cross tile and group boundaries). With
    MOE_OPS_TPU_NATIVE=1: compiled for jax's TPU, with that generation's tiling."""
    _check_dtype(p)
    _pallas()
    native = _native()
    generation = _jax_tpu_generation() if native else "interpret"
    args, transposed = _args(p, mat_a, mat_b, offs, bias)
    fn = _jax_fn(p, offs is not None, bias is not None, transposed, not native, generation)
    return _to_torch(fn(*[_to_jax(t) for t in args]))


# --- XLA key: PyTorch/XLA ----------------------------------------------------------------------


def _xla_hw(device: torch.device) -> str:
    import torch_xla.core.xla_model as xm

    return xm.xla_device_hw(device)


def serves_xla_device(device) -> bool:
    """True for XLA devices that are TPUs, or the CPU (kernels in interpret mode); False for
    AWS Neuron and other XLA devices. torch_xla is consulted only when already imported (an XLA
    tensor exists only then), so routing does not depend on the order backends were loaded."""
    device = torch.device(device)
    if device.type != "xla" or "torch_xla" not in sys.modules:
        return False
    try:
        return _xla_hw(device).upper() in ("TPU", "CPU")
    except (ImportError, RuntimeError):  # torch_xla too old or the device unknown: not ours
        return False


@functools.lru_cache(maxsize=None)
def _call_jax_missing():
    """Why ``call_jax`` cannot run here, or None. It needs torchax, which it imports through
    torch_xla's ``maybe_get_torchax`` and, when that fails, raises AssertionError on every call;
    torch-xla 2.9.0's wheel ships a torchax (0.0.6) whose import needs flax, which
    ``torch_xla[pallas]`` does not install. The same helper is asked here (a torch_xla without
    it is left to call_jax)."""
    try:
        from torch_xla._internal.jax_workarounds import maybe_get_torchax
    except ImportError:
        return None
    if maybe_get_torchax() is None:
        return "torch_xla's call_jax needs torchax, which cannot be imported (pip install torchax)"
    return None


def xla_impl(p, mat_a, mat_b, offs, bias):
    """The kernels on ``xla`` tensors, through ``torch_xla.core.xla_builder.call_jax``.

    XLA tensors carry no strides, so transposed views are not detected: a transposed mat_b
    becomes an HLO transpose feeding the kernel (one copy of the weights, done by XLA).
    Declined (NotImplementedError: the reference computes the call) without jax or torchax.
    """
    _check_dtype(p)
    tp = _pallas_or_decline()
    missing = _call_jax_missing()
    if missing:
        raise NotImplementedError(missing)
    import torch_xla.core.xla_model as xm
    from torch_xla.core import xla_builder

    hw = _xla_hw(mat_a.device)
    interpret = hw != "TPU"
    generation = "interpret" if interpret else tp.generation_of(xm.xla_device_kind(mat_a.device))
    args, transposed = _args(p, mat_a, mat_b, offs, bias)
    fn = _jax_fn(p, offs is not None, bias is not None, transposed, interpret, generation)
    out = xla_builder.call_jax(fn, tuple(args))
    note_kernel("tpu:pallas-xla")
    return out


# --- PrivateUse1 "tpu": TorchTPU ---------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _torchtpu_op():
    """``moe_tpu::grouped_mm``, made once from ``tpu_pallas.torchtpu_entry`` by TorchTPU's
    ``torch.tpu.pallas.jax_op`` (its non-tensor arguments become static)."""
    tp = _pallas_or_decline()
    try:
        from torch.tpu import pallas as bridge
    except ImportError as e:
        raise NotImplementedError(f"PrivateUse1 is named 'tpu' but TorchTPU's torch.tpu.pallas is missing ({e})") from e
    return bridge.jax_op("moe_tpu::grouped_mm", tp.torchtpu_entry)


def privateuse1_impl(p, mat_a, mat_b, offs, bias):
    """The kernels on TorchTPU ``tpu`` tensors, compiled by Mosaic through TorchTPU's bridge.

    Declined (NotImplementedError: the reference computes the call) when PrivateUse1 is named
    "tpu" but TorchTPU or jax is not loaded.
    """
    _check_dtype(p)
    tp = _pallas_or_decline()
    op = _torchtpu_op()
    x, y, transposed = _orient(p, mat_a, mat_b)
    generation = tp.generation_of(torch.tpu.get_device_name())
    out = op(x, y, None if offs is None else offs.to(torch.int32), None if bias is None else bias.contiguous(),
             p.layout, p.G, p.M, transposed, _out_dtype_name(p), generation)
    note_kernel("tpu:pallas-torchtpu")
    return out

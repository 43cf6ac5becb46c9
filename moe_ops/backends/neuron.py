"""AWS Neuron (Trainium) backend: the block-wise grouped matmul behind TorchNeuron and torch-neuronx.

Dispatch keys (both shared, routed in ``moe_ops/backends/__init__.py``):

* PrivateUse1 when its backend name is "neuron" (TorchNeuron, Neuron SDK 2.33+): the NKI kernels
  through TorchNeuron's ``nki_op`` where ``nki`` and ``torch_neuronx`` import, else the block-wise
  PyTorch formulation running eagerly on the neuron device.
* XLA when the XLA device is a Neuron device (torch-neuronx on torch_xla): the NKI kernels
  through ``nki.jit`` (a custom call in the lazy graph) where ``nki`` imports, else the
  block-wise PyTorch formulation compiled with the rest of the graph by neuronx-cc.

Layouts 2D x 3D (forward, input gradient) and 2D x 2D (weight gradient); bf16, fp16, fp32 (the
Tensor Engine's dtypes; Trainium has no fp64 matmul). Other calls raise NotImplementedError, so
the op runs the reference for them.

Verification on machines without the Neuron SDK (all of this project's): the block-wise PyTorch
code runs natively on CPU; the NKI kernels run on our numpy emulator (``run_here``), which is
not AWS's simulator; neither was compiled by neuronx-cc nor run on Trainium.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
from typing import Optional

import torch

from .._contract import LAYOUT_2D2D, LAYOUT_2D3D, Problem
from .._op import note_kernel
from . import Status, neuron_blockwise, neuron_nki

NAME = "neuron"
PRIVATEUSE1_NAME = "neuron"
LAYOUTS = (LAYOUT_2D3D, LAYOUT_2D2D)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

NKI_MISSING = "nki not installable: PyPI has only placeholders"


def register() -> None:
    """Nothing to register here: the XLA and PrivateUse1 routers in ``backends/__init__.py`` call
    ``serves_xla_device`` / ``xla_impl`` and ``privateuse1_impl`` (no toolchain is imported)."""


@functools.lru_cache(maxsize=None)
def nki_status() -> tuple:
    """(True, "") when the real ``nki`` package imports, else (False, why). Imports nki if present."""
    if importlib.util.find_spec("nki") is None:
        return False, f"{NKI_MISSING} (the Neuron SDK comes from AWS's package repository)"
    try:
        for name in ("nki", "nki.language", "nki.isa"):
            importlib.import_module(name)
    except Exception as e:  # the PyPI placeholder raises on import
        return False, f"nki does not import ({type(e).__name__}: {e}); {NKI_MISSING}"
    return True, ""


@functools.lru_cache(maxsize=None)
def _torch_neuronx_nki() -> tuple:
    """(True, "") when TorchNeuron's NKI op mechanism (torch_neuronx.nki_op / wrap_nki) is usable."""
    ok, why = nki_status()
    if not ok:
        return False, why
    try:
        tnx = importlib.import_module("torch_neuronx")
    except Exception as e:
        return False, f"torch_neuronx does not import ({type(e).__name__}: {e})"
    if not (hasattr(tnx, "nki_op") and hasattr(tnx, "wrap_nki")):
        return False, "this torch_neuronx has no nki_op / wrap_nki (TorchNeuron needs Neuron SDK 2.33+)"
    return True, ""


def status() -> Status:
    ok, why = nki_status()
    device = ("NKI kernels (nki.jit on XLA, nki_op on TorchNeuron)" if ok
              else f"block-wise PyTorch; the NKI kernels are off: {why}")
    return Status(NAME, ("XLA", "PrivateUse1"), "emulator",
                  "run_here: the NKI kernels on moe_ops' numpy emulator (not AWS's simulator or compiler); "
                  f"on a Neuron device: {device}")


def _check_served(p: Problem) -> None:
    if p.layout not in LAYOUTS:
        raise NotImplementedError(f"the Neuron kernels serve 2d3d and 2d2d, not {p.layout}")
    if p.dtype not in DTYPES:
        raise NotImplementedError(f"the Neuron kernels serve float32, bfloat16 and float16, not {p.dtype} "
                                  "(the Tensor Engine has no float64)")


# ---------------------------------------------------------------- NKI kernel arguments
def _itemsize(p: Problem) -> int:
    return torch.empty((), dtype=p.dtype).element_size()


# SBUF per partition the weight-gradient kernel may spend on its per-block restart flags (one
# fp32 per block, kept on chip for the whole call), beside the 64 KiB of gathered rows and the
# 32 KiB of fp32 accumulators: up to 16384 blocks, e.g. G = 16000 groups or K = 2M tokens.
WGRAD_FLAGS_SBUF_BUDGET = 64 * 1024


def nki_unfit(p: Problem) -> str:
    """Why the NKI kernels cannot take this problem, or "" when they can. The forward keeps a
    block's transposed rows (K elements per partition per 128-row tile) within its SBUF budget,
    so K x itemsize <= 64 KiB (K <= 32768 in bf16, 16384 in fp32). The weight gradient streams
    its contraction dimension and tiles M and N in passes, but keeps one fp32 flag per block in
    SBUF: ceil(K / block) + G - 1 blocks, at most 16384."""
    if p.layout == LAYOUT_2D3D:
        if p.K * _itemsize(p) > neuron_blockwise.ROWS_SBUF_BUDGET:
            return f"K = {p.K} is too wide for the NKI forward kernel's SBUF budget"
        return ""
    blocks = -(-p.K // neuron_blockwise.choose_block(p)) + p.G - 1
    if 4 * blocks > WGRAD_FLAGS_SBUF_BUDGET:
        return (f"{blocks} blocks (K = {p.K}, G = {p.G}) are too many for the NKI weight-gradient "
                f"kernel's SBUF budget (at most {WGRAD_FLAGS_SBUF_BUDGET // 4})")
    return ""


def nki_fits(p: Problem) -> bool:
    """Whether the NKI kernels take this problem (see ``nki_unfit``)."""
    return not nki_unfit(p)


def panel_width(K: int, itemsize: int) -> int:
    """Output columns per weight panel of the forward kernel: up to 512 (one fp32 PSUM bank), a
    multiple of 128, with the panel's K / 128 tiles within 64 KiB of SBUF per partition."""
    n_kt = max(1, -(-K // 128))
    return max(128, min(512, neuron_blockwise.ROWS_SBUF_BUDGET // (n_kt * itemsize) // 128 * 128))


def _kernel_call(p: Problem, a, b, offs, bias, block: Optional[int] = None):
    """(kernel, positional args, static kwargs) for the NKI kernel of a served problem, or None
    when the result is empty or zero by shape alone (M, N or the contraction is 0 in 2D x 2D;
    M or N is 0 in 2D x 3D), which the caller computes directly."""
    block = block or neuron_blockwise.choose_block(p)
    out_fp32 = p.out_dtype == torch.float32 and p.dtype != torch.float32
    if p.layout == LAYOUT_2D3D:
        if p.M == 0 or p.N == 0:
            return None
        s = neuron_blockwise.schedule_2d3d(offs, p.M, block)
        # The input gradient passes the weights as a transposed view of [G, N, K] storage: read
        # that storage as is (the kernel transposes tiles on chip) instead of copying it.
        w_transposed = b.transpose(1, 2).is_contiguous()
        w = b.transpose(1, 2) if w_transposed else b.contiguous()
        # Real slots scatter their results; slots of rows past offs[-1] scatter zeros.
        scatter = torch.where(s.valid, s.scatter, p.M)
        zero = torch.where(s.valid, p.M, s.scatter)
        args = (a.contiguous(), w, None if bias is None else bias.contiguous(), s.group, s.gather, scatter, zero,
                None if bias is None else s.valid.to(p.dtype))
        return neuron_nki.block_mm_2d3d, args, dict(block=block, w_transposed=w_transposed, out_fp32=out_fp32,
                                                    n_panel=panel_width(p.K, _itemsize(p)))
    if p.K == 0 or p.M == 0 or p.N == 0:
        return None
    s2 = neuron_blockwise.schedule_2d2d(offs, p.K, block)
    keep = s2.keep.unsqueeze(0).expand(128, -1).contiguous()  # one copy per partition
    # mat_a is [M, K] with K ragged; the kernel wants K on partitions: [K, M]. In the weight
    # gradient mat_a is x.t(), so this is x itself and no copy is made.
    args2 = (a.t().contiguous(), b.contiguous(), s2.gather, keep, s2.store)
    return neuron_nki.block_mm_2d2d, args2, dict(block=block, n_groups=p.G, out_fp32=out_fp32)


def _by_shape(p: Problem, a):
    return a.new_zeros(p.out_shape, dtype=p.out_dtype)


def run_on_emulator(p: Problem, a, b, offs, bias, block: Optional[int] = None, **static):
    """The NKI kernel for a served problem on CPU tensors, on moe_ops' numpy emulator.

    static: overrides of the kernel's compile-time tiling arguments (e.g. m_pass_tiles).
    Returns (result, instruction counts); counts are empty when no kernel was needed.
    """
    _check_served(p)
    why = nki_unfit(p)
    if why:
        raise NotImplementedError(why)
    call = _kernel_call(p, a, b, offs, bias, block)
    if call is None:
        return _by_shape(p, a), {}
    kernel, args, kwargs = call
    return neuron_nki.run_on_emulator(kernel, args, {**kwargs, **static})


def run_on_simulator(p: Problem, a, b, offs, bias, block: Optional[int] = None, **static):
    """The same on AWS's nki.simulate (needs the real nki package); returns the result."""
    _check_served(p)
    why = nki_unfit(p)
    if why:
        raise NotImplementedError(why)
    call = _kernel_call(p, a, b, offs, bias, block)
    if call is None:
        return _by_shape(p, a)
    kernel, args, kwargs = call
    return neuron_nki.run_on_simulator(kernel, args, {**kwargs, **static})


def run_here(p: Problem, a, b, offs, bias):
    """The backend's NKI kernels on CPU tensors, executed on our numpy emulator (mode "emulator")."""
    out, _ = run_on_emulator(p, a, b, offs, bias)
    return out


# ---------------------------------------------------------------- device paths
def serves_xla_device(device) -> bool:
    """True when ``device`` is an XLA device backed by an AWS Neuron core (torch-neuronx).

    torch_xla names the real device of an XLA device "NEURON:<n>" under PJRT_DEVICE=NEURON; only
    torch_xla is consulted, and only when it is already imported (an XLA tensor exists only
    then), so this costs nothing without it.
    """
    device = torch.device(device)
    if device.type != "xla" or "torch_xla" not in sys.modules:
        return False
    try:
        xm = importlib.import_module("torch_xla.core.xla_model")
        return xm.xla_device_hw(device).upper() == "NEURON"
    except Exception:  # torch_xla missing or too old to resolve the device: not ours to serve
        return False


@functools.lru_cache(maxsize=None)
def _jit(kernel):
    return neuron_nki._real_nki().nki.jit(kernel)


def _on_device(p: Problem, a, b, offs, bias, *, nki_ready: bool, compile_kernel, names: tuple):
    """The NKI kernels (``compile_kernel(kernel)`` makes one callable on the device) where the
    SDK is ready and the problem fits them, else the block-wise PyTorch path on the device.
    names: what ``kernel_counts`` calls the two (NKI, block-wise)."""
    _check_served(p)
    if nki_ready and nki_fits(p):
        note_kernel(names[0])
        call = _kernel_call(p, a, b, offs, bias)
        if call is None:
            return _by_shape(p, a)
        kernel, args, kwargs = call
        return compile_kernel(kernel)(*args, **kwargs)
    note_kernel(names[1])
    return neuron_blockwise.compute(p, a, b, offs, bias)


def xla_impl(p: Problem, a, b, offs, bias):
    """moe::grouped_mm on a Neuron XLA device: nki.jit kernels where nki imports, else block-wise PyTorch."""
    return _on_device(p, a, b, offs, bias, nki_ready=nki_status()[0], compile_kernel=_jit,
                      names=("xla:neuron-nki", "xla:neuron-blockwise"))


@functools.lru_cache(maxsize=None)
def _torchneuron_op(kernel):
    """The kernel registered through TorchNeuron's NKI op mechanism (``torch_neuronx.nki_op``)."""
    tnx = importlib.import_module("torch_neuronx")
    wrapped = tnx.wrap_nki(_jit(kernel))
    if kernel is neuron_nki.block_mm_2d3d:
        @tnx.nki_op("moe_neuron::block_mm_2d3d", mutates_args={})
        def op(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], group: torch.Tensor,
               gather: torch.Tensor, scatter: torch.Tensor, zero: torch.Tensor, valid: Optional[torch.Tensor],
               block: int, w_transposed: bool, out_fp32: bool, n_panel: int) -> torch.Tensor:
            return wrapped(x, w, bias, group, gather, scatter, zero, valid, block=block, w_transposed=w_transposed,
                           out_fp32=out_fp32, n_panel=n_panel)
    else:
        @tnx.nki_op("moe_neuron::block_mm_2d2d", mutates_args={})
        def op(xt: torch.Tensor, dy: torch.Tensor, gather: torch.Tensor, keep: torch.Tensor, store: torch.Tensor,
               block: int, n_groups: int, out_fp32: bool) -> torch.Tensor:
            return wrapped(xt, dy, gather, keep, store, block=block, n_groups=n_groups, out_fp32=out_fp32)
    return op


def privateuse1_impl(p: Problem, a, b, offs, bias):
    """moe::grouped_mm on TorchNeuron's "neuron" device: NKI kernels through nki_op where the SDK
    imports, else block-wise PyTorch on the device."""
    return _on_device(p, a, b, offs, bias, nki_ready=_torch_neuronx_nki()[0], compile_kernel=_torchneuron_op,
                      names=("neuron:nki", "neuron:blockwise"))

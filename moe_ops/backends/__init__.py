"""Device backends of ``moe::grouped_mm``: one module per device family.

A backend module ``moe_ops/backends/<name>.py`` provides:

* ``NAME``: its name in ``moe_ops.testing.backend_names()``.
* ``register()``: registers its kernels with ``moe_ops._op.register_device_kernel``. It must not
  import optional toolchains (triton, jax, nki, ...): kernels import them on first use. It may
  raise to say the backend is off; the reason is logged and reported by ``python -m moe_ops``.
* ``status() -> Status``: what is registered and whether / how it can run on this machine.
* ``run_here(problem, mat_a, mat_b, offs, bias)``: runs the backend's kernel on CPU tensors,
  natively or through the vendor interpreter / our emulator; raises ``BackendUnavailable`` when
  it cannot run here and NotImplementedError for a layout or dtype it does not serve.
* optionally ``CLAMPS_OFFS = True``: its kernels apply ``_contract.sanitize_offs``'s clamp
  themselves, so on the device they are handed offs unsanitized (see ``_op.kernel_entry``), and
  ``moe_ops.testing.run_backend(check_offs=False)`` hands ``run_here`` invalid offs as they are.

Two dispatch keys are shared by several device families: XLA (TPU through torch_xla, or AWS
Neuron through torch-neuronx) and PrivateUse1 (TorchTPU renames it "tpu", TorchNeuron "neuron").
A backend that serves them provides ``serves_xla_device(device) -> bool`` and ``xla_impl``, or
``PRIVATEUSE1_NAME`` and ``privateuse1_impl``; the routers below pick the backend per call.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Optional

import torch

from .._op import register_device_kernel

log = logging.getLogger("moe_ops")

# Import order is report order. Each device issue adds its module here.
BACKEND_MODULES: tuple = ("cpu", "cuda", "tpu", "neuron")


class BackendUnavailable(RuntimeError):
    """A backend cannot run on this machine; the message names what is missing."""


@dataclass(frozen=True)
class Status:
    """One backend on this machine.

    keys: dispatch keys it registered kernels for. mode: how ``run_here`` runs it here
    ("native", "interpreter", "emulator", "compile-only") or None when it cannot run here.
    detail: which kernel runs, or why not.
    """

    name: str
    keys: tuple
    mode: Optional[str]
    detail: str


_loaded: dict = {}
_off: dict = {}


def load_all() -> None:
    """Import and register every backend once; a backend that fails is recorded as off."""
    if _loaded or _off:
        return
    for name in BACKEND_MODULES:
        try:
            module = importlib.import_module(f"{__name__}.{name}")
            module.register()
        except Exception as e:  # a broken optional backend must not break the package
            _off[name] = f"{type(e).__name__}: {e}"
            log.warning("moe_ops: backend %s is off: %s", name, _off[name])
            continue
        _loaded[name] = module
    _register_shared_keys()


def module(name: str):
    """The loaded module of a backend; BackendUnavailable if it is off."""
    load_all()
    if name in _off:
        raise BackendUnavailable(f"backend {name!r} is off: {_off[name]}")
    if name not in _loaded:
        raise KeyError(f"unknown backend {name!r}; known: {list(BACKEND_MODULES)}")
    return _loaded[name]


def statuses() -> list:
    load_all()
    out = []
    for name in BACKEND_MODULES:
        if name in _off:
            out.append(Status(name, (), None, f"off: {_off[name]}"))
        else:
            out.append(_loaded[name].status())
    return out


def _xla_router(p, mat_a, mat_b, offs, bias):
    for m in _loaded.values():
        if hasattr(m, "serves_xla_device") and m.serves_xla_device(mat_a.device):
            return m.xla_impl(p, mat_a, mat_b, offs, bias)
    raise NotImplementedError(f"no moe_ops backend serves the XLA device {mat_a.device}")


def _privateuse1_router(p, mat_a, mat_b, offs, bias):
    current = torch._C._get_privateuse1_backend_name()
    for m in _loaded.values():
        if getattr(m, "PRIVATEUSE1_NAME", None) == current:
            return m.privateuse1_impl(p, mat_a, mat_b, offs, bias)
    raise NotImplementedError(f"no moe_ops backend serves the PrivateUse1 backend {current!r}")


def _register_shared_keys() -> None:
    if any(hasattr(m, "xla_impl") for m in _loaded.values()):
        register_device_kernel("xla", "xla", _xla_router)
    if any(hasattr(m, "privateuse1_impl") for m in _loaded.values()):
        register_device_kernel("privateuseone", "privateuse1", _privateuse1_router)

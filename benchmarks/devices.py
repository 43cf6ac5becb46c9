"""Devices the benchmark can run on. Each knows whether it is usable here, how to wait for its
work, and how big its shapes may be.

* cpu: always (threads from --threads).
* accelerator: whatever ``torch.accelerator`` reports (CUDA, XPU, MPS, or a PrivateUse1 device
  such as TorchTPU's "tpu" or TorchNeuron's "neuron"), synchronized with
  ``torch.accelerator.synchronize()``.
* xla: torch_xla devices (TPU or Neuron through torch_xla), synchronized with
  ``torch_xla.sync()`` and ``xm.wait_device_ops()``.

Only the cpu device has been run on this project's machines; the others follow the vendors'
documented synchronization calls.
"""

from __future__ import annotations

import os
import platform
import subprocess

import torch

from moe_ops.backends.cpu import thp_mode


def tensor_pages() -> str:
    """How torch backs large CPU tensors in this process: huge pages or 4 KiB pages, or "" where
    Linux's transparent huge pages are not there to ask. Reported with every CPU result because
    it moves the memory-bound cases: on this project's VM a core streams weights from 4 KiB pages
    at about half the rate it reaches from huge pages (README, "Huge pages for the weights")."""
    mode = thp_mode()
    if not mode:
        return ""
    env = os.environ.get("THP_MEM_ALLOC_ENABLE")  # read by torch's CPU allocator: "1" or "0"
    if mode == "always":
        return "tensors in huge pages (THP always)"
    if mode == "madvise" and env == "1":
        return "tensors in huge pages (THP_MEM_ALLOC_ENABLE=1)"
    setting = f"THP_MEM_ALLOC_ENABLE={env}" if env is not None else "THP_MEM_ALLOC_ENABLE unset"
    return f"tensors in 4 KiB pages (THP {mode}, {setting})"


class Device:
    name = "?"
    tokens = 512  # tokens per model shape (M = tokens * top-k)
    weight_budget = 64 << 20  # bytes of bf16 expert weights per model shape

    def available(self):
        """(True, "") or (False, why not)."""
        raise NotImplementedError

    def torch_device(self):
        raise NotImplementedError

    def sync(self) -> None:
        pass

    def describe(self) -> str:
        return self.name


class Cpu(Device):
    name = "cpu"

    def __init__(self, threads: int | None):
        if threads:
            torch.set_num_threads(threads)

    def available(self):
        return True, ""

    def torch_device(self):
        return torch.device("cpu")

    def describe(self) -> str:
        model, flags = platform.processor() or platform.machine(), set()
        try:
            out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
            info = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
            model = info.get("Model name", model).strip()
            # "AMD EPYC" names Zen 4 (family 25) and Zen 5 (family 26) alike, and the kernels pick
            # their schemes by family: say which.
            if "CPU family" in info:
                model += f" (family {info['CPU family'].strip()}, model {info.get('Model', '?').strip()})"
            flags = set(info.get("Flags", "").split())
        except (OSError, subprocess.SubprocessError, ValueError):
            pass
        isa = [f for f in ("avx512f", "avx512_bf16", "amx_bf16") if f in flags] or (["avx2"] if "avx2" in flags else [])
        pages = tensor_pages()
        return (f"cpu: {model}, {os.cpu_count()} cores, {torch.get_num_threads()} threads"
                + (f", {' '.join(isa)}" if isa else "") + (f", {pages}" if pages else ""))


class Accelerator(Device):
    tokens = 8192
    weight_budget = 4 << 30

    def __init__(self):
        acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        self.name = acc.type if acc is not None else "accelerator"
        self._device = acc

    def available(self):
        if self._device is None:
            return False, "torch.accelerator reports no accelerator"
        return True, ""

    def torch_device(self):
        return self._device

    def sync(self) -> None:
        torch.accelerator.synchronize()

    def describe(self) -> str:
        if self.name == "cuda":
            return f"cuda: {torch.cuda.get_device_name()}"
        return self.name


class Xla(Device):
    name = "xla"
    tokens = 8192
    weight_budget = 4 << 30

    def __init__(self):
        self._xm = None
        self._why = ""
        try:
            import torch_xla.core.xla_model as xm  # noqa: F401

            self._xm = xm
        except Exception as e:  # not installed, or built for another torch
            self._why = f"torch_xla unavailable ({type(e).__name__}: {e})"

    def available(self):
        if self._xm is None:
            return False, self._why
        return True, ""

    def torch_device(self):
        return self._xm.xla_device()

    def sync(self) -> None:
        import torch_xla

        torch_xla.sync()
        self._xm.wait_device_ops()


def pick(names, threads):
    """The requested devices ("all" = every usable one) as (device, usable, reason) tuples."""
    factories = {"cpu": lambda: Cpu(threads), "accelerator": Accelerator, "xla": Xla}
    wanted = list(factories) if "all" in names else names
    out = []
    for n in wanted:
        if n not in factories:
            raise SystemExit(f"unknown device {n!r}; expected one of {sorted(factories)} or 'all'")
        d = factories[n]()
        ok, why = d.available()
        out.append((d, ok, why))
    return out

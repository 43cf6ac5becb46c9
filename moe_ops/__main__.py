"""``python -m moe_ops``: what this machine has and which kernel each device would use."""

from __future__ import annotations

import platform

import torch

import moe_ops
from moe_ops import _op, backends


def _devices() -> list:
    found = ["cpu"]
    if torch.cuda.is_available():
        found += [f"cuda:{i} ({torch.cuda.get_device_name(i)}, sm_{''.join(map(str, torch.cuda.get_device_capability(i)))})"
                  for i in range(torch.cuda.device_count())]
    pu1 = torch._C._get_privateuse1_backend_name()
    if pu1 != "privateuseone":
        found.append(f"PrivateUse1 renamed to {pu1!r}")
    return found


def _keys_with_kernels() -> list:
    keys = ["CompositeExplicitAutograd", "Autograd", "Meta", "CPU", "CUDA", "XLA", "PrivateUse1"]
    return [k for k in keys if torch._C._dispatch_has_kernel_for_dispatch_key("moe::grouped_mm", k)]


def main() -> None:
    print(f"moe_ops {moe_ops.__version__}  torch {torch.__version__}  python {platform.python_version()}  "
          f"{platform.machine()}")
    print(f"devices: {', '.join(_devices())}")
    print(f"moe::grouped_mm kernels for dispatch keys: {', '.join(_keys_with_kernels())}")
    print(f"Autograd kernel: {_op.autograd_status()}")
    print()
    rows = [("reference", "default (all devices)", "native", "ATen ops; loop on CPU, sync-free blocks elsewhere")]
    for s in backends.statuses():
        rows.append((s.name, ", ".join(s.keys) or "-", s.mode or "cannot run here", s.detail))
    w = [max(len(r[i]) for r in rows + [("backend", "keys", "runs here as", "")]) for i in range(3)]
    print(f"{'backend':<{w[0]}}  {'keys':<{w[1]}}  {'runs here as':<{w[2]}}  detail")
    for r in rows:
        print(f"{r[0]:<{w[0]}}  {r[1]:<{w[1]}}  {r[2]:<{w[2]}}  {r[3]}")


if __name__ == "__main__":
    main()

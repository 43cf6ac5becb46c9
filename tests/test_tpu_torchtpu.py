"""TorchTPU (PrivateUse1 "tpu") entry of the TPU backend, as far as it goes without a TPU.

Needs torch-tpu 0.2.0 (it autoloads with torch and needs libtpu >= 0.0.50, while the CI
environment pins jax[tpu]==0.10.2 with libtpu 0.0.42, so CI does not install it; the module
is skipped there). Where it is installed, without a TPU:
* ``torch.tpu.pallas.jax_op`` accepts ``tpu_pallas.torchtpu_entry`` and registers
  ``moe_tpu::grouped_mm`` with the schema we expect;
* ``privateuse1_impl`` runs on fake tensors for all four layouts: TorchTPU's fake kernel
  exports our jax function for platform "tpu" (Pallas lowered to Mosaic), and the result has
  the contract's shape and dtype. Nothing is compiled by Mosaic or run.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("torch_tpu") is None or not hasattr(torch, "tpu"):
    pytest.skip("TorchTPU not installed (pip install torch-tpu==0.2.0 'libtpu>=0.0.50'; not in CI: its libtpu "
                "conflicts with jax[tpu]==0.10.2)", allow_module_level=True)

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from moe_ops import _contract, _op  # noqa: E402
from moe_ops.backends import tpu  # noqa: E402


def test_jax_op_registers_our_entry():
    tpu._torchtpu_op()
    schema = str(torch.ops.moe_tpu.grouped_mm.default._schema)
    assert schema.startswith("moe_tpu::grouped_mm(Tensor x, Tensor y, Tensor? offs, Tensor? bias, str layout")
    assert schema.endswith("-> Tensor")


CASES = [
    # layout, shape of mat_a, shape of mat_b, G, dtype, out_dtype, bias, transpose mat_b
    ("2d3d", (64, 32), (4, 32, 48), 4, torch.bfloat16, torch.float32, True, False),
    ("2d3d", (64, 32), (4, 32, 48), 4, torch.bfloat16, None, False, True),
    ("2d2d", (32, 64), (64, 48), 4, torch.float32, None, False, False),
    ("3d3d", (4, 16, 32), (4, 32, 48), 4, torch.bfloat16, None, True, False),
    ("3d2d", (4, 16, 32), (32, 48), 4, torch.float32, None, False, False),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[4]}" for c in CASES])
def test_privateuse1_impl_traces_for_tpu(case):
    layout, sa, sb, G, dtype, out_dtype, has_bias, transpose_b = case
    with FakeTensorMode():
        a = torch.empty(sa, dtype=dtype)
        b = torch.empty(sb[:-2] + sb[:-3:-1], dtype=dtype).transpose(-1, -2) if transpose_b else torch.empty(sb, dtype=dtype)
        offs = None if layout == "3d3d" else torch.empty(G, dtype=torch.int64)
        bias = torch.empty(G, sb[-1], dtype=dtype) if has_bias else None
        p = _contract.check_args(a, b, offs, bias, out_dtype)
        out = tpu.privateuse1_impl(p, a, b, offs, bias)
    assert tuple(out.shape) == p.out_shape and out.dtype == p.out_dtype
    assert _op._served.name == "tpu:pallas-torchtpu"

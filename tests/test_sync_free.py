"""No host sync on accelerators: the op's accelerator path never reads a tensor value on the host.

The meta device stands in for an accelerator: its tensors have no data, so any .item(),
.tolist(), .cpu() or data-dependent shape raises. The op's default kernel (the contract checks,
offs sanitizing and the reference's sync-free formulation) runs on meta tensors for every
layout; in checked mode the same path does read offs (which is what checked mode is for).
"""

from __future__ import annotations

import pytest
import torch

import moe_ops
from moe_ops import _op

G, M, K, N = 4, 30, 16, 8


def _meta_args(layout):
    e = lambda *s, dtype=torch.bfloat16: torch.empty(*s, dtype=dtype, device="meta")  # noqa: E731
    offs = e(G, dtype=torch.int32)
    if layout == "2d3d":
        return e(M, K), e(G, N, K).transpose(1, 2), offs, e(G, N)
    if layout == "2d2d":
        return e(M, K), e(K, N), offs, None
    if layout == "3d2d":
        return e(G, M, K), e(K, N), offs, None
    return e(G, M, K), e(G, K, N), None, e(G, N)


@pytest.mark.parametrize("layout", ["2d3d", "2d2d", "3d3d", "3d2d"])
def test_default_kernel_reads_no_values_on_an_accelerator(layout, monkeypatch):
    monkeypatch.delenv("MOE_OPS_CHECKED", raising=False)
    out = _op._default_kernel(*_meta_args(layout), torch.float32)
    want = {"2d3d": (M, N), "2d2d": (G, M, N), "3d3d": (G, M, N), "3d2d": (M, N)}[layout]
    assert out.shape == want and out.dtype == torch.float32 and out.device.type == "meta"


def test_checked_mode_reads_offs():
    with moe_ops.checked(), pytest.raises(NotImplementedError, match="meta tensor"):
        _op._default_kernel(*_meta_args("2d3d"), None)

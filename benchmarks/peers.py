"""The implementations a case is timed with, side by side.

Each peer returns a zero-argument callable computing the case's result (so it can be checked
against the reference once and then timed), or None and the reason it does not run here.
"""

from __future__ import annotations

import torch

import moe_ops

DENSE = "dense torch.mm"
# For bf16 / fp16 on CPU: the same dense matmul in fp32, a second roofline for CPUs on which
# ATen's 16-bit matmul is slow (on an AVX2-only Zen 2, oneDNN's bf16 ran at 0.3-6 GFLOP/s
# against MKL's ~100 in fp32, so a ratio to the bf16 dense roofline says nothing there).
DENSE_FP32 = "dense torch.mm fp32"
ROOFLINES = (DENSE, DENSE_FP32)
OP = "moe_ops"
REFERENCE = "moe_ops reference"
LOOP = "loop of torch.mm"
GROUPED_MM = "torch._grouped_mm"
PADDED = "padded bmm"
JAX = "jax"

ORDER = (DENSE, DENSE_FP32, OP, REFERENCE, LOOP, GROUPED_MM, PADDED, JAX)


def _op_args(t):
    return (t.a.t(), t.b) if t.mode == "wgrad" else (t.a, t.b)


def _dense(t, dtype=None):
    a, b = (t.a, t.dense_b) if dtype is None else (t.a.to(dtype), t.dense_b.to(dtype))
    if t.mode == "wgrad":
        return lambda: torch.mm(a.t(), b)
    return lambda: torch.mm(a, b)


def _loop(t):
    a, b, offs = t.a, t.b, t.offs

    def fwd():
        out = a.new_empty(a.shape[0], b.shape[2])
        s = 0
        for g, e in enumerate(offs.tolist()):
            torch.mm(a[s:e], b[g], out=out[s:e])
            s = e
        out[s:].zero_()
        return out

    def wgrad():
        out = a.new_empty(offs.shape[0], a.shape[1], b.shape[1])
        s = 0
        for g, e in enumerate(offs.tolist()):
            torch.mm(a[s:e].t(), b[s:e], out=out[g])
            s = e
        return out

    return wgrad if t.mode == "wgrad" else fwd


def _padded(t):
    """Pad every group to the largest one, one bmm, unpad: the sync-free textbook fallback."""
    a, b, offs = t.a, t.b, t.offs
    G = offs.shape[0]

    def layout():
        ends = offs.to(torch.int64)
        sizes = torch.diff(ends, prepend=ends.new_zeros(1))
        used = int(ends[-1])
        gid = torch.repeat_interleave(torch.arange(G, device=a.device), sizes)
        pos = torch.arange(used, device=a.device) - (ends - sizes)[gid]
        return int(sizes.max()), used, gid, pos

    def fwd():
        maxm, used, gid, pos = layout()
        xp = a.new_zeros(G, maxm, a.shape[1])
        xp[gid, pos] = a[:used]
        yp = torch.bmm(xp, b)
        out = a.new_zeros(a.shape[0], b.shape[2])
        out[:used] = yp[gid, pos]
        return out

    def wgrad():
        maxm, used, gid, pos = layout()
        xp = a.new_zeros(G, maxm, a.shape[1])
        xp[gid, pos] = a[:used]
        dyp = b.new_zeros(G, maxm, b.shape[1])
        dyp[gid, pos] = b[:used]
        return torch.bmm(xp.transpose(1, 2), dyp)

    return wgrad if t.mode == "wgrad" else fwd


def _jax(t, device):
    if t.mode == "wgrad":
        return None, "jax.lax.ragged_dot covers 2D x 3D only"
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        return None, "jax not installed (pip install jax)"
    backend = jax.default_backend()
    if device.type == "cpu" and backend == "cpu":
        # XLA:CPU's ragged_dot: jax's own grouped matmul on this CPU (its own thread pool).
        # The case's 16-bit dtype kept (fp16 once ran as float32 beside the fp16 peers).
        dt = {torch.bfloat16: jnp.bfloat16, torch.float16: jnp.float16}.get(t.a.dtype, jnp.float32)
        a = jnp.asarray(t.a.float().numpy()).astype(dt)
        b = jnp.asarray(t.b.float().contiguous().numpy()).astype(dt)
        sizes = jnp.asarray(torch.diff(t.offs.to(torch.int64), prepend=t.offs.new_zeros(1).long()).numpy().astype("int32"))
        f = jax.jit(lambda x, w, s: jax.lax.ragged_dot(x, w, s))
        return (lambda: torch.from_numpy(jax.device_get(f(a, b, sizes)).astype("float32"))), "jax.lax.ragged_dot on XLA:CPU (always the case's one draw of group sizes)"
    if backend == "tpu":
        return None, "MegaBlox on TPU needs jax arrays on the TPU; run this benchmark's jax peer on a TPU host"
    return None, (f"jax backend {backend!r}: MegaBlox runs there only in Pallas interpret mode, "
                  "which measures the interpreter, not the kernel")


def _grouped_mm(t):
    if not hasattr(torch, "_grouped_mm"):
        return None, "this torch has no torch._grouped_mm"
    a, b = _op_args(t)
    return (lambda: torch._grouped_mm(a, b, offs=t.offs)), ""


def peers(t, device: torch.device, with_jax: bool = False) -> dict:
    """{peer name: (callable or None, note)} for one case's tensors. jax is opt-in: XLA:CPU's
    thread pool keeps its threads spinning after each call, which slowed every other peer of
    the same process several-fold in a first run here (bf16 reference 0.5 s instead of ~20 ms)."""
    a, b = _op_args(t)
    out = {
        DENSE: (_dense(t), "same M, K, N as one matmul (the roofline)"),
        OP: (lambda: moe_ops.grouped_mm(a, b, t.offs), ""),
        REFERENCE: (lambda: moe_ops.reference.grouped_mm(a, b, t.offs), ""),
        GROUPED_MM: _grouped_mm(t),
        PADDED: (_padded(t), ""),
    }
    if device.type == "cpu" and t.a.dtype in (torch.bfloat16, torch.float16):
        out[DENSE_FP32] = (_dense(t, torch.float32), "the dense roofline in fp32 (inputs converted before timing)")
    out[LOOP] = (_loop(t), "" if device.type == "cpu" else "reads offs on the host: one sync per call")
    out[JAX] = _jax(t, device) if with_jax else (None, "opt-in (--with-jax)")
    return out

"""The op's batching rule: ``torch.vmap`` over ``moe::grouped_mm`` in one call of the op.

vmap is also how torch.func builds jacrev, jacfwd, hessian and per-sample gradients (it maps
the backward over a batch of cotangents, or the jvp over a batch of tangents). Without a rule
torch calls the op once per batch element, and warns. The op is linear in each matrix, so a
batch folds into a dimension of the problem and the whole batch is one call of the op:

* one matrix batched, offs unbatched (vmap over inputs with shared weights, jacrev's
  cotangents, jacfwd's tangents): the batch joins a free dimension of that matrix, M of mat_a
  or N of mat_b. Where that dimension is the ragged one (M of 2Dx3D, N of 3Dx2D) the batch is
  interleaved (index i * B + s) and offs scaled by B, so group g's slice of every sample stays
  one slice. A batched bias goes with a batched mat_b (bias [G, N] joins N).
* both matrices batched (ensembles, per-sample gradients' weight gradient, per-sample routing
  with per-sample weights), offs batched or not: the samples become blocks of the ragged
  dimension and their groups one list of B x G groups, offs of sample s shifted by s x extent.
  A sample's trailing part (past its last group end) would land in the next sample's first
  group: for 2Dx3D and 3Dx2D its rows / columns are set to zero afterwards (selected, so
  whatever they computed is dropped); for 2Dx2D, whose trailing K indices would add into the
  next sample's first group, each sample gets one extra group that absorbs them and is dropped.
  Where autograd differentiates the folded call, the tail is also zeroed in the batched
  operands that hold it (a masked copy: mat_a of 2Dx3D, mat_b of 3Dx2D, both of 2Dx2D), so that
  whatever it holds, NaN included, reaches no gradient.
* 2Dx3D with a batched offs (each sample routed on its own) and shared weights: the rows of
  all samples, sorted by group on the device, are one call with G groups, and the result is put
  back in the samples' order; with batched weights and shared rows, mat_a is repeated per
  sample and the blocks above apply.
* anything else (a batched bias with only mat_a batched; a batched offs in the other layouts
  with one matrix batched; only offs or bias batched; offs batched by an outer transform, such
  as jacrev inside a vmap over offs, where this level cannot read its values): one call per
  batch element, as torch's fallback does, without its warning. Folding there would copy the
  unbatched matrix B times (expert weights, usually), which can cost more than the calls.

Shapes and offs values are checked per sample (the messages name the sample's shapes), with
the op's rules: offs values validated on CPU and in checked mode, else clamped on the device as
every kernel does (``_contract.sanitize_offs``), before they are shifted or scaled.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from . import _contract
from ._contract import LAYOUT_2D2D, LAYOUT_2D3D, LAYOUT_3D2D, LAYOUT_3D3D


def _sample(t, dim):
    """One sample's view of t (batch dimension ``dim``, or None: unbatched)."""
    return t if t is None or dim is None else t.select(dim, 0)


def _empty_sample(t, dim):
    """A stand-in for one sample of t, for a batch of size 0 (which has none): one element of t's
    dtype on t's device, expanded to the sample's shape. Unbatched arguments are themselves, so
    their devices and shared offs values are checked as in any call."""
    if t is None or dim is None:
        return t
    shape = list(t.shape)
    del shape[dim]
    return t.new_empty(()).expand(shape)


def _major(t, dim, d):
    """t's batch (at ``dim``) merged into per-sample dimension d as its major part: index s * size + i."""
    return t.movedim(dim, d).flatten(d, d + 1)


def _minor(t, dim, d):
    """t's batch merged into per-sample dimension d as its minor part: index i * B + s."""
    return t.movedim(dim, d + 1).flatten(d, d + 1)


def _outer_level(offs) -> bool:
    """Whether offs is still wrapped by a functorch transform outside this vmap level (vmap or
    jacrev inside a vmap over offs): its values belong to that level and cannot be read here."""
    return torch._C._functorch.is_functorch_wrapped_tensor(offs)


def _values_readable(offs) -> bool:
    """Whether offs values are checked here: on CPU and in checked mode, as the op does, but
    not while torch.compile traces (fake tensors have no values)."""
    if torch.compiler.is_compiling() or is_fake(offs):
        return False
    return offs.device.type == "cpu" or _contract.checked_mode()


def _offs_rows(offs, offs_dim, batch, extent):
    """[B, G] int64 offs per sample, checked (CPU, checked mode) or clamped (elsewhere); offs
    unbatched (offs_dim None) is checked once and repeated."""
    rows = offs.movedim(offs_dim, 0) if offs_dim is not None else offs.expand(batch, offs.shape[0])
    if _values_readable(rows):
        for s, values in enumerate((rows if offs_dim is not None else rows[:1]).tolist()):  # one read
            try:
                _contract.check_offs_list(values, extent)
            except ValueError as e:
                raise ValueError(f"{e} (sample {s} of the vmapped batch)" if offs_dim is not None else str(e)) from None
    else:
        rows = _contract.sanitize_offs(rows, extent)
    return rows.to(torch.int64)


def _shifted(rows, extent):
    """[B, G] offs -> [B * G] offs of the samples laid end to end, each ``extent`` long."""
    starts = torch.arange(rows.shape[0], device=rows.device, dtype=torch.int64) * extent
    return (rows + starts[:, None]).flatten()


def _past(t, rows, dim):
    """A mask broadcastable to t (batch at 0): the indices of dimension ``dim`` at or past each
    sample's last group end rows[:, -1]."""
    index = torch.arange(t.shape[dim], device=t.device)
    past = index[None, :] >= rows[:, -1:]  # [B, extent]
    shape = [1] * t.dim()
    shape[0], shape[dim] = past.shape
    return past.view(shape)


def _sorted_rows(mat_a, a_dim, mat_b, rows, bias, out_dtype, p):
    """2Dx3D with per-sample partitions and shared weights (vmap over sequences routed one by
    one): the rows of all samples, sorted by group (stable, so sample by sample within a group)
    and past every group at the end, are one call with G groups; the result is put back in the
    samples' row order. On the device: no host sync."""
    batch, M = rows.shape[0], p.M
    index = torch.arange(M, device=rows.device, dtype=torch.int64).expand(batch, M).contiguous()
    group = torch.searchsorted(rows.contiguous(), index, right=True).flatten()  # [B * M], G: past every group
    order = torch.sort(group, stable=True).indices
    # Out of place: rows (so group) may be batched by an outer vmap where offs values are not
    # read (an accelerator, torch.compile), and vmap refuses an in-place scatter of a batched
    # index into the unbatched zeros.
    counts = torch.zeros(p.G + 1, dtype=torch.int64, device=rows.device)
    counts = counts.scatter_add(0, group, torch.ones_like(group))
    # Indexing, not index_select: torch_xla 2.9 aborts (XLA:CPU, "Check failed: buffer !=
    # nullptr") on index_select whose index is a sort's output as it stands.
    out = torch.ops.moe.grouped_mm(_major(mat_a, a_dim, 0)[order], mat_b, torch.cumsum(counts[:-1], 0), bias,
                                   out_dtype)
    back = torch.empty_like(order).scatter(0, order,
                                           torch.arange(order.numel(), device=order.device))
    return out[back].unflatten(0, (batch, M))


def _loop(op, batch, in_dims, args, out_dtype):
    outs = []
    for s in range(batch):
        sample = [t if t is None or d is None else t.select(d, s) for t, d in zip(args, in_dims)]
        outs.append(op(*sample, out_dtype))
    return torch.stack(outs), 0


def grouped_mm_vmap(info, in_dims, mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """The batching rule: (result, its batch dimension) for a batch of ``info.batch_size``."""
    # The dispatcher leaves out trailing arguments that hold their defaults.
    in_dims = (*in_dims, None, None, None)[:4]
    a_dim, b_dim, offs_dim, bias_dim = in_dims
    batch = info.batch_size
    op = torch.ops.moe.grouped_mm
    # vmap's layer runs before the Autocast kernel: apply its casts first, as it would per sample.
    device_type = mat_a.device.type
    # Only device types autocast knows: is_autocast_enabled raises for others (meta tensors).
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        mat_a, mat_b, bias = (_contract.autocast_cast(t, dtype) for t in (mat_a, mat_b, bias))
    one = _sample if batch > 0 else _empty_sample
    p = _contract.check_args(one(mat_a, a_dim), one(mat_b, b_dim), one(offs, offs_dim), one(bias, bias_dim), out_dtype)
    if batch == 0:
        if offs is not None and offs_dim is None and not _outer_level(offs):
            _offs_rows(offs, None, 1, p.extent)  # shared offs: checked as a call checks them
        out = mat_a.new_zeros((0, *p.out_shape), dtype=p.out_dtype)
        # Connected to the inputs as a call would be (an empty result, so zero gradients and
        # tangents, whatever the inputs hold): without it, loss.backward() over an empty batch
        # raised "element 0 of tensors does not require grad". Reverse mode only: forward-mode
        # tangents need no node, and unpack_dual has no batching rule (jacfwd over K = 0 maps
        # over 0 tangents inside another vmap).
        for t in (mat_a, mat_b, bias):
            if t is not None and torch.is_grad_enabled() and t.requires_grad:
                out = out + t.sum().to(out.dtype)
        return out, 0
    if offs is not None and _outer_level(offs) and _values_readable(offs):
        # Calls per sample hand offs to the outer level's rule, which reads and checks them.
        return _loop(op, batch, in_dims, (mat_a, mat_b, offs, bias), out_dtype)
    layout, G = p.layout, p.G
    a_b, b_b = a_dim is not None, b_dim is not None
    if layout == LAYOUT_2D3D and offs_dim is not None:
        if a_b and not b_b and bias_dim is None:
            return _sorted_rows(mat_a, a_dim, mat_b, _offs_rows(offs, offs_dim, batch, p.M), bias, out_dtype, p), 0
        if b_b and not a_b:  # mat_a repeated: B x [M, K], no larger than a batched mat_a
            mat_a, a_dim, a_b = mat_a.expand(batch, *mat_a.shape), 0, True

    if a_b and b_b:
        rows = None if offs is None else _offs_rows(offs, offs_dim, batch, p.extent)
        a, b = mat_a.movedim(a_dim, 0), mat_b.movedim(b_dim, 0)
        # A sample's tail joins another group of the folded call. Where autograd differentiates
        # that call, the tail is zeroed in the operands too (copies): NaN there (uninitialised
        # padding) gave 0 * NaN in the backward, a NaN in another sample's weight gradient or in
        # the tail's own zero gradient. Forward values and tangents never mix a tail into
        # another sample's results, and vmap(grad)'s folded backward calls are not
        # differentiated further: they skip the copies (benchmarks/vmap.py's per-sample
        # gradients took 2.8-2.9 ms with them, 2.0-2.6 ms without).
        if rows is not None and torch.is_grad_enabled() and (mat_a.requires_grad or mat_b.requires_grad):
            if layout in (LAYOUT_2D3D, LAYOUT_2D2D):
                a = a.masked_fill(_past(a, rows, 1 if layout == LAYOUT_2D3D else 2), 0)
            if layout in (LAYOUT_3D2D, LAYOUT_2D2D):
                b = b.masked_fill(_past(b, rows, 2 if layout == LAYOUT_3D2D else 1), 0)
        a = _major(a, 0, 1 if layout == LAYOUT_2D2D else 0)
        b = _major(b, 0, 1 if layout == LAYOUT_3D2D else 0)
        if bias is not None:
            bias = _major(bias, bias_dim, 0) if bias_dim is not None else bias.repeat(batch, 1)
        if layout == LAYOUT_2D3D:
            out = op(a, b, _shifted(rows, p.M), bias, out_dtype).unflatten(0, (batch, p.M))
            return out.masked_fill_(_past(out, rows, 1), 0), 0
        if layout == LAYOUT_3D3D:
            return op(a, b, None, bias, out_dtype).unflatten(0, (batch, G)), 0
        assert rows is not None  # every layout but 3d3d has offs
        if layout == LAYOUT_3D2D:
            # Masked in place before the batch moves to the front: an in-place op on the
            # movedim view cannot be functionalized (torch.compile failed, "Cannot view").
            out = op(a, b, _shifted(rows, p.N), None, out_dtype)
            out = out.unflatten(1, (batch, p.N))  # [M, B, N]
            out.masked_fill_(_past(out.movedim(1, 0), rows, 2).movedim(0, 1), 0)
            return out.movedim(1, 0), 0
        # 2Dx2D: one extra group per sample, ending at the sample's end, absorbs its tail.
        ends = torch.full((batch, 1), p.K, dtype=torch.int64, device=rows.device)
        out = op(a, b, _shifted(torch.cat([rows, ends], 1), p.K), None, out_dtype)
        return out.unflatten(0, (batch, G + 1))[:, :G], 0

    if offs_dim is None and (a_b and bias_dim is None or b_b):
        if layout == LAYOUT_2D3D and a_b:
            offs = _offs_rows(offs, None, 1, p.M)[0] * batch
            return op(_minor(mat_a, a_dim, 0), mat_b, offs, bias, out_dtype).unflatten(0, (p.M, batch)), 1
        if layout == LAYOUT_3D2D and b_b:
            offs = _offs_rows(offs, None, 1, p.N)[0] * batch
            return op(mat_a, _minor(mat_b, b_dim, 1), offs, None, out_dtype).unflatten(1, (p.N, batch)), 2
        if a_b:  # the batch joins M
            a = _major(mat_a, a_dim, 0 if layout == LAYOUT_2D2D else 1)
            out = op(a, mat_b, offs, bias, out_dtype)
            if layout == LAYOUT_3D2D:
                return out.unflatten(0, (batch, p.M)), 0
            return out.unflatten(1, (batch, p.M)), 1
        # the batch joins N
        d = 1 if layout in (LAYOUT_2D2D, LAYOUT_3D2D) else 2
        if bias is not None:
            bias = _major(bias, bias_dim, 1) if bias_dim is not None else bias.repeat(1, batch)
        out = op(mat_a, _major(mat_b, b_dim, d), offs, bias, out_dtype)
        n_dim = out.dim() - 1
        return out.unflatten(n_dim, (batch, p.N)), n_dim

    return _loop(op, batch, in_dims, (mat_a, mat_b, offs, bias), out_dtype)

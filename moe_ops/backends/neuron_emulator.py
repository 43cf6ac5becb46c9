"""A small numpy emulator of the nki.language / nki.isa subset the moe_ops NKI kernels use.

THIS IS NOT AWS'S SIMULATOR (``nki.simulate``) AND NOT THE NEURON COMPILER. It is our own
reading of the NKI documentation (NKI API of Neuron SDK 2.33, the ``nki.*`` namespace), written
so that the kernels in ``moe_ops.backends.neuron_nki`` can run on a machine without the Neuron
SDK (every Neuron package on PyPI is a placeholder). A kernel that passes here can still fail to
compile with neuronx-cc, or compute something else on Trainium. It is a test utility: the path a
real Neuron device takes never imports it.

What it executes: the kernel's own Python function, unchanged. ``neuron_nki`` resolves its ``nl``
and ``nisa`` names at call time; ``run_kernel`` points them at this module's ``language`` and
``isa`` namespaces instead of the real ``nki`` ones.

What it enforces, so that index-math and tiling bugs fail here instead of on hardware:

* memory spaces: ``nc_matmul`` reads SBUF and writes PSUM; ``nc_transpose`` reads SBUF and
  writes PSUM; DMA moves between HBM and SBUF only; engine instructions work on SBUF / PSUM;
  indirect (gather / scatter) views only on HBM.
* tile limits (Trainium2, NeuronCore-v3): at most 128 partitions per SBUF / PSUM tile; a PSUM
  tile holds at most 2 KiB per partition (one bank, 512 fp32); an SBUF tile at most 192 KiB per
  partition, and the tiles alive at one time (Python object lifetimes, an estimate of the
  compiler's allocator) at most 192 KiB of SBUF and 16 KiB of PSUM per partition;
  ``nc_matmul`` operands: contraction over equal partition counts <= 128, stationary free size
  <= 128, moving free size <= 512, dst shape [stationary free, moving free].
* tensor_copy_predicated: a uint8 predicate of dst's shape, src of dst's dtype, reverse_pred only
  with a scalar src, src and predicate not both in PSUM;
* dtype rules: matmul inputs bf16 / fp16 / fp32, fp32 only with fp32, result fp32 in PSUM
  (bf16 / fp16 products summed in fp32 in partition order, see ``_tensor_engine_sum``);
  transposes keep the dtype; engine arithmetic in fp32 and one rounding (round to nearest even)
  to the destination dtype; DMA between different dtypes goes through fp32.
* PSUM accumulation: ``accumulate=True`` on a location a matmul did not initialise is undefined
  behaviour on hardware and an error here; ``accumulate=None`` is inferred per location (first
  write overwrites, later writes accumulate).
* memory safety: every access is bounds-checked against its tensor's storage; an indirect index
  outside its dimension raises unless the DMA says ``oob_mode=skip`` (then that transfer is
  skipped, as on hardware); reading never-written SBUF / PSUM / HBM is an error; a kernel whose
  returned HBM tensor has unwritten elements fails.

What it does not model: timing, engines running in parallel, DMA queues, the compiler's
allocator and scheduling, loop-carried dependencies inside ``affine_range`` (loops run in program
order), and everything the kernels do not use: ``language`` / ``isa`` below hold only the names
they need, and arguments the kernels never pass raise ``NotEmulated``. bf16 is stored as float32
rounded to bf16.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import weakref
from types import SimpleNamespace
from typing import Optional, Union

import numpy as np
import torch

__all__ = ["EmulatorError", "NotEmulated", "language", "isa", "run_kernel", "Tensor"]


class EmulatorError(RuntimeError):
    """A kernel broke a hardware or API rule (the message says which)."""


class NotEmulated(NotImplementedError):
    """The kernel used an NKI feature this emulator does not implement."""


# ---------------------------------------------------------------- hardware constants (NeuronCore-v3)
PMAX = 128                     # partitions of SBUF / PSUM; contraction size of one matmul
GEMM_STATIONARY_FMAX = 128     # free size of the stationary operand (systolic array columns)
GEMM_MOVING_FMAX = 512         # free size of the moving operand (one PSUM bank of fp32)
PSUM_BANK_BYTES = 2048         # per partition
PSUM_BANKS = 8
SBUF_PARTITION_BYTES = 192 * 1024  # 24 MiB / 128 partitions

# ---------------------------------------------------------------- dtypes and buffers
# NKI names dtypes with strings; bf16 is stored as float32 values rounded to bf16.
_STORAGE = {
    "float32": (np.float32, 4), "bfloat16": (np.float32, 2), "float16": (np.float16, 2), "int32": (np.int32, 4),
    "uint8": (np.uint8, 1),
}
_MATMUL_DTYPES = ("bfloat16", "float16", "float32")
_INT_DTYPES = ("int32", "uint8")
_PREDICATE_DTYPES = ("uint8",)  # NKI allows uint8 / uint16 / uint32 predicates; the kernels use uint8

SBUF, PSUM, SHARED_HBM = "sbuf", "psum", "shared_hbm"
_ON_CHIP = (SBUF, PSUM)


def _is_hbm(buffer) -> bool:
    return buffer == SHARED_HBM


def _round_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> nearest bf16 (ties to even), returned as float32; NaN stays NaN."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    out = rounded.view(np.float32).copy()
    out[np.isnan(x)] = np.nan
    return out


def _convert(values: np.ndarray, src_dtype: str, dst_dtype: str) -> np.ndarray:
    """Values of src_dtype as dst_dtype: bit-exact when equal, else through float32 (round to nearest even)."""
    if src_dtype == dst_dtype:
        return values
    if dst_dtype in _INT_DTYPES:
        f = np.asarray(values, dtype=np.float32)
        if not np.all(np.isfinite(f)):
            raise EmulatorError(f"casting non-finite values to {dst_dtype}")
        return np.rint(f).astype(_STORAGE[dst_dtype][0])
    f = np.asarray(values, dtype=np.float32)
    if dst_dtype == "bfloat16":
        return _round_bf16(f)
    return f.astype(_STORAGE[dst_dtype][0])


def _check_dtype(dtype) -> str:
    if dtype not in _STORAGE:
        raise NotEmulated(f"dtype {dtype!r} is not emulated (emulated: {sorted(_STORAGE)})")
    return dtype


# ---------------------------------------------------------------- run state
class _Run:
    """Per-kernel-call state: live on-chip bytes per partition and instruction counts."""

    def __init__(self):
        self.live = {SBUF: 0, PSUM: 0}
        self.counts: collections.Counter = collections.Counter()


_state = threading.local()


def _run() -> _Run:
    run = getattr(_state, "run", None)
    if run is None:
        raise EmulatorError("NKI emulator used outside run_kernel()")
    return run


class _Storage:
    """One allocation: flat numpy data, a written mask, and for PSUM which elements a matmul initialised."""

    def __init__(self, size: int, dtype: str, buffer: str, per_partition_bytes: int = 0, data=None):
        np_dtype = _STORAGE[dtype][0]
        self.dtype, self.buffer = dtype, buffer
        if data is None:
            self.data = np.zeros(size, dtype=np_dtype)
            self.written = np.zeros(size, dtype=bool)
        else:
            self.data = np.ascontiguousarray(data, dtype=np_dtype).reshape(-1).copy()
            self.written = np.ones(self.data.size, dtype=bool)
        self.mm_init = np.zeros(size, dtype=bool) if buffer == PSUM else None
        if buffer in _ON_CHIP:
            run = _run()
            run.live[buffer] += per_partition_bytes
            weakref.finalize(self, _release, run, buffer, per_partition_bytes)


def _release(run: _Run, buffer: str, nbytes: int) -> None:
    run.live[buffer] -= nbytes


# ---------------------------------------------------------------- tensors and views
class _Indirect:
    """A runtime index on one dimension of an HBM view: a (1, 1) scalar or a (P, 1) per-partition vector."""

    def __init__(self, kind: str, index: "Tensor", stride: int, bound: int):
        self.kind, self.index, self.stride, self.bound = kind, index, stride, bound


class Tensor:
    """An NKI tensor view: storage + shape + element strides + offset (+ an optional runtime index).

    On-chip tensors (SBUF / PSUM) have the partition dimension first.
    """

    def __init__(self, storage: _Storage, shape, strides, offset: int, indirect: Optional[_Indirect] = None):
        self._storage, self.shape, self.strides = storage, tuple(shape), tuple(strides)
        self.offset, self._indirect = offset, indirect

    dtype = property(lambda self: self._storage.dtype)
    buffer = property(lambda self: self._storage.buffer)
    ndim = property(lambda self: len(self.shape))

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def __repr__(self):
        return f"<emulated NKI tensor {self.shape} {self.dtype} in {self.buffer}>"

    def _with(self, shape, strides, offset, indirect="same") -> "Tensor":
        return Tensor(self._storage, shape, strides, offset, self._indirect if indirect == "same" else indirect)

    def __getitem__(self, key) -> "Tensor":
        if not isinstance(key, tuple):
            key = (key,)
        if any(k is Ellipsis for k in key):
            raise NotEmulated("Ellipsis indexing is not emulated")
        if len(key) > self.ndim:
            raise EmulatorError(f"{len(key)} indices for a {self.ndim}-D tensor of shape {self.shape}")
        key = key + (slice(None),) * (self.ndim - len(key))
        shape, strides, offset = [], [], self.offset
        for d, (k, n, s) in enumerate(zip(key, self.shape, self.strides)):
            if self._indirect is not None and self._indirect.kind == "vector" and d == 0 and k != slice(None):
                raise EmulatorError("the partition dimension of a vector-indirect view cannot be sliced")
            if isinstance(k, slice):
                start, stop, step = k.indices(n)
                if k.start is not None and not -n <= k.start <= n or k.stop is not None and not -n <= k.stop <= n:
                    raise EmulatorError(f"slice {k} out of range for dimension {d} of size {n}")
                if step < 1:
                    raise NotEmulated("slices need a positive step")
                count = max(0, -(-(stop - start) // step))
                if count == 0:
                    raise EmulatorError(f"empty slice {k} of dimension {d} (size {n})")
                shape.append(count)
                strides.append(s * step)
                offset += start * s
            elif isinstance(k, (int, np.integer)):
                k = int(k)
                if not -n <= k < n:
                    raise EmulatorError(f"index {k} out of range for dimension {d} of size {n}")
                offset += (k % n) * s
                if d == 0 and self.buffer in _ON_CHIP:  # on-chip tensors keep the partition dim
                    shape.append(1)
                    strides.append(s)
            else:
                raise NotEmulated(f"index {k!r} is not emulated (ints and slices)")
        return self._with(shape, strides, offset)

    def select(self, dim: int, index) -> "Tensor":
        """Drop dimension ``dim`` at ``index``: an int, or a (1, 1) int32 SBUF tensor read at run time (HBM only)."""
        if not 0 <= dim < self.ndim:
            raise EmulatorError(f"select dim {dim} of a {self.ndim}-D tensor")
        shape = self.shape[:dim] + self.shape[dim + 1:]
        strides = self.strides[:dim] + self.strides[dim + 1:]
        if isinstance(index, (int, np.integer)):
            if not 0 <= index < self.shape[dim]:
                raise EmulatorError(f"select index {index} out of range for dimension {dim} of size {self.shape[dim]}")
            return self._with(shape, strides, self.offset + int(index) * self.strides[dim])
        _check_index_tensor(index, (1, 1), "select")
        if not _is_hbm(self.buffer):
            raise EmulatorError("a runtime select applies to HBM tensors only")
        if self._indirect is not None:
            raise EmulatorError("an indirect view cannot be indirected again")
        return self._with(shape, strides, self.offset, _Indirect("scalar", index, self.strides[dim], self.shape[dim]))

    def ap(self, pattern, offset=None, scalar_offset=None, vector_offset=None, indirect_dim=0, dtype=None):
        """An explicit access pattern [[stride, count], ...] over this HBM tensor's storage.

        ``vector_offset`` ((P, 1) int32 SBUF): partition p starts at index[p] along ``indirect_dim``
        (the pattern's first entry must be [that dimension's stride, P]). ``scalar_offset``
        ((1, 1) int32 SBUF): one runtime index along ``indirect_dim`` for the whole pattern.
        """
        if not _is_hbm(self.buffer):
            raise NotEmulated("ap() is emulated on HBM tensors only")
        if dtype is not None:
            raise NotEmulated("ap(dtype=...) reinterpretation is not emulated")
        if self._indirect is not None:
            raise EmulatorError("an indirect view cannot be indirected again")
        pattern = [tuple(int(v) for v in entry) for entry in pattern]
        if not pattern or any(len(e) != 2 or e[1] < 1 for e in pattern):
            raise EmulatorError(f"access pattern {pattern} must be [[stride, count >= 1], ...]")
        strides = [e[0] for e in pattern]
        shape = [e[1] for e in pattern]
        base = self.offset + (0 if offset is None else int(offset))
        indirect = None
        if scalar_offset is not None and vector_offset is not None:
            raise EmulatorError("vector_offset and scalar_offset are mutually exclusive")
        if scalar_offset is not None or vector_offset is not None:
            if not 0 <= indirect_dim < self.ndim:
                raise EmulatorError(f"indirect_dim {indirect_dim} of a {self.ndim}-D tensor")
            stride, bound = self.strides[indirect_dim], self.shape[indirect_dim]
            if scalar_offset is not None:
                _check_index_tensor(scalar_offset, (1, 1), "scalar_offset")
                indirect = _Indirect("scalar", scalar_offset, stride, bound)
            else:
                _check_index_tensor(vector_offset, (shape[0], 1), "vector_offset")
                if strides[0] != stride:
                    raise EmulatorError(
                        f"with vector_offset the pattern's partition entry must step by the indirect "
                        f"dimension's stride {stride}, got {pattern[0]}")
                indirect = _Indirect("vector", vector_offset, stride, bound)
        return self._with(shape, strides, base, indirect)


def _check_index_tensor(t, shape, what: str) -> None:
    if not isinstance(t, Tensor) or t.buffer != SBUF or t.dtype != "int32":
        raise EmulatorError(f"{what} must be an int32 SBUF tensor, got {t!r}")
    if t.shape != tuple(shape):
        raise EmulatorError(f"{what} must have shape {tuple(shape)}, got {t.shape}")


# ---------------------------------------------------------------- element access
def _addresses(t: Tensor):
    """(flat storage addresses [shape], mask of elements that take part [shape]) of a view, now."""
    addr = np.full(t.shape, t.offset, dtype=np.int64)
    for d, (n, s) in enumerate(zip(t.shape, t.strides)):
        view = [1] * t.ndim
        view[d] = n
        addr = addr + (np.arange(n, dtype=np.int64) * s).reshape(view)
    mask = np.ones(t.shape, dtype=bool)
    ind = t._indirect
    if ind is not None:
        idx = _read(ind.index).astype(np.int64).reshape(-1)
        inside = (idx >= 0) & (idx < ind.bound)
        if ind.kind == "scalar":
            addr = addr + int(idx[0]) * ind.stride
            mask[...] = bool(inside[0])
        else:
            # The view's dim-0 stride was the pattern's partition stride (== ind.stride): replace the
            # p * stride term by index[p] * stride.
            shift = (idx - np.arange(t.shape[0])) * ind.stride
            addr = addr + shift.reshape((-1,) + (1,) * (t.ndim - 1))
            mask = mask & inside.reshape((-1,) + (1,) * (t.ndim - 1))
    live = addr[mask]
    if live.size and (live.min() < 0 or live.max() >= t._storage.data.size):
        raise EmulatorError(f"out-of-bounds access: {t!r} reaches element {int(live.max())} of "
                            f"{t._storage.data.size} (or {int(live.min())})")
    return addr, mask


def _read(t: Tensor, addr=None, mask=None) -> np.ndarray:
    if addr is None:
        addr, mask = _addresses(t)
        if not mask.all():
            raise EmulatorError(f"reading {t!r} through an out-of-bounds index")
    sel = addr[mask] if mask is not None else addr
    if not t._storage.written[sel].all():
        raise EmulatorError(f"reading never-written elements of {t!r}")
    return t._storage.data[addr]


def _write(t: Tensor, values: np.ndarray, src_dtype: str, mask=None, addr=None) -> None:
    if addr is None:
        addr, mask = _addresses(t)
        if not mask.all():
            raise EmulatorError(f"writing {t!r} through an out-of-bounds index")
    values = _convert(np.asarray(values).reshape(t.shape), src_dtype, t.dtype)
    if mask is None:
        mask = np.ones(t.shape, dtype=bool)
    st = t._storage
    st.data[addr[mask]] = values[mask]
    st.written[addr[mask]] = True
    if st.mm_init is not None:
        st.mm_init[addr[mask]] = False


def _flat2d(t: Tensor, what: str) -> np.ndarray:
    """An on-chip view as [partitions, elements per partition] (numpy, already read)."""
    if t.buffer not in _ON_CHIP:
        raise EmulatorError(f"{what} must be an SBUF or PSUM tile, got {t!r}")
    return _read(t).reshape(t.shape[0], -1)


def _partitions(t: Tensor) -> int:
    return t.shape[0]


def _per_partition(t: Tensor) -> int:
    return t.size // t.shape[0]


# ---------------------------------------------------------------- nki.language
def ndarray(shape, dtype, buffer=SBUF, name="", address=None):
    """Allocate an uninitialised tensor (reading it before writing is an error)."""
    if address is not None:
        raise NotEmulated("manual addresses are not emulated")
    shape = tuple(int(s) for s in shape)
    dtype = _check_dtype(dtype)
    if buffer not in (SBUF, PSUM, SHARED_HBM):
        raise EmulatorError(f"unknown buffer {buffer!r}")
    if not shape or any(s < 1 for s in shape):
        raise EmulatorError(f"tensor shape {shape} must have at least one dimension, all >= 1")
    size = int(np.prod(shape, dtype=np.int64))
    per_partition = 0
    if buffer in _ON_CHIP:
        if shape[0] > PMAX:
            raise EmulatorError(f"partition dimension {shape[0]} > {PMAX} in a {buffer} tile of shape {shape}")
        per_partition = size // shape[0] * _STORAGE[dtype][1]
        limit = PSUM_BANK_BYTES if buffer == PSUM else SBUF_PARTITION_BYTES
        if per_partition > limit:
            raise EmulatorError(f"{buffer} tile {shape} {dtype} needs {per_partition} bytes per partition; "
                                f"the limit is {limit}" + (" (one PSUM bank)" if buffer == PSUM else ""))
        capacity = PSUM_BANK_BYTES * PSUM_BANKS if buffer == PSUM else SBUF_PARTITION_BYTES
        live = _run().live[buffer]
        if live + per_partition > capacity:
            raise EmulatorError(f"{buffer} over capacity: {live} bytes per partition live, {per_partition} more "
                                f"requested, capacity {capacity}")
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    _run().counts["ndarray"] += 1
    return Tensor(_Storage(size, dtype, buffer, per_partition), shape, strides, 0)


def _add(x, y):
    return x + y


def _multiply(x, y):
    return x * y


_ALU = {"add": _add, "multiply": _multiply}

language = SimpleNamespace(
    ndarray=ndarray, affine_range=range, sequential_range=range,
    tile_size=SimpleNamespace(pmax=PMAX, gemm_moving_fmax=GEMM_MOVING_FMAX),
    float32="float32", bfloat16="bfloat16", float16="float16", int32="int32", uint8="uint8",
    sbuf=SBUF, psum=PSUM, shared_hbm=SHARED_HBM, add=_add, multiply=_multiply,
)


# ---------------------------------------------------------------- nki.isa
class oob_mode:  # noqa: N801 (the NKI name)
    error = "error"
    skip = "skip"


def _no_extras(op: str, **given) -> None:
    extras = {k: v for k, v in given.items() if v not in (None, False, ())}
    if extras:
        raise NotEmulated(f"{op}: arguments {sorted(extras)} are not emulated")


def dma_copy(dst: Tensor, src: Tensor, priority=None, oob_mode=oob_mode.error, dge_mode=None, engine=None,
             name=None):
    """dst = src between HBM and SBUF; gathers / scatters through indirect views."""
    _no_extras("dma_copy", priority=priority, dge_mode=dge_mode, engine=engine)
    _run().counts["dma_copy"] += 1
    for what, t in (("src", src), ("dst", dst)):
        if not isinstance(t, Tensor):
            raise EmulatorError(f"dma_copy {what} must be an NKI tensor, got {t!r}")
        if t.buffer == PSUM:
            raise EmulatorError(f"dma_copy cannot access PSUM ({what} {t!r}); copy to SBUF first")
    if src.size != dst.size:
        raise EmulatorError(f"dma_copy element counts differ: src {src.shape} vs dst {dst.shape}")
    if oob_mode not in ("error", "skip"):
        raise EmulatorError(f"unknown oob_mode {oob_mode!r}")
    s_addr, s_mask = _addresses(src)
    d_addr, d_mask = _addresses(dst)
    if oob_mode == "error" and not (s_mask.all() and d_mask.all()):
        raise EmulatorError("dma_copy: an indirect index is out of bounds (pass oob_mode=skip to skip it)")
    flat_s, flat_d = s_mask.reshape(-1), d_mask.reshape(-1)
    both = flat_s & flat_d  # a transfer happens only where neither side was skipped
    if not both.any():
        return
    vals = _read(src, s_addr.reshape(-1)[both], None)
    addr = d_addr.reshape(-1)[both]
    st = dst._storage
    st.data[addr] = _convert(vals, src.dtype, dst.dtype)
    st.written[addr] = True


def memset(dst: Tensor, value, engine=None, name=None):
    _no_extras("memset", engine=engine)
    _run().counts["memset"] += 1
    if dst.buffer not in _ON_CHIP:
        raise EmulatorError(f"memset writes SBUF or PSUM, not {dst.buffer}")
    _write(dst, np.full(dst.shape, value, dtype=np.float64 if dst.dtype not in _INT_DTYPES else np.int64),
           "float32" if dst.dtype not in _INT_DTYPES else dst.dtype)


def tensor_copy(dst: Tensor, src: Tensor, engine=None, name=None):
    """dst = src on chip (SBUF / PSUM), cast to dst's dtype."""
    _no_extras("tensor_copy", engine=engine)
    _run().counts["tensor_copy"] += 1
    vals = _flat2d(src, "tensor_copy src")
    if dst.buffer not in _ON_CHIP:
        raise EmulatorError(f"tensor_copy dst must be SBUF or PSUM, got {dst!r}")
    if _partitions(dst) != _partitions(src) or _per_partition(dst) != _per_partition(src):
        raise EmulatorError(f"tensor_copy shapes differ per partition: src {src.shape} vs dst {dst.shape}")
    _write(dst, vals, src.dtype)


def nc_transpose(dst: Tensor, data: Tensor, engine=None, name=None):
    """Tensor Engine transpose: data [p <= 128, f <= 128] in SBUF -> dst [f, p] in PSUM, same dtype."""
    _no_extras("nc_transpose", engine=engine)
    _run().counts["nc_transpose"] += 1
    if data.buffer != SBUF or dst.buffer != PSUM:
        raise EmulatorError(f"nc_transpose reads SBUF and writes PSUM, got data in {data.buffer}, dst in {dst.buffer}")
    if data.ndim != 2 or dst.ndim != 2:
        raise NotEmulated("nc_transpose is emulated for 2-D tiles")
    if data.shape[0] > PMAX or data.shape[1] > GEMM_STATIONARY_FMAX:
        raise EmulatorError(f"nc_transpose input {data.shape} exceeds [{PMAX}, {GEMM_STATIONARY_FMAX}]")
    if dst.shape != (data.shape[1], data.shape[0]):
        raise EmulatorError(f"nc_transpose dst {dst.shape} must be {(data.shape[1], data.shape[0])}")
    if dst.dtype != data.dtype:
        raise EmulatorError(f"nc_transpose keeps the dtype: data {data.dtype}, dst {dst.dtype}")
    _write(dst, _read(data).T, data.dtype)


def _tensor_engine_sum(stationary: np.ndarray, moving: np.ndarray) -> np.ndarray:
    """stationary.T @ moving for bf16 / fp16 operands, summed as our model of the Tensor Engine.

    stationary [k, m], moving [k, n]: bf16 (stored as float32) or float16 values, k <= 128.
    Returns [m, n] float32. The NKI docs say only "The matmul accumulation and results are
    always in float32" (nki.isa.nc_matmul); they give no order. Ours, fixed so that the
    emulator's results do not depend on the BLAS library: a running fp32 sum over the
    contraction (partition) index p = 0, 1, ..., k-1, starting from 0, with round to nearest
    even after every addition. A product of two bf16 (8 significant bits) or fp16 (11) values
    is exact in fp32 (24 bits; only products below fp32's normal range are not), so whether
    torch fuses the multiply-add does not change the sum. One rank-1 update per partition: a
    128 x 128 x 512 matmul takes about 2 ms here instead of BLAS's 0.3 ms.
    """
    s = torch.from_numpy(np.ascontiguousarray(stationary, dtype=np.float32))
    mv = torch.from_numpy(np.ascontiguousarray(moving, dtype=np.float32))
    acc = torch.zeros((s.shape[1], mv.shape[1]), dtype=torch.float32)
    for p in range(s.shape[0]):
        acc.addcmul_(s[p, :, None], mv[p, None, :])
    return acc.numpy()


def nc_matmul(dst: Tensor, stationary: Tensor, moving: Tensor, is_stationary_onezero=False, is_moving_onezero=False,
              is_transpose=False, accumulate=None, tile_position=(), tile_size=(), perf_mode=None, name=None):
    """dst[PSUM, fp32] (+)= stationary.T @ moving, both operands in SBUF, contraction over partitions."""
    _no_extras("nc_matmul", is_transpose=is_transpose, tile_position=tile_position, tile_size=tile_size,
               perf_mode=perf_mode)
    _run().counts["nc_matmul"] += 1
    if stationary.buffer != SBUF or moving.buffer != SBUF:
        raise EmulatorError(f"nc_matmul operands must be in SBUF: stationary in {stationary.buffer}, "
                            f"moving in {moving.buffer}")
    if dst.buffer != PSUM:
        raise EmulatorError(f"nc_matmul writes PSUM, dst is in {dst.buffer}")
    if stationary.ndim != 2 or moving.ndim != 2 or dst.ndim != 2:
        raise NotEmulated("nc_matmul is emulated for 2-D tiles")
    (k, m), (k2, n) = stationary.shape, moving.shape
    if k != k2:
        raise EmulatorError(f"nc_matmul contraction (partition) sizes differ: stationary {stationary.shape}, "
                            f"moving {moving.shape}")
    if k > PMAX:
        raise EmulatorError(f"nc_matmul contraction size {k} > {PMAX} partitions")
    if m > GEMM_STATIONARY_FMAX:
        raise EmulatorError(f"nc_matmul stationary free size {m} > {GEMM_STATIONARY_FMAX}")
    if n > GEMM_MOVING_FMAX:
        raise EmulatorError(f"nc_matmul moving free size {n} > {GEMM_MOVING_FMAX}")
    if dst.shape != (m, n):
        raise EmulatorError(f"nc_matmul dst {dst.shape} must be [stationary free, moving free] = {(m, n)}")
    for what, t in (("stationary", stationary), ("moving", moving)):
        if t.dtype not in _MATMUL_DTYPES:
            raise EmulatorError(f"nc_matmul {what} dtype {t.dtype} is not a Tensor Engine input dtype")
    if (stationary.dtype == "float32") != (moving.dtype == "float32"):
        raise EmulatorError(f"nc_matmul: float32 only pairs with float32 ({stationary.dtype} x {moving.dtype})")
    if dst.dtype != "float32":
        raise EmulatorError(f"nc_matmul accumulates into a float32 PSUM tile, dst is {dst.dtype}")
    addr, _ = _addresses(dst)
    st = dst._storage
    assert st.mm_init is not None  # every PSUM storage has one, and dst is in PSUM (checked above)
    init = st.mm_init[addr]
    if accumulate is None:
        if init.any() and not init.all():
            raise EmulatorError("nc_matmul accumulate=None on a PSUM tile only partly initialised by matmuls")
        accumulate = bool(init.all())
    elif accumulate and not init.all():
        raise EmulatorError("nc_matmul accumulate=True on PSUM not initialised by a matmul "
                            "(undefined behaviour on hardware)")
    wide: type
    if stationary.dtype == "float32":
        # fp32 inputs are multiplied and summed in fp64 here, more exactly than the engine's
        # multi-pass fp32, and rounded to fp32 once.
        wide = np.float64
        product = (torch.from_numpy(_read(stationary).astype(wide)).T
                   @ torch.from_numpy(_read(moving).astype(wide))).numpy()
    else:
        wide = np.float32
        product = _tensor_engine_sum(_read(stationary), _read(moving))
    # accumulate: the instruction's own sum, then one addition onto the PSUM value (our model
    # of PSUM accumulation; the docs do not say where the running sum starts)
    if accumulate:
        product = _read(dst).astype(wide) + product
    st.data[addr] = product.astype(np.float32)
    st.written[addr] = True
    st.mm_init[addr] = True


def _operand0(t, data: Tensor) -> Union[np.ndarray, np.float32]:
    if isinstance(t, Tensor):
        if t.shape != (data.shape[0], 1):
            raise EmulatorError(f"operand0 must be a scalar or a ({data.shape[0]}, 1) tile, got {t.shape}")
        if t.buffer not in _ON_CHIP:
            raise EmulatorError(f"operand0 must be on chip, got {t!r}")
        return _read(t).astype(np.float32).reshape(-1, 1)
    return np.float32(t)


def _alu(op):
    for name, fn in _ALU.items():
        if op is fn:
            return fn
    raise NotEmulated(f"ALU operator {op!r} is not emulated (emulated: {sorted(_ALU)})")


def scalar_tensor_tensor(dst: Tensor, data: Tensor, op0, operand0, op1, operand1: Tensor, reverse0=False,
                         reverse1=False, name=None):
    """dst = (data op0 operand0) op1 operand1 on the Vector Engine, in fp32."""
    _run().counts["scalar_tensor_tensor"] += 1
    if data.buffer == PSUM and operand1.buffer == PSUM:
        raise EmulatorError("scalar_tensor_tensor: data and operand1 cannot both be in PSUM")
    x = _flat2d(data, "scalar_tensor_tensor data").astype(np.float32)
    y = _flat2d(operand1, "scalar_tensor_tensor operand1").astype(np.float32)
    if x.shape != y.shape or _partitions(dst) != x.shape[0] or _per_partition(dst) != x.shape[1]:
        raise EmulatorError(f"scalar_tensor_tensor shapes differ: data {data.shape}, operand1 {operand1.shape}, "
                            f"dst {dst.shape}")
    if x.shape[0] > PMAX:
        raise EmulatorError(f"scalar_tensor_tensor over {x.shape[0]} > {PMAX} partitions")
    s = _operand0(operand0, data)
    f0, f1 = _alu(op0), _alu(op1)
    t = f0(s, x) if reverse0 else f0(x, s)
    r = f1(y, t) if reverse1 else f1(t, y)
    _write(dst, r.astype(np.float32), "float32")


def tensor_copy_predicated(dst: Tensor, src, predicate: Tensor, reverse_pred=False, name=None):
    """dst = src where predicate is non-zero (where it is zero, with reverse_pred) on the Vector
    Engine; the other elements of dst keep their values. src: a tile of dst's dtype and shape
    per partition, or a Python scalar (the only kind reverse_pred takes)."""
    _run().counts["tensor_copy_predicated"] += 1
    if dst.buffer not in _ON_CHIP or predicate.buffer not in _ON_CHIP:
        raise EmulatorError("tensor_copy_predicated: dst and predicate must be SBUF or PSUM tiles")
    if predicate.dtype not in _PREDICATE_DTYPES:
        raise EmulatorError(f"tensor_copy_predicated: predicate dtype must be one of {_PREDICATE_DTYPES}, "
                            f"got {predicate.dtype}")
    if _partitions(predicate) != _partitions(dst) or _per_partition(predicate) != _per_partition(dst):
        raise EmulatorError(f"tensor_copy_predicated: predicate {predicate.shape} and dst {dst.shape} differ")
    take = _flat2d(predicate, "tensor_copy_predicated predicate") != 0
    if reverse_pred:
        if isinstance(src, Tensor):
            raise EmulatorError("tensor_copy_predicated: reverse_pred needs a scalar src")
        take = ~take
    if isinstance(src, Tensor):
        if src.buffer == PSUM and predicate.buffer == PSUM:
            raise EmulatorError("tensor_copy_predicated: src and predicate cannot both be in PSUM")
        if src.dtype != dst.dtype:
            raise EmulatorError(f"tensor_copy_predicated: src {src.dtype} and dst {dst.dtype} dtypes differ")
        if _partitions(src) != _partitions(dst) or _per_partition(src) != _per_partition(dst):
            raise EmulatorError(f"tensor_copy_predicated: src {src.shape} and dst {dst.shape} differ")
        values, src_dtype = _flat2d(src, "tensor_copy_predicated src"), src.dtype
    else:
        integer = dst.dtype in _INT_DTYPES
        if integer != isinstance(src, int):
            raise EmulatorError(f"tensor_copy_predicated: scalar {src!r} does not match dst dtype {dst.dtype}")
        values = np.full(take.shape, src, dtype=np.int64 if integer else np.float64)
        src_dtype = dst.dtype if integer else "float32"
    addr, _ = _addresses(dst)
    _write(dst, values, src_dtype, mask=take.reshape(dst.shape), addr=addr)


isa = SimpleNamespace(
    dma_copy=dma_copy, memset=memset, tensor_copy=tensor_copy, nc_transpose=nc_transpose, nc_matmul=nc_matmul,
    scalar_tensor_tensor=scalar_tensor_tensor, tensor_copy_predicated=tensor_copy_predicated, oob_mode=oob_mode,
)


# ---------------------------------------------------------------- running a kernel
def hbm_tensor(array: np.ndarray, dtype: str) -> Tensor:
    """An input HBM tensor holding ``array`` as NKI dtype ``dtype`` (bf16 values must be bf16-exact)."""
    dtype = _check_dtype(dtype)
    array = np.ascontiguousarray(array)
    if dtype == "bfloat16" and not np.array_equal(_round_bf16(array.astype(np.float32)), array.astype(np.float32),
                                                  equal_nan=True):
        raise EmulatorError("bfloat16 input values must be exactly representable in bf16")
    st = _Storage(array.size, dtype, SHARED_HBM, data=array)
    shape = array.shape
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    return Tensor(st, shape, strides, 0)


@contextlib.contextmanager
def _running():
    if getattr(_state, "run", None) is not None:
        raise EmulatorError("run_kernel() is not re-entrant")
    _state.run = _Run()
    # One thread for the many tiny matmuls: on a loaded 2-core machine, multi-threaded BLAS on
    # 128 x 128 x 512 tiles measured 12-29 ms per matmul instead of 0.3 ms.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield _state.run
    finally:
        torch.set_num_threads(threads)
        _state.run = None


def run_kernel(kernel, args, kwargs=None, *, activate):
    """Run ``kernel(*args, **kwargs)`` on the emulator and return (outputs, instruction counts).

    args: numpy arrays given as (array, nki dtype name) pairs become HBM tensors; anything else
    (ints, bools, None) passes through as a compile-time constant. activate: a context-manager
    factory that points the kernel's ``nl`` / ``nisa`` at ``language`` / ``isa`` (see
    ``neuron_nki.use``). outputs: an (array, nki dtype name) pair per returned tensor (bf16 as
    float32 arrays), a tuple of them when the kernel returns a tuple, None when it returns None.
    """
    with _running() as run, activate(SimpleNamespace(language=language, isa=isa)):
        hbm_args = [hbm_tensor(*a) if isinstance(a, tuple) else a for a in args]
        result = kernel(*hbm_args, **(kwargs or {}))
        if result is None:
            return None, dict(run.counts)
        outs = result if isinstance(result, tuple) else (result,)
        arrays = []
        for t in outs:
            if not isinstance(t, Tensor) or not _is_hbm(t.buffer):
                raise EmulatorError(f"a kernel returns HBM tensors, got {t!r}")
            addr, _ = _addresses(t)
            missing = ~t._storage.written[addr]
            if missing.any():
                first = tuple(int(i) for i in np.argwhere(missing)[0])
                raise EmulatorError(f"the kernel left {int(missing.sum())} elements of its output {t.shape} "
                                    f"unwritten (first at {first})")
            arrays.append((t._storage.data[addr].copy(), t.dtype))
        counts = dict(run.counts)
    return (tuple(arrays) if isinstance(result, tuple) else arrays[0]), counts

"""Blackwell (sm_100a, sm_100f) grouped GEMM for ``moe::grouped_mm``, written in NVIDIA's CuTe DSL.

What it computes: the 2Dx3D layout (``out[rows of group g] = mat_a[rows] @ mat_b[g] (+ bias[g])``)
with mat_b either a [G, K, N] tensor (forward) or the transposed view of a [G, N, K] tensor
(input gradient), and the 3Dx3D layout viewed as 2Dx3D. bf16/fp16 inputs, fp32 accumulation,
output in the input dtype or fp32. The 2Dx2D weight gradient stays on the Triton kernel.

The kernel (``_GroupedGemmSm100``), one persistent CTA per SM, 6 warps:

* warp 5 (TMA): loads 128 x 64 tiles of A and tile_n x 64 tiles of B[g] into shared memory with
  TMA (``UTMALDG``); rows past M and columns past N/K are zero-filled by the TMA unit.
* warp 4 (MMA): one thread issues ``tcgen05.mma`` (``UTCHMMA``) 128 x tile_n x 16 instructions
  accumulating in tensor memory (TMEM); two accumulator buffers (2 x tile_n <= 512 TMEM
  columns) let the epilogue of one tile overlap the main loop of the next.
* warps 0-3 (epilogue): ``tcgen05.ld`` the accumulator (one row per thread), add bias in fp32,
  convert, and store 16-byte vectors to global memory with a row and column predicate.

Tile schedule, computed on the device from offs (no host metadata, no host sync): tiles are
aligned to group starts, so group g owns ceil(size_g / 128) x ceil(N / tile_n) tiles and a tile
never mixes two experts' weights. The tiles of all groups, followed by those of a virtual group
G covering the rows past offs[-1], are numbered linearly; CTA c processes tiles c, c + grid,
c + 2 grid, ... Every warp walks the same schedule with a cursor over offs (one global load of
offs per group boundary it crosses), so the roles agree without exchanging messages. Tiles of
the virtual group skip the main loop and write zeros, so the output needs no memset. A group's
last tile reads (but never writes) rows of the next group: the store predicate is
``row < end of group``. Empty groups own no tiles.

Why not a TMA store: a TMA store writes a whole box and clips only at the tensor's edge, so the
last tile of a group would overwrite the next group's rows; NVIDIA's MoE example builds one
descriptor per group on the device for this. The predicated 16-byte stores need N % 8 == 0,
which TMA loads need anyway (16-byte aligned strides).

Within a group the m-tile index runs fastest: the ~148 concurrent CTAs then share one band of
expert weights and re-read token rows from L2 (Mixtral: a group's 4096 x 4096 bf16 rows are
32 MiB, its 4096 x 14336 weights 112 MiB; the other order would stream the weights from DRAM
once per 128-row band).

Verification here (no GPU): the kernel is compiled ahead of time for sm_100a from fake tensors
and its SASS is checked for UTCHMMA and UTMALDG (tests/test_cuda_blackwell.py). It has not run
on hardware. Compiled kernels are cached on disk (``cache_dir()``), keyed by arch, dtypes, tile,
layout and bias, plus a hash of this file, the CuTe DSL packages' versions and the CUTE_DSL_*
settings, so a second process loads the object file (~40 ms) instead of compiling (0.6-5 s per
variant on 2 cores). The first call of a variant in a process also loads its module onto the
GPU: warm up before capturing a CUDA graph.
"""

# No "from __future__ import annotations": the DSL evaluates the kernel's annotations, and the
# DSL names exist only inside _kernel_class() (imported lazily).
import functools
import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import re
import struct
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ..._contract import LAYOUT_2D3D, LAYOUT_3D3D, Problem
from ..._op import note_kernel

__all__ = [
    "DTYPES", "LAYOUTS", "TILE_NS", "ARCHS", "KernelKey", "CompiledKernel", "Plan",
    "available", "grouped_mm", "compile_kernel", "choose_tile_n", "plan", "cache_dir",
    "compile_stats", "fatbin_from_object", "sass", "opcode_counts",
]

DTYPES = (torch.bfloat16, torch.float16)
LAYOUTS = (LAYOUT_2D3D, LAYOUT_3D3D)
# b_major: "n" when mat_b is [G, K, N] with N contiguous (forward), "k" when it is the transposed
# view of a [G, N, K] tensor (input gradient: grad @ W.transpose(1, 2)).
B_MAJORS = ("n", "k")
TILE_M, TILE_K = 128, 64  # 128 = TMEM lanes of one CTA; 64 bf16 = one 128-byte swizzle row
TILE_NS = (64, 128, 256)
# sm_100a: B200/GB200 (compute capability 10.0). sm_100f: the sm_100 family target, which NVIDIA
# documents as running on 10.0 and 10.3 (B300/GB300); used for 10.3 because cutlass-dsl 4.8.1
# compiles sm_103a but fails to export it ("Failed to dump object file with PIC relocation").
ARCHS = ("sm_100a", "sm_100f")
_CAPABILITY_ARCH = {(10, 0): "sm_100a", (10, 3): "sm_100f"}
_ALIGN = 16  # bytes: TMA base addresses and strides, and the epilogue's vector stores
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_INSTALL_HINT = "pip install nvidia-cutlass-dsl==4.8.1"

log = logging.getLogger("moe_ops")


# ----------------------------------------------------------------------------------------------
# Host side: availability, argument preparation, tile choice, compile cache, launch.
# ----------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def cutlass_dsl_version() -> Optional[str]:
    """The installed nvidia-cutlass-dsl version, or None."""
    try:
        version = importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:
        return None
    return version if importlib.util.find_spec("cutlass") else None


@functools.lru_cache(maxsize=None)
def _device_arch(index: int) -> tuple:
    """(arch or None, description) of CUDA device ``index``."""
    cap = torch.cuda.get_device_capability(index)
    return _CAPABILITY_ARCH.get(cap), f"{torch.cuda.get_device_name(index)} (sm_{cap[0]}{cap[1]})"


def available(device=None) -> tuple:
    """(True, "") when this module can serve calls on ``device`` (a CUDA device, default the
    current one), else (False, reason). Needs an sm_100/sm_103 GPU and nvidia-cutlass-dsl."""
    if cutlass_dsl_version() is None:
        return False, f"nvidia-cutlass-dsl is not installed ({_INSTALL_HINT})"
    if not torch.cuda.is_available():
        return False, "no CUDA device (the Blackwell kernel is compile-only here)"
    device = torch.device("cuda") if device is None else torch.device(device)
    if device.type != "cuda":
        return False, f"{device} is not a CUDA device"
    arch, name = _device_arch(device.index if device.index is not None else torch.cuda.current_device())
    if arch is None:
        return False, f"{name} has no tcgen05 (the kernel needs sm_100 or sm_103)"
    return True, ""


@dataclass(frozen=True)
class KernelKey:
    """One compiled variant. dtype / out_dtype: "bf16" | "fp16" | "fp32"; b_major: "n" | "k"."""

    arch: str
    dtype: str
    out_dtype: str
    tile_n: int
    b_major: str
    bias: bool

    @property
    def name(self) -> str:
        """A C identifier naming the variant (the object file and symbol prefix)."""
        return (f"moe_gmm_{self.arch}_{self.dtype}_{self.out_dtype}_{TILE_M}x{self.tile_n}x{TILE_K}_"
                f"b{self.b_major}{'_bias' if self.bias else ''}")

    @property
    def layout(self) -> str:
        return "2d3d" if self.b_major == "n" else "2d3d_bt"


def choose_tile_n(M: int, N: int, G: int, num_sms: int = 148) -> int:
    """tile_n for a 2Dx3D problem: the widest of 256/128 that still gives every SM a tile, else 64.

    Wider tiles re-read A fewer times (A traffic ~ N / tile_n); 256 is the widest tcgen05 MMA
    and fills 2 x 256 = 512 TMEM columns. ceil(M / 128) + G counts the m-tiles, each group's
    partial last tile included. A width is considered only for N > 3/4 of it (the rest of the
    tile would be padding). When no width fills the SMs, the problem is latency-bound and the
    narrowest tile gives the most CTAs work.
    """
    m_tiles = -(-M // TILE_M) + G
    for tile_n in (256, 128):
        if 4 * N > 3 * tile_n and m_tiles * -(-N // tile_n) >= num_sms:
            return tile_n
    return 64


@dataclass(frozen=True)
class Plan:
    """How one call maps onto the kernel: the variant and the tensors in kernel order.

    a: [M, K] (K contiguous); b: [G, K, N] with N contiguous (b_major "n") or K contiguous
    ("k"); bias: [G, N] or None; M, N, K, G: the GEMM sizes; out_shape: the op's result shape
    (the kernel writes an [M, N] view of it).
    """

    key: KernelKey
    a: torch.Tensor
    b: torch.Tensor
    bias: Optional[torch.Tensor]
    M: int
    N: int
    K: int
    G: int
    out_shape: tuple


def _aligned(t: torch.Tensor, contiguous_dim: int) -> bool:
    """TMA needs the contiguous dim at stride 1, other strides and the base 16-byte aligned."""
    el = t.element_size()
    return (t.stride(contiguous_dim) == 1
            and all(s * el % _ALIGN == 0 for d, s in enumerate(t.stride()) if d != contiguous_dim)
            and t.data_ptr() % _ALIGN == 0)


# The kernel's scheduler computes row, column and K tile bounds in int32, adding up to a tile
# less one to a size (g_end - g_start + 127, N + tile_n - 1, K + 63, a tile's last row), so every
# size keeps a tile's headroom below 2^31 (without it, M = 2^31 - 50 wrote past the output).
_MAX_DIM = 2**31 - 1 - 256


def plan(p: Problem, mat_a, mat_b, bias, *, arch: str = "sm_100a", num_sms: int = 148) -> Plan:
    """Map a validated problem onto the kernel, or raise NotImplementedError saying why not.

    Reads only metadata (shapes, strides, dtypes, pointers), never values: safe on CPU tensors
    and free of host syncs on CUDA tensors.
    """
    if p.dtype not in DTYPES:
        raise NotImplementedError(f"blackwell kernel serves bf16/fp16 inputs, not {p.dtype}")
    if p.layout == LAYOUT_3D3D:
        G, M, K = mat_a.shape
        a = mat_a.reshape(G * M, K)  # a view when the groups are stacked rows, else a copy
    elif p.layout == LAYOUT_2D3D:
        a = mat_a
    else:
        raise NotImplementedError(f"blackwell kernel serves 2d3d and 3d3d, not {p.layout} (Triton serves it)")
    M, K = a.shape
    G, _, N = mat_b.shape
    if K == 0:
        raise NotImplementedError("K == 0 (the result is bias or zeros; Triton computes it)")
    if max(M, N, K, G) > _MAX_DIM:
        raise NotImplementedError(f"a dimension > {_MAX_DIM} (the scheduler's tile arithmetic is 32-bit)")
    if any(s == 0 and n > 1 for t in (a, mat_b) for s, n in zip(t.stride(), t.shape)):
        raise NotImplementedError("a broadcast (stride 0) operand: TMA descriptors need real strides")
    if N % 8 or K % 8:
        raise NotImplementedError(f"N={N} and K={K} must be multiples of 8 (16-byte TMA strides and stores)")
    if not _aligned(a, 1):
        raise NotImplementedError("mat_a must have K contiguous and 16-byte aligned rows")
    if _aligned(mat_b, 2):
        b_major = "n"
    elif _aligned(mat_b, 1):
        b_major = "k"
    else:
        raise NotImplementedError("mat_b must have N or K contiguous and 16-byte aligned strides")
    if bias is not None and bias.stride(1) != 1:
        bias = bias.contiguous()
    key = KernelKey(arch, _DTYPE_NAMES[p.dtype], _DTYPE_NAMES[p.out_dtype],
                    choose_tile_n(M, N, G, num_sms), b_major, bias is not None)
    return Plan(key, a, mat_b, bias, M, N, K, G, tuple(p.out_shape))


def cache_dir() -> Path:
    """Where compiled kernels live: $MOE_OPS_CACHE_DIR/blackwell or ~/.cache/moe_ops/blackwell."""
    root = os.environ.get("MOE_OPS_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "moe_ops")
    return Path(root) / "blackwell"


@functools.lru_cache(maxsize=None)
def _source_tag() -> str:
    """Part of every cache key: a change to this file, to the DSL or to its settings invalidates
    old objects.

    The DSL is several distributions (nvidia-cutlass-dsl and its libs-base / libs-core /
    libs-cu12 or -cu13 packages, the latter carrying the CUDA toolchain), so each one's name and
    version counts. CUTE_DSL_* variables change what the DSL compiles (e.g. LINEINFO,
    ENABLE_TVM_FFI, COMPILER_OPT; the DSL keys its own JIT cache on them), so they count too,
    except CUTE_DSL_ARCH, which ``--gpu-arch`` overrides.
    """
    h = hashlib.sha256(Path(__file__).read_bytes())
    dists = sorted({(d.metadata["Name"] or "").lower(): d.version
                    for d in importlib.metadata.distributions()
                    if (d.metadata["Name"] or "").lower().startswith("nvidia-cutlass-dsl")}.items())
    settings = sorted((k, v) for k, v in os.environ.items()
                      if k.startswith("CUTE_DSL_") and k != "CUTE_DSL_ARCH")
    h.update(repr((dists, settings)).encode())
    return h.hexdigest()[:12]


@dataclass
class CompiledKernel:
    """A loaded variant. source: "compiled" (this call compiled it), "disk" (loaded from the
    cache) or "memory" (already loaded in this process); seconds: what that took."""

    key: KernelKey
    function: Callable[..., object]
    object_path: Path
    source: str
    seconds: float


_lock = threading.Lock()
_loaded: dict = {}
_stats = {"compiled": 0, "disk": 0, "memory": 0}


def compile_stats() -> dict:
    """How many variants this process compiled, loaded from disk, or found in memory."""
    return dict(_stats)


def _torch_dtype(name: str) -> torch.dtype:
    return {v: k for k, v in _DTYPE_NAMES.items()}[name]


def compile_kernel(arch: str = "sm_100a", dtype=torch.bfloat16, tile=(TILE_M, 128), layout: str = "2d3d",
                   out_dtype=None, bias: bool = False, *, use_cache: bool = True) -> CompiledKernel:
    """Compile one variant ahead of time (no GPU needed), or load it from the disk cache.

    Args:
        arch: "sm_100a" (B200/GB200) or "sm_100f" (the sm_100 family: B200 and B300).
        dtype: torch.bfloat16 or torch.float16 (the inputs).
        tile: (128, tile_n) with tile_n in 64, 128, 256; the k-tile is 64.
        layout: "2d3d" (mat_b [G, K, N], N contiguous) or "2d3d_bt" (mat_b the transposed view
            of a [G, N, K] tensor, K contiguous).
        out_dtype: None (= dtype) or torch.float32.
        bias: whether the variant adds a [G, N] bias.
        use_cache: False compiles even if the object file exists (and rewrites it).
    """
    if tile[0] != TILE_M or tile[1] not in TILE_NS:
        raise ValueError(f"tile must be ({TILE_M}, n) with n in {TILE_NS}, got {tile}")
    if layout not in ("2d3d", "2d3d_bt"):
        raise ValueError(f"layout must be '2d3d' or '2d3d_bt', got {layout!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype}")
    out_dtype = dtype if out_dtype is None else out_dtype
    if out_dtype not in (dtype, torch.float32):
        raise ValueError(f"out_dtype must be None, {dtype} or torch.float32, got {out_dtype}")
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    key = KernelKey(arch, _DTYPE_NAMES[dtype], _DTYPE_NAMES[out_dtype], tile[1],
                    "n" if layout == "2d3d" else "k", bias)
    return _kernel(key, use_cache=use_cache)


def _kernel(key: KernelKey, *, use_cache: bool = True) -> CompiledKernel:
    with _lock:
        if use_cache and key in _loaded:
            _stats["memory"] += 1
            k = _loaded[key]
            return CompiledKernel(k.key, k.function, k.object_path, "memory", 0.0)
        import cutlass.cute as cute  # lazy: importing the DSL takes ~1-2 s

        directory = cache_dir()
        path = directory / f"{key.name}_{_source_tag()}.o"
        t0 = time.perf_counter()
        function = None
        if use_cache and path.exists():
            try:
                function = getattr(cute.runtime.load_module(str(path)), key.name)
                source = "disk"
            except Exception as e:  # noqa: BLE001 - truncated, corrupt or removed meanwhile
                # The cache is only a cache: an object file that does not load (a crash after
                # the rename, another build's cleanup unlinking it) is compiled again and
                # replaced, instead of failing every call of this variant in every process.
                log.warning("moe_ops: cannot load the cached Blackwell kernel %s (%s); "
                            "compiling it", path, e)
        if function is None:
            function = _compile(key)
            try:
                _store(function, key, path)
            except OSError as e:  # a read-only home must not break the kernel, only the cache
                log.warning("moe_ops: cannot write the Blackwell kernel cache %s (%s)", directory, e)
            source = "compiled"
        _stats[source] += 1
        k = CompiledKernel(key, function, path, source, time.perf_counter() - t0)
        _loaded[key] = k
        return k


_unbuildable: dict = {}  # KernelKey -> why its compile or load failed in this process


def kernel_or_decline(key: KernelKey) -> CompiledKernel:
    """``_kernel(key)`` for a call, or NotImplementedError (so Triton serves it) where the DSL
    cannot build or load the variant: an nvidia-cutlass-dsl other than the tested one (the kernel
    uses its cutlass.utils.gemm.sm100 and tensor_utils modules), a missing CUDA toolchain piece.
    A failure is remembered for the process: compiling takes 0.6-5 s, too long to retry per call.
    """
    if key in _unbuildable:
        raise NotImplementedError(_unbuildable[key])
    try:
        return _kernel(key)
    except Exception as e:  # noqa: BLE001 - any DSL failure; the message names it
        first = (str(e).splitlines() or [""])[0][:200]
        why = f"the CuTe DSL could not build {key.name} ({type(e).__name__}: {first})"
        _unbuildable[key] = why
        log.warning("moe_ops: %s; Triton serves it", why)
        raise NotImplementedError(why) from None


def _store(function, key: KernelKey, path: Path) -> None:
    """Write the object file atomically and drop older builds of the same variant."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # Export into a private directory, then rename: a concurrent process never sees a
    # half-written object file.
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        function.export_to_c(tmp, key.name, function_prefix=key.name)
        os.replace(os.path.join(tmp, f"{key.name}.o"), path)
    # Only this variant's builds: "<name>_<12 hex digits>.o" (a bare "<name>_*.o" also matched
    # the bias variant's "<name>_bias_<tag>.o" and deleted it).
    build = re.compile(re.escape(key.name) + r"_[0-9a-f]{12}\.o")
    for old in path.parent.glob(f"{key.name}_*.o"):
        if old != path and build.fullmatch(old.name):
            old.unlink(missing_ok=True)


def _fake_args(key: KernelKey):
    """Fake tensors with symbolic sizes and strides (one compiled kernel serves every shape)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor, make_fake_stream

    el = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "fp32": cutlass.Float32}
    M, N, K, G = (cute.sym_int64(symbol=s) for s in "MNKG")
    row = lambda: cute.sym_int64(divisibility=8)  # noqa: E731 - a 16-byte aligned stride
    a = make_fake_tensor(el[key.dtype], (M, K), (row(), 1), assumed_align=_ALIGN)
    if key.b_major == "n":
        b = make_fake_tensor(el[key.dtype], (G, K, N), (row(), row(), 1), assumed_align=_ALIGN)
    else:
        b = make_fake_tensor(el[key.dtype], (G, K, N), (row(), 1, row()), assumed_align=_ALIGN)
    c = make_fake_tensor(el[key.out_dtype], (M, N), (row(), 1), assumed_align=_ALIGN)
    offs = make_fake_tensor(cutlass.Int32, (G,), (1,), assumed_align=4)
    bias = None
    if key.bias:
        bias = make_fake_tensor(el[key.dtype], (G, N), (cute.sym_int64(), 1), assumed_align=2)
    return a, b, c, offs, bias, cutlass.Int32(1), make_fake_stream()


def _compile(key: KernelKey):
    import cutlass.cute as cute

    gemm = _kernel_class()(key.tile_n)
    return cute.compile(gemm, *_fake_args(key), options=f"--gpu-arch {key.arch}")


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def grouped_mm(p: Problem, mat_a, mat_b, offs, bias) -> torch.Tensor:
    """The Blackwell kernel on CUDA tensors (the ``impl`` signature of ``kernel_entry``).

    offs was sanitized on the device by the caller; it is never read on the host. Runs on
    torch's current stream. Raises NotImplementedError for calls it does not serve (the op then
    uses another kernel).
    """
    ok, why = available(mat_a.device)
    if not ok:
        raise NotImplementedError(why)
    index = mat_a.device.index if mat_a.device.index is not None else torch.cuda.current_device()
    arch, sms = _device_arch(index)[0], _num_sms(index)
    pl = plan(p, mat_a, mat_b, bias, arch=arch, num_sms=sms)
    out = torch.empty(pl.out_shape, dtype=p.out_dtype, device=mat_a.device)
    if pl.M == 0 or pl.N == 0:
        return out
    if offs is None:  # 3d3d: G stacked groups of M / G rows each
        per = pl.M // pl.G
        offs = torch.arange(per, pl.M + 1, per, dtype=torch.int32, device=mat_a.device)[: pl.G]
    offs = offs.to(torch.int32)  # values <= M < 2^31 (plan checked M)
    k = kernel_or_decline(pl.key)
    # Upper bound on the tiles of the schedule: sum over groups 0..G of ceil(rows / 128) is
    # at most M / 128 + G + 1; more CTAs than tiles would only idle.
    n_tiles = -(-pl.N // pl.key.tile_n)
    grid = min(sms, (pl.M // TILE_M + pl.G + 1) * n_tiles)
    with torch.cuda.device(mat_a.device):
        k.function(*_runtime_args(pl, out.view(pl.M, pl.N), offs, grid, torch.cuda.current_stream()))
    note_kernel("cuda:blackwell")
    return out


def _runtime_args(pl: Plan, out2d: torch.Tensor, offs: torch.Tensor, grid: int, stream):
    """The compiled function's arguments for one call, in the order of ``_fake_args``."""
    import cuda.bindings.driver as cuda
    import cutlass
    from cutlass.cute.runtime import from_dlpack

    # Detached: DLPack refuses a tensor that requires grad (BufferError), which an expert weight
    # (an nn.Parameter) always does, even under no_grad. The kernel only reads the memory.
    def t(x, leading, align=_ALIGN):
        return from_dlpack(x.detach(), assumed_align=align).mark_layout_dynamic(leading_dim=leading)

    b_leading = 2 if pl.key.b_major == "n" else 1
    bias = None if pl.bias is None else t(pl.bias, 1, pl.bias.element_size())
    return (t(pl.a, 1), t(pl.b, b_leading), t(out2d, 1), t(offs, 0, 4),
            bias, cutlass.Int32(grid), cuda.CUstream(stream.cuda_stream))


# ----------------------------------------------------------------------------------------------
# Inspecting what was compiled (the tests assert on it; no GPU involved).
# ----------------------------------------------------------------------------------------------

_FATBIN_MAGIC = 0xBA55ED50


def fatbin_from_object(path) -> bytes:
    """The fatbin (an sm_100a cubin inside) embedded in an exported object file."""
    data = Path(path).read_bytes()
    start = data.find(struct.pack("<I", _FATBIN_MAGIC))
    if start < 0:
        raise ValueError(f"{path} contains no fatbin")
    header_size, = struct.unpack_from("<H", data, start + 6)
    payload, = struct.unpack_from("<Q", data, start + 8)
    return data[start:start + header_size + payload]


def sass(path) -> str:
    """SASS of the kernel in an exported object file, by cuobjdump (nvidia-cuda-cuobjdump) with
    nvdisasm (nvidia-cuda-nvdisasm), found through cuda.pathfinder (a cuda-bindings dependency)."""
    from cuda.pathfinder import find_nvidia_binary_utility

    tools = {n: find_nvidia_binary_utility(n) for n in ("cuobjdump", "nvdisasm")}
    missing = [n for n, p in tools.items() if p is None]
    if missing:
        raise FileNotFoundError(f"{' and '.join(missing)} not found "
                                "(pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    with tempfile.TemporaryDirectory() as tmp:
        fatbin = os.path.join(tmp, "kernel.fatbin")
        Path(fatbin).write_bytes(fatbin_from_object(path))
        env = dict(os.environ, NVDISASM_PATH=os.path.dirname(tools["nvdisasm"]))
        return subprocess.run([tools["cuobjdump"], "-sass", fatbin], check=True, capture_output=True,
                              text=True, env=env).stdout


_SASS_LINE = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[0-9T]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)")


def opcode_counts(sass_text: str) -> dict:
    """{opcode with modifiers: count}, e.g. {"UTCHMMA": 12, "UTMALDG.3D": 2, "STG.E.128": 16}."""
    counts: dict = {}
    for line in sass_text.splitlines():
        m = _SASS_LINE.match(line)
        if m:
            counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return counts


# ----------------------------------------------------------------------------------------------
# Device side. Built on first use so that importing this module never imports the DSL.
# ----------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _kernel_class():
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    import cutlass.memory as memory
    import cutlass.pipeline as pipeline
    import cutlass.utils as utils
    from cutlass.cute.nvgpu import cpasync, tcgen05
    from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait
    from cutlass.tensor_utils import LayoutEnum
    from cutlass.utils.gemm.sm100 import transform_partitioned_tensor_layout

    Int32 = cutlass.Int32

    class _GroupedGemmSm100:
        """Persistent, warp-specialized grouped GEMM: out[rows of g] = A[rows] @ B[g] (+ bias[g]).

        Kernel-domain tensors (CuTe's (M, N, K, L) convention): A (M, K, 1), B (N, K, G),
        C (M, N, 1); L selects the expert for B and is 0 for A and C.
        """

        def __init__(self, tile_n: int):
            self.tile_n = tile_n
            self.mma_tiler = (TILE_M, tile_n, TILE_K)
            self.acc_dtype = cutlass.Float32
            self.num_acc_stage = 2
            self.epilogue_warps = (0, 1, 2, 3)  # warp w % 4 may only read TMEM lanes 32w..32w+31
            self.mma_warp = 4
            self.tma_warp = 5
            self.threads = 32 * 6
            self.epi_sync_bar = 1
            self.tmem_alloc_bar = 2
            # Epilogue sub-tile: 128 rows x 32 columns, read from TMEM 8 columns at a time so
            # that each thread holds 8-column (16-byte for bf16) vectors that are entirely
            # inside or entirely outside [0, N) when N % 8 == 0.
            self.epi_tile = (TILE_M, 32)
            self.vec = 8

        @cute.jit
        def __call__(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, offs: cute.Tensor,
                     bias, grid: cutlass.Int32, stream: cuda.CUstream):
            """a [M, K], b [G, K, N] (N- or K-contiguous), c [M, N], offs [G] int32 (sanitized
            group ends), bias [G, N] or None; grid persistent CTAs on ``stream``."""
            self.a_dtype = a.element_type
            self.c_dtype = c.element_type
            one, zero = Int32(1), Int32(0)
            # Traced, a tensor's shape and stride are tuples; the DSL annotates them as an int or a
            # tuple, which mypy will not index (the type: ignore[index] here and below).
            mA = cute.make_tensor(a.iterator, cute.make_layout(
                (a.shape[0], a.shape[1], one), stride=(a.stride[0], a.stride[1], zero)))  # type: ignore[index]
            mB = cute.make_tensor(b.iterator, cute.make_layout(
                (b.shape[2], b.shape[1], b.shape[0]),  # type: ignore[index]
                stride=(b.stride[2], b.stride[1], b.stride[0])))  # type: ignore[index]
            mC = cute.make_tensor(c.iterator, cute.make_layout(
                (c.shape[0], c.shape[1], one), stride=(c.stride[0], c.stride[1], zero)))  # type: ignore[index]
            a_major = LayoutEnum.from_tensor(mA).mma_major_mode()
            b_major = LayoutEnum.from_tensor(mB).mma_major_mode()

            tiled_mma = utils.sm100.make_trivial_tiled_mma(
                self.a_dtype, self.a_dtype, a_major, b_major, self.acc_dtype, tcgen05.CtaGroup.ONE,
                self.mma_tiler[:2])
            cluster_vmnk = cute.tiled_divide(cute.make_layout((1, 1, 1)), (tiled_mma.thr_id.shape,))

            # Shared memory: as many A/B stages as fit next to ~1 KiB of barriers.
            a_one = utils.sm100.make_smem_layout_a(tiled_mma, self.mma_tiler, self.a_dtype, 1)
            b_one = utils.sm100.make_smem_layout_b(tiled_mma, self.mma_tiler, self.a_dtype, 1)
            stage_bytes = cute.size_in_bytes(self.a_dtype, a_one) + cute.size_in_bytes(self.a_dtype, b_one)
            smem_capacity = memory.get_smem_capacity_in_bytes("sm_100")
            self.num_ab_stage = (smem_capacity - 1024) // stage_bytes
            a_smem = utils.sm100.make_smem_layout_a(tiled_mma, self.mma_tiler, self.a_dtype, self.num_ab_stage)
            b_smem = utils.sm100.make_smem_layout_b(tiled_mma, self.mma_tiler, self.a_dtype, self.num_ab_stage)

            acc_shape = tiled_mma.partition_shape_C(self.mma_tiler[:2])
            acc_fake = tiled_mma.make_fragment_C(cute.append(acc_shape, self.num_acc_stage))
            self.num_tmem_cols = memory.get_num_tmem_alloc_cols(acc_fake, arch="sm_100")

            a_one_stage = cute.slice_(a_smem, (None, None, None, 0))
            b_one_stage = cute.slice_(b_smem, (None, None, None, 0))
            tma_op = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)
            tma_atom_a, tma_a = cute.nvgpu.make_tiled_tma_atom_A(
                tma_op, mA, a_one_stage, self.mma_tiler, tiled_mma, cluster_vmnk.shape)
            tma_atom_b, tma_b = cute.nvgpu.make_tiled_tma_atom_B(
                tma_op, mB, b_one_stage, self.mma_tiler, tiled_mma, cluster_vmnk.shape)
            self.tma_bytes = (cute.size_in_bytes(self.a_dtype, a_one_stage)
                              + cute.size_in_bytes(self.a_dtype, b_one_stage))

            self.kernel(tiled_mma, tma_atom_a, tma_a, tma_atom_b, tma_b, mC, offs, bias,
                        a_smem, b_smem).launch(grid=(grid, 1, 1), block=(self.threads, 1, 1),
                                               cluster=(1, 1, 1), stream=stream)

        @cute.jit
        def next_tile(self, t, g, g_start, g_end, tiles_before, offs: cute.Tensor, M, n_tiles):
            """Advance the group cursor until linear tile t lies in group g (g == G: the rows
            past offs[-1]; g > G: t is past the schedule). Returns the new cursor."""
            G = Int32(offs.shape[0])  # type: ignore[index]
            g_tiles = (g_end - g_start + TILE_M - 1) // TILE_M * n_tiles
            searching = (t >= tiles_before + g_tiles) & (g <= G)
            while searching:
                tiles_before = tiles_before + g_tiles
                g = g + 1
                g_start = g_end
                g_end = M
                if g < G:
                    # offs is sanitized by the caller; clamping again keeps every row index
                    # inside [0, M] whatever the buffer holds.
                    g_end = cutlass.min(cutlass.max(offs[g], g_start), M)
                g_tiles = (g_end - g_start + TILE_M - 1) // TILE_M * n_tiles
                searching = (t >= tiles_before + g_tiles) & (g <= G)
            return g, g_start, g_end, tiles_before

        @cute.jit
        def first_group(self, offs: cute.Tensor, M):
            return cutlass.min(cutlass.max(offs[0], Int32(0)), M)

        @cute.kernel
        def kernel(self, tiled_mma: cute.TiledMma, tma_atom_a: cute.CopyAtom, mA: cute.Tensor,
                   tma_atom_b: cute.CopyAtom, mB: cute.Tensor, mC: cute.Tensor, offs: cute.Tensor,
                   bias, a_smem: cute.ComposedLayout, b_smem: cute.ComposedLayout):
            warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            tidx, _, _ = cute.arch.thread_idx()
            bid, _, _ = cute.arch.block_idx()
            nctas, _, _ = cute.arch.grid_dim()

            # A cluster of one CTA (layouts built here: kernels cannot capture host values).
            cluster_vmnk = cute.tiled_divide(cute.make_layout((1, 1, 1)), (tiled_mma.thr_id.shape,))
            if warp_idx == self.tma_warp:
                cpasync.prefetch_descriptor(tma_atom_a)
                cpasync.prefetch_descriptor(tma_atom_b)

            # The DSL reads these annotations (MemRange[element, count]) as the struct's layout; to
            # mypy they are not types.
            @cute.struct
            class SharedStorage:
                ab_mbar: cute.struct.MemRange[cutlass.Int64, self.num_ab_stage * 2]  # type: ignore
                acc_mbar: cute.struct.MemRange[cutlass.Int64, self.num_acc_stage * 2]  # type: ignore
                tmem_dealloc_mbar: cutlass.Int64
                tmem_holding_buf: cutlass.Int32

            smem = memory.SmemAllocator()
            # A SharedStorage whose fields are the barriers' memory (allocate is annotated for
            # numeric types only, and as returning a Pointer).
            storage: Any = smem.allocate(SharedStorage)  # type: ignore[arg-type]

            # TMA warp -> MMA warp: one stage is full when both tiles' bytes have landed.
            ab_producer, ab_consumer = pipeline.PipelineTmaUmma.create(
                barrier_storage=storage.ab_mbar.data_ptr(), num_stages=self.num_ab_stage,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
                tx_count=self.tma_bytes, cta_layout_vmnk=cluster_vmnk, defer_sync=True,
            ).make_participants()
            # MMA warp -> epilogue warps: one accumulator buffer is complete / free again.
            acc_pipeline = pipeline.PipelineUmmaAsync.create(
                barrier_storage=storage.acc_mbar.data_ptr(), num_stages=self.num_acc_stage,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, len(self.epilogue_warps)),
                cta_layout_vmnk=cluster_vmnk, defer_sync=True,
            )
            tmem = memory.TmemAllocator(
                storage.tmem_holding_buf.ptr,
                barrier_for_retrieve=pipeline.NamedBarrier(
                    barrier_id=self.tmem_alloc_bar, num_threads=32 * (1 + len(self.epilogue_warps))),
                allocator_warp_id=self.epilogue_warps[0],
                is_two_cta=False,
                two_cta_tmem_dealloc_mbar_ptr=storage.tmem_dealloc_mbar.ptr,
            )
            pipeline_init_arrive(cluster_shape_mn=cluster_vmnk, is_relaxed=True)

            sA = smem.allocate_tensor(element_type=self.a_dtype, layout=a_smem.outer,
                                      byte_alignment=128, swizzle=a_smem.inner)
            sB = smem.allocate_tensor(element_type=self.a_dtype, layout=b_smem.outer,
                                      byte_alignment=128, swizzle=b_smem.inner)
            tCrA = tiled_mma.make_fragment_A(sA)  # (MMA, MMA_M, MMA_K, STAGE)
            tCrB = tiled_mma.make_fragment_B(sB)  # (MMA, MMA_N, MMA_K, STAGE)
            acc_shape = tiled_mma.partition_shape_C(self.mma_tiler[:2])
            acc_fake = tiled_mma.make_fragment_C(cute.append(acc_shape, self.num_acc_stage))
            thr_mma = tiled_mma.get_slice(0)
            pipeline_init_wait(cluster_shape_mn=cluster_vmnk)

            # Scheduler arithmetic in 32 bits (the host serves M, N, K, G <= _MAX_DIM only, so a
            # size plus a tile stays below 2^31); addresses are computed from the 64-bit strides.
            M = Int32(mC.shape[0])  # type: ignore[index]
            N = Int32(mC.shape[1])  # type: ignore[index]
            G = Int32(offs.shape[0])  # type: ignore[index]
            n_tiles = (N + self.tile_n - 1) // self.tile_n
            k_tiles = (Int32(mA.shape[1]) + TILE_K - 1) // TILE_K  # type: ignore[index]

            # ---------------- TMA warp ----------------
            if warp_idx == self.tma_warp:
                # (bN, bK, RestN, RestK, G) -> TMA view; the expert is the L coordinate.
                gB = cute.local_tile(mB, cute.slice_(self.mma_tiler, (0, None, None)), (None, None, None))
                tBsB, tBgB = cpasync.tma_partition(
                    tma_atom_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 3),
                    cute.group_modes(thr_mma.partition_B(gB), 0, 3))
                t = bid
                g, g_start, g_end, before = self.next_tile(
                    t, Int32(0), Int32(0), self.first_group(offs, M), Int32(0), offs, M, n_tiles)
                while g <= G:
                    if g < G:
                        m_tiles = (g_end - g_start + TILE_M - 1) // TILE_M
                        local = t - before
                        # A's TMA coordinates shifted to the group's first row: m-tile i of the
                        # group starts at row g_start + 128 i, wherever that is.
                        gA = cute.local_tile(cute.domain_offset((g_start, 0, 0), mA),
                                             cute.slice_(self.mma_tiler, (None, 0, None)), (None, None, None))
                        tAsA, tAgA = cpasync.tma_partition(
                            tma_atom_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 3),
                            cute.group_modes(thr_mma.partition_A(gA), 0, 3))
                        tAgA_tile = tAgA[(None, local % m_tiles, None, 0)]
                        tBgB_tile = tBgB[(None, local // m_tiles, None, g)]
                        ab_producer.reset()
                        peek = ab_producer.try_acquire()
                        for k in cutlass.range(0, k_tiles, 1, unroll=1):
                            handle = ab_producer.acquire_and_advance(peek)
                            cute.copy(tma_atom_a, tAgA_tile[(None, handle.count)], tAsA[(None, handle.index)],
                                      tma_bar_ptr=handle.barrier)
                            cute.copy(tma_atom_b, tBgB_tile[(None, handle.count)], tBsB[(None, handle.index)],
                                      tma_bar_ptr=handle.barrier)
                            peek = cutlass.Boolean(1)
                            if handle.count + 1 < k_tiles:
                                peek = ab_producer.try_acquire()
                    t = t + nctas
                    g, g_start, g_end, before = self.next_tile(t, g, g_start, g_end, before, offs, M, n_tiles)
                ab_producer.tail()

            # ---------------- MMA warp ----------------
            if warp_idx == self.mma_warp:
                tmem.wait_for_alloc()
                tCtAcc_base = cute.make_tensor(tmem.retrieve_ptr(self.acc_dtype), acc_fake.layout)
                acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_acc_stage)
                t = bid
                g, g_start, g_end, before = self.next_tile(
                    t, Int32(0), Int32(0), self.first_group(offs, M), Int32(0), offs, M, n_tiles)
                while g <= G:
                    if g < G:
                        tCtAcc = tCtAcc_base[(None, None, None, acc_state.index)]
                        ab_consumer.reset()
                        peek = ab_consumer.try_wait()
                        acc_pipeline.producer_acquire(acc_state)
                        tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
                        for k in range(k_tiles):
                            handle = ab_consumer.wait_and_advance(peek)
                            for kb in cutlass.range(cute.size(tCrA, mode=[2]), unroll_full=True):
                                crd = (None, None, kb, handle.index)
                                cute.gemm(tiled_mma, tCtAcc, tCrA[crd], tCrB[crd], tCtAcc)
                                tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
                            handle.release()
                            peek = cutlass.Boolean(1)
                            if handle.count + 1 < k_tiles:
                                peek = ab_consumer.try_wait()
                        acc_pipeline.producer_commit(acc_state)
                        acc_state.advance()
                    t = t + nctas
                    g, g_start, g_end, before = self.next_tile(t, g, g_start, g_end, before, offs, M, n_tiles)
                acc_pipeline.producer_tail(acc_state)

            # ---------------- epilogue warps ----------------
            if warp_idx < self.mma_warp:
                tmem.allocate(self.num_tmem_cols)
                tmem.wait_for_alloc()
                tmem_ptr = tmem.retrieve_ptr(self.acc_dtype)
                # ((ATOM_M, MMA_M), (ATOM_N, MMA_N), STAGE)
                tAcc = transform_partitioned_tensor_layout(cute.make_tensor(tmem_ptr, acc_fake.layout))
                tAcc_epi = cute.flat_divide(tAcc, self.epi_tile)  # (EPI_M, EPI_N, 1, nEPI, STAGE)
                t2r = tcgen05.make_tmem_copy(
                    cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition.x8), self.acc_dtype),
                    tAcc_epi[(None, None, 0, 0, 0)])
                thr_t2r = t2r.get_slice(tidx)
                tTR_tAcc_all = thr_t2r.partition_S(tAcc_epi)  # (T2R, T2R_M, T2R_N, 1, nEPI, STAGE)
                idC = cute.make_identity_tensor(mC.shape)
                store = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.c_dtype,
                                            num_bits_per_copy=min(128, self.vec * self.c_dtype.width))
                epi_bar = pipeline.NamedBarrier(barrier_id=self.epi_sync_bar,
                                                num_threads=32 * len(self.epilogue_warps))
                acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_acc_stage)
                t = bid
                g, g_start, g_end, before = self.next_tile(
                    t, Int32(0), Int32(0), self.first_group(offs, M), Int32(0), offs, M, n_tiles)
                while g <= G:
                    m_tiles = (g_end - g_start + TILE_M - 1) // TILE_M
                    local = t - before
                    tile_mn = (local % m_tiles, local // m_tiles, 0)
                    # This tile of C and its global coordinates, rows counted from g_start.
                    tiler = cute.slice_(self.mma_tiler, (None, None, 0))
                    gC = cute.local_tile(cute.domain_offset((g_start, 0, 0), mC), tiler, (None, None, None))
                    cC = cute.local_tile(cute.domain_offset((g_start, 0, 0), idC), tiler, (None, None, None))
                    tTR_gC = thr_t2r.partition_D(cute.flat_divide(
                        transform_partitioned_tensor_layout(thr_mma.partition_C(gC)), self.epi_tile))
                    tTR_cC = thr_t2r.partition_D(cute.flat_divide(
                        transform_partitioned_tensor_layout(thr_mma.partition_C(cC)), self.epi_tile))
                    tTR_gC = tTR_gC[(None, None, None, 0, None, *tile_mn)]  # (T2R, T2R_M, T2R_N, nEPI)
                    tTR_cC = tTR_cC[(None, None, None, 0, None, *tile_mn)]
                    tTR_tAcc = tTR_tAcc_all[(None, None, None, 0, None, acc_state.index)]
                    rAcc = cute.make_rmem_tensor(tTR_gC[(None, None, None, 0)].shape, self.acc_dtype)
                    rC = cute.make_rmem_tensor(tTR_gC[(None, None, None, 0)].shape, self.c_dtype)
                    limit = (g_end, N, Int32(1))  # rows of this group only; columns inside N
                    if g < G:
                        acc_pipeline.consumer_wait(acc_state)
                    for e in cutlass.range_constexpr(cute.size(tTR_gC, mode=[3])):
                        if g < G:
                            cute.copy(t2r, tTR_tAcc[(None, None, None, e)], rAcc)
                            if cutlass.const_expr(bias is not None):
                                for i in cutlass.range_constexpr(cute.size(rAcc)):
                                    col = cutlass.min(tTR_cC[(None, None, None, e)][i][1], N - 1)
                                    rAcc[i] = rAcc[i] + bias[(g, col)].to(self.acc_dtype)
                            rC.store(rAcc.load().to(self.c_dtype))
                        else:
                            rC.fill(0)  # rows past offs[-1]
                        cC_e = tTR_cC[(None, None, None, e)]
                        pred = cute.make_rmem_tensor((1, *cC_e.shape[1:]), cutlass.Boolean)
                        for mi in cutlass.range_constexpr(cC_e.shape[1]):
                            for ni in cutlass.range_constexpr(cC_e.shape[2]):
                                pred[(0, mi, ni)] = cute.elem_less(cC_e[(0, mi, ni)], limit)
                        cute.copy(store, rC, tTR_gC[(None, None, None, e)], pred=pred)
                    if g < G:
                        cute.arch.fence_view_async_tmem_load()
                        with cute.arch.elect_one():
                            acc_pipeline.consumer_release(acc_state)
                        acc_state.advance()
                    t = t + nctas
                    g, g_start, g_end, before = self.next_tile(t, g, g_start, g_end, before, offs, M, n_tiles)
                # All epilogue warps are done reading TMEM before it is freed.
                epi_bar.arrive_and_wait()
                tmem.relinquish_alloc_permit()
                tmem.free(tmem_ptr)

    return _GroupedGemmSm100


def _main(argv=None) -> None:
    """``python -m moe_ops.backends.cuda.blackwell [--arch sm_100a] [--all]``: compile variants
    into the cache and print compile (or load) time and SASS instruction counts for each."""
    import argparse

    parser = argparse.ArgumentParser(description=_main.__doc__)
    parser.add_argument("--arch", default="sm_100a", choices=ARCHS)
    parser.add_argument("--all", action="store_true", help="all 48 variants (default: one per dtype and layout)")
    parser.add_argument("--recompile", action="store_true", help="ignore the disk cache")
    args = parser.parse_args(argv)
    variants = [(d, o, n, lay, b) for d in DTYPES for o in (None, torch.float32) for n in TILE_NS
                for lay in ("2d3d", "2d3d_bt") for b in (False, True)]
    if not args.all:
        variants = [v for v in variants if v[1] is None and v[2] == 128 and not v[4]]
    shown = ("UTCHMMA", "UTMALDG", "LDTM", "STG.E.128", "LDG.E.U16", "STL", "LDL")
    print(f"cache: {cache_dir()}  cutlass-dsl {cutlass_dsl_version()}")
    print(f"{'variant':<46} {'source':>8} {'s':>6}  " + " ".join(f"{h:>9}" for h in shown))
    for d, o, n, lay, b in variants:
        k = compile_kernel(args.arch, d, (TILE_M, n), lay, o, b, use_cache=not args.recompile)
        ops = opcode_counts(sass(k.object_path))
        row = [sum(c for op, c in ops.items() if op == h or op.startswith(h + ".")) for h in shown]
        print(f"{k.key.name:<46} {k.source:>8} {k.seconds:6.2f}  " + " ".join(f"{c:>9}" for c in row))


if __name__ == "__main__":
    _main()

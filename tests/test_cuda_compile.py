"""Ahead-of-time compiles of the CUDA backend's Triton kernels for sm_80, sm_90 and sm_100 (no GPU).

Categories:
* every kernel variant the launcher can produce (rows kernel: 2Dx3D with bias and fp32 output,
  transposed mat_b, 3Dx3D; ragged-K kernel: weight gradient; fp32 ieee and tf32; fp64) compiles
  for each target through ``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))``;
* the 16-bit variants use the target's tensor-core instructions: mma.sync / HMMA on sm_80,
  wgmma / HGMMA on sm_90, tcgen05.mma / UTCHMMA on sm_100 (PTX, and SASS from the cuobjdump that
  ships with triton), on their own operand type (bf16 / f16, not tf32), with the compile-time
  arguments the launcher passes on a GPU (``common_constexprs``);
* their K loop is software pipelined (asynchronous global->shared copies in the TTGIR), which a
  mask along a contiguous dimension silently prevents;
* no register spills beyond a small epilogue stack (cuobjdump -res-usage);
* fp32 stays off tensor cores (FMA, no tf32) unless MOE_OPS_CUDA_FP32_PRECISION opts in; fp64
  uses the fp64 MMA (DMMA) on every target.

The argument specialisation mimics what Triton's JIT does for real MoE shapes: pointers and
sizes divisible by 16, unit strides as constants.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

import pytest
import torch

tk = pytest.importorskip("moe_ops.backends.cuda.triton_kernels", reason="triton is not installed (pip install triton==3.9.0)")
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

ARCHS = (80, 90, 100)
_TL = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}
# PTX and SASS of a 16-bit tensor-core MMA on each target.
_MMA_PTX = {80: "mma.sync.aligned", 90: "wgmma.mma_async", 100: "tcgen05.mma"}
_MMA_SASS = {80: "HMMA", 90: "HGMMA", 100: "UTCHMMA"}
# The operand types each target's MMA names in the PTX (sm_100's tcgen05.mma carries them in its
# instruction descriptor and names only the kind: f16 for fp16 and bf16 alike).
_PTX_TYPE = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "tf32"}
_MMA_OPERANDS = {80: r"\.row\.col\.f32\.{t}\.{t}\.f32", 90: r"k\d+\.f32\.{t}\.{t}\b", 100: r"\.kind::{kind}\b"}


@dataclass(frozen=True)
class Variant:
    """One specialisation of a kernel, as the launcher would launch it."""

    kernel: str  # "rows" or "ragged_k"
    dtype: torch.dtype
    out_dtype: torch.dtype
    offs_dtype: torch.dtype = torch.int32
    has_offs: bool = True
    has_bias: bool = False
    unit_strides: tuple = ()  # stride arguments equal to 1 (Triton makes them constants)
    precision: str = "tf32"
    mma: str = "tensor cores"  # "tensor cores" (16-bit or tf32), "fp64" (DMMA) or "none" (FMA)
    env: tuple = ()  # environment variables set while the variant is built
    tma: bool = False  # a_ptr / b_ptr are TMA descriptors (MOE_OPS_CUDA_TMA=1; sm_90 and newer)
    b_k_contiguous: bool = False  # with tma: mat_b is the transposed view of a [G, N, K] tensor


VARIANTS = {
    # MoE forward: x [M, K] @ W[g] [K, N], bias, fp32 output.
    "forward bf16 bias fp32-out": Variant("rows", torch.bfloat16, torch.float32, has_bias=True,
                                          unit_strides=("s_ak", "s_bn", "s_on", "s_biasn")),
    # Input gradient: grad [M, N] @ W[g].T, mat_b a transposed view (unit stride along K).
    "input-grad fp16 transposed mat_b": Variant("rows", torch.float16, torch.float16, offs_dtype=torch.int64,
                                                unit_strides=("s_ak", "s_bk", "s_on")),
    "3d3d bf16": Variant("rows", torch.bfloat16, torch.bfloat16, has_offs=False,
                         unit_strides=("s_ak", "s_bn", "s_on")),
    # The same three with TMA operand copies (opt-in, sm_90+).
    "forward bf16 bias fp32-out TMA": Variant("rows", torch.bfloat16, torch.float32, has_bias=True,
                                              unit_strides=("s_on", "s_biasn"), env=(("MOE_OPS_CUDA_TMA", "1"),),
                                              tma=True),
    "input-grad fp16 transposed mat_b TMA": Variant("rows", torch.float16, torch.float16, offs_dtype=torch.int64,
                                                    unit_strides=("s_on",), env=(("MOE_OPS_CUDA_TMA", "1"),),
                                                    tma=True, b_k_contiguous=True),
    "3d3d bf16 TMA": Variant("rows", torch.bfloat16, torch.bfloat16, has_offs=False, unit_strides=("s_on",),
                             env=(("MOE_OPS_CUDA_TMA", "1"),), tma=True),
    # Weight gradient: x.T [K_in, M] (column-major) @ grad [M, N] over ragged M, fp32 output.
    "weight-grad bf16 fp32-out": Variant("ragged_k", torch.bfloat16, torch.float32, unit_strides=("s_am", "s_bn", "s_on")),
    "weight-grad fp16": Variant("ragged_k", torch.float16, torch.float16, unit_strides=("s_am", "s_bn", "s_on")),
    "forward fp32 ieee": Variant("rows", torch.float32, torch.float32, unit_strides=("s_ak", "s_bn", "s_on"),
                                 precision="ieee", mma="none"),
    "forward fp32 tf32 opt-in": Variant("rows", torch.float32, torch.float32, unit_strides=("s_ak", "s_bn", "s_on"),
                                        env=(("MOE_OPS_CUDA_FP32_PRECISION", "tf32"),)),
    "weight-grad fp32 ieee": Variant("ragged_k", torch.float32, torch.float32, unit_strides=("s_am", "s_bn", "s_on"),
                                     precision="ieee", mma="none"),
    "forward fp64": Variant("rows", torch.float64, torch.float64, unit_strides=("s_ak", "s_bn", "s_on"),
                            precision="ieee", mma="fp64"),
    "weight-grad fp64": Variant("ragged_k", torch.float64, torch.float64, unit_strides=("s_am", "s_bn", "s_on"),
                                precision="ieee", mma="fp64"),
}

_POINTERS = {"a_ptr", "b_ptr", "out_ptr", "bias_ptr", "offs_ptr"}
_KERNEL_CONSTEXPRS = {"HAS_OFFS", "HAS_BIAS", "BM", "BN", "BK", "GROUP_M", "ACC_DTYPE", "PRECISION", "DOT_UPCAST",
                      "EPILOGUE_SPLIT", "TMA", "B_K_CONTIGUOUS"}


def _source(v: Variant, arch: int, monkeypatch):
    for name, value in v.env:
        monkeypatch.setenv(name, value)
    fn = tk._rows_kernel if v.kernel == "rows" else tk._ragged_k_kernel
    cfg = tk.tile_config(arch, v.dtype)
    constexprs = tk.common_constexprs(cfg, v.dtype, interpret=False)  # what a GPU launch passes
    assert constexprs["PRECISION"] == v.precision
    if v.kernel == "rows":
        constexprs.update(HAS_OFFS=v.has_offs, HAS_BIAS=v.has_bias, TMA=v.tma, B_K_CONTIGUOUS=v.b_k_contiguous)
        if v.has_offs:  # 2Dx3D: rows are global, no batch stride
            constexprs.update(s_ag=0, s_og=0)
    descriptors = {}
    if v.tma:
        assert cfg.tma, f"tile_config({arch}) did not take the TMA opt-in"
        tl_type = _TL[v.dtype]
        a_block = [cfg.BM, cfg.BK] if v.has_offs else [1, cfg.BM, cfg.BK]
        b_block = [1, cfg.BN, cfg.BK] if v.b_k_contiguous else [1, cfg.BK, cfg.BN]
        descriptors = {"a_ptr": f"tensordesc<{tl_type}{a_block}>", "b_ptr": f"tensordesc<{tl_type}{b_block}>"}
    for name in v.unit_strides:
        constexprs[name] = 1
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in descriptors:
            signature[name] = descriptors[name]
            continue
        elif name == "offs_ptr":
            signature[name] = "*" + ("i32" if v.offs_dtype == torch.int32 else "i64")
        elif name == "out_ptr":
            signature[name] = "*" + _TL[v.out_dtype]
        elif name in _POINTERS:
            signature[name] = "*" + _TL[v.dtype]
        else:
            signature[name] = "i32"
        if signature[name] != "constexpr" and name not in ("G", "NUM_PROGRAMS"):
            attrs[(i,)] = [["tt.divisibility", 16]]  # 16-aligned pointers, sizes and strides
    assert set(constexprs) >= _KERNEL_CONSTEXPRS & set(fn.arg_names)
    return ASTSource(fn, signature, constexprs, attrs), cfg


_compiled: dict = {}


def _compile(name: str, arch: int, monkeypatch):
    if (name, arch) not in _compiled:
        src, cfg = _source(VARIANTS[name], arch, monkeypatch)
        _compiled[(name, arch)] = triton.compile(
            src, target=GPUTarget("cuda", arch, 32), options=tk.launch_options(cfg))
    return _compiled[(name, arch)]


def _cuobjdump(kernel, flag: str) -> str:
    cuobjdump = triton.knobs.nvidia.cuobjdump.path
    if not cuobjdump or shutil.which(cuobjdump) is None:
        pytest.skip("cuobjdump not found (it ships with the triton wheel)")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([cuobjdump, flag, f.name], check=True, capture_output=True, text=True).stdout


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", list(VARIANTS))
def test_kernel_variant_compiles_for_target(name, arch, monkeypatch):
    v = VARIANTS[name]
    if v.tma and arch < 90:
        pytest.skip("TMA copies need sm_90 or newer; tile_config never asks for them below")
    kernel = _compile(name, arch, monkeypatch)
    ptx = kernel.asm["ptx"]
    assert f".target sm_{arch}" in ptx
    if v.tma:
        assert "cp.async.bulk.tensor" in ptx, f"{name} on sm_{arch}: no TMA copy in the PTX"
    if v.mma == "tensor cores":
        assert _MMA_PTX[arch] in ptx, f"{name} on sm_{arch}: no {_MMA_PTX[arch]} in the PTX"
        # On the inputs' own type: a bf16 dot upcast to fp32 (the interpreter's workaround) would
        # still use tensor cores, as tf32 at half the rate or less.
        t = _PTX_TYPE[v.dtype]
        operands = _MMA_OPERANDS[arch].format(t=t, kind="tf32" if t == "tf32" else "f16")
        mmas = set(re.findall(re.escape(_MMA_PTX[arch]) + r"[\w.:]*", ptx))
        assert mmas and all(re.search(operands, m) for m in mmas), f"{name} on sm_{arch}: MMAs {sorted(mmas)}"
        ttgir = kernel.asm["ttgir"]
        assert "async_copy_global_to_local" in ttgir or "async_tma_copy" in ttgir, \
            f"{name} on sm_{arch}: the K loop is not software pipelined"
    elif v.mma == "fp64":
        assert "mma.sync.aligned.m8n8k4.row.col.f64" in ptx, f"{name} on sm_{arch}: no fp64 MMA (DMMA)"
    else:
        assert "tf32" not in ptx and "fma.rn.f32" in ptx, f"{name} on sm_{arch}: fp32 must use FMA, not tf32"


# Bytes of stack (spilled registers) allowed per thread. Measured with triton 3.9: 0 for every
# 16-bit variant except the forward with bias and fp32 output, 56 bytes on sm_90 and 0 on sm_100
# in its epilogue, and 16 / 48 for the fp32 tf32 opt-in, since the K loop steps its pointers in
# 64 bits and the group size cannot wrap (64 / 8 and 0 / 8 before; 56 / 0 for the former before
# the kernel clamped offs itself; 224 / 264 before the epilogue stored 128x256 tiles in halves).
_STACK_BYTES = 64


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", [n for n, v in VARIANTS.items() if v.mma == "tensor cores"])
def test_no_register_spills(name, arch, monkeypatch):
    if VARIANTS[name].tma and arch < 90:
        pytest.skip("TMA copies need sm_90 or newer")
    usage = _cuobjdump(_compile(name, arch, monkeypatch), "-res-usage")
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    assert stack <= _STACK_BYTES, f"{name} on sm_{arch}: {stack} bytes of spilled registers per thread"


@pytest.mark.parametrize("arch", ARCHS)
def test_sass_uses_tensor_cores(arch, monkeypatch):
    sass = _cuobjdump(_compile("forward bf16 bias fp32-out", arch, monkeypatch), "-sass")
    assert _MMA_SASS[arch] in sass, f"no {_MMA_SASS[arch]} in the sm_{arch} SASS"


@pytest.mark.parametrize("arch", [a for a in ARCHS if a >= 90])
@pytest.mark.parametrize("name", [n for n, v in VARIANTS.items() if v.tma])
def test_tma_variants_copy_with_tma_in_sass(name, arch, monkeypatch):
    sass = _cuobjdump(_compile(name, arch, monkeypatch), "-sass")
    assert "UTMALDG" in sass and _MMA_SASS[arch] in sass, f"{name} on sm_{arch}: no UTMALDG / {_MMA_SASS[arch]}"


def test_tf32_opt_in_uses_tensor_cores(monkeypatch):
    ptx = _compile("forward fp32 tf32 opt-in", 90, monkeypatch).asm["ptx"]
    assert "tf32" in ptx and "wgmma" in ptx


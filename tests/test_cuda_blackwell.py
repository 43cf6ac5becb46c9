"""The Blackwell (sm_100a) CuTe DSL kernel, verified without a GPU.

Categories:
* ahead-of-time compile for sm_100a: a covering set of variants (both dtypes, both mat_b
  layouts, all three tile widths, fp32 output, bias) compiles, and its SASS contains tcgen05 MMA
  (UTCHMMA), tcgen05 TMEM loads (LDTM), TMA loads (UTMALDG), 16-byte predicated stores and no
  register spills;
* the disk cache: a fresh process loads what an earlier one compiled instead of compiling;
* host side on CPU tensors: which calls the kernel serves (``plan``), the tile chooser, and that
  the runtime arguments match the compiled signature.

Nothing here runs the kernel: that needs a B200/B300. The compile tests need nvidia-cutlass-dsl
(and nvidia-cuda-cuobjdump / nvidia-cuda-nvdisasm for SASS); without them they skip, unless
MOE_OPS_REQUIRE_BACKENDS names "cuda" (as CI does), where the skip becomes a failure.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from moe_ops import _contract
from moe_ops.backends.cuda import blackwell as bw

_REQUIRED = "cuda" in os.environ.get("MOE_OPS_REQUIRE_BACKENDS", "").split(",")


def _needs_dsl():
    if bw.cutlass_dsl_version() is None:
        msg = "nvidia-cutlass-dsl is not installed (pip install -r requirements-test.txt)"
        if _REQUIRED:
            pytest.fail(msg + "; MOE_OPS_REQUIRE_BACKENDS requires the cuda backend's toolchain")
        pytest.skip(msg)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A private kernel cache for this module, so every compile test really compiles."""
    _needs_dsl()
    root = tmp_path_factory.mktemp("moe_ops_cache")
    old = os.environ.get("MOE_OPS_CACHE_DIR")
    os.environ["MOE_OPS_CACHE_DIR"] = str(root)
    bw._loaded.clear()
    yield root
    bw._loaded.clear()
    if old is None:
        del os.environ["MOE_OPS_CACHE_DIR"]
    else:
        os.environ["MOE_OPS_CACHE_DIR"] = old


# Every dtype, output dtype, mat_b layout, tile width and bias setting appears at least once.
# (All 48 sm_100a variants compile too: python -m moe_ops.backends.cuda.blackwell --all.)
VARIANTS = [
    dict(dtype=torch.bfloat16, layout="2d3d", tile=(128, 128)),
    dict(dtype=torch.bfloat16, layout="2d3d_bt", tile=(128, 256)),
    dict(dtype=torch.float16, layout="2d3d", tile=(128, 256)),
    dict(dtype=torch.float16, layout="2d3d_bt", tile=(128, 64)),
    dict(dtype=torch.bfloat16, layout="2d3d", tile=(128, 64), out_dtype=torch.float32, bias=True),
    dict(dtype=torch.float16, layout="2d3d_bt", tile=(128, 128), out_dtype=torch.float32, bias=True),
    dict(dtype=torch.bfloat16, layout="2d3d", tile=(128, 128), arch="sm_100f"),  # served on sm_103
]


def _vid(v: dict) -> str:
    return "-".join([v.get("arch", "sm_100a"), str(v["dtype"]).split(".")[-1], v["layout"], f"n{v['tile'][1]}",
                     *(["out_fp32"] if v.get("out_dtype") else []), *(["bias"] if v.get("bias") else [])])


@pytest.mark.parametrize("variant", VARIANTS, ids=_vid)
def test_compiles_for_sm100_with_tcgen05_and_tma(cache, variant):
    variant = {"arch": "sm_100a", **variant}
    k = bw.compile_kernel(use_cache=False, **variant)
    assert k.source == "compiled" and k.object_path.is_file()
    text = bw.sass(k.object_path)
    assert f"arch = {variant['arch']}" in text
    ops = bw.opcode_counts(text)
    total = lambda prefix: sum(n for op, n in ops.items() if op == prefix or op.startswith(prefix + "."))  # noqa: E731
    assert total("UTCHMMA") > 0, "no tcgen05.mma (UTCHMMA) in the SASS"
    assert total("UTMALDG") > 0, "no TMA load (UTMALDG) in the SASS"
    assert total("LDTM") > 0, "no tcgen05.ld (LDTM): the accumulator is not read from tensor memory"
    # One 16-byte store per 8 output columns of a thread's row (2 per 8 columns for fp32):
    # the epilogue is vectorized, not element by element.
    tile_n, el = variant["tile"][1], 4 if variant.get("out_dtype") else 2
    assert ops.get("STG.E.128", 0) == tile_n * el // 16, ops
    assert total("STL") == 0 and total("LDL") == 0, "register spills to local memory"
    if variant.get("bias"):
        assert total("LDG.E.U16") > 0, "bias is read as 16-bit values"


def test_disk_cache_serves_a_second_process(cache):
    variant = VARIANTS[0]
    first = bw.compile_kernel(**variant)  # compiled above or now: either way on disk afterwards
    assert first.object_path.is_file()
    again = bw.compile_kernel(**variant)
    assert again.source == "memory"
    script = (
        "import json, time, torch\n"
        "from moe_ops.backends.cuda import blackwell as bw\n"
        "t = time.perf_counter()\n"
        "k = bw.compile_kernel(dtype=torch.bfloat16, layout='2d3d', tile=(128, 128))\n"
        "print(json.dumps({'source': k.source, 'seconds': k.seconds, 'total': time.perf_counter() - t,\n"
        "                  'stats': bw.compile_stats(), 'path': str(k.object_path)}))\n"
    )
    env = dict(os.environ, MOE_OPS_CACHE_DIR=str(cache))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    info = json.loads(done.stdout.strip().splitlines()[-1])
    assert info["source"] == "disk" and info["stats"] == {"compiled": 0, "disk": 1, "memory": 0}, info
    assert info["path"] == str(first.object_path)
    # Loading an object file takes tens of milliseconds; compiling takes seconds.
    assert info["seconds"] < 1.0, info


@pytest.mark.parametrize("content", [b"", b"not an object file"], ids=["empty", "garbage"])
def test_an_object_file_that_does_not_load_is_compiled_again(cache, content):
    """A cache entry that the loader rejects (an empty file left by a crash after the rename, a
    garbage one) is recompiled and replaced; it used to raise RuntimeError on every call of the
    variant, in every process, until someone deleted the file. Variant: bf16 2d3d, tile_n 64."""
    key = bw.KernelKey("sm_100a", "bf16", "bf16", 64, "n", False)
    path = bw.cache_dir() / f"{key.name}_{bw._source_tag()}.o"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    bw._loaded.pop(key, None)
    k = bw.compile_kernel(dtype=torch.bfloat16, layout="2d3d", tile=(128, 64))
    assert k.source == "compiled" and k.object_path == path
    assert bw.opcode_counts(bw.sass(path)).get("UTCHMMA", 0) > 0  # a real object replaced it


@pytest.mark.parametrize("error", [RuntimeError, ModuleNotFoundError, AttributeError])
def test_a_variant_the_dsl_cannot_build_is_declined_once(cache, monkeypatch, caplog, error):
    """A DSL failure while compiling (an untested nvidia-cutlass-dsl, a missing toolchain piece)
    becomes NotImplementedError, so the CUDA backend's Triton kernel serves the call instead of
    every call failing; the failure is remembered, not retried per call (a compile takes
    seconds), and logged once as a warning (a silent decline would hide a slow path). Another
    DSL release fails as an import or attribute error (the kernel uses cutlass.utils.gemm.sm100),
    not only RuntimeError. Variant: fp16 2d3d, tile_n 64, never compiled in this module."""
    key = bw.KernelKey("sm_100a", "fp16", "fp16", 64, "n", False)
    calls = []

    def broken(k):
        calls.append(k)
        raise error("DSL internal error\nsecond line")

    monkeypatch.setattr(bw, "_compile", broken)
    monkeypatch.setattr(bw, "_unbuildable", {})
    bw._loaded.pop(key, None)
    with caplog.at_level(logging.INFO, logger="moe_ops"):
        for _ in range(2):
            why = rf"\({error.__name__}: DSL internal error\)$"
            with pytest.raises(NotImplementedError, match=why):
                bw.kernel_or_decline(key)
    assert calls == [key]
    warned = [r for r in caplog.records
              if r.levelno == logging.WARNING and key.name in r.getMessage()]
    assert len(warned) == 1, caplog.records


def test_dsl_settings_are_part_of_the_cache_key(monkeypatch):
    """CUTE_DSL_* variables change what the DSL compiles (CUTE_DSL_LINEINFO=1 gives another
    object file), so a kernel compiled without them must not be served to a process with them.
    CUTE_DSL_ARCH is overridden by the --gpu-arch option and stays out of the key."""
    for name in [k for k in os.environ if k.startswith("CUTE_DSL_")]:
        monkeypatch.delenv(name)
    bw._source_tag.cache_clear()
    try:
        plain = bw._source_tag()
        monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
        bw._source_tag.cache_clear()
        assert bw._source_tag() == plain
        monkeypatch.setenv("CUTE_DSL_LINEINFO", "1")
        bw._source_tag.cache_clear()
        assert bw._source_tag() != plain
    finally:
        monkeypatch.undo()
        bw._source_tag.cache_clear()


def test_cache_dir_is_moe_ops_cache_dir_or_the_users_cache(monkeypatch, tmp_path):
    """$MOE_OPS_CACHE_DIR/blackwell when set and not empty, else ~/.cache/moe_ops/blackwell."""
    monkeypatch.setenv("MOE_OPS_CACHE_DIR", str(tmp_path / "cache"))
    assert bw.cache_dir() == tmp_path / "cache" / "blackwell"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for unset in (lambda: monkeypatch.delenv("MOE_OPS_CACHE_DIR"),
                  lambda: monkeypatch.setenv("MOE_OPS_CACHE_DIR", "")):
        unset()
        assert bw.cache_dir() == tmp_path / "home" / ".cache" / "moe_ops" / "blackwell"


def test_the_cache_key_covers_this_file_and_every_dsl_package(monkeypatch, tmp_path):
    """An object file compiled from another version of blackwell.py, or by another release of
    one of the DSL's distributions (nvidia-cutlass-dsl*, the CUDA toolchain among them), must
    not be loaded: each changes the tag in the object file's name. The other release is a
    dist-info directory on sys.path; the other source is a copy with one byte more."""
    bw._source_tag.cache_clear()
    try:
        plain = bw._source_tag()
        edited = tmp_path / "blackwell.py"
        edited.write_bytes(Path(bw.__file__).read_bytes() + b"\n")
        with monkeypatch.context() as m:
            m.setattr(bw, "__file__", str(edited))
            bw._source_tag.cache_clear()
            assert bw._source_tag() != plain
        info = tmp_path / "site" / "nvidia_cutlass_dsl_libs_other-1.0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(
            "Metadata-Version: 2.1\nName: nvidia-cutlass-dsl-libs-other\nVersion: 1.0\n")
        monkeypatch.syspath_prepend(str(tmp_path / "site"))
        bw._source_tag.cache_clear()
        assert bw._source_tag() != plain
    finally:
        monkeypatch.undo()
        bw._source_tag.cache_clear()


class _Exported:
    """What ``_compile`` returns, as far as ``_store`` uses it: writes a stand-in object file."""

    def export_to_c(self, directory, name, function_prefix):
        Path(directory, f"{name}.o").write_bytes(b"object")


def test_use_cache_false_compiles_whatever_memory_or_disk_holds(monkeypatch, tmp_path, caplog):
    """compile_kernel(use_cache=False) compiles and rewrites the object file whatever this
    process or the disk holds (python -m ...blackwell --all relies on it), without trying to
    load it. _compile is replaced by a stand-in, so nothing is compiled (and the stand-in's
    object file would not load: a load attempt logs a warning). Variant: bf16 2d3d, n 128."""
    _needs_dsl()
    monkeypatch.setenv("MOE_OPS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(bw, "_loaded", {})
    compiled = []
    monkeypatch.setattr(bw, "_compile", lambda key: compiled.append(key) or _Exported())
    key = bw.KernelKey("sm_100a", "bf16", "bf16", 128, "n", False)
    assert bw._kernel(key).source == "compiled" and bw._kernel(key).source == "memory"
    assert bw._kernel(key, use_cache=False).source == "compiled"  # in memory
    bw._loaded.clear()
    with caplog.at_level(logging.WARNING, logger="moe_ops"):
        assert bw._kernel(key, use_cache=False).source == "compiled"  # on disk only
    assert not [r for r in caplog.records if "cannot load" in r.getMessage()], caplog.records
    assert compiled == [key] * 3 and bw._kernel(key).object_path.is_file()


def test_an_unwritable_cache_costs_only_the_cache(monkeypatch, tmp_path, caplog):
    """A cache directory that cannot be created (here its parent is a file) is logged, and the
    compiled kernel is still returned. _compile is replaced by a stand-in."""
    _needs_dsl()
    (tmp_path / "file").write_bytes(b"")
    monkeypatch.setenv("MOE_OPS_CACHE_DIR", str(tmp_path / "file"))
    monkeypatch.setattr(bw, "_loaded", {})
    monkeypatch.setattr(bw, "_compile", lambda key: _Exported())
    key = bw.KernelKey("sm_100a", "bf16", "bf16", 128, "n", False)
    with caplog.at_level(logging.WARNING, logger="moe_ops"):
        assert bw._kernel(key).source == "compiled"
    assert any("cannot write the Blackwell kernel cache" in r.getMessage() for r in caplog.records)


def test_storing_a_variant_drops_only_its_own_older_builds(tmp_path):
    """A new object file replaces older builds of its variant, never another variant's (the
    no-bias variant's name is a prefix of the bias variant's)."""
    plain = bw.KernelKey("sm_100a", "bf16", "bf16", 128, "n", False)
    biased = dataclasses.replace(plain, bias=True)
    assert biased.name.startswith(plain.name)
    kept = [tmp_path / f"{biased.name}_{'1' * 12}.o", tmp_path / f"{plain.name}_extra_{'2' * 12}.o"]
    for path in kept + [tmp_path / f"{plain.name}_{'3' * 12}.o"]:
        path.write_bytes(b"object")
    new = tmp_path / f"{plain.name}_{'4' * 12}.o"
    bw._store(_Exported(), plain, new)
    assert sorted(tmp_path.glob("*.o")) == sorted(kept + [new])


def test_cache_key_covers_every_variant_dimension():
    keys = {bw.KernelKey(a, d, o, n, m, b).name
            for a in bw.ARCHS for d in ("bf16", "fp16") for o in (d, "fp32")
            for n in bw.TILE_NS for m in bw.B_MAJORS for b in (False, True)}
    assert len(keys) == len(bw.ARCHS) * 2 * 2 * len(bw.TILE_NS) * len(bw.B_MAJORS) * 2
    assert all(k.isidentifier() for k in keys)


def test_compile_kernel_rejects_what_it_cannot_build():
    with pytest.raises(ValueError, match="tile"):
        bw.compile_kernel(tile=(256, 128))
    with pytest.raises(ValueError, match="tile"):
        bw.compile_kernel(tile=(128, 96))
    with pytest.raises(ValueError, match="layout"):
        bw.compile_kernel(layout="2d2d")
    with pytest.raises(ValueError, match="dtype"):
        bw.compile_kernel(dtype=torch.float32)
    with pytest.raises(ValueError, match="out_dtype"):
        bw.compile_kernel(dtype=torch.bfloat16, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="arch"):
        bw.compile_kernel(arch="sm_90a")
    with pytest.raises(ValueError, match="arch"):
        bw.compile_kernel(arch="sm_103a")  # compiles in cutlass-dsl 4.8.1 but fails to export


# ------------------------------------------------------------------ host side, CPU tensors


def _plan(a, b, offs=None, bias=None, out_dtype=None, **kw):
    return bw.plan(_contract.check_args(a, b, offs, bias, out_dtype), a, b, bias, **kw)


def _offs(*ends):
    return torch.tensor(ends, dtype=torch.int32)


def test_plan_forward_and_input_gradient_layouts():
    a = torch.randn(300, 64, dtype=torch.bfloat16)
    w = torch.randn(4, 64, 128, dtype=torch.bfloat16)
    p = _plan(a, w, _offs(10, 10, 200, 250))
    assert (p.M, p.N, p.K, p.G) == (300, 128, 64, 4) and p.key.b_major == "n" and p.key.layout == "2d3d"
    assert p.a is a and p.b is w and p.out_shape == (300, 128)
    # the input gradient multiplies by W^T: a transposed view of a [G, N, K] tensor
    wt = torch.randn(4, 128, 64, dtype=torch.float16).transpose(1, 2)
    p = _plan(a.half(), wt, _offs(300, 300, 300, 300))
    assert p.key.b_major == "k" and p.key.layout == "2d3d_bt" and p.key.dtype == "fp16"


def test_plan_dtypes_and_bias():
    a = torch.randn(64, 32, dtype=torch.float16)
    w = torch.randn(2, 32, 16, dtype=torch.float16)
    bias = torch.randn(16, 2, dtype=torch.float16).t()  # [G, N] with N strided
    p = _plan(a, w, _offs(30, 64), bias, torch.float32)
    assert (p.key.dtype, p.key.out_dtype, p.key.bias) == ("fp16", "fp32", True)
    assert p.bias.stride(1) == 1 and torch.equal(p.bias, bias)


def test_plan_3d3d_is_2d3d_over_stacked_rows():
    a = torch.randn(3, 40, 16, dtype=torch.bfloat16)
    w = torch.randn(3, 16, 24, dtype=torch.bfloat16)
    p = _plan(a, w)
    assert (p.M, p.G) == (120, 3) and p.out_shape == (3, 40, 24)
    assert p.a.data_ptr() == a.data_ptr() and p.a.shape == (120, 16)  # a view, no copy


@pytest.mark.parametrize("why, make", [
    ("fp32", lambda: (torch.randn(16, 16), torch.randn(2, 16, 16), _offs(8, 16))),
    ("fp64", lambda: (torch.randn(16, 16, dtype=torch.float64), torch.randn(2, 16, 16, dtype=torch.float64), _offs(8, 16))),
    ("2d2d", lambda: (torch.randn(16, 32, dtype=torch.bfloat16), torch.randn(32, 16, dtype=torch.bfloat16), _offs(8, 32))),
    ("3d2d", lambda: (torch.randn(2, 16, 32, dtype=torch.bfloat16), torch.randn(32, 16, dtype=torch.bfloat16), _offs(8, 16))),
    ("N % 8", lambda: (torch.randn(16, 16, dtype=torch.bfloat16), torch.randn(2, 16, 12, dtype=torch.bfloat16), _offs(8, 16))),
    ("K % 8", lambda: (torch.randn(16, 12, dtype=torch.bfloat16), torch.randn(2, 12, 16, dtype=torch.bfloat16), _offs(8, 16))),
    ("K == 0", lambda: (torch.randn(16, 0, dtype=torch.bfloat16), torch.randn(2, 0, 16, dtype=torch.bfloat16), _offs(8, 16))),
    ("mat_a M-major", lambda: (torch.randn(16, 16, dtype=torch.bfloat16).t(), torch.randn(2, 16, 16, dtype=torch.bfloat16), _offs(8, 16))),
    ("misaligned base", lambda: (torch.randn(16 * 16 + 1, dtype=torch.bfloat16)[1:].view(16, 16),
                                 torch.randn(2, 16, 16, dtype=torch.bfloat16), _offs(8, 16))),
    ("mat_b no unit stride", lambda: (torch.randn(16, 16, dtype=torch.bfloat16),
                                      torch.randn(2, 16, 32, dtype=torch.bfloat16)[:, :, ::2], _offs(8, 16))),
    ("mat_b broadcast", lambda: (torch.randn(16, 16, dtype=torch.bfloat16),
                                 torch.randn(1, 16, 16, dtype=torch.bfloat16).expand(2, 16, 16), _offs(8, 16))),
])
def test_plan_refuses_what_the_kernel_does_not_serve(why, make):
    a, b, offs = make()
    with pytest.raises(NotImplementedError):
        _plan(a, b, offs)


@pytest.mark.parametrize("why, make", [
    # Strides padded to 16 bytes, so only the size rule can refuse (the unpadded cases above are
    # refused by the alignment rule first, with or without the size rule).
    ("N % 8", lambda: (torch.randn(16, 16, dtype=torch.bfloat16),
                       torch.randn(2, 16, 16, dtype=torch.bfloat16)[:, :, :12])),
    ("K % 8", lambda: (torch.randn(16, 16, dtype=torch.bfloat16)[:, :12],
                       torch.randn(2, 16, 16, dtype=torch.bfloat16)[:, :12, :])),
    ("K == 0", lambda: (torch.randn(16, 8, dtype=torch.bfloat16)[:, :0],
                        torch.randn(2, 8, 16, dtype=torch.bfloat16)[:, :0, :])),
])
def test_plan_refuses_sizes_it_cannot_take_even_with_aligned_strides(why, make):
    """N or K not a multiple of 8 (the output's [M, N] rows are written in 16-byte vectors) and
    K == 0 (nothing to load; Triton writes bias or zeros) have rules of their own.
    a: [16, K], b: [2, K, N] bf16 views whose strides are multiples of 16 bytes."""
    a, b = make()
    with pytest.raises(NotImplementedError, match="multiples of 8" if "%" in why else "K == 0"):
        _plan(a, b, _offs(8, 16))


@pytest.mark.parametrize("dim", ["M", "N"])
def test_plan_refuses_a_dimension_within_a_tile_of_2_31(dim):
    """The scheduler's tile bounds are int32: M or N above _MAX_DIM is refused, a size below it
    is served. Meta tensors (no memory; data_ptr() 0 is aligned) with real strides, so no other
    rule (the broadcast rule refuses an expand()ed operand) can be what refuses it.
    a: [M, 16], b: [2, 16, N] bf16; the other dimension is 16."""
    meta = dict(dtype=torch.bfloat16, device="meta")
    offs = torch.empty(2, dtype=torch.int32, device="meta")
    for size, refused in ((bw._MAX_DIM + 1, True), (bw._MAX_DIM - 7, False)):  # both % 8 == 0
        M, N = (size, 16) if dim == "M" else (16, size)
        a, b = torch.empty(M, 16, **meta), torch.empty(2, 16, N, **meta)
        if refused:
            with pytest.raises(NotImplementedError, match="32-bit"):
                _plan(a, b, offs)
        else:
            assert (_plan(a, b, offs).M, _plan(a, b, offs).N) == (M, N)


def test_plan_uses_the_devices_arch_and_sm_count():
    """grouped_mm hands plan the device's arch (sm_100f on a B300, where an sm_100a cubin does
    not run) and SM count (the tile width depends on it). a: [1024, 64], b: [8, 64, 2048] bf16."""
    a = torch.randn(1024, 64, dtype=torch.bfloat16)
    w = torch.randn(8, 64, 2048, dtype=torch.bfloat16)
    offs = _offs(*range(128, 1025, 128))
    assert _plan(a, w, offs, arch="sm_100f").key.arch == "sm_100f"
    assert _plan(a, w, offs).key.tile_n == 128  # 16 x 8 = 128 tiles at 256 < 148 SMs
    assert _plan(a, w, offs, num_sms=128).key.tile_n == 256


def test_grouped_mm_refuses_without_a_blackwell_gpu():
    """On this CPU machine the impl must hand the call back (the op then uses another kernel)."""
    if torch.cuda.is_available() and bw.available()[0]:
        pytest.skip("a Blackwell GPU is present: the property suite runs the kernel there")
    ok, why = bw.available()
    assert not ok and why
    a = torch.randn(16, 16, dtype=torch.bfloat16)
    w = torch.randn(2, 16, 16, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError):
        bw.grouped_mm(_contract.check_args(a, w, _offs(8, 16)), a, w, _offs(8, 16), None)


def test_choose_tile_n():
    sms = 148
    for M, N, G in [(64, 8, 1), (4096, 14336, 8), (65536, 2048, 256), (4096, 768, 128), (256, 4096, 2)]:
        n = bw.choose_tile_n(M, N, G, sms)
        assert n in bw.TILE_NS
        if n == 256:  # the widest tile only when every SM still gets a tile
            assert (-(-M // 128) + G) * -(-N // 256) >= sms
    assert bw.choose_tile_n(64, 64, 1, sms) == 64  # a wider tile would be padding
    assert bw.choose_tile_n(16384, 14336, 8, sms) == 256  # Mixtral 8x7B up-projection
    assert bw.choose_tile_n(4096, 768, 128, sms) == 256  # Qwen3-30B-A3B: (32 + 128) x 3 tiles
    assert bw.choose_tile_n(1024, 2048, 8, sms) == 128  # 16 x 8 = 128 tiles at 256, 256 at 128
    assert bw.choose_tile_n(512, 1024, 2, sms) == 64  # even 128 gives 6 x 8 = 48 tiles < 148 SMs


def test_choose_tile_n_at_its_boundaries():
    """Each rule of the chooser at its edge: a width only for N > 3/4 of it; exactly one tile
    per SM is enough; a group's partial row tile counts (ceil(M / 128) + G)."""
    big = 1 << 20  # enough row tiles for every width
    assert bw.choose_tile_n(big, 192, 1) == 128 and bw.choose_tile_n(big, 200, 1) == 256
    assert bw.choose_tile_n(big, 96, 1) == 64 and bw.choose_tile_n(big, 104, 1) == 128
    # (10 + 2) row tiles x 2 column tiles = 24 tiles at 256
    assert bw.choose_tile_n(1280, 512, 2, 24) == 256 and bw.choose_tile_n(1280, 512, 2, 25) == 128
    assert bw.choose_tile_n(129, 256, 1, 3) == 256  # 2 row tiles + 1 for the group


@pytest.mark.parametrize("b_major, bias", [("n", False), ("k", True)])
def test_runtime_arguments_match_the_compiled_signature(b_major, bias):
    """What grouped_mm passes at run time has the dtypes, ranks and unit strides that the kernel
    was compiled for (the DSL does not check this when a loaded kernel is called). The operands
    require grad, as expert weights and a training forward's activations do (DLPack refuses
    those unless detached)."""
    _needs_dsl()
    a = torch.randn(200, 32, dtype=torch.bfloat16, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(3, 32, 24, dtype=torch.bfloat16))
    if b_major == "k":
        w = torch.nn.Parameter(w.detach().transpose(1, 2).contiguous()).transpose(1, 2)
    bias_t = torch.randn(3, 24, dtype=torch.bfloat16, requires_grad=True) if bias else None
    p = _plan(a, w, _offs(50, 50, 120), bias_t, torch.float32)
    out = torch.empty(p.M, p.N, dtype=torch.float32)

    class Stream:
        cuda_stream = 0

    real = bw._runtime_args(p, out, _offs(50, 50, 120), 7, Stream())
    fake = bw._fake_args(p.key)
    assert len(real) == len(fake)
    for r, f, t in zip(real[:5], fake[:5], (p.a, p.b, out, None, p.bias)):
        if f is None:
            assert r is None
            continue
        assert r.element_type == f.element_type
        assert len(r.shape) == len(f.shape)
        assert [s == 1 for s in r.stride] == [isinstance(s, int) and s == 1 for s in f.stride]
        if t is not None:
            assert tuple(r.shape) == tuple(t.shape) and tuple(r.stride) == tuple(t.stride())
    assert int(real[5]) == 7


def test_module_imports_without_the_dsl():
    """Importing the module (what the CUDA backend's register() does) must not import cutlass."""
    code = "import sys, moe_ops.backends.cuda.blackwell; assert 'cutlass' not in sys.modules"
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
    assert time.perf_counter() - t < 120

"""moe_ops: one MoE grouped-matmul operator for PyTorch, a native kernel per device.

Install with ``pip install --no-build-isolation -e .`` so that native parts build against the
torch already installed (build isolation would fetch another torch and break the ABI).

The C++ parts are optional: the native CPU kernel (csrc/cpu, module ``moe_ops._cpu``) and the
op's Autograd kernel in C++ (csrc/autograd, module ``moe_ops._autograd``). Without torch at build
time, without a C++ compiler, or with MOE_OPS_NO_EXTENSION=1, the pure-Python package installs
alone: the op then uses the reference on CPU and its Python Autograd kernel (``python -m moe_ops``
says why).
"""

import os
import sys

from setuptools import find_packages, setup


def _extensions():
    """(ext_modules, cmdclass) for the C++ modules, or empty ones when they cannot be built."""
    if os.environ.get("MOE_OPS_NO_EXTENSION", "0") not in ("", "0"):
        return [], {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except Exception as e:  # torch missing at build time (e.g. build isolation)
        print(f"moe_ops: not building the C++ modules: cannot import torch.utils.cpp_extension ({e})", file=sys.stderr)
        return [], {}

    import torch

    # MOE_OPS_OPT overrides both modules' optimization flag. .ci/sanitizers.sh builds at -O1, as
    # AddressSanitizer's documentation advises: measured here, the build took 65 s instead of
    # ~175 s at -O3 and its tests 137 s instead of 161 s, and a planted overrun was still caught.
    opt = os.environ.get("MOE_OPS_OPT")
    # Without debug information unless CFLAGS asks for it: Python's own build flags carry -g into
    # every extension build, which made this one ~1.6x slower (measured on a Zen 3 VM, 2026-12-07:
    # the four CPU sources 184 s of compiler time with -g, 117 s with -g0) and _cpu's file 19 MB.
    # The symbol table stays, so profilers still name the functions. (.ci/sanitizers.sh sets -g1:
    # ASan's reports give source lines.)
    debug = [] if any(f.startswith("-g") for f in os.environ.get("CFLAGS", "").split()) else ["-g0"]

    class OptionalBuildExtension(BuildExtension):
        """Builds each module; a failure (no compiler, ...) is reported and the install goes on.
        A module that failed is also removed where an earlier build left it (the build tree and,
        for in-place builds, the package), so that a failed rebuild after an edit leaves the
        reference in use, with its reason, instead of the previous build's module."""

        def run(self):
            self._failed = []
            try:
                super().run()
            except Exception as e:  # no usable compiler at all, ...
                for ext in self.extensions:
                    _not_built(ext, e)
                self._failed = list(self.extensions)
            for ext in self._failed:  # (in place: the package's copy; else the build tree's, if left)
                _remove(self.get_ext_fullpath(ext.name))

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as e:  # a compile error, ...
                _not_built(ext, e)
                self._failed.append(ext)
                _remove(self.get_ext_fullpath(ext.name))  # not copied in place then (optional)

    cpu = CppExtension(
        "moe_ops._cpu",
        ["csrc/cpu/grouped_mm.cpp", "csrc/cpu/kernels_x86.cpp", "csrc/cpu/kernels_avx2.cpp", "csrc/cpu/output_cache.cpp"],
        # -fopenmp: at::parallel_for is OpenMP in torch's CPU wheels and is inlined here; the
        # x86 kernels select their instruction set with a pragma and are used only after a
        # CPUID check, so the build needs no -march flag and runs on any x86-64.
        # The module refuses to load under any other torch (csrc/common/torch_version_guard.h).
        # MOE_OPS_AMX_EMULATOR=1: a test build whose AMX kernels run on our emulator of the tiles
        # (csrc/cpu/amx_emulator.h; .ci/sanitizers.sh on CPUs without AMX).
        define_macros=[("MOE_OPS_TORCH_VERSION", torch.__version__)]
        + ([("MOE_OPS_AMX_EMULATOR", "1")] if os.environ.get("MOE_OPS_AMX_EMULATOR", "0") not in ("", "0") else []),
        extra_compile_args=[opt or "-O3", "-fopenmp", *debug],
        extra_link_args=["-fopenmp"],
        optional=True,  # setuptools then skips the in-place copy of a module that was not built
    )
    autograd = CppExtension(
        "moe_ops._autograd",
        ["csrc/autograd/grouped_mm_autograd.cpp"],
        # Likewise.
        define_macros=[("MOE_OPS_TORCH_VERSION", torch.__version__)],
        extra_compile_args=[opt or "-O2", *debug],
        optional=True,
    )
    return [cpu, autograd], {"build_ext": OptionalBuildExtension}


FALLBACK = {
    "moe_ops._cpu": "the op will use the reference on CPU",
    "moe_ops._autograd": "the op will use its Python Autograd kernel",
}


def _remove(path: str) -> None:
    if os.path.exists(path):
        os.remove(path)
        print(f"moe_ops: removed {path}, an earlier build of a module that did not build now", file=sys.stderr)


def _not_built(ext, e: Exception) -> None:
    print(f"moe_ops: WARNING: {ext.name} was not built ({type(e).__name__}: {e}); {FALLBACK[ext.name]}",
          file=sys.stderr)


ext_modules, cmdclass = _extensions()

setup(
    name="moe_ops",
    version="0.1.0",
    description="torch.ops.moe.grouped_mm: one grouped-matmul op for MoE, a native kernel per device",
    packages=find_packages(include=["moe_ops", "moe_ops.*"]),
    package_data={"moe_ops": ["py.typed"]},  # PEP 561: type checkers read the package's annotations
    python_requires=">=3.10",
    install_requires=["torch>=2.9"],
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)

"""moe_ops: one MoE grouped-matmul operator for PyTorch, a native kernel per device.

Install with ``pip install --no-build-isolation -e .`` so that native parts build against the
torch already installed (build isolation would fetch another torch and break the ABI).

The native CPU kernel (csrc/cpu, module ``moe_ops._cpu``) is optional: without torch at build
time, without a C++ compiler, or with MOE_OPS_NO_EXTENSION=1, the pure-Python package installs
alone and the op uses the reference on CPU (``python -m moe_ops`` says why).
"""

import os
import sys

from setuptools import find_packages, setup


def _cpu_extension():
    """(ext_modules, cmdclass) for the CPU kernel, or empty ones when it cannot be built."""
    if os.environ.get("MOE_OPS_NO_EXTENSION", "0") not in ("", "0"):
        return [], {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except Exception as e:  # torch missing at build time (e.g. build isolation)
        print(f"moe_ops: not building the CPU kernel: cannot import torch.utils.cpp_extension ({e})", file=sys.stderr)
        return [], {}

    class OptionalBuildExtension(BuildExtension):
        """Builds the kernel; a failure (no compiler, ...) is reported and the install goes on."""

        def run(self):
            try:
                super().run()
            except Exception as e:  # compiler missing or unusable, compile error, ...
                print(f"moe_ops: WARNING: the CPU kernel moe_ops._cpu was not built ({type(e).__name__}: {e}); "
                      "the op will use the reference on CPU", file=sys.stderr)

    ext = CppExtension(
        "moe_ops._cpu",
        ["csrc/cpu/grouped_mm.cpp", "csrc/cpu/kernels_x86.cpp", "csrc/cpu/output_cache.cpp"],
        # -fopenmp: at::parallel_for is OpenMP in torch's CPU wheels and is inlined here; the
        # x86 kernels select their instruction set with a pragma and are used only after a
        # CPUID check, so the build needs no -march flag and runs on any x86-64.
        extra_compile_args=["-O3", "-fopenmp"],
        extra_link_args=["-fopenmp"],
    )
    return [ext], {"build_ext": OptionalBuildExtension}


ext_modules, cmdclass = _cpu_extension()

setup(
    name="moe_ops",
    version="0.1.0",
    description="torch.ops.moe.grouped_mm: one grouped-matmul op for MoE, a native kernel per device",
    packages=find_packages(include=["moe_ops", "moe_ops.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.9"],
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)

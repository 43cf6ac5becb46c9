"""moe_ops: one MoE grouped-matmul operator for PyTorch, a native kernel per device.

Install with ``pip install --no-build-isolation -e .`` so that native parts build against the
torch already installed (build isolation would fetch another torch and break the ABI).
"""

from setuptools import find_packages, setup

setup(
    name="moe_ops",
    version="0.1.0",
    description="torch.ops.moe.grouped_mm: one grouped-matmul op for MoE, a native kernel per device",
    packages=find_packages(include=["moe_ops", "moe_ops.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.9"],
)

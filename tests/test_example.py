"""The example MoE layer (eager, torch.compile, torch.export), the main command, and the README.

Categories: the example trains (loss goes down) eagerly and compiled with the op's kernel
serving every call; compiled and eager layers agree in value and gradient; torch.export keeps
moe.grouped_mm in the exported graph; ``python -m moe_ops`` reports every backend; the README's
Quickstart test command is the one .ci/run runs.
"""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import pytest
import torch

import moe_ops
from moe_ops.testing import backend_names

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("moe_layer", ROOT / "examples" / "moe_layer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _layer(example, seed=0):
    torch.manual_seed(seed)
    return example.MoEFeedForward(d_model=16, d_ff=24, n_experts=6, top_k=2)


@pytest.mark.parametrize("compile_", [False, True], ids=["eager", "compiled"])
def test_example_trains(example, compile_):
    torch._dynamo.reset()
    moe_ops.reset_kernel_counts()
    losses = example.train(_layer(example), steps=12, device="cpu", compile_=compile_, tokens=64)
    assert losses[-1] < 0.8 * losses[0], losses
    counts = moe_ops.kernel_counts()
    assert sum(counts.values()) == 12 * 5, counts  # 2 forward + 3 backward calls a step
    if torch._C._dispatch_has_kernel_for_dispatch_key("moe::grouped_mm", "CPU"):
        # The CPU backend's kernels serve them all (no call left to the reference).
        assert all(name.startswith("cpu:") for name in counts), counts


def test_compiled_layer_matches_eager(example):
    torch._dynamo.reset()
    layer = _layer(example, seed=1)
    x = torch.randn(40, 16)
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    got, want = compiled(x), layer(x)
    torch.testing.assert_close(got, want)
    g_got = torch.autograd.grad(got.square().sum(), list(layer.parameters()))
    g_want = torch.autograd.grad(want.square().sum(), list(layer.parameters()))
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b)


def test_export_keeps_the_op(example):
    layer = _layer(example, seed=2)
    x = torch.randn(32, 16)
    exported = torch.export.export(layer, (x,))
    targets = {n.target for n in exported.graph.nodes if n.op == "call_function"}
    assert torch.ops.moe.grouped_mm.default in targets
    torch.testing.assert_close(exported.module()(x), layer(x))


def test_main_command_reports_every_backend():
    out = subprocess.run([sys.executable, "-m", "moe_ops"], capture_output=True, text=True, check=True,
                         cwd=ROOT).stdout
    assert f"torch {torch.__version__}" in out
    for name in backend_names():
        assert f"\n{name} " in out, out


def test_readme_quickstart_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    block = readme.split("## Quickstart", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    test_command = [line for line in block.strip().splitlines() if "pytest" in line]
    assert len(test_command) == 1 and test_command[0] in ci.splitlines()

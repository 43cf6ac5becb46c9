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


def test_main_command_reports_keys_autograd_and_a_renamed_privateuse1():
    """`python -m moe_ops` names every dispatch key the op has a kernel for (XLA and PrivateUse1
    come from the routers of backends/__init__.py), the Autograd kernel, and a PrivateUse1 key
    renamed by a device runtime (here as TorchTPU would, to "tpu")."""
    code = ("import torch; torch.utils.rename_privateuse1_backend('tpu')\n"
            "import runpy; runpy.run_module('moe_ops', run_name='__main__')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT).stdout
    keys = next(line for line in out.splitlines() if line.startswith("moe::grouped_mm kernels"))
    listed = keys.split(": ", 1)[1].split(", ")
    for key in ("CompositeExplicitAutograd", "Autograd", "Meta", "CPU", "CUDA", "XLA",
                "PrivateUse1"):
        assert key in listed, keys
    assert f"Autograd kernel: {moe_ops._op.autograd_status()}" in out, out
    assert "PrivateUse1 renamed to 'tpu'" in out, out


def test_a_backend_that_fails_to_register_is_off_and_reported():
    """A backend whose register() raises (here every one, through stand-in modules: a broken
    optional toolchain must not break the package) is recorded as off, once: the import works,
    the reason is logged once, statuses() lists it as unable to run with the reason,
    backends.module() and run_backend raise BackendUnavailable naming it, `python -m moe_ops`
    shows it as "cannot run here", and CPU calls still compute (with the reference).
    Shapes: mat_a [6, 4], mat_b [2, 4, 3] float32, offs [2] int64."""
    code = (
        "import sys, types\n"
        "def broken(name):\n"
        "    m = types.ModuleType('moe_ops.backends.' + name)\n"
        "    def register():\n"
        "        raise RuntimeError(name + ' runtime is broken')\n"
        "    m.register = register\n"
        "    return m\n"
        "for n in ('cpu', 'cuda', 'tpu', 'neuron'):\n"
        "    sys.modules['moe_ops.backends.' + n] = broken(n)\n"
        "import torch, moe_ops, moe_ops.testing\n"
        "from moe_ops import backends\n"
        "for _ in range(2):\n"
        "    for s in backends.statuses():\n"
        "        print('STATUS', s.name, s.keys, s.mode, '|', s.detail)\n"
        "try:\n"
        "    backends.module('tpu')\n"
        "except backends.BackendUnavailable as e:\n"
        "    print('UNAVAILABLE', e)\n"
        "a, b, offs = torch.randn(6, 4), torch.randn(2, 4, 3), torch.tensor([2, 6])\n"
        "try:\n"
        "    moe_ops.testing.run_backend('cpu', a, b, offs)\n"
        "except backends.BackendUnavailable as e:\n"
        "    print('RUN_BACKEND', e)\n"
        "want = moe_ops.reference.grouped_mm(a, b, offs)\n"
        "torch.testing.assert_close(moe_ops.grouped_mm(a, b, offs), want)\n"
        "print('COUNTS', moe_ops.kernel_counts())\n"
        "import runpy; runpy.run_module('moe_ops', run_name='__main__')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr
    for name in backend_names()[1:]:
        reason = f"RuntimeError: {name} runtime is broken"
        assert r.stderr.count(f"backend {name} is off: {reason}") == 1, r.stderr  # logged once
        assert r.stdout.count(f"STATUS {name} () None | off: {reason}") == 2, r.stdout
        row = next(line for line in r.stdout.splitlines() if line.startswith(f"{name} "))
        assert row.split() == [name, "-", "cannot", "run", "here", "off:", "RuntimeError:", name,
                               "runtime", "is", "broken"], row
    unavailable = "UNAVAILABLE backend 'tpu' is off: RuntimeError: tpu runtime is broken"
    assert unavailable in r.stdout, r.stdout
    assert "RUN_BACKEND backend 'cpu' is off" in r.stdout, r.stdout
    assert "COUNTS {'reference': 1}" in r.stdout, r.stdout


def test_readme_quickstart_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    block = readme.split("## Quickstart", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    test_command = [line for line in block.strip().splitlines() if "pytest" in line]
    assert len(test_command) == 1 and test_command[0] in ci.splitlines()


_USER_SCRIPT = '''\
import torch
import moe_ops
from moe_ops.testing import assert_close, reference_results, run_backend

x, w = torch.randn(8, 4, dtype=torch.bfloat16), torch.randn(2, 4, 3, dtype=torch.bfloat16)
offs = torch.tensor([3, 8], dtype=torch.int32)
y: torch.Tensor = moe_ops.grouped_mm(x, w, offs, out_dtype=torch.float32)
with moe_ops.checked():
    r: torch.Tensor = moe_ops.reference.grouped_mm(x, w, offs)
assert_close(run_backend("cpu", x, w, offs), *reference_results(x, w, offs))
counts: dict[str, int] = moe_ops.kernel_counts()
released: int = moe_ops.empty_cpu_cache() + moe_ops.cpu_huge_pages(w)
moe_ops.grouped_mm(x, w, offs, out_dtype="float32")  # misuse: a string for a dtype
moe_ops.grouped_mm(x, w, offs=[3, 8])  # misuse: a list for offs
'''


@pytest.mark.outside_cpp
def test_the_package_is_typed_for_its_users(tmp_path, source_tree):
    """moe_ops ships py.typed (PEP 561), so type checkers read its annotations: the wheel holds the
    marker (built without the C++ modules from a copy of the tree), mypy finds no error in the
    package (every module, the backends' kernels included, with pyproject.toml's [tool.mypy]:
    function bodies checked whether annotated or not) nor in examples/, and in a script that uses
    the API as documented it flags exactly the two misuses (a str for out_dtype, a list for offs)."""
    pytest.importorskip("mypy", reason="mypy is not installed (pip install -r requirements-test.txt)")
    import os
    import zipfile

    r = subprocess.run([sys.executable, "setup.py", "-q", "bdist_wheel", "--dist-dir", str(tmp_path / "dist")],
                       capture_output=True, text=True, timeout=300, cwd=source_tree,
                       env={**os.environ, "MOE_OPS_NO_EXTENSION": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").iterdir()
    assert "moe_ops/py.typed" in zipfile.ZipFile(wheel).namelist()

    script = tmp_path / "user.py"
    script.write_text(_USER_SCRIPT)
    # The package, the examples and the script in one run, in the checkout (where mypy finds
    # moe_ops: an editable install hides it from mypy): no error but the script's two.
    args = ["--cache-dir", str(tmp_path / "mypy_cache"), "--follow-imports=silent", "--no-error-summary"]
    r = subprocess.run([sys.executable, "-m", "mypy", *args, "moe_ops", "examples", str(script)], capture_output=True,
                       text=True, timeout=600, cwd=ROOT)
    out = r.stdout + r.stderr
    errors = [line for line in out.splitlines() if ": error:" in line]
    assert [line.split(":")[:2] for line in errors] == [[str(script), "13"], [str(script), "14"]], out
    assert "out_dtype" in errors[0] and "offs" in errors[1], out

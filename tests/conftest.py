"""Shared fixtures: hypothesis profiles, and the implementations every property test runs over.

Profiles: "ci" (default; derandomized, no example database, no deadline) and "dev" (more
examples, random), picked with HYPOTHESIS_PROFILE=dev.

Implementations: every backend in ``moe_ops.testing.backend_names()`` run on CPU tensors
through ``run_backend`` (natively, in its vendor's interpreter, or on our emulator), plus the
reference's sync-free formulation, plus the op itself on each accelerator present. A backend
that cannot run here is skipped with a reason that names what is missing; set
MOE_OPS_REQUIRE_BACKENDS=cpu,cuda,... (as CI does) to turn such a skip into a failure.

Autograd: tests that take the ``autograd_kernel`` fixture run against both Autograd kernels of
the op, the C++ one (moe_ops._autograd, the default when it loads) and the Python one. The C++
one is skipped when it cannot load; where MOE_OPS_REQUIRE_BACKENDS names cpu that skip is a
failure (the build that makes the CPU kernel makes both C++ modules).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from hypothesis import HealthCheck, settings

import moe_ops
from moe_ops import _contract, _op, backends, reference
from moe_ops.testing import run_backend
from strategies import DTYPES, LAYOUTS

_suppress = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture]
settings.register_profile("ci", derandomize=True, database=None, deadline=None, max_examples=60,
                          suppress_health_check=_suppress, print_blob=True)
settings.register_profile("dev", deadline=None, max_examples=400, suppress_health_check=_suppress,
                          print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


class Impl:
    """One way of computing grouped_mm in the test suite.

    cost: "cheap" for native code, "slow" for interpreters and emulators, whose property tests
    draw fewer examples (a Triton interpreter program costs ~5 ms). layouts / dtypes: what the
    implementation serves (a backend module may narrow them with LAYOUTS / DTYPES); the property
    tests draw only those, and a NotImplementedError for them is a failure.
    """

    def __init__(self, name, fn, cost="cheap", device="cpu", layouts=LAYOUTS, dtypes=DTYPES):
        self.name, self.fn, self.cost, self.device = name, fn, cost, device
        self.layouts, self.dtypes = tuple(layouts), tuple(dtypes)

    def __call__(self, mat_a, mat_b, offs=None, bias=None, out_dtype=None, *, check_offs=True):
        return self.fn(mat_a, mat_b, offs, bias, out_dtype, check_offs)

    def __repr__(self):
        return self.name


def _backend_impl(name):
    def fn(a, b, offs, bias, out_dtype, check_offs):
        return run_backend(name, a, b, offs, bias, out_dtype, check_offs=check_offs)
    return fn


def _sync_free(a, b, offs, bias, out_dtype, check_offs):
    if check_offs and offs is not None:
        _contract.check_offs_values(offs, _contract.check_args(a, b, offs, bias, out_dtype).extent)
    return reference.grouped_mm_sync_free(a, b, offs, bias, out_dtype)


def _on_device(device):
    def fn(a, b, offs, bias, out_dtype, check_offs):
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        with moe_ops.checked(check_offs):
            out = moe_ops.grouped_mm(move(a), move(b), move(offs), move(bias), out_dtype)
        return out.cpu()
    return fn


def _required() -> set:
    return {n for n in os.environ.get("MOE_OPS_REQUIRE_BACKENDS", "").split(",") if n}


def _autograd_for_test(kind):
    """Registers the op's Autograd kernel `kind` for a test, and the one before it afterwards."""
    before = _op._Autograd.active
    try:
        _op.use_autograd(kind)
    except RuntimeError as e:
        if "cpu" in _required():
            pytest.fail(f"{e}; MOE_OPS_REQUIRE_BACKENDS=cpu requires the C++ modules")
        pytest.skip(f"the C++ Autograd kernel cannot run here: {e}")
    yield kind
    _op.use_autograd(before)


@pytest.fixture(params=["cpp", "python"])
def autograd_kernel(request):
    """Each Autograd kernel of the op in turn, "cpp" and "python"."""
    yield from _autograd_for_test(request.param)


@pytest.fixture
def cpp_autograd():
    """The C++ Autograd kernel (a test about it)."""
    yield from _autograd_for_test("cpp")


@pytest.fixture
def unwritten_outputs_are_nan():
    """The test under torch.use_deterministic_algorithms(True), whose fill_uninitialized_memory
    makes new outputs NaN (torch.empty, and the C++ CPU kernel's csrc/cpu/output_cache.cpp
    new_output): every element of an output must be written, and one a kernel misses must fail
    the test rather than pass with what an earlier call of the same size left in the memory
    (malloc and the output cache hand it back: a kernel that dropped rows 8-16 of its groups
    passed tests/test_cpu.py's bf16 cases that way, the AVX2 level having filled the buffer)."""
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)


@pytest.fixture
def source_tree(tmp_path):
    """A copy of the repository's sources (no git data, virtual environments, build outputs or
    compiled modules) under tmp_path, for tests that run setup.py: its build, sdist and wheel
    write their outputs next to setup.py, which here is not the checkout."""
    import shutil

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tree = tmp_path / "tree"
    skip = shutil.ignore_patterns(".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", "*.so",
                                  ".hypothesis", ".pytest_cache", "bench-out")
    shutil.copytree(root, tree, ignore=skip)
    return tree


def implementations():
    """pytest params, one per implementation; unavailable ones carry a skip mark with the reason."""
    status = {s.name: s for s in backends.statuses()}
    params = [pytest.param(Impl("reference", _backend_impl("reference")), id="reference"),
              pytest.param(Impl("reference-sync-free", _sync_free), id="reference-sync-free")]
    for name in backends.BACKEND_MODULES:
        s = status[name]
        marks = [getattr(pytest.mark, f"backend_{name}")]
        if s.mode is None:
            marks.append(pytest.mark.skip(reason=f"backend {name} cannot run here: {s.detail}"))
        cost = "cheap" if s.mode == "native" else "slow"
        module = backends.module(name) if s.mode is not None else None
        impl = Impl(name, _backend_impl(name), cost,
                    layouts=getattr(module, "LAYOUTS", LAYOUTS), dtypes=getattr(module, "DTYPES", DTYPES))
        params.append(pytest.param(impl, id=name, marks=marks))
    if torch.cuda.is_available():
        params.append(pytest.param(Impl("op@cuda", _on_device("cuda"), device="cuda"), id="op@cuda"))
    return params


def pytest_collection_finish(session):
    """The deviceless TPU compiles of test_tpu_mosaic.py start once the session is known to run
    one of its tests (see its start_workers)."""
    if session.config.option.collectonly:
        return
    module = next((i.module for i in session.items if i.module.__name__ == "test_tpu_mosaic"), None)
    if module is not None:
        module.start_workers(early=True)


def pytest_sessionfinish(session):
    module = sys.modules.get("test_tpu_mosaic")
    if module is not None:  # a session stopped early (-x, Ctrl-C) leaves no compile running
        module.stop_workers()


def pytest_configure(config):
    for name in backends.BACKEND_MODULES:
        config.addinivalue_line("markers", f"backend_{name}: tests of the {name} backend")
    missing = [f"{s.name} ({s.detail})" for s in backends.statuses() if s.name in _required() and s.mode is None]
    unknown = _required() - set(backends.BACKEND_MODULES)
    if missing or unknown:
        raise pytest.UsageError(
            "MOE_OPS_REQUIRE_BACKENDS names backends that cannot run here: "
            + "; ".join(missing + [f"{u} (unknown)" for u in sorted(unknown)])
        )

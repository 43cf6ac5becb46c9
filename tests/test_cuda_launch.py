"""The CUDA backend's opt-in launch cache (``triton_kernels._launch``), checked without a GPU.

A compiled kernel is reused for a later launch when ``specialization_key`` of the runtime
arguments is equal, and its launcher is then called with ``launch_arguments``, without asking
Triton. That is right only if
* the key determines Triton's own specialization (the argument types and attributes its cache
  key is made of): Triton's binder for the cuda target (what ``kernel[grid](...)`` runs on every
  launch) specializes argument tuples drawn around every boundary Triton distinguishes, and no
  key may get two specializations; a Triton that starts to specialize on something more fails;
* the arguments are the ones Triton's run passes its launcher (its binder's bound arguments, in
  order, constexpr defaults included);
* launch hooks (profilers) are seen: then every launch goes through Triton.
On a GPU, tests/test_cuda_device.py runs the cache itself.
"""

from __future__ import annotations

import random

import pytest
import torch

tk = pytest.importorskip("moe_ops.backends.cuda.triton_kernels", reason="triton is not installed (pip install triton==3.9.0)")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

# Integers on each side of what Triton looks at: 1, multiples of 16, the int32 and int64 ranges.
INTS = (0, 1, 2, 8, 15, 16, 17, 24, 48, 4096, 14336, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, 2**32, 2**40 + 3,
        2**63 - 16, 2**63 - 1, 2**63, 2**63 + 1, 2**64 - 16)
DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int32, torch.int64)


def _binder(kernel):
    return create_function_from_signature(kernel.signature, kernel.params, make_backend(GPUTarget("cuda", 90, 32)))


def _tensor(rng, storage):
    """A view of ``storage`` (bytes) in one of DTYPES, at an element offset that keeps or breaks
    16-byte alignment."""
    dtype = rng.choice(DTYPES)
    flat = storage.view(dtype)
    return flat[rng.choice((0, 1, 2, 4, 8, 16))]


@pytest.mark.parametrize("name", ["_rows_kernel", "_ragged_k_kernel"])
def test_specialization_key_determines_tritons_specialization(name):
    kernel = getattr(tk, name)
    binder = _binder(kernel)
    runtime = [p for p in kernel.params if not p.is_constexpr]
    pointers = [p.name for p in runtime if p.name.endswith("_ptr")]
    storage = torch.zeros(1024, dtype=torch.uint8)
    constexprs = {p.name: 1 for p in kernel.params if p.is_constexpr}
    rng = random.Random(0)
    # Both specialize argument by argument, so the check is per argument: (position, its key)
    # -> its Triton specialization must be a function. (Whole tuples of 16-21 arguments would
    # almost never repeat a key, and the check would pass whatever the key.)
    seen: dict = {}
    for _ in range(300):
        args = tuple(_tensor(rng, storage) if p.name in pointers else rng.choice(INTS) for p in runtime)
        _, specialization, _ = binder(*args, **constexprs)
        for i, (key, spec) in enumerate(zip(tk.specialization_key(args), specialization)):
            assert seen.setdefault((i, key), spec) == spec, (
                f"{name}, argument {runtime[i].name}: one key {key}, two Triton specializations "
                f"{seen[(i, key)]} and {spec}")
    # Every argument was drawn on both sides of the boundaries: each int argument took 7 keys
    # (1; multiple of 16 or not, in int32, int64 and uint64), each pointer 2 alignments x 6 dtypes.
    per_arg = {runtime[i].name: sum(1 for (j, _) in seen if j == i) for i in range(len(runtime))}
    assert all(n == (12 if arg in pointers else 7) for arg, n in per_arg.items()), per_arg


def test_specialization_key_tells_apart_what_triton_does():
    """Arguments Triton compiles differently get different keys (the cache would otherwise launch
    a kernel built for another alignment, width or unit stride)."""
    storage = torch.zeros(256, dtype=torch.uint8)
    aligned, shifted = storage.view(torch.bfloat16)[0], storage.view(torch.bfloat16)[1]
    keys = [tk.specialization_key(args) for args in (
        (aligned, 16), (shifted, 16), (aligned.view(torch.float16), 16), (aligned, 1), (aligned, 17),
        (aligned, 2**31), (aligned, 2**63))]
    assert len(set(keys)) == len(keys)


@pytest.mark.parametrize("name", ["_rows_kernel", "_ragged_k_kernel"])
def test_launch_arguments_are_what_tritons_run_passes(name):
    kernel = getattr(tk, name)
    binder = _binder(kernel)
    runtime = [p for p in kernel.params if not p.is_constexpr]
    storage = torch.zeros(64, dtype=torch.uint8)
    args = tuple(storage.view(torch.bfloat16)[:4] if p.name.endswith("_ptr") else 16 + i for i, p in enumerate(runtime))
    given = {p.name: f"value of {p.name}" for p in kernel.params if p.is_constexpr}
    for meta in (given, {k: v for k, v in given.items() if k not in ("TMA", "B_K_CONTIGUOUS")}):
        bound, _, _ = binder(*args, **meta)
        assert tk.launch_arguments(kernel, args, {**meta, "num_warps": 4}) == list(bound.values())


def test_descriptors_take_tritons_path():
    from triton.tools.tensor_descriptor import TensorDescriptor

    a = torch.zeros(32, 32, dtype=torch.bfloat16)
    assert tk.specialization_key((TensorDescriptor(a, [32, 32], [32, 1], [16, 16]), a, 16)) is None


def test_launch_hooks_are_seen():
    import triton

    knobs = triton.knobs
    assert not tk._hooks_set(knobs), "a fresh triton has no launch hooks"
    hook = lambda *args: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert tk._hooks_set(knobs)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert not tk._hooks_set(knobs)

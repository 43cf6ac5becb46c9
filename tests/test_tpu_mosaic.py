"""Real Mosaic compiles of the TPU kernels for TPU v5e, v6e and v4, without a TPU.

libtpu (``pip install "jax[tpu]==0.10.2"``) compiles for a deviceless topology
(``jax.experimental.topologies.get_topology_desc``): ``jit(...).trace(...).lower().compile()``
runs the Mosaic compiler for that chip, which rejects a kernel whose buffers do not fit the
scoped VMEM limit. This is "compiled for the target ISA", not run: nothing executes.

Categories:
* every tile configuration that ``choose_tiles`` picks for MoE layers shaped like Mixtral 8x7B,
  DeepSeek-V3 and Qwen3-30B-A3B (forward up/down projections with bias, input gradient with the
  weights read transposed, weight gradient with the activations read transposed; bf16, and
  fp32 for one model on v5e) compiles for each generation;
* ``vmem_bytes`` is Mosaic's own count: an oversized configuration fails, and the size Mosaic
  reports is ours (on v4, where the limit is the whole VMEM, XLA adds register-allocator spill
  slots: 1.2-2.5 MiB for such tiles, which the budget's spare quarter covers).

Compiles run in one subprocess per generation, the three at once, started when the session has
collected these tests, with a timeout (one oversized compile was seen to take 198 s; these take
0.5-8 s each alone).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

TOPOLOGIES = {"v5e": "v5e:2x2", "v6e": "v6e:2x2", "v4": "v4:2x2x1"}

# name: (rows = tokens x top_k, d_model, d_ff of one expert, experts), 4096 tokens per chip.
MOE_SHAPES = {
    "mixtral-8x7b": (4096 * 2, 4096, 14336, 8),
    "deepseek-v3": (4096 * 8, 7168, 2048, 256),
    "qwen3-30b-a3b": (4096 * 8, 2048, 768, 128),
}

_WORKER = r"""
import functools, json, re, sys, time
import jax, jax.numpy as jnp
from jax.experimental import topologies
from moe_ops.backends import tpu_pallas as tp

generation, topology, shapes = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
device = topologies.get_topology_desc(topology, "tpu").devices[0]
sharding = jax.sharding.SingleDeviceSharding(device)
S = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)


def compile_one(kind, m, k, n, G, dt, transposed, bias, tiles):
    if kind == "gmm":
        f = functools.partial(tp.gmm, tiles=tiles, transpose_b=transposed, generation=generation)
        args = (S((m, k), dt), S((G, n, k) if transposed else (G, k, n), dt), S((G,), jnp.int32),
                S((G, n), dt) if bias else None)
    else:
        f = functools.partial(tp.tgmm, tiles=tiles, transpose_a=transposed, generation=generation)
        args = (S((k, m) if transposed else (m, k), dt), S((k, n), dt), S((G,), jnp.int32))
    # CPU seconds, not wall: the worker may wait at nice 19 behind other tests (start_workers).
    t = time.process_time()
    try:
        jax.jit(f).trace(*args).lower().compile()
        error = None
    except Exception as e:
        error = str(e)
    return error, time.process_time() - t


seen = set()
for name, (M, D, F, G), dtype in shapes:
    dt = jnp.dtype(dtype)
    for what, kind, (m, k, n), transposed, bias in (
        ("up", "gmm", (M, D, F), False, False),
        ("down+bias", "gmm", (M, F, D), False, True),
        ("d_input", "gmm", (M, F, D), True, False),
        ("d_weight", "tgmm", (D, M, F), True, False),
    ):
        tiles = tp.choose_tiles(kind, m, k, n, G, dt, dt, generation, bias)
        key = (kind, tiles, dtype, transposed, bias, k % tiles.tk > 0)
        if key in seen:
            continue
        seen.add(key)
        error, seconds = compile_one(kind, m, k, n, G, dt, transposed, bias, tiles)
        print(json.dumps(dict(case=f"{name} {what} {dtype}", tiles=[tiles.tm, tiles.tk, tiles.tn],
                              vmem=tp.vmem_bytes(kind, tiles, dt.itemsize, dt.itemsize, bias),
                              seconds=round(seconds, 2), error=error)), flush=True)

# One configuration over the limit: Mosaic must refuse it and report our byte count.
limit = tp.GENERATIONS[generation].vmem_limit
tiles = tp.Tiles(1024, 1024, 2048) if limit <= 16 << 20 else tp.Tiles(1024, 2048, 2048)
need = tp.vmem_bytes("gmm", tiles, 2, 2)
error, seconds = compile_one("gmm", 4 * tiles.tm, 2 * tiles.tk, 2 * tiles.tn, 4, jnp.dtype("bfloat16"),
                             False, False, tiles)
# Where the limit is below the capacity (v5e, v6e) Mosaic reports its scoped allocation; where
# they are equal (v4) XLA lists the allocations, ours plus register-allocator spill slots.
scoped = re.search(r"Scoped allocation with size ([0-9.]+)M", error or "")
if scoped:
    reported = float(scoped.group(1))
else:
    parts = re.split(r"\n\s*\d+\. Size: ", error or "")[1:]
    reported = sum(float(p.split("M", 1)[0]) for p in parts if "spill" not in p) if parts else None
print(json.dumps(dict(oversized=[tiles.tm, tiles.tk, tiles.tn], need=need, limit=limit,
                      reported=None if reported is None else reported * (1 << 20),
                      seconds=round(seconds, 2), error=None if error is None else error[:400])), flush=True)
"""


def _require_libtpu():
    if importlib.util.find_spec("libtpu") is not None:
        return
    reason = 'libtpu not installed (pip install "jax[tpu]==0.10.2"): no Mosaic compiler'
    if "tpu" in os.environ.get("MOE_OPS_REQUIRE_BACKENDS", "").split(","):
        pytest.fail(reason + "; MOE_OPS_REQUIRE_BACKENDS requires the tpu backend")
    pytest.skip(reason)


_procs: dict = {}


def start_workers(early=False):
    """Starts one worker per generation, all at once, unless started: each is mostly one core's
    work for ~20-50 s (jax's import, then compiles), 145 s of CPU for the three. conftest.py calls
    this (early) as soon as the session has collected a test of this file: then they start at
    nice 19, to run in the cycles the other tests leave idle (the suite keeps ~1.3 of 2 cores
    busy) instead of the suite waiting for them here (~90 s on a Zen 3 VM), and get their
    priority back (where the OS lets us raise it) when the tests reach them. At normal priority
    from the start, the three slowed the tests beside them by as much as they saved. Their
    processes, by generation; none without libtpu."""
    if not _procs and importlib.util.find_spec("libtpu") is not None:
        # The compile needs no TPU runtime. TPU_SKIP_MDS_QUERY keeps libtpu off the cloud metadata
        # server; ALLOW_MULTIPLE_LIBTPU_LOAD lets it load although this pytest process, whose jax
        # initialised every platform, holds libtpu's lockfile (and so do the other workers).
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "TPU_SKIP_MDS_QUERY": "1", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
        for generation, topology in TOPOLOGIES.items():
            shapes = [[name, shape, "bfloat16"] for name, shape in MOE_SHAPES.items()]
            if generation == "v5e":  # fp32 (6-pass bf16 matmuls) for one model on one chip: ~4 s a compile
                shapes.append(["qwen3-30b-a3b", MOE_SHAPES["qwen3-30b-a3b"], "float32"])
            _procs[generation] = subprocess.Popen(
                [sys.executable, "-c", _WORKER, generation, topology, json.dumps(shapes)], stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True, env=env, preexec_fn=(lambda: os.nice(19)) if early else None)
    elif not early:
        for p in _procs.values():
            try:
                os.setpriority(os.PRIO_PROCESS, p.pid, 0)
            except OSError:  # not ours to raise (no CAP_SYS_NICE), or already ended
                pass
    return _procs


def stop_workers():
    """Ends the workers (at this file's end, or the session's where it stopped before)."""
    for p in _procs.values():
        p.kill()
        p.communicate()
    _procs.clear()


@pytest.fixture(scope="module")
def workers():
    """The workers' processes, by generation (started here where conftest.py did not)."""
    _require_libtpu()
    yield start_workers()
    stop_workers()


@pytest.fixture(scope="module", params=list(TOPOLOGIES))
def compiled(request, workers):
    """The worker's JSON lines for one generation."""
    generation = request.param
    proc = workers[generation]
    try:
        stdout, stderr = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        pytest.fail(f"worker for {generation} ran past 600 s:\n{stderr[-3000:]}")
    lines = [json.loads(x) for x in stdout.splitlines() if x.startswith("{")]
    assert proc.returncode == 0 and lines, f"worker failed for {generation}:\n{stderr[-3000:]}"
    return generation, lines


def test_picked_tiles_compile_for_target(compiled):
    generation, lines = compiled
    cases = [x for x in lines if "case" in x]
    assert len(cases) >= 12
    failed = [f"{x['case']} tiles={x['tiles']}: {x['error'][:300]}" for x in cases if x["error"]]
    assert not failed, f"{generation}: configurations the tiling function picked do not compile:\n" + "\n".join(failed)
    slow = [x for x in cases if x["seconds"] > 60]
    assert not slow, f"{generation}: compiles over 60 s of CPU: {slow}"


def test_vmem_count_is_mosaics(compiled):
    generation, lines = compiled
    over = next(x for x in lines if "oversized" in x)
    assert over["error"] is not None and "vmem" in over["error"].lower(), (
        f"{generation}: tiles {over['oversized']} ({over['need']} bytes > limit {over['limit']}) compiled")
    # Mosaic prints MiB with two decimals.
    assert over["reported"] is not None and abs(over["reported"] - over["need"]) < 0.01 * (1 << 20), (
        f"{generation}: Mosaic counted {over['reported']} bytes, we {over['need']}")

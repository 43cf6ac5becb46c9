"""benchmarks/gpu_check.py without a GPU: it imports, parses its arguments, builds its cases and
group sizes, and refuses to report anything when there is no CUDA device; gpu_overhead.py and
gpu_tile_sweep.py refuse with a reason too.

The GPU phases themselves (suite on the device, benchmarks) run only on a CUDA machine.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_arguments(gpu_check, tmp_path):
    args = gpu_check.parse_args(["--out", str(tmp_path), "--models", "qwen3-30b-a3b", "--tokens", "4096,8192"])
    assert args.models == ["qwen3-30b-a3b"] and args.tokens == [4096, 8192] and args.budget_s < 300
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--models", "gpt-5"])
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--tokens", "1000"])  # not a multiple of 16


def test_cases_cover_every_model_at_every_size(gpu_check):
    cases = gpu_check.cases(list(gpu_check.MODELS), list(gpu_check.TOKENS))
    assert len(cases) == 9
    assert {(c["model"], c["M"]) for c in cases} == {(m, t) for m in gpu_check.MODELS for t in (4096, 16384, 65536)}
    assert [c["M"] for c in cases[:3]] == [16384] * 3  # every model before the largest sizes
    deepseek = next(c for c in cases if c["model"] == "deepseek-v3")
    assert (deepseek["G"], deepseek["K"], deepseek["N"]) == (256, 7168, 2048)


@pytest.mark.parametrize("M,G", [(4096, 256), (16384, 8), (65536, 128), (16, 3)])
def test_group_sizes(gpu_check, M, G):
    sizes = gpu_check.group_sizes(M, G, seed=3)
    assert len(sizes) == G and sum(sizes) == M
    assert all(s >= 0 and s % 16 == 0 for s in sizes)
    assert sizes == gpu_check.group_sizes(M, G, seed=3)
    if G == 256:
        assert sizes.count(0) > 0  # 256 experts over 256 units of 16 rows: some get none


def test_flops(gpu_check):
    case = dict(model="x", G=8, K=4096, N=14336, M=4096)
    assert gpu_check.flops(case, "forward") == 2 * 4096 * 4096 * 14336
    assert gpu_check.flops(case, "backward") == 3 * gpu_check.flops(case, "forward")


def test_list_needs_no_gpu(gpu_check, capsys):
    assert gpu_check.main(["--list"]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 9


@pytest.mark.skipif(torch.cuda.is_available(), reason="describes a machine without a CUDA device")
def test_without_a_gpu_it_reports_nothing_measured(gpu_check, tmp_path):
    assert gpu_check.main(["--out", str(tmp_path)]) == 2
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert data["error"].startswith("no CUDA device")
    assert data["environment"]["cuda_available"] is False
    assert "benchmarks" not in data and "suite" not in data


def test_goals_are_read_from_speedups(gpu_check):
    result = dict(model="deepseek-v3", M=4096, G=256, speedup_vs={
        "dense_torch.mm": {"forward": 0.8, "backward": 0.6},
        "torch._grouped_mm": {"forward": 1.1, "backward": 0.9},
        "loop_torch.mm": {"forward": 1.2, "backward": 2.0}})
    assert gpu_check.goals([result])["deepseek-v3@4096"] == {
        "forward >= 70% of dense": True, "forward not slower than _grouped_mm": True,
        "backward not slower than _grouped_mm": False, "forward >= 1.5x loop": False}


def test_pytest_plugin_hook_sets_the_example_budget(gpu_check, monkeypatch):
    from hypothesis import settings

    monkeypatch.setenv("MOE_OPS_GPU_CHECK_EXAMPLES", "7")
    # The settings in force before, restored exactly: this test runs inside gpu_check.py's own
    # suite too, where loading "ci" here gave every later test 60 examples instead of its budget.
    before = settings()
    try:
        gpu_check.pytest_configure(None)
        assert settings().max_examples == 7
        assert settings().derandomize == settings.get_profile("ci").derandomize
    finally:
        settings.register_profile("before-gpu-check-test", before)
        settings.load_profile("before-gpu-check-test")
    assert settings().max_examples == before.max_examples


def test_benchmark_code_path_runs_on_cpu_tensors(gpu_check):
    """The benchmark body on a tiny CPU problem, so that a Python error cannot waste the blind GPU
    run. The numbers are CPU wall-clock times of the reference and are not reported anywhere."""
    result = gpu_check.bench_case(dict(model="tiny", G=4, K=32, N=48, M=64), device="cpu", budget_s=0.01)
    assert set(result["impls"]) == {"moe_ops", "torch._grouped_mm", "loop_torch.mm", "dense_torch.mm"}
    ours = result["impls"]["moe_ops"]
    assert "error" not in ours, ours
    assert ours["correct"] and ours["forward_ms"] > 0 and ours["forward_backward_ms"] > 0
    assert set(result["speedup_vs"]["loop_torch.mm"]) == {"forward", "backward"}
    assert result["group_sizes"]["min"] >= 0 and result["moe_ops_kernels"]
    json.dumps(result)


def test_errors_in_chunks_and_the_deadline(gpu_check):
    """The relative error is computed a chunk at a time (whole fp32 copies of DeepSeek-V3's weight
    gradient do not fit on an 80 GB GPU), and past the deadline no implementation starts."""
    x, ref = torch.randn(1000), torch.randn(1000)
    whole = float((x - ref).abs().max() / ref.abs().max())
    assert gpu_check._rel_err(x, ref, chunk=7) == pytest.approx(whole, rel=1e-6)
    result = gpu_check.bench_case(dict(model="tiny", G=4, K=32, N=48, M=64), device="cpu", budget_s=0.01,
                                  deadline=0.0)
    assert all(e == {"error": "not run: the time budget was spent"} for e in result["impls"].values())


def test_variants_are_timed_beside_the_default_and_restored(gpu_check, monkeypatch):
    """--variants: each opt-in is one more implementation, checked and timed in the same run, and
    the environment and launch cache are as before afterwards."""
    tk = pytest.importorskip("moe_ops.backends.cuda.triton_kernels", reason="triton is not installed")
    monkeypatch.delenv("MOE_OPS_CUDA_TMA", raising=False)
    cache_before = tk._launch_cache_on
    result = gpu_check.bench_case(dict(model="tiny", G=4, K=32, N=48, M=64), device="cpu", budget_s=0.01,
                                  variants=list(gpu_check.VARIANTS))
    for v in gpu_check.VARIANTS:
        entry = result["impls"][f"moe_ops ({v})"]
        assert "error" not in entry and entry["correct"], entry
        assert set(result["variant_speedup"][v]) == {"forward", "backward"}
    assert "MOE_OPS_CUDA_TMA" not in os.environ and tk._launch_cache_on == cache_before
    with gpu_check.variant("tma+launch-cache"):
        assert os.environ["MOE_OPS_CUDA_TMA"] == "1" and tk._launch_cache_on
    assert "MOE_OPS_CUDA_TMA" not in os.environ and tk._launch_cache_on == cache_before
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--variants", "no-such-opt-in"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a CUDA device")
@pytest.mark.parametrize("script", ["gpu_overhead.py", "gpu_tile_sweep.py"])
def test_the_other_gpu_scripts_refuse_without_a_gpu(script, tmp_path):
    # They import moe_ops from the checkout, as on the lent machine, and exit 2 with a reason.
    spec = importlib.util.spec_from_file_location(script[:-3], _PATH.parent / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--out", str(tmp_path)]) == 2
    assert not any(tmp_path.iterdir())


def test_a_nan_result_is_wrong(gpu_check):
    """A NaN anywhere in the result (in any chunk) is an infinite error, so that both the check's
    ``< 2e-2`` and gpu_tile_sweep's ``> 2e-2`` call it wrong: Python's max(err, nan) keeps err,
    and a result full of NaN was reported exact. x, ref: [1000] fp32."""
    ref = torch.randn(1000)
    for where in (slice(None), slice(0, 1), slice(500, 501), slice(999, None)):
        x = ref.clone()
        x[where] = float("nan")
        assert gpu_check._rel_err(x, ref, chunk=7) == float("inf"), where
        assert gpu_check._rel_err(ref, x, chunk=7) == float("inf"), where


def test_a_wrong_result_gets_no_speedups(gpu_check, monkeypatch):
    """The op's time does not count when its result failed the check: no speedup_vs, and goals()
    says "moe_ops correct": False instead of reporting issue #3's targets as met. Tiny CPU case,
    bf16; the op's result doubled stands for a wrong kernel."""
    import moe_ops

    real = moe_ops.grouped_mm
    monkeypatch.setattr(moe_ops, "grouped_mm", lambda *args, **kw: real(*args, **kw) * 2)
    case = dict(model="deepseek-v3", G=4, K=32, N=48, M=64)
    result = gpu_check.bench_case(case, device="cpu", budget_s=0.01)
    assert result["impls"]["moe_ops"]["correct"] is False
    assert "speedup_vs" not in result
    assert gpu_check.goals([result]) == {"deepseek-v3@64": {"moe_ops correct": False}}

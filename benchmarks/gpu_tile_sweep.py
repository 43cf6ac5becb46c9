"""Time the Triton kernels under candidate tile configurations on MoE shapes (a CUDA GPU only).

    python3 benchmarks/gpu_tile_sweep.py --out DIR [--budget-s 120]

This is the measurement behind ``tile_config`` in moe_ops/backends/cuda/triton_kernels.py. For
the MoE expert GEMMs of benchmarks/gpu_check.py (Mixtral 8x7B, DeepSeek-V3, Qwen3-30B-A3B) and
each direction (forward 2Dx3D; input gradient, 2Dx3D with mat_b a transposed [G, N, K] view;
weight gradient, 2Dx2D ragged over M), it times the heuristic's choice, every candidate of
CANDIDATES, on sm_90+ each of those again with TMA operand copies (``--no-tma`` leaves them
out; the forward and input gradient only), and torch._grouped_mm on the same bf16 tensors (CUDA events, median of batches), and
writes ``tile_sweep.json`` after every shape, so a run cut short keeps what it measured. Every
configuration's result is compared with a loop of torch.mm before it is timed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402

from gpu_check import MODELS, REL_ERR_LIMIT, _rel_err, _time_ms, group_sizes, moe_ops_env  # noqa: E402
from moe_ops import _contract  # noqa: E402

# (BM, BN, BK, num_warps, num_stages, programs_per_sm): around the heuristic's sm_90 choices
# (128x256x64 / 8 warps; 64x128x64 / 4 warps for groups under 64 rows).
CANDIDATES = [
    (128, 256, 64, 8, 3, 1),
    (128, 128, 64, 8, 4, 1),
    (128, 128, 64, 4, 4, 1),
    (128, 128, 64, 4, 3, 2),
    (64, 128, 64, 4, 4, 2),
    (64, 256, 64, 4, 3, 1),
    (128, 64, 64, 4, 4, 2),
    (256, 128, 64, 8, 3, 1),
]


def time_ms(fn) -> float:
    """Median ms of one call: gpu_check's CUDA-event timing of batches of calls."""
    return _time_ms(fn, torch.device("cuda"), budget_s=0.3)


def loop_reference(a, b, offs):
    """One torch.mm per group (host-side bounds: this is a benchmark, a sync is fine)."""
    ends = offs.tolist()
    bounds = list(zip([0] + ends[:-1], ends))
    if b.dim() == 3:
        return torch.cat([a[s:e] @ b[g] for g, (s, e) in enumerate(bounds)])
    return torch.stack([a[:, s:e] @ b[s:e] for s, e in bounds])


def time_grouped_mm(a, b, offs):
    """torch._grouped_mm's time on the first operand layout it takes: as given, then with
    row-major mat_a and column-major mat_b, then both row-major (copies made outside timing)."""
    variants = {"as given": (a, b), "a row-major, b column-major": (a.contiguous(), b.mT.contiguous().mT),
                "both row-major": (a.contiguous(), b.contiguous())}
    errors = []
    for name, (x, y) in variants.items():
        try:
            torch._grouped_mm(x, y, offs=offs)
        except Exception as e:
            errors.append(f"{name}: {type(e).__name__}: {e}"[:200])
            continue
        return time_ms(lambda: torch._grouped_mm(x, y, offs=offs)), name
    return None, errors


def measure_config(entry: dict, run, ref, grouped_mm_ms) -> None:
    """One configuration into entry: run()'s result checked against ref (rel_err; over REL_ERR_LIMIT, or
    NaN, is "wrong result" and is not timed), then its time "ms" and "vs_grouped_mm",
    torch._grouped_mm's time over it (> 1: faster than torch._grouped_mm)."""
    err = _rel_err(run(), ref)  # in chunks: DeepSeek-V3's weight gradient is 7 GiB in bf16
    entry["rel_err"] = err
    if err > REL_ERR_LIMIT:
        entry["error"] = "wrong result"
        return
    entry["ms"] = time_ms(run)
    if grouped_mm_ms:
        entry["vs_grouped_mm"] = grouped_mm_ms / entry["ms"]


def best(row: dict) -> dict:
    """row["best"]: the fastest timed configuration of row["configs"]; returns {name: ms}."""
    timed = {k: v["ms"] for k, v in row["configs"].items() if "ms" in v}
    if timed:
        row["best"] = min(timed, key=timed.get)
    return timed


def problems(model: str, M: int):
    """(direction, mat_a, mat_b, offs) for one model and M routed rows, bf16 on the GPU."""
    G, K, N = MODELS[model]
    offs = torch.tensor(group_sizes(M, G), device="cuda").cumsum(0).to(torch.int32)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(M, K, device="cuda", generator=gen) * K ** -0.5).to(torch.bfloat16)
    w = torch.randn(G, K, N, device="cuda", generator=gen).to(torch.bfloat16)
    dy = (torch.randn(M, N, device="cuda", generator=gen) * N ** -0.5).to(torch.bfloat16)
    return [("forward", x, w, offs), ("input-grad", dy, w.transpose(1, 2), offs),
            ("weight-grad", x.t(), dy, offs)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "bench-out")
    ap.add_argument("--budget-s", type=float, default=120.0)
    ap.add_argument("--tma", action=argparse.BooleanOptionalAction, default=True,
                    help="also time each configuration with TMA operand copies (forward, input gradient; sm_90+)")
    ap.add_argument("--shapes", default="qwen3-30b-a3b:16384,deepseek-v3:16384,mixtral-8x7b:16384,"
                                        "qwen3-30b-a3b:4096,deepseek-v3:65536")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_tile_sweep.py needs a CUDA GPU; none is visible to torch here", file=sys.stderr)
        return 2
    from moe_ops.backends.cuda import triton_kernels as tk

    deadline = time.perf_counter() + args.budget_s
    cap = torch.cuda.get_device_capability()
    arch = 10 * cap[0] + cap[1]
    path = Path(args.out) / "tile_sweep.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"gpu": torch.cuda.get_device_name(), "arch": arch, "torch": torch.__version__,
           "triton": __import__("triton").__version__, "results": [], "not_run": [],
           "moe_ops_env": moe_ops_env()}
    for spec in args.shapes.split(","):
        model, M = spec.split(":")
        for direction, a, b, offs in problems(model, int(M)):
            if time.perf_counter() > deadline:
                doc["not_run"].append(f"{model}:{M}:{direction}")
                continue
            p = _contract.check_args(a, b, offs)
            row = {"model": model, "M": int(M), "direction": direction, "configs": {}}
            ref = loop_reference(a, b, offs)
            row["torch._grouped_mm_ms"], row["torch._grouped_mm_layout"] = time_grouped_mm(a, b, offs)
            heuristic = tk.tile_config(arch, p.dtype, (p.M // p.G) if p.layout == "2d3d" else None)
            configs = [("heuristic", heuristic)] + [
                ("x".join(map(str, c)), tk.TileConfig(c[0], c[1], c[2], GROUP_M=8, num_warps=c[3], num_stages=c[4],
                                                     programs_per_sm=c[5], epilogue_split=c[1] >= 256))
                for c in CANDIDATES]
            if args.tma and direction != "weight-grad" and arch >= 90:
                # Each configuration's twin with TMA operand copies, right after it.
                configs = [twin for name, cfg in configs
                           for twin in ((name, cfg), (name + " tma", dataclasses.replace(cfg, tma=True)))]
            for name, cfg in configs:
                if time.perf_counter() > deadline:
                    break
                entry = row["configs"][name] = {"config": [cfg.BM, cfg.BN, cfg.BK, cfg.num_warps, cfg.num_stages,
                                                           cfg.programs_per_sm], "tma": cfg.tma}
                try:
                    def run(cfg=cfg):
                        return tk.grouped_mm(p, a, b, offs, None, config=cfg, arch=arch)

                    measure_config(entry, run, ref, row["torch._grouped_mm_ms"])
                except Exception as e:  # a configuration that does not compile or fit is data
                    entry["error"] = f"{type(e).__name__}: {e}"[:300]
            timed = best(row)
            doc["results"].append(row)
            path.write_text(json.dumps(doc, indent=1))
            print(f"{model}:{M} {direction}: _grouped_mm {row['torch._grouped_mm_ms']} ms, "
                  + ", ".join(f"{k} {v:.3f}" for k, v in sorted(timed.items(), key=lambda kv: kv[1])[:4]), flush=True)
    path.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""CPU decode: one token through one expert projection of real MoE models, side by side.

    python benchmarks/decode.py [--threads 2] [--tokens 1] [--rounds 25] [--out DIR]

In decode a MoE layer sends each token to top-k of G experts, so a call multiplies top-k rows
by top-k expert matrices out of G: it is bound by reading those matrices from memory, not by
FLOPs, and the dense-roofline ratio of bench.py says little about it. This times, per model
(experts, top-k, hidden, ffn of cases.MODELS; dims divided by a power of two only where the
bf16 weights would pass --weight-budget-mib), the forward 2Dx3D call for ``moe_ops.grouped_mm``,
``torch._grouped_mm`` and a loop of ``torch.mm`` over the non-empty groups, with the expert
weights stored [G, N, K] (nn.Linear-style, viewed as [G, K, N]: k-contiguous) and stored
[G, K, N] (n-contiguous, as some MoE codebases keep them; also the layout of the input gradient). Every call routes anew (each token picks top-k distinct
experts at random), so the experts' weights come from memory as in a real decode step, not from
a cache that the previous call warmed. Rounds alternate the order of the peers; medians.

Reported per case: time per call, the GB/s of expert weights that time amounts to, and the
ratio of each peer to moe_ops (a peer that refuses a case, e.g. torch._grouped_mm for strides
that are not multiples of 16 bytes, is noted instead). Writes ``decode.json`` to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import moe_ops  # noqa: E402
from cases import MODELS  # noqa: E402
from devices import tensor_pages  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
LAYOUTS = {"gnk": "[G, N, K]", "gkn": "[G, K, N]"}


def routed_offs(G: int, tokens: int, top_k: int, gen: torch.Generator) -> torch.Tensor:
    """[G] int32 group ends for `tokens` tokens that each pick top_k distinct experts."""
    sizes = torch.zeros(G, dtype=torch.int64)
    for _ in range(tokens):
        sizes[torch.randperm(G, generator=gen)[:top_k]] += 1
    return torch.cumsum(sizes, 0).to(torch.int32)


def _loop(a, b, offs):
    out = a.new_empty(a.shape[0], b.shape[2])
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            torch.mm(a[start:end], b[g], out=out[start:end])
        start = end
    return out


PEERS = {
    "moe_ops": lambda a, b, offs: moe_ops.grouped_mm(a, b, offs),
    "torch._grouped_mm": lambda a, b, offs: torch._grouped_mm(a, b, offs=offs),
    "loop of torch.mm": _loop,
}


def bench_model(name, G, top_k, hidden, ffn, dtype, tokens, rounds, budget, layout,
                clock=time.perf_counter) -> dict:
    """One row of the table (clock: time.perf_counter, or a test's)."""
    s = 1
    while G * (hidden // s) * (ffn // s) * 2 > budget:
        s *= 2
    K, N = hidden // s, ffn // s
    gen = torch.Generator().manual_seed(0)
    if layout == "gnk":
        weights = torch.randn(G, N, K, generator=gen, dtype=torch.float32).to(dtype)
        b = weights.transpose(1, 2)
    else:
        weights = b = torch.randn(G, K, N, generator=gen, dtype=torch.float32).to(dtype)
    a = torch.randn(tokens * top_k, K, generator=gen, dtype=torch.float32).to(dtype)
    offs = routed_offs(G, tokens, top_k, gen)
    ref = _loop(a, b, offs).float()
    notes = {}
    for peer, fn in PEERS.items():  # a wrong result is not timed; a peer that refuses the case is noted
        try:
            err = (fn(a, b, offs).float() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)
        except RuntimeError as e:  # e.g. torch._grouped_mm wants strides of multiples of 16 bytes
            notes[peer] = f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
            continue
        if not err <= (1e-4 if dtype == torch.float32 else 3e-2):  # not '>': NaN must fail
            raise RuntimeError(f"{name} {dtype}: {peer} differs from the loop of torch.mm by {err:.2e}")
    names = [peer for peer in PEERS if peer not in notes]
    times = {peer: [] for peer in names}
    experts = []
    for r in range(rounds):
        offs = routed_offs(G, tokens, top_k, gen)
        experts.append(int((torch.diff(offs, prepend=offs.new_zeros(1)) > 0).sum()))
        for peer in names if r % 2 == 0 else names[::-1]:
            t0 = clock()
            PEERS[peer](a, b, offs)
            times[peer].append(clock() - t0)
    med = {peer: statistics.median(v) for peer, v in times.items()}
    read = statistics.mean(experts) * K * N * weights.element_size()
    tag = f"{name} /{s}" if s > 1 else name
    return {"model": tag, "weights": layout, "G": G, "top_k": top_k, "K": K, "N": N, "tokens": tokens,
            "dtype": str(dtype).replace("torch.", ""), "expert_bytes_per_call": read,
            "us": {p: m * 1e6 for p, m in med.items()}, "GB_per_s": {p: read / m / 1e9 for p, m in med.items()},
            "vs_moe_ops": {p: m / med["moe_ops"] for p, m in med.items()}, "not_run": notes}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--weight-budget-mib", type=int, default=1024, help="bf16 expert weights per model, at most")
    ap.add_argument("--weights", default="gnk,gkn", help="how the expert weights are stored: gnk ([G, N, K]), gkn")
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows, pages = [], tensor_pages()
    print(f"{torch.get_num_threads()} threads; {pages or 'page size of tensors unknown'}\n")
    print("| model | weights | dtype | experts read | moe_ops | torch._grouped_mm | loop of torch.mm |\n"
          "|---|---|---|---|---|---|---|")
    for (name, G, top_k, hidden, ffn), layout, d in [(m, w, d) for m in MODELS for w in args.weights.split(",")
                                                      for d in args.dtypes.split(",")]:
        r = bench_model(name, G, top_k, hidden, ffn, DTYPES[d], args.tokens, args.rounds,
                        args.weight_budget_mib << 20, layout)
        rows.append(r)
        cells = [r["not_run"][p] if p in r["not_run"] else f"{r['us'][p]:.0f} us ({r['GB_per_s'][p]:.0f} GB/s"
                 + ("" if p == "moe_ops" else f", x{r['vs_moe_ops'][p]:.2f}") + ")" for p in PEERS]
        print(f"| {r['model']} (G={G}, top-{top_k}, K={r['K']}, N={r['N']}) | {LAYOUTS[layout]} | {d} | "
              f"{r['expert_bytes_per_call'] / 2**20:.1f} MiB | " + " | ".join(cells) + " |", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "threads": torch.get_num_threads(), "pages": pages, "tokens": args.tokens,
            "rounds": args.rounds, "date": time.strftime("%Y-%m-%d")}
    (out / "decode.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

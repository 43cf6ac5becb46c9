"""Printing, JSON and the plot of benchmark results.

A result row is a dict: device, shape, G, M, K, N, mode, dtype, and per peer a dict with
median_ms, p25_ms, p75_ms, min_ms, gflops, ratio (median over the dense roofline's median) or
a note saying why it did not run.
"""

from __future__ import annotations

import json
import textwrap

from peers import DENSE, ORDER


def _cell(r: dict, peer: str) -> str:
    p = r["peers"].get(peer)
    if p is None or "median_ms" not in p:
        return "n/a"
    if peer == DENSE:
        return f"{p['median_ms']:.2f} ms ({p['gflops']:.0f} GFLOP/s)"
    return f"x{p['ratio']:.2f} ({p['median_ms']:.2f} ms)"


def table(rows: list, markdown: bool = False) -> str:
    """One line per case: the dense time and GFLOP/s, then every peer's ratio to it."""
    peers = [p for p in ORDER if any(p in r["peers"] and "median_ms" in r["peers"][p] for r in rows)]
    head = ["case", "mode", "dtype"] + peers
    body = [[r["shape"], r["mode"], r["dtype"]] + [_cell(r, p) for p in peers] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(row) + " |" for row in body]
        return "\n".join(lines)
    widths = [max(len(str(x[i])) for x in [head] + body) for i in range(len(head))]
    fmt = "  ".join("{:<%d}" % w for w in widths)
    return "\n".join([fmt.format(*head)] + [fmt.format(*row) for row in body])


def notes(rows: list) -> str:
    """Why peers did not run (one line per distinct reason)."""
    seen = {}
    for r in rows:
        for name, p in r["peers"].items():
            if "median_ms" not in p and p.get("note"):
                seen.setdefault((name, p["note"]), 0)
                seen[(name, p["note"])] += 1
    return "\n".join(f"- {name}: {note} ({n} cases)" for (name, note), n in seen.items())


def write_json(path: str, meta: dict, rows: list) -> None:
    with open(path, "w") as f:
        json.dump({"meta": meta, "results": rows}, f, indent=1)


def bars(rows: list) -> tuple:
    """What plot draws: ({(mode, dtype): (shapes, {peer: [ratio to the dense roofline per shape,
    NaN where the peer has none]})}, the peers drawn), panels forward first."""
    keys = sorted({(r["mode"], r["dtype"]) for r in rows}, key=lambda x: (x[0] != "fwd", x[0], x[1]))
    peers = [p for p in ORDER if p != DENSE and any("ratio" in r["peers"].get(p, {}) for r in rows)]
    panels = {}
    for mode, dtype in keys:
        sel = [r for r in rows if r["mode"] == mode and r["dtype"] == dtype]
        panels[(mode, dtype)] = ([r["shape"] for r in sel],
                                 {p: [r["peers"].get(p, {}).get("ratio", float("nan")) for r in sel] for p in peers})
    return panels, peers


def plot(path: str, rows: list, title: str) -> str:
    """Bar chart of the ratio to the dense roofline, one panel per (mode, dtype). Returns "" or
    why no plot was drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed (pip install -r benchmarks/requirements.txt)"
    panels, peers = bars(rows)
    cols = 2
    nrows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(13, 3.1 * nrows), squeeze=False)
    colors = plt.get_cmap("tab10")
    for ax, ((mode, dtype), (shapes, heights)) in zip(axes.flat, panels.items()):
        width = 0.8 / max(1, len(peers))
        for i, peer in enumerate(peers):
            xs = [j + (i - (len(peers) - 1) / 2) * width for j in range(len(shapes))]
            ax.bar(xs, heights[peer], width, label=peer, color=colors(i))
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_yscale("log")
        ax.set_title(f"{mode}, {dtype}", fontsize=9)
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels(shapes, rotation=25, ha="right", fontsize=7)
        ax.tick_params(axis="y", labelsize=7)
        ax.set_ylabel("time / dense mm", fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    # The title (the machine's description, ~200 characters) wrapped above the legend: on one
    # line it ran past the figure's edges and under the legend.
    lines = textwrap.wrap(title, 150)
    height = fig.get_figheight()  # inches; a line of 9-point text is ~0.17 in
    legend_top = 1 - (0.08 + 0.17 * len(lines)) / height
    fig.suptitle("\n".join(lines), fontsize=9, y=1 - 0.04 / height)
    fig.legend(handles, labels, loc="upper center", ncol=len(peers), fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, legend_top))
    fig.tight_layout(rect=(0, 0, 1, legend_top - 0.25 / height))
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return ""

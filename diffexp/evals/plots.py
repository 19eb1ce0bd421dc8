"""The figures of the evaluations (matplotlib, imported only when a figure is drawn, with the Agg backend
unless one is already chosen): the ICL accuracy curve, the needle retrieval heatmaps and the loss by position.

The drawing functions read the results objects (``diffexp.evals.icl.ICLResults``,
``diffexp.evals.needle.NeedleResults``, ``diffexp.evals.nll.NLLResults``) by attribute only; this
module imports none, so the results modules can import it without a loop."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np


def pyplot():
    """matplotlib.pyplot, on the non-interactive Agg backend unless a backend is already chosen."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | Path, dpi: float | str = "figure") -> Path:
    """Write ``fig`` to ``path`` (its directory created) and close it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path


def icl_figure(results):
    """An ``ICLResults``' accuracy vs n demos (log2 axis), one line per ordering with a min-max band and ±std bars."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    rows = results.to_rows()
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, ordering in enumerate(results.orderings):
        r = [row for row in rows if row["ordering"] == ordering]
        x = np.array([row["n_demos"] for row in r], dtype=float)
        mean = np.array([row["mean"] for row in r])
        lo, hi = np.array([row["min"] for row in r]), np.array([row["max"] for row in r])
        std = np.array([row["std"] for row in r])
        color = colors[i % len(colors)]
        ax.fill_between(x, lo, hi, color=color, alpha=0.18, linewidth=0)
        ax.errorbar(x, mean, yerr=std, color=color, marker="o", markersize=4, capsize=3, linewidth=1.6,
                    label=ordering)
    ax.axhline(results.chance, color="0.4", linestyle="--", linewidth=1, label=f"chance 1/{results.k_classes}")
    ax.set_xscale("log", base=2)
    ticks = results.n_demos or [1]
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("demonstrations in context (n)")
    ax.set_ylabel(f"accuracy ({results.n_tests} held-out tests)")
    ax.set_title(f"Many-shot in-context classification, {results.source}, K={results.k_classes}\n"
                 f"lines: mean \u00b1 std, bands: min-max over {results.n_orderings} orders of the same demos",
                 fontsize=10)
    ax.grid(True, alpha=0.3)
    if results.skipped:
        skipped = ", ".join(str(s["n_demos"]) for s in results.skipped)
        ax.text(0.99, 0.01, f"skipped (context > {results.max_seq_len} tokens): n = {skipped}",
                transform=ax.transAxes, ha="right", va="bottom", fontsize=8, color="0.3")
    if not results.accuracies:
        ax.text(0.5, 0.5, "no n fits the context", transform=ax.transAxes, ha="center")
    ax.legend(loc="best", fontsize=8, framealpha=0.85)
    fig.tight_layout()
    return fig


def needle_heatmaps(results) -> dict[tuple[str, int, int], object]:
    """A ``NeedleResults``' heatmaps (context length x depth), one figure per (method, N, R)."""
    plt = pyplot()
    figures = {}
    depths, lengths = results.depths, results.context_lens
    for method in results.methods:
        for n, r in results.nr:
            grid = np.array(results.grid(method, n, r), dtype=np.float64)
            width = max(4.0, 1.1 * len(depths) + 2.0)
            fig, ax = plt.subplots(figsize=(width, max(2.6, 0.55 * len(lengths) + 1.8)))
            image = ax.imshow(grid, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
            ax.set_xticks(range(len(depths)), [f"{d:.0%}" for d in depths])
            ax.set_yticks(range(len(lengths)), [str(c) for c in lengths])
            ax.set_xlabel("answer depth")
            ax.set_ylabel("context length (tokens)")
            chance = f", chance {1 / n:.2f}" if method == "rank" else ""
            ax.set_title(f"needles N={n}, R={r}: {method} accuracy{chance}")
            for i, j in itertools.product(range(len(lengths)), range(len(depths))):
                value = float(grid[i, j])
                if not math.isnan(value):
                    ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=10,
                            color="black" if 0.12 < value < 0.88 else "white")
            fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
            fig.tight_layout()
            figures[(method, n, r)] = fig
    return figures


def nll_figure(results):
    """An ``NLLResults``' loss against token position (log axis): the cumulative average, and the mean loss at
    each position behind it."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    positions = np.arange(1, results.context_len + 1)
    ax.plot(positions, results.per_position, color="0.6", linewidth=0.6, alpha=0.7, label="at each position")
    ax.plot(positions, results.cumulative, color="C0", linewidth=2.0, label="cumulative average (1..position)")
    ax.set_xscale("log")
    ax.set_xlim(1, results.context_len)
    ax.set_xlabel("token position")
    ax.set_ylabel("negative log-likelihood (nats)")
    ax.set_title(f"Loss by position, {results.documents} documents of {results.source}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="best", fontsize=8, framealpha=0.85)
    fig.tight_layout()
    return fig

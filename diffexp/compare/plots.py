"""The comparison's figures: validation loss vs step per case, and the objective per case as bars.

matplotlib is imported inside the functions (compare --no-plots never loads it) and drawn on Agg
figures, without touching pyplot's global backend.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from diffexp.compare.stats import CaseSummary, best_case
from diffexp.sweep.runs import StudyRuns, TrialRun

CURVE_TAG = "val/loss"
PLOT_DPI = 120


def series_colors(n: int) -> list:
    """n distinct colors, one per plotted series: tab10, tab20, then samples of turbo."""
    from matplotlib import colormaps

    name = "tab10" if n <= 10 else "tab20" if n <= 20 else "turbo"
    cmap = colormaps[name]
    return [cmap(i) if n <= 20 else cmap(i / max(1, n - 1)) for i in range(n)]


def new_figure(width: float, height: float):
    """An Agg matplotlib Figure of width x height inches at PLOT_DPI, with a constrained layout."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=PLOT_DPI, layout="constrained")
    FigureCanvasAgg(fig)  # Agg, without touching pyplot's global backend
    return fig


def _case_curve(trials: Sequence[TrialRun], tag: str):
    """steps, mean, min, max over the trials, at every step logged by at least one of them."""
    series = [dict(t.curves[tag]) for t in trials if t.curves.get(tag)]
    if not series:
        return [], [], [], [], 0
    steps = sorted({s for points in series for s in points})
    grid = np.array([[points.get(step, np.nan) for step in steps] for points in series])  # NaN: not logged
    return (steps, np.nanmean(grid, axis=0).tolist(), np.nanmin(grid, axis=0).tolist(),
            np.nanmax(grid, axis=0).tolist(), len(series))


def plot_val_curves(runs: StudyRuns, rows: Sequence[CaseSummary], path: str | Path, tag: str = CURVE_TAG) -> bool:
    """Validation loss vs step per case (complete seeds): mean line, min–max band. False when nothing to plot."""
    curves = [(row, _case_curve(row.complete, tag)) for row in rows]
    curves = [(row, c) for row, c in curves if c[0]]
    if not curves:
        return False
    fig = new_figure(13, 5.2 + 0.25 * math.ceil(len(curves) / 3))
    full, zoom = fig.subplots(1, 2)
    colors = dict(zip([row.case.slug for row in rows], series_colors(len(rows))))
    last_step = max(c[0][-1] for _, c in curves)
    zoom_from = last_step / 2
    zoom_values = []
    for row, (steps, mean, low, high, n) in curves:
        color = colors[row.case.slug]
        label = f"{row.case.name} ({n} seed{'s' if n > 1 else ''})"
        for ax in (full, zoom):
            ax.plot(steps, mean, color=color, lw=1.8, marker="o" if len(steps) <= 30 else None, ms=3,
                    label=label if ax is full else None)
            if n > 1:
                ax.fill_between(steps, low, high, color=color, alpha=0.18, lw=0)
        zoom_values += [v for s, lo, hi in zip(steps, low, high) if s >= zoom_from for v in (lo, hi)]
    full.set_title("whole run")
    zoom.set_title(f"second half (step ≥ {zoom_from:,.0f})")
    if zoom_values:
        lo, hi = min(zoom_values), max(zoom_values)
        pad = (hi - lo) * 0.08 or abs(hi) * 0.01 or 0.01
        zoom.set_xlim(zoom_from - last_step * 0.02, last_step * 1.02)
        zoom.set_ylim(lo - pad, hi + pad)
    for ax in (full, zoom):
        ax.set_xlabel("step")
        ax.set_ylabel(tag)
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"{runs.study}: {tag} vs step, mean over complete seeds, shaded band = min–max over seeds")
    fig.legend(loc="outside lower center", ncol=min(len(curves), 3), fontsize=9, frameon=False)
    fig.savefig(path, dpi=PLOT_DPI)
    return True


def plot_objective_bars(runs: StudyRuns, rows: Sequence[CaseSummary], path: str | Path) -> None:
    """Horizontal bars of the objective mean per case (table order, top to bottom), std error bars, seed dots."""
    metric = runs.objective
    best = best_case(runs, rows)
    n = len(rows)
    fig = new_figure(9, max(2.6, 0.5 * n + 1.6))
    ax = fig.subplots()
    ys = list(range(n))[::-1]
    scored = [(y, row) for y, row in zip(ys, rows) if row.stats[metric].mean is not None]
    extents = []
    for _, row in scored:
        stat = row.stats[metric]
        spread = stat.std or 0.0
        extents += [stat.mean - spread, stat.mean + spread, *stat.values]
    if extents:
        lo, hi = min(extents), max(extents)
        pad = (hi - lo) * 0.25 or abs(hi) * 0.02 or 0.01
        left, right = lo - pad, hi + pad * 1.6  # room for the value labels
    else:
        left, right = 0.0, 1.0
    for y, row in scored:
        stat = row.stats[metric]
        color = "tab:orange" if row is best else "tab:blue"
        ax.barh(y, stat.mean - left, left=left, height=0.6, color=color, alpha=0.85)
        if stat.std is not None:
            ax.errorbar(stat.mean, y, xerr=stat.std, fmt="none", ecolor="black", capsize=4, lw=1.2)
        ax.scatter(stat.values, [y] * stat.n, s=14, color="black", zorder=3)
        ax.annotate(stat.format(), xy=(max(stat.mean + (stat.std or 0.0), *stat.values), y), xytext=(7, 0),
                    textcoords="offset points", va="center", fontsize=9)
    for y, row in zip(ys, rows):
        if row.stats[metric].mean is None:
            ax.text(left + (right - left) * 0.01, y, "no completed seed", va="center", fontsize=9, color="gray",
                    style="italic")
    ax.set_xlim(left, right)
    ax.set_ylim(-0.7, n - 0.3)
    ax.set_yticks(ys, [f"{row.case.name}  ({len(row.complete)}/{row.n_expected})" for row in rows])
    ax.set_xlabel(f"{metric} ({runs.direction}; axis does not start at 0)")
    ax.grid(True, axis="x", alpha=0.3)
    ax.set_title(f"{runs.study}: {metric}, mean ± sample std over complete seeds (dots: seeds; best in orange)",
                 fontsize=10)
    fig.savefig(path, dpi=PLOT_DPI)

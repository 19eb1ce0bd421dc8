"""The comparison's figures: validation loss vs step per case, the objective per case as bars, each case's
paired difference to the reference case with its interval, and metrics measured at several bit widths.

matplotlib is imported inside the functions (compare --no-plots never loads it) and drawn on Agg
figures, without touching pyplot's global backend.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from diffexp.compare.paired import TOO_FEW, PairedReport
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


def case_colors(runs: StudyRuns, rows: Sequence[CaseSummary] = ()) -> dict[str, tuple]:
    """Case slug -> its colour in every plot of a compare: decided once, from the study's cases in sweep.json
    order (then any other row's, e.g. a view's), so a case keeps its colour whichever cases a plot shows."""
    slugs = list(dict.fromkeys([case.slug for case in runs.cases] + [row.case.slug for row in rows]))
    return dict(zip(slugs, series_colors(len(slugs))))


def sparse_curves_note(runs: StudyRuns, rows: Sequence[CaseSummary], tag: str = CURVE_TAG) -> str | None:
    """A warning when every case's curve has at most one point (validation ran only at the last step), else None."""
    points = [len(_case_curve(row.complete, tag)[0]) for row in rows]
    if not any(points) or max(points) > 1:
        return None
    return (f"val_loss_curves.png has one point per case: {tag} was logged only once per trial "
            "(trainer.val_check_interval >= trainer.max_steps). For curves, set a lower trainer.val_check_interval "
            "in the sweep's overrides (e.g. max_steps / 10); each validation costs trainer.limit_val_batches "
            "batches.")


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


def plot_val_curves(runs: StudyRuns, rows: Sequence[CaseSummary], path: str | Path, tag: str = CURVE_TAG,
                    colors: dict[str, tuple] | None = None) -> bool:
    """Validation loss vs step per case (complete seeds): mean line, min–max band; where every case has one
    point, plot_val_points. False when nothing to plot."""
    curves = [(row, _case_curve(row.complete, tag)) for row in rows]
    curves = [(row, c) for row, c in curves if c[0]]
    if not curves:
        return False
    colors = colors or case_colors(runs, rows)
    if max(len(c[0]) for _, c in curves) == 1:
        plot_val_points(runs, curves, path, tag, colors)
        return True
    fig = new_figure(13, 5.2 + 0.25 * math.ceil(len(curves) / 3))
    full, zoom = fig.subplots(1, 2)
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


def plot_val_points(runs: StudyRuns, curves: list, path: str | Path, tag: str, colors: dict[str, tuple]) -> None:
    """One validation per trial: each case's mean at its step with the min–max over seeds as an error bar (the
    band of a curve), side by side a little apart, on a step axis from 0, so the figure says where in training the
    one point lies; one panel (a zoom on one step shows nothing more)."""
    import textwrap

    fig = new_figure(9, 4.4 + 0.25 * math.ceil(len(curves) / 3))
    ax = fig.subplots()
    last_step = max(c[0][-1] for _, c in curves)
    apart = last_step * 0.012
    for i, (row, (steps, mean, low, high, n)) in enumerate(curves):
        x = steps[0] + (i - (len(curves) - 1) / 2) * apart
        ax.errorbar([x], mean, yerr=[[mean[0] - low[0]], [high[0] - mean[0]]], fmt="o", ms=6, capsize=4, lw=1.6,
                    color=colors[row.case.slug], label=f"{row.case.name} ({n} seed{'s' if n > 1 else ''})")
    ax.set_xlim(0, last_step + max(apart * len(curves), last_step * 0.05))
    ax.set_xlabel("step")
    ax.set_ylabel(tag)
    ax.grid(True, alpha=0.3)
    title = (f"{runs.study}: {tag} at the one validation of each trial (step {last_step:,}), mean over complete "
             "seeds, error bar = min–max over seeds; for curves, lower trainer.val_check_interval")
    ax.set_title("\n".join(textwrap.wrap(title, 95)), fontsize=10)
    fig.legend(loc="outside lower center", ncol=min(len(curves), 3), fontsize=9, frameon=False)
    fig.savefig(path, dpi=PLOT_DPI)


def plot_objective_bars(runs: StudyRuns, rows: Sequence[CaseSummary], path: str | Path,
                        colors: dict[str, tuple] | None = None) -> None:
    """Horizontal bars of the objective mean per case (table order, top to bottom) in the case's colour, std error
    bars, seed dots; the best case's bar outlined."""
    metric = runs.objective
    colors = colors or case_colors(runs, rows)
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
        ax.barh(y, stat.mean - left, left=left, height=0.6, color=colors[row.case.slug], alpha=0.85,
                edgecolor="black" if row is best else "none", linewidth=2.0 if row is best else 0.0)
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
    ax.set_title(f"{runs.study}: {metric}, mean ± sample std over complete seeds (dots: seeds; best outlined)",
                 fontsize=10)
    fig.savefig(path, dpi=PLOT_DPI)


def plot_paired_diffs(runs: StudyRuns, rows: Sequence[CaseSummary], paired: PairedReport, path: str | Path,
                      view: str = "", colors: dict[str, tuple] | None = None) -> bool:
    """Per case (table order, top to bottom; the reference left out): the mean paired difference to the reference,
    its interval as error bars, each seed's difference as a dot, the verdict beside it, and a zero line.
    False when the study has no case besides the reference."""
    others = [row for row in rows if paired.of(row) is not None]
    if not others:
        return False
    colors = colors or case_colors(runs, rows)  # as in val_loss_curves.png
    fig = new_figure(9, max(2.6, 0.5 * len(others) + 1.8))
    ax = fig.subplots()
    ys = list(range(len(others)))[::-1]
    extents = [0.0]
    for y, row in zip(ys, others):
        diff = paired.of(row)
        if diff.n == 0:
            continue
        color = colors[row.case.slug]
        ax.errorbar(diff.mean, y, xerr=diff.half_width, fmt="o", color=color, ecolor=color, capsize=5, lw=1.6,
                    ms=7, zorder=3)
        ax.scatter(diff.diffs, [y] * diff.n, s=14, color="black", alpha=0.6, zorder=4)
        right = max(diff.high if diff.n > 1 else diff.mean, *diff.diffs)
        ax.annotate(diff.verdict, xy=(right, y), xytext=(7, 0), textcoords="offset points", va="center", fontsize=9)
        extents += [diff.low if diff.n > 1 else diff.mean, right, *diff.diffs]
    lo, hi = min(extents), max(extents)
    pad = (hi - lo) * 0.12 or 0.01
    ax.set_xlim(lo - pad, hi + pad * 3)  # room for the verdicts
    for y, row in zip(ys, others):
        if paired.of(row).n == 0:
            ax.text(lo - pad * 0.9, y, TOO_FEW, va="center", fontsize=9, color="gray", style="italic")
    ax.axvline(0.0, color="black", lw=1, ls="--")
    ax.set_ylim(-0.7, len(others) - 0.3)
    ax.set_yticks(ys, [f"{row.case.name}  ({paired.of(row).n} paired)" for row in others])
    better = "left" if runs.direction == "minimize" else "right"
    ax.set_xlabel(f"{runs.objective}: case − {paired.reference.case.name} ({runs.direction}; {better} of 0 is better)")
    ax.grid(True, axis="x", alpha=0.3)
    ref = paired.reference.case.name
    shown_view = f" ({view})" if view and not ref.endswith(view) else ""  # a grid point is in its row's name already
    ax.set_title(f"{runs.study}{shown_view}: paired difference to {ref}\n"
                 f"mean and {paired.level * 100:g}% CI (Student t; dots: seeds)", fontsize=10)
    fig.savefig(path, dpi=PLOT_DPI)
    return True


def plot_grid(runs: StudyRuns, rows: Sequence[CaseSummary], path: str | Path) -> bool:
    """A grid study (one view per grid point): the objective's mean over complete seeds against the grid point, a
    line per case, every seed a dot; a grid point where seeds diverged marked with a cross and "k/n", one where all
    did with a cross on the top edge. False without grid views."""
    if not runs.views or runs.tuned:
        return False
    by_name = {row.case.name: row for row in rows}
    points = list(runs.views)
    cases = list(runs.views[points[0]])
    colors = dict(zip(cases, series_colors(len(cases))))
    fig = new_figure(9, 5.2)
    ax = fig.subplots()
    values = [v for point in points for case in cases for v in by_name[runs.views[point][case]].stats[
        runs.objective].values]
    top = max(values) if values else 1.0
    bottom = min(values) if values else 0.0
    edge = top + (top - bottom) * 0.08 + 1e-9
    offsets = np.linspace(-0.12, 0.12, len(cases)) if len(cases) > 1 else [0.0]
    for case, offset in zip(cases, offsets):
        xs, means = [], []
        for x, point in enumerate(points):
            row = by_name[runs.views[point][case]]
            stat = row.stats[runs.objective]
            if stat.mean is not None:
                xs.append(x + offset)
                means.append(stat.mean)
                ax.scatter([x + offset] * stat.n, stat.values, s=10, color=colors[case], alpha=0.5, zorder=3)
            if row.diverged:
                y = edge if stat.mean is None else stat.mean
                ax.scatter([x + offset], [y], marker="x", s=60, color=colors[case], linewidths=2, zorder=4)
                if stat.mean is not None:  # some seeds: how many diverged (on the dotted line: all of them)
                    ax.annotate(f"{len(row.diverged)}/{row.n_expected}", xy=(x + offset, y), xytext=(4, 4),
                                textcoords="offset points", fontsize=8, color=colors[case])
        ax.plot(xs, means, marker="o", ms=5, lw=1.6, color=colors[case], label=case, zorder=3)
    ax.axhline(edge, color="gray", lw=0.8, ls=":")
    ax.text(-0.45, edge, "all seeds diverged", ha="left", va="bottom", fontsize=8, color="gray")
    ax.set_xticks(range(len(points)), points)
    ax.set_xlim(-0.5, len(points) - 0.5)
    ax.set_xlabel("grid point")
    ax.set_ylabel(f"{runs.objective} ({runs.direction})")
    ax.grid(True, alpha=0.3)
    ax.set_ylim(top=edge + (top - bottom) * 0.06 + 1e-9)
    ax.legend(fontsize=9, loc="lower right")
    ax.set_title(f"{runs.study}: {runs.objective} by grid point, mean over complete seeds (dots: seeds)\n"
                 "x: seeds diverged (k/n), on the dotted line when all did", fontsize=10)
    fig.savefig(path, dpi=PLOT_DPI)
    return True


#: a metric measured at several bit widths (diffexp eval quantize): <family>_b<bits>
BITS_METRIC = re.compile(r"^(?P<family>.+)_b(?P<bits>\d+)$")


def bit_width_families(rows: Sequence[CaseSummary]) -> dict[str, list[tuple[int, str]]]:
    """family -> [(bits, metric)] for each metric family recorded at two or more widths, widest first."""
    families: dict[str, list[tuple[int, str]]] = {}
    for metric in dict.fromkeys(name for row in rows for name in row.stats):
        found = BITS_METRIC.match(metric)
        if found:
            families.setdefault(found["family"], []).append((int(found["bits"]), metric))
    return {family: sorted(points, reverse=True) for family, points in families.items() if len(points) > 1}


def plot_bit_widths(runs: StudyRuns, rows: Sequence[CaseSummary], path: str | Path,
                    colors: dict[str, tuple] | None = None) -> bool:
    """Each bit-width family (e.g. quantize/loss at 16, 8, 6 and 4 bits) against the width, one line per case:
    the mean over complete seeds with sample-std bars, widest width left. False (nothing written) without one."""
    families = bit_width_families(rows)
    if not families:
        return False
    colors = colors or case_colors(runs, rows)
    fig = new_figure(6.5 * len(families), 4.2)
    axes = fig.subplots(1, len(families), squeeze=False)[0]
    for ax, (family, points) in zip(axes, families.items()):
        widths = [bits for bits, _ in points]
        for row in rows:
            stats = [row.stats.get(metric) for _, metric in points]
            shown = [(i, s) for i, s in enumerate(stats) if s is not None and s.mean is not None]
            if not shown:
                continue
            ax.errorbar([i for i, _ in shown], [s.mean for _, s in shown], yerr=[s.std or 0.0 for _, s in shown],
                        marker="o", capsize=3, color=colors[row.case.slug], label=row.case.name)
        ax.set_xticks(range(len(widths)), [str(bits) for bits in widths])
        ax.set_xlabel("bits")
        ax.set_ylabel(family)
        ax.grid(True, alpha=0.3)
        ax.set_title(f"{family} by bit width", fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle(f"{runs.study}: mean ± sample std over complete seeds", fontsize=10)
    fig.savefig(path, dpi=PLOT_DPI)
    return True

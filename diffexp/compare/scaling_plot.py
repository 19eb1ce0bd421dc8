"""The scaling figure (scaling.png): loss vs non-embedding parameters per variant, with the fitted curves.

Per variant: every seed's point (small dots), each size's mean over seeds (markers), the pooled fit
(line, over the sizes it ran and out to the N it needs); the target L* as a dashed horizontal line and
each variant's N needed as a dotted vertical one. Log-scaled N axis.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from diffexp.compare.plots import PLOT_DPI, _colors, _figure
from diffexp.compare.render import format_params
from diffexp.compare.scaling_study import ScalingReport


def plot_scaling(report: ScalingReport, study: str, path: str | Path) -> None:
    fig = _figure(9, 5.6)
    ax = fig.subplots()
    colors = _colors(len(report.rows))
    for color, row in zip(colors, report.rows):
        series, fit = row.series, row.fit
        ax.scatter([p.n for p in series.points], [p.loss for p in series.points], s=10, color=color, alpha=0.35,
                   lw=0)
        sizes, means = series.means()
        label = row.variant
        if row.ratio is not None:
            label += f": {row.ratio:.2f}× N_ref"
        if fit is not None:
            label += f" (b={fit.b:.2f}, {fit.method})"
        ax.plot(sizes, means, "o", color=color, ms=6, label=label)
        if fit is not None:
            ends = [sizes[0], sizes[-1]] + ([row.n_needed] if row.n_needed is not None else [])
            low, high = min(ends) / 1.15, max(ends) * 1.15
            xs = np.geomspace(low, high, 200)
            ax.plot(xs, fit.loss(xs), color=color, lw=1.6)
        if row.n_needed is not None and row.variant != report.reference:
            ax.axvline(row.n_needed, color=color, ls=":", lw=1.2)
    ax.axhline(report.target, color="gray", ls="--", lw=1.0,
               label=f"L* = {report.target:.3f}: {report.reference} at N_ref = {format_params(report.n_ref)}")
    ax.set_xscale("log")
    ax.set_xlabel("non-embedding parameters N (log scale)")
    ax.set_ylabel(report.metric)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(f"{study}: {report.metric} = a·N^-b + c per variant (dots: seeds; markers: mean over seeds; "
                 "dotted: N needed for L*)", fontsize=9)
    ax.legend(fontsize=8, frameon=False)
    fig.savefig(path, dpi=PLOT_DPI)

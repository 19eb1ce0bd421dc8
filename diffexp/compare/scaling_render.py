"""The scaling section as text: its rich table, its part of compare.md, and scaling.csv.

Columns per variant: the sizes it ran, the fit (method, a, b, c), its fitted loss at N_ref, the N it needs
to reach L* and the ratio N needed / N_ref (pooled fit), then the per-seed ratios as mean ± sample std
and 95% CI half-width (diffexp.compare.scaling_study defines each number).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from diffexp.compare.render import format_params
from diffexp.compare.scaling import LOG_LINEAR
from diffexp.compare.scaling_study import PARAMS_KEY, ScalingReport, VariantScaling
from diffexp.compare.stats import EMPTY, NA, format_number

TITLE = "Scaling: parameters needed to reach the reference's loss"
HEADER = ["Variant", "Sizes", "N range", "Fit", "a", "b", "c", "Loss at N_ref", "N needed", "Ratio",
          "Ratio per seed", "95% CI", "Seeds"]


def _num(x: float | None, digits: int = 3) -> str:
    return EMPTY if x is None else f"{x:.{digits}g}" if abs(x) >= 1e4 or abs(x) < 1e-3 else f"{x:.{digits}f}"


def _ratio_text(row: VariantScaling) -> str:
    if row.ratio is None:
        return "not reached"
    return f"{row.ratio:.3f}" + (" *" if row.extrapolated else "")


def cells(report: ScalingReport, row: VariantScaling) -> list[str]:
    """One row of the table, as text (HEADER order)."""
    sizes = row.series.sizes
    fit = row.fit
    stat = row.ratio_stat
    per_seed = EMPTY if stat.mean is None else \
        f"{stat.mean:.3f} ± {NA if stat.std is None else f'{stat.std:.3f}'}"
    return [
        row.variant + (" (reference)" if row.variant == report.reference else ""),
        str(len(sizes)),
        f"{format_params(sizes[0])}–{format_params(sizes[-1])}",
        EMPTY if fit is None else (fit.method if fit.method != LOG_LINEAR else f"{LOG_LINEAR} (c={fit.c:g})"),
        _num(fit.a if fit else None), _num(fit.b if fit else None), _num(fit.c if fit else None),
        EMPTY if fit is None else format_number(float(fit.loss(report.n_ref))),
        EMPTY if row.n_needed is None else format_params(round(row.n_needed)),
        _ratio_text(row),
        per_seed,
        EMPTY if stat.ci95 is None else f"± {stat.ci95:.3f}",
        f"{len(row.seed_ratios)}/{len(row.series.seeds)}",
    ]


def explanation(report: ScalingReport) -> list[str]:
    """The lines under the table: what was fitted, the target, how to read the ratio, and fit notes."""
    lines = [
        f"Fit per variant: {report.metric} = a·N^-b + c over N = non-embedding parameters (trial.json "
        f"params.{PARAMS_KEY}), to each size's mean over seeds; scipy curve_fit with 4+ sizes, else (or when it "
        f"fails) a log-linear fit with c fixed (Fit column).",
        f"Target: the reference ({report.reference}) fit at its largest size N_ref = {format_params(report.n_ref)}: "
        f"L* = {format_number(report.target)}. N needed: where the variant's fit reaches L*; "
        "Ratio = N needed / N_ref (< 1: fewer parameters than the reference for the same loss).",
        "Ratio per seed: each seed's points refit (the reference's too, for that seed's L*); mean ± sample std "
        "over seeds, 95% CI half-width from Student's t; n/a with one seed.",
    ]
    if any(row.extrapolated for row in report.rows):
        lines.append("* N needed lies outside the sizes the variant ran: an extrapolation of its fit.")
    for row in report.rows:
        if row.fit is not None and row.fit.note:
            lines.append(f"{row.variant}: {row.fit.describe()}.")
        if row.ratio is None and row.fit is not None:
            lines.append(f"{row.variant}: its fit never reaches L* (b = {row.fit.b:.3g}, c = {row.fit.c:.3g}).")
    for series in report.unfitted:
        lines.append(f"{series.variant}: no fit ({len(series.sizes)} size(s); a fit needs 2 or more).")
    return lines


def render_scaling_markdown(report: ScalingReport) -> str:
    """The `## Scaling` section appended to compare.md."""
    lines = [f"## {TITLE}", "", "| " + " | ".join(HEADER) + " |",
             "|---|" + "|".join(["---:"] * 2 + ["---"] + ["---:"] * (len(HEADER) - 4)) + "|"]
    for row in report.rows:
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells(report, row)) + " |")
    lines += [""] + [f"{line}  " for line in explanation(report)] + ["", "Figure: scaling.png.", ""]
    return "\n".join(lines)


def print_scaling(console, report: ScalingReport) -> None:
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"{TITLE} ({report.metric})", title_justify="left")
    for i, label in enumerate(HEADER):
        table.add_column(label, justify="left" if i in (0, 3) else "right", overflow="fold")
    for row in report.rows:
        table.add_row(*(Text(c) for c in cells(report, row)))
    console.print(table)
    for line in explanation(report):
        console.print(Text(line), soft_wrap=True)


def write_scaling_csv(path: str | Path, report: ScalingReport) -> None:
    """One row per variant: the sizes, the pooled fit, N needed and ratio, and the per-seed ratios."""
    fields = ["variant", "reference", "metric", "n_ref", "target_loss", "sizes", "method", "fit_note", "a", "b", "c",
              "n_needed", "ratio", "extrapolated", "ratio_seed_mean", "ratio_seed_std", "ratio_seed_ci95",
              "ratio_seed_n", "ratios_per_seed"]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for row in report.rows:
            fit, stat = row.fit, row.ratio_stat
            record = {
                "variant": row.variant, "reference": report.reference, "metric": report.metric,
                "n_ref": report.n_ref, "target_loss": report.target, "sizes": ";".join(map(str, row.series.sizes)),
                "method": fit.method if fit else None, "fit_note": fit.note if fit else None,
                "a": fit.a if fit else None, "b": fit.b if fit else None, "c": fit.c if fit else None,
                "n_needed": row.n_needed, "ratio": row.ratio, "extrapolated": row.extrapolated,
                "ratio_seed_mean": stat.mean, "ratio_seed_std": stat.std, "ratio_seed_ci95": stat.ci95,
                "ratio_seed_n": stat.n, "ratios_per_seed": json.dumps({str(k): v for k, v in row.seed_ratios.items()}),
            }
            writer.writerow({k: "" if v is None else v for k, v in record.items()})

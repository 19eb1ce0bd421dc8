"""Scaling laws across model sizes: per attention variant, loss = a·N^-b + c over the non-embedding parameter
count N, and how many parameters each variant needs to reach the reference's loss; as a table, a compare.md
section, scaling.csv and scaling.png. Only a study whose variants span several sizes has this section.
"""

from __future__ import annotations

import csv
import json
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from diffexp.compare import markdown
from diffexp.compare.paired import reference_variant_name
from diffexp.compare.plots import PLOT_DPI, new_figure, series_colors
from diffexp.compare.render import format_params
from diffexp.compare.stats import EMPTY, NA, Stat, format_number
from diffexp.sweep.runs import StudyRuns, TrialRun

# ----------------------------------------------------------------------------- the fit: loss = a * N^-b + c
# curve_fit fits all three (bounded: a > 0, B_MIN <= b <= B_MAX, 0 <= c <= min loss) given MIN_FULL_POINTS
# distinct sizes; with fewer, or when it fails or ends on a bound of b or c, the log-linear fit holds c at FIXED_C
# and fits log(loss - c) = log a - b log N by least squares (PowerLaw.method and .note say which, and why).

MIN_FULL_POINTS = 4  # distinct sizes for the three-parameter fit
MIN_POINTS = 2  # distinct sizes for any fit (the log-linear fallback)
FIXED_C = 0.0  # the fallback's c: a pure power law
B_MIN, B_MAX = 1e-6, 5.0  # bounds of the exponent b in curve_fit; a fit that ends on one is refused
CURVE_FIT = "curve_fit"
LOG_LINEAR = "log-linear"


@dataclass(frozen=True)
class PowerLaw:
    """loss(N) = a * N^-b + c, fitted to `n_points` distinct sizes by `method` (CURVE_FIT or LOG_LINEAR)."""

    a: float
    b: float
    c: float
    method: str
    n_points: int
    note: str | None = None  # why the fallback was used

    def loss(self, n: float | np.ndarray) -> float | np.ndarray:
        return self.a * np.asarray(n, dtype=float) ** -self.b + self.c

    def params_for(self, loss: float) -> float | None:
        """The N at which the fit reaches `loss`: (a / (loss - c))^(1/b). None when it never does (loss at or
        below the asymptote c, or a fit whose loss does not fall with N, b <= 0)."""
        if not (self.b > 0 and loss > self.c and self.a > 0):
            return None
        with np.errstate(over="ignore"):
            value = (self.a / (loss - self.c)) ** (1.0 / self.b)
        return float(value) if math.isfinite(value) else None

    def describe(self) -> str:
        """'curve_fit' or 'log-linear, c fixed at 0 (3 sizes < 4)'."""
        if self.method == CURVE_FIT:
            return CURVE_FIT
        text = f"{LOG_LINEAR}, c fixed at {self.c:g}"
        return f"{text} ({self.note})" if self.note else text


def _log_linear(n: np.ndarray, loss: np.ndarray, c: float, distinct: int, note: str | None) -> PowerLaw | None:
    if np.any(loss <= c):
        return None
    slope, intercept = np.polyfit(np.log(n), np.log(loss - c), 1)
    return PowerLaw(a=float(math.exp(intercept)), b=float(-slope), c=c, method=LOG_LINEAR, n_points=distinct,
                    note=note)


def _curve_fit(n: np.ndarray, loss: np.ndarray) -> tuple[tuple[float, float, float] | None, str | None]:
    """(a, b, c) or (None, why). N is scaled by its geometric mean inside the fit for conditioning."""
    from scipy.optimize import OptimizeWarning, curve_fit

    scale = float(np.exp(np.mean(np.log(n))))
    x = n / scale
    low, high = float(loss.min()), float(loss.max())
    spread = max(high - low, 1e-6)

    def model(x, a, b, c):
        return a * x ** -b + c

    best, best_sse, why = None, math.inf, "curve_fit did not converge"
    for c0 in (0.0, 0.5 * low, low - 2 * spread, low - 0.5 * spread, low - 0.1 * spread):
        c0 = min(max(c0, 0.0), low * (1 - 1e-6))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", OptimizeWarning)
                params, _ = curve_fit(model, x, loss, p0=(max(float(np.mean(loss)) - c0, 1e-6), 0.3, c0),
                                      bounds=([1e-12, B_MIN, 0.0], [np.inf, B_MAX, low]), maxfev=20000)
        except (RuntimeError, ValueError, OptimizeWarning) as exc:
            why = f"curve_fit failed: {' '.join(str(exc).split())[:80]}"
            continue
        if not np.all(np.isfinite(params)):
            continue
        sse = float(np.sum((model(x, *params) - loss) ** 2))
        if sse < best_sse:
            best, best_sse = params, sse
    if best is None:
        return None, why
    a, b, c = (float(v) for v in best)
    if b >= B_MAX * (1 - 1e-3):
        return None, f"curve_fit ended on b's bound {B_MAX:g}"
    if b <= B_MIN * 10:
        return None, "curve_fit ended on b's lower bound: the loss does not fall with N"
    if c >= low - 1e-6 * max(abs(low), 1.0):
        return None, "curve_fit put c at the lowest loss"
    return (a * scale ** b, b, c), None


def fit_power_law(n, loss, fixed_c: float = FIXED_C) -> PowerLaw | None:
    """Fit loss = a N^-b + c to the points (n[i], loss[i]); sizes may repeat (several seeds).

    curve_fit with MIN_FULL_POINTS or more distinct sizes, else (or when it fails) the log-linear fit with
    c = fixed_c. None with fewer than MIN_POINTS distinct sizes or a loss at or below fixed_c.
    """
    n = np.asarray(n, dtype=float)
    loss = np.asarray(loss, dtype=float)
    keep = np.isfinite(n) & np.isfinite(loss) & (n > 0)
    n, loss = n[keep], loss[keep]
    distinct = len(np.unique(n))
    if distinct < MIN_POINTS:
        return None
    if distinct < MIN_FULL_POINTS:
        note = f"{distinct} sizes < {MIN_FULL_POINTS}"
    else:
        params, note = _curve_fit(n, loss)
        if params is not None:
            a, b, c = params
            return PowerLaw(a=a, b=b, c=c, method=CURVE_FIT, n_points=distinct)
    return _log_linear(n, loss, fixed_c, distinct, note)

# ----------------------------------------------------------------------------- the study: series, fits, ratios
# Points: complete trials with the metric in trial.json and trial.json's params.non_embedding, grouped by the
# variant each ran. Reference: the registry's reference variant when it has a fit, else the first fitted one in
# case order. N_ref is its largest size and L* its fitted loss there; a variant's ratio = (the N at which its fit
# reaches L*) / N_ref, below 1 when it needs fewer parameters. Per seed: each seed's points refit (the
# reference's too, with that seed's L*), the ratios summarized over seeds as a Stat.

METRIC = "val/loss"
PARAMS_KEY = "non_embedding"  # the key of trial.json's "params" (Decoder.parameter_report) that is N
MIN_SIZES = 3  # distinct non-embedding counts of one variant that make a study a scaling study
MIN_SPAN = 2.0  # ... spanning at least this factor (largest / smallest)


@dataclass(frozen=True)
class SizePoint:
    n: int  # non-embedding parameters
    loss: float
    seed: int
    case: str


@dataclass
class Series:
    """One variant's (N, loss) points over the study's cases and seeds."""

    variant: str
    points: list[SizePoint] = field(default_factory=list)

    @property
    def sizes(self) -> list[int]:
        return sorted({p.n for p in self.points})

    @property
    def seeds(self) -> list[int]:
        return sorted({p.seed for p in self.points})

    def means(self) -> tuple[np.ndarray, np.ndarray]:
        """(sizes, mean loss over the seeds at each size)."""
        sizes = self.sizes
        return np.array(sizes, float), np.array([np.mean([p.loss for p in self.points if p.n == n]) for n in sizes])

    def of_seed(self, seed: int) -> tuple[np.ndarray, np.ndarray]:
        chosen = [p for p in self.points if p.seed == seed]
        return np.array([p.n for p in chosen], float), np.array([p.loss for p in chosen])

    def spans(self) -> bool:
        sizes = self.sizes
        return len(sizes) >= MIN_SIZES and sizes[-1] >= MIN_SPAN * sizes[0]


@dataclass
class VariantScaling:
    """A variant's fits and the parameters it needs to reach the reference's loss at N_ref."""

    series: Series
    fit: PowerLaw | None  # pooled: each size's mean loss over seeds
    seed_fits: dict[int, PowerLaw | None]
    n_needed: float | None  # pooled fit's N at L*
    ratio: float | None  # n_needed / N_ref
    seed_ratios: dict[int, float]  # per seed: that seed's fit against that seed's reference L*

    @property
    def variant(self) -> str:
        return self.series.variant

    @property
    def ratio_stat(self) -> Stat:
        return Stat(list(self.seed_ratios.values()))

    @property
    def extrapolated(self) -> bool:
        """N needed lies outside the sizes this variant ran: the fit's extrapolation, not a measurement."""
        sizes, slack = self.series.sizes, 1e-6  # the reference's own N_ref, found again to rounding
        return self.n_needed is not None and not sizes[0] * (1 - slack) <= self.n_needed <= sizes[-1] * (1 + slack)


@dataclass
class ScalingReport:
    metric: str
    reference: str  # the variant ratios are relative to
    n_ref: int  # the reference's largest size
    target: float  # L*: the reference's pooled fitted loss at n_ref
    rows: list[VariantScaling]  # every variant with a series, study order; the reference first
    unfitted: list[Series]  # variants no fit could be made for (fewer than MIN_POINTS sizes, say)

    @property
    def seeds(self) -> list[int]:
        return sorted({s for row in self.rows for s in row.series.seeds})


def _non_embedding(trial: TrialRun) -> int | None:
    value = ((trial.record or {}).get("params") or {}).get(PARAMS_KEY)
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None


def collect_series(runs: StudyRuns, metric: str = METRIC) -> list[Series]:
    """One Series per variant, in the order its first case appears in sweep.json; complete trials only."""
    series: dict[str, Series] = {}
    for case in runs.cases:
        for trial in runs.trials_of(case):
            n, loss = _non_embedding(trial), trial.metrics.get(metric)
            if trial.state != "complete" or trial.variant is None or n is None or loss is None:
                continue
            series.setdefault(trial.variant, Series(trial.variant)).points.append(
                SizePoint(n, loss, trial.seed, case.name))
    return list(series.values())


def is_scaling_study(series: Sequence[Series]) -> bool:
    """Some variant spans MIN_SIZES sizes or more over a factor MIN_SPAN (an ordinary table has none)."""
    return any(s.spans() for s in series)


def _ratio(fit: PowerLaw | None, target: float | None, n_ref: int) -> tuple[float | None, float | None]:
    if fit is None or target is None:
        return None, None
    needed = fit.params_for(target)
    return needed, (needed / n_ref if needed is not None else None)


def scaling_report(runs: StudyRuns, metric: str = METRIC, reference: str | None = None) -> ScalingReport | None:
    """The scaling section, or None when the study is not a scaling study (or no variant can be fitted)."""
    series = collect_series(runs, metric)
    if not is_scaling_study(series):
        return None
    fits = {s.variant: fit_power_law(*s.means()) for s in series}
    fitted = [s for s in series if fits[s.variant] is not None]
    if not fitted:
        return None
    wanted = reference or reference_variant_name()
    ref = next((s for s in fitted if s.variant == wanted), fitted[0])
    n_ref = ref.sizes[-1]
    target = float(fits[ref.variant].loss(n_ref))
    ref_seed_targets = {}
    for seed in ref.seeds:
        seed_fit = fit_power_law(*ref.of_seed(seed))
        ref_seed_targets[seed] = float(seed_fit.loss(n_ref)) if seed_fit is not None else None
    rows = []
    for s in [ref] + [s for s in fitted if s is not ref]:
        seed_fits = {seed: fit_power_law(*s.of_seed(seed)) for seed in s.seeds}
        n_needed, ratio = _ratio(fits[s.variant], target, n_ref)
        seed_ratios = {}
        for seed, seed_fit in seed_fits.items():
            _, seed_ratio = _ratio(seed_fit, ref_seed_targets.get(seed), n_ref)
            if seed_ratio is not None:
                seed_ratios[seed] = seed_ratio
        rows.append(VariantScaling(s, fits[s.variant], seed_fits, n_needed, ratio, seed_ratios))
    return ScalingReport(metric, ref.variant, n_ref, target, rows, [s for s in series if fits[s.variant] is None])

# ----------------------------------------------------------------------------- as text: table, compare.md, csv

TITLE = "Scaling: parameters needed to reach the reference's loss"
HEADER = ["Variant", "Sizes", "N range", "Fit", "a", "b", "c", "Loss at N_ref", "N needed", "Ratio",
          "Ratio per seed", "95% CI", "Seeds"]


def _coefficient_text(x: float | None, digits: int = 3) -> str:
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
        *(_coefficient_text(x) for x in ((fit.a, fit.b, fit.c) if fit else (None, None, None))),
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
    align = ["left", "right", "right", "left"] + ["right"] * (len(HEADER) - 4)
    lines = [f"## {TITLE}", "", *markdown.table(HEADER, [cells(report, row) for row in report.rows], align)]
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

# ----------------------------------------------------------------------------- the figure: scaling.png

def plot_scaling(report: ScalingReport, study: str, path: str | Path) -> None:
    fig = new_figure(9, 5.6)
    ax = fig.subplots()
    colors = series_colors(len(report.rows))
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

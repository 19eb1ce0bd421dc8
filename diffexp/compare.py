"""`diffexp compare RUNS_DIR`: one table (and plots) of a sweep's cases, mean ± std over seeds.

Input is a study's run directory as the sweep runner writes it::

    runs/<study>/sweep.json                              cases (table order), seeds, objective
    runs/<study>/<case_slug>/seed<k>/trial.json          written when a trial ends (complete or pruned)
    runs/<study>/<case_slug>/seed<k>/events.out.tfevents.*   its TensorBoard scalars
    runs/<study>/<case_slug>/seed<k>-draw<d>/...         search draw d > 0 (diffexp.sweep.layout names them)

or an Optuna study (`--study NAME --storage URL`) whose user attribute ``runs_dir`` points there.

Rules of the summary:

* one row per case of sweep.json, in its order, whether or not any of its trials finished;
* means and sample standard deviations (ddof=1) are over the *complete* trials of the case; with a
  single complete seed the std is reported as ``n/a`` (empty in compare.csv), never as 0;
* pruned trials are excluded from every mean but counted (Seeds column, "pruned" section);
* a search sweep's draws (sweep.json's n_trials) are trials of their case like its seeds;
* a (case, seed[, draw]) with no trial.json is missing: "running or crashed" when its run directory exists,
  "not started" otherwise; trial.json states other than complete/pruned are listed as failed;
* every numeric key under trial.json's "metrics" is a column: the objective (from sweep.json) first, then
  val/*, test/*, train/*, the rest, alphabetical within each;
  if a complete trial lacks the objective there, the last value of that tag in its events is used.

Outputs (default ``runs/<study>/compare/``): ``compare.md``, ``compare.csv``, ``val_loss_curves.png``,
``objective_bars.png``; the table is also printed with rich.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diffexp.errors import UserError, guarded
from diffexp.sweep.layout import SWEEP_FILE
from diffexp.sweep.runs import Case, StudyRuns, TrialRun, load_curves, load_study_runs  # noqa: F401

CURVE_TAG = "val/loss"
DEFAULT_OUT = "compare"
PLOT_DPI = 120
NA = "n/a"  # the std of a single seed
EMPTY = "—"  # a case with no complete seed

_PREFIXES = {"val": "Valid", "test": "Test", "train": "Train"}


class CompareError(UserError):
    """Bad input (missing/invalid study dir, unknown metric, bad storage); main() prints it and exits 2."""


# -- summary ---------------------------------------------------------------------------------------------
@dataclass
class Stat:
    """Mean and sample std (ddof=1) of the complete seeds; std is None with one value, both None with none."""

    values: list[float]

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float | None:
        return statistics.fmean(self.values) if self.values else None

    @property
    def std(self) -> float | None:
        return statistics.stdev(self.values) if len(self.values) > 1 else None

    def format(self) -> str:
        if self.mean is None:
            return EMPTY
        return f"{_num(self.mean)} ± {NA if self.std is None else _num(self.std)}"


@dataclass
class CaseSummary:
    case: Case
    n_expected: int
    complete: list[TrialRun]
    pruned: list[TrialRun]
    failed: list[TrialRun]  # trial.json with another state, or unreadable
    missing: list[TrialRun]  # no trial.json
    stats: dict[str, Stat]
    params_total: int | None
    params_non_embedding: int | None
    tokens_per_s: float | None
    wall_s: float | None

    @property
    def seeds_text(self) -> str:
        notes = [f"{len(group)} {word}" for group, word in
                 ((self.pruned, "pruned"), (self.failed, "failed"), (self.missing, "missing")) if group]
        return f"{len(self.complete)}/{self.n_expected}" + (f" ({', '.join(notes)})" if notes else "")


def _mean(values: Iterable[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _param(trials: Sequence[TrialRun], key: str) -> int | None:
    for trial in trials:  # the same for every seed of a case: take the first that has it
        value = _number(((trial.record or {}).get("params") or {}).get(key))
        if value is not None:
            return int(value)
    return None


def check_metrics(runs: StudyRuns, metrics: Sequence[str] | None) -> list[str]:
    """The metric columns: the objective then `metrics` (default: every recorded metric). Unknown -> CompareError."""
    available = runs.metric_names()
    if not metrics:
        return available
    unknown = [m for m in metrics if m not in available]
    if unknown:
        have = ", ".join(available[1:]) if len(available) > 1 else "none besides the objective yet"
        raise CompareError(f"unknown --metric {', '.join(map(repr, unknown))}: available metrics of study "
                           f"{runs.study!r} are {runs.objective} (objective), {have}")
    return list(dict.fromkeys([runs.objective, *metrics]))


def summarize(runs: StudyRuns, metrics: Sequence[str] | None = None) -> list[CaseSummary]:
    """One CaseSummary per case of sweep.json, in its order (see the module docstring for the rules)."""
    columns = check_metrics(runs, metrics)
    rows = []
    for case in runs.cases:
        trials = runs.trials_of(case)
        complete = [t for t in trials if t.state == "complete"]
        pruned = [t for t in trials if t.state == "pruned"]
        missing = [t for t in trials if t.record is None and t.error is None]
        failed = [t for t in trials if (t.record is not None and t.state not in ("complete", "pruned")) or t.error]
        stats = {}
        for name in columns:
            values = []
            for trial in complete:
                value = trial.metrics.get(name)
                if value is None and name == runs.objective and trial.curves.get(name):
                    value = trial.curves[name][-1][1]  # fallback: last logged value of the objective tag
                if value is not None:
                    values.append(value)
            stats[name] = Stat(values)
        rows.append(CaseSummary(
            case=case, n_expected=len(trials), complete=complete, pruned=pruned, failed=failed, missing=missing,
            stats=stats,
            params_total=_param(complete + pruned + failed, "total"),
            params_non_embedding=_param(complete + pruned + failed, "non_embedding"),
            tokens_per_s=_mean(_number((t.record or {}).get("tokens_per_s")) for t in complete),
            wall_s=_mean(_number((t.record or {}).get("wall_s")) for t in complete),
        ))
    return rows


def best_case(runs: StudyRuns, rows: Sequence[CaseSummary]) -> CaseSummary | None:
    scored = [r for r in rows if r.stats[runs.objective].mean is not None]
    if not scored:
        return None
    pick = min if runs.direction == "minimize" else max
    return pick(scored, key=lambda r: r.stats[runs.objective].mean)


# -- formatting ------------------------------------------------------------------------------------------
def _num(x: float) -> str:
    if not math.isfinite(x):
        return str(x)
    return f"{x:,.1f}" if abs(x) >= 1000 else f"{x:.3f}"


def format_params(n: int | None) -> str:
    """Paper style: 920_000 -> '0.92M', 1_003_000 -> '1.00M', 830_000_000 -> '830M', 1.4e9 -> '1.40B'."""
    if n is None:
        return EMPTY
    for scale, suffix in ((1e9, "B"), (1e5, "M"), (1e3, "K")):
        if abs(n) >= scale:
            value = n / (1e6 if suffix == "M" else scale)
            return f"{value:.0f}{suffix}" if abs(value) >= 100 else f"{value:.{1 if abs(value) >= 10 else 2}f}{suffix}"
    return str(n)


def metric_label(name: str) -> str:
    """'val/loss' -> 'Valid loss', 'train/loss' -> 'Train loss'; other names unchanged."""
    head, sep, tail = name.partition("/")
    if sep and head in _PREFIXES:
        return f"{_PREFIXES[head]} {tail}"
    return name


def _arrow(direction: str) -> str:
    return "↓" if direction == "minimize" else "↑"


def _ago(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def issues(runs: StudyRuns, rows: Sequence[CaseSummary], now: float | None = None) -> dict[str, list[str]]:
    """Plain-text lines of the sections below the table: missing, no completed seed, pruned, failed, unexpected."""
    now = time.time() if now is None else now
    out: dict[str, list[str]] = {"missing": [], "no completed seed": [], "pruned": [], "failed": [],
                                 "unexpected": []}
    for row in rows:
        for trial in row.missing:
            if trial.path.is_dir():
                detail = "run dir exists, no trial.json (running or crashed)"
                step, written = trial.last_step, trial.last_write
                if step is not None:
                    detail += f"; last logged step {step}"
                if written is not None:
                    detail += f"; last write {_ago(max(0.0, now - written))} ago"
            else:
                detail = "not started (no run dir)"
            out["missing"].append(f"{row.case.name}, {trial.label}: {detail}")
        if not row.complete:
            out["no completed seed"].append(row.case.name)
        for trial in row.pruned:
            step = (trial.record or {}).get("global_step")
            value = trial.metrics.get(runs.objective)
            where = f" at step {step}" if step is not None else ""
            last = f" ({runs.objective} {_num(value)})" if value is not None else ""
            out["pruned"].append(f"{row.case.name}, {trial.label}: pruned{where}{last}")
        for trial in row.failed:
            why = trial.error or f"state {trial.state!r}"
            out["failed"].append(f"{row.case.name}, {trial.label}: {why}")
    for path in runs.unexpected:
        out["unexpected"].append(f"{path.relative_to(runs.study_dir)}: not a trial of {SWEEP_FILE}; ignored")
    return {k: v for k, v in out.items() if v}


_SECTION_TITLES = {
    "missing": "Missing trials (no trial.json)",
    "no completed seed": "Cases with no completed seed (shown as —)",
    "pruned": "Pruned trials (counted in Seeds, excluded from the means)",
    "failed": "Failed trials (excluded from the means)",
    "unexpected": "Unexpected run directories",
}

NOTE = ("mean ± sample std (ddof=1) over the complete seeds; std is n/a with a single complete seed; "
        "pruned trials are counted in Seeds but excluded from the means")


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_markdown(runs: StudyRuns, rows: Sequence[CaseSummary], metrics: Sequence[str]) -> str:
    best = best_case(runs, rows)
    header = ["Model", "Params", "Non-emb. params"]
    header += [f"{metric_label(m)} {_arrow(runs.direction)}" if m == runs.objective else metric_label(m)
               for m in metrics]
    header += ["Seeds", "Tokens/s"]
    lines = [f"# {runs.study}: comparison", ""]
    meta = f"Objective: `{runs.objective}` ({runs.direction})"
    if runs.spec:
        meta += f". Spec: `{runs.spec}`"
    meta += f". Seeds: {', '.join(map(str, runs.seeds))}."
    lines += [meta, "", "| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    for row in rows:
        cells = [_md_cell(row.case.name), format_params(row.params_total), format_params(row.params_non_embedding)]
        for m in metrics:
            text = row.stats[m].format()
            cells.append(f"**{text}**" if m == runs.objective and row is best else text)
        cells += [row.seeds_text, EMPTY if row.tokens_per_s is None else f"{row.tokens_per_s:,.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Values: {NOTE}. Best objective in bold. Params: total and non-embedding counts.", ""]
    for key, items in issues(runs, rows).items():
        lines += [f"## {_SECTION_TITLES[key]}", ""] + [f"- {_md_cell(item)}" for item in items] + [""]
    return "\n".join(lines)


def write_csv(path: str | Path, runs: StudyRuns, rows: Sequence[CaseSummary], metrics: Sequence[str]) -> None:
    """One row per case; for each metric `<metric>_mean`, `<metric>_std` (empty with < 2 seeds), `<metric>_n`."""
    fields = ["case", "slug", "overrides", "n_expected", "n_complete", "n_pruned", "n_failed", "n_missing",
              "seeds_complete", "seeds_pruned", "params_total", "params_non_embedding", "tokens_per_s_mean",
              "wall_s_mean"]
    for m in metrics:
        fields += [f"{m}_mean", f"{m}_std", f"{m}_n"]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            record: dict[str, Any] = {
                "case": row.case.name, "slug": row.case.slug, "overrides": json.dumps(row.case.overrides),
                "n_expected": row.n_expected, "n_complete": len(row.complete), "n_pruned": len(row.pruned),
                "n_failed": len(row.failed), "n_missing": len(row.missing),
                "seeds_complete": ";".join(t.path.name[len("seed"):] for t in row.complete),
                "seeds_pruned": ";".join(t.path.name[len("seed"):] for t in row.pruned),
                "params_total": row.params_total, "params_non_embedding": row.params_non_embedding,
                "tokens_per_s_mean": row.tokens_per_s, "wall_s_mean": row.wall_s,
            }
            for m in metrics:
                stat = row.stats[m]
                record.update({f"{m}_mean": stat.mean, f"{m}_std": stat.std, f"{m}_n": stat.n})
            writer.writerow({k: "" if v is None else v for k, v in record.items()})


def _column_width(label: str, cells: Sequence[str]) -> int:
    """Width of a rich table column: the widest of its label and cells, plus padding and its border."""
    return max([len(label), *map(len, cells)]) + 3


def _pack_columns(widths: Sequence[int], first_used: int, used_by_each: int, room: int) -> list[list[int]]:
    """Split column indices, in order, into groups that fit `room`: the first group beside `first_used`
    characters (it may stay empty), each later one beside `used_by_each` (never empty)."""
    groups: list[list[int]] = [[]]
    used = first_used
    for i, width in enumerate(widths):
        if used + width > room and (groups[-1] or len(groups) == 1):
            groups.append([])
            used = used_by_each
        groups[-1].append(i)
        used += width
    return groups


def print_report(console, runs: StudyRuns, rows: Sequence[CaseSummary], metrics: Sequence[str]) -> None:
    """The table, split into as many tables as the console width needs; each repeats the Case column.

    The first holds what a paper's table shows (the objective, parameters, seeds, tokens/s); the other
    recorded metrics follow in order, so every column stays readable instead of squeezed to an ellipsis.
    """
    from rich.table import Table
    from rich.text import Text

    best = best_case(runs, rows)

    def metric_column(m: str):
        label = metric_label(m) + (f" {_arrow(runs.direction)}" if m == runs.objective else "")
        cells = [Text(row.stats[m].format(), style="green" if m == runs.objective and row is best else "")
                 for row in rows]
        return label, cells, "bold" if m == runs.objective else None

    def text_column(label: str, values: Sequence[str], styles: Sequence[str] | None = None):
        return label, [Text(v, style=(styles[i] if styles else "")) for i, v in enumerate(values)], None

    objective = [m for m in metrics if m == runs.objective]
    head = [metric_column(m) for m in objective] + [
        text_column("Params", [format_params(r.params_total) for r in rows]),
        text_column("Non-emb.", [format_params(r.params_non_embedding) for r in rows]),
        text_column("Seeds", [r.seeds_text for r in rows],
                    ["" if len(r.complete) == r.n_expected else "yellow" for r in rows]),
        text_column("Tokens/s", [EMPTY if r.tokens_per_s is None else f"{r.tokens_per_s:,.0f}" for r in rows]),
    ]
    rest = [metric_column(m) for m in metrics if m != runs.objective]
    case_width = _column_width("Case", [r.case.name for r in rows]) + 1
    room = max(console.width, 40)
    head_width = sum(_column_width(label, [c.plain for c in cells]) for label, cells, _ in head)
    widths = [_column_width(label, [c.plain for c in cells]) for label, cells, _ in rest]
    packed = _pack_columns(widths, case_width + head_width, case_width, room)
    groups = [head + [rest[i] for i in packed[0]]] + [[rest[i] for i in group] for group in packed[1:]]

    for n, columns in enumerate(groups):
        title = f"{runs.study}: objective {runs.objective} ({runs.direction})"
        if len(groups) > 1:
            title += f" [{n + 1}/{len(groups)}]"
        table = Table(title=title, title_justify="left")
        table.add_column("Case", no_wrap=True)
        for label, _, style in columns:
            table.add_column(label, justify="right", no_wrap=True, style=style)
        for r, row in enumerate(rows):
            table.add_row(Text(row.case.name), *(cells[r] for _, cells, _ in columns))
        console.print(table)
    # plain lines hold paths and case names: never wrapped inside them, whatever the console width
    console.print(Text(NOTE), soft_wrap=True)
    for key, items in issues(runs, rows).items():
        console.print(Text(_SECTION_TITLES[key] + ":", style="bold yellow" if key != "pruned" else "bold"),
                      soft_wrap=True)
        for item in items:
            console.print(Text("  - " + item), soft_wrap=True)


# -- plots -----------------------------------------------------------------------------------------------
def _colors(n: int) -> list:
    from matplotlib import colormaps

    name = "tab10" if n <= 10 else "tab20" if n <= 20 else "turbo"
    cmap = colormaps[name]
    return [cmap(i) if n <= 20 else cmap(i / max(1, n - 1)) for i in range(n)]


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=PLOT_DPI, layout="constrained")
    FigureCanvasAgg(fig)  # Agg, without touching pyplot's global backend
    return fig


def _case_curve(trials: Sequence[TrialRun], tag: str):
    """steps, mean, min, max over the trials, at every step logged by at least one of them."""
    series = [dict(t.curves[tag]) for t in trials if t.curves.get(tag)]
    steps = sorted({s for points in series for s in points})
    mean, low, high = [], [], []
    for step in steps:
        values = [points[step] for points in series if step in points]
        mean.append(statistics.fmean(values))
        low.append(min(values))
        high.append(max(values))
    return steps, mean, low, high, len(series)


def plot_val_curves(runs: StudyRuns, rows: Sequence[CaseSummary], path: str | Path, tag: str = CURVE_TAG) -> bool:
    """Validation loss vs step per case (complete seeds): mean line, min–max band. False when nothing to plot."""
    curves = [(row, _case_curve(row.complete, tag)) for row in rows]
    curves = [(row, c) for row, c in curves if c[0]]
    if not curves:
        return False
    fig = _figure(13, 5.2 + 0.25 * math.ceil(len(curves) / 3))
    full, zoom = fig.subplots(1, 2)
    colors = dict(zip([row.case.slug for row in rows], _colors(len(rows))))
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
    fig = _figure(9, max(2.6, 0.5 * n + 1.6))
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


# -- Optuna storage ------------------------------------------------------------------------------------
def runs_dir_from_optuna(study_name: str, storage: str, origin: str = "--storage") -> Path:
    """The study run directory recorded in the Optuna study's user attribute "runs_dir".

    A relative runs_dir is taken from the current directory, else from the storage file's directory;
    if it names the parent (runs/) rather than runs/<study>/, runs/<study_name>/ is used.
    `origin` says where the URL came from (--storage or DIFFEXP_STORAGE), for messages; they show it masked.
    """
    import optuna

    from diffexp.sweep.storage import describe, failure, journal_path, open_storage, sqlite_path

    where = describe(storage, origin)
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        handle = open_storage(storage, origin, create=False)
        try:
            study = optuna.load_study(study_name=study_name, storage=handle)
        except KeyError:
            names = optuna.get_all_study_names(storage=handle)
            have = ", ".join(map(repr, names)) if names else "none"
            raise CompareError(f"--study {study_name!r} not found in {where} (studies there: {have})") from None
        except Exception as exc:  # connection lost, permission denied, ...: never echo the password
            raise failure(storage, where, exc, doing="cannot read the study") from None
    finally:
        optuna.logging.set_verbosity(verbosity)
    runs_dir = study.user_attrs.get("runs_dir")
    if not runs_dir:
        raise CompareError(f"Optuna study {study_name!r} in {where} has no user attribute 'runs_dir' "
                           "(the sweep runner sets it to the study's run directory)")
    candidates = [Path(runs_dir)]
    storage_file = sqlite_path(storage) or journal_path(storage)
    if not Path(runs_dir).is_absolute() and storage_file is not None:
        candidates.append(storage_file.resolve().parent / runs_dir)
    for base in candidates:
        for path in (base, base / study_name):
            if (path / SWEEP_FILE).is_file():
                return path
    return candidates[0]  # load_study_runs explains what is missing there


# -- entry point -----------------------------------------------------------------------------------------
def compare(study_dir: str | Path, out: str | Path | None = None, metrics: Sequence[str] | None = None,
            plots: bool = True, console=None) -> list[CaseSummary]:
    """Load, summarize, print, and write compare.md, compare.csv (and the PNGs) into `out`."""
    from rich.console import Console

    console = console or Console()
    runs = load_study_runs(study_dir, curves=plots)
    columns = check_metrics(runs, metrics)
    rows = summarize(runs, columns)
    out = Path(out) if out is not None else runs.study_dir / DEFAULT_OUT
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CompareError(f"--out {str(out)!r}: cannot create the directory ({exc.strerror or exc})") from exc
    print_report(console, runs, rows, columns)
    written = [out / "compare.md", out / "compare.csv"]
    (out / "compare.md").write_text(render_markdown(runs, rows, columns))
    write_csv(out / "compare.csv", runs, rows, columns)
    if plots:
        if plot_val_curves(runs, rows, out / "val_loss_curves.png"):
            written.append(out / "val_loss_curves.png")
        else:
            console.print(f"no {CURVE_TAG} curve in any complete trial: val_loss_curves.png not written",
                          soft_wrap=True, markup=False, highlight=False)
        plot_objective_bars(runs, rows, out / "objective_bars.png")
        written.append(out / "objective_bars.png")
    console.print("wrote " + ", ".join(str(p) for p in written), soft_wrap=True, markup=False, highlight=False)
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="diffexp compare",
        description="Compare the cases of a sweep: mean ± std over seeds per case, as a table (printed, "
                    "compare.md, compare.csv) and plots.")
    parser.add_argument("runs_dir", nargs="?", metavar="RUNS_DIR",
                        help="the study's run directory (runs/<study>/, holding sweep.json)")
    parser.add_argument("--study", help="Optuna study name (with --storage) instead of RUNS_DIR")
    parser.add_argument("--storage", help="Optuna storage of --study: an RDB URL, a .db file or a .log/.journal "
                                          "file (default: the environment variable DIFFEXP_STORAGE)")
    parser.add_argument("--out", help="output directory (default RUNS_DIR/compare/)")
    parser.add_argument("--metric", nargs="+", action="extend", metavar="NAME",
                        help="metric columns to show besides the objective (default: all recorded)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    return parser


def main(argv: list[str] | None = None) -> int:
    """`diffexp compare RUNS_DIR [--out DIR] [--metric NAME ...] [--no-plots]` or `--study NAME [--storage URL]`.

    Returns 0 on success (partial studies included), 2 on bad input, printed as one `error: ...` paragraph
    (diffexp.errors.guarded; DIFFEXP_DEBUG=1 shows the traceback instead).
    """
    try:
        return guarded(_main, argv)
    except SystemExit as exc:  # a UserError (printed by guarded), or argparse's usage error or --help
        return exc.code if isinstance(exc.code, int) else 2


def _main(argv: list[str] | None) -> int:
    from rich.console import Console

    from diffexp.sweep.storage import STORAGE_URL_ENV, resolve_url

    args = build_parser().parse_args(argv)
    console = Console()
    if not console.is_terminal:  # piped or captured: do not squeeze the table into 80 columns
        console = Console(width=max(console.width, 200))
    if args.runs_dir and (args.study or args.storage):
        raise CompareError("give either RUNS_DIR or --study NAME (with --storage URL or DIFFEXP_STORAGE), not both")
    if args.runs_dir:
        study_dir = Path(args.runs_dir)
    elif args.study:
        storage, origin = resolve_url(args.storage)
        if storage is None:
            raise CompareError(f"--study {args.study!r} needs the study's storage: --storage URL, or the URL in "
                               f"the environment variable {STORAGE_URL_ENV}")
        study_dir = runs_dir_from_optuna(args.study, storage, origin)
    elif args.storage:
        raise CompareError("--storage goes with --study NAME: --study NAME --storage URL")
    else:
        raise CompareError("expected RUNS_DIR (a study's run directory, runs/<study>/) "
                           f"or --study NAME with --storage URL (or {STORAGE_URL_ENV})")
    compare(study_dir, out=args.out, metrics=args.metric, plots=not args.no_plots, console=console)
    return 0


if __name__ == "__main__":
    sys.exit(main())

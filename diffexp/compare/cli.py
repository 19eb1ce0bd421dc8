"""`diffexp compare RUNS_DIR` or `--study NAME [--storage URL]`: the arguments, and what runs in which order."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from diffexp.compare.errors import CompareError
from diffexp.compare.harness import DEFAULT_METRIC, harness_markdown, harness_table, print_harness, write_harness_csv
from diffexp.compare.paired import LEVEL, check_level, paired_reports
from diffexp.compare.paired_metrics import check_paired_metrics, paired_metrics_markdown, print_paired_metrics
from diffexp.compare.paper import paper_checks, paper_markdown, paper_metrics, print_paper
from diffexp.compare.plots import (
    CURVE_TAG,
    case_colors,
    plot_bit_widths,
    plot_grid,
    plot_objective_bars,
    plot_paired_diffs,
    plot_val_curves,
    sparse_curves_note,
)
from diffexp.compare.render import print_report, render_markdown, write_csv
from diffexp.compare.scaling import (
    plot_scaling,
    print_scaling,
    render_scaling_markdown,
    scaling_report,
    write_scaling_csv,
)
from diffexp.compare.stats import CaseSummary, check_metrics, summarize
from diffexp.compare.study import runs_dir_from_optuna
from diffexp.compare.views import plot_name, print_views, view_rows, views_markdown, write_paired_csv
from diffexp.sweep.runs import load_study_runs

DEFAULT_OUT = "compare"
PIPED_WIDTH = 200  # piped or captured output is read in an editor, not a terminal: no need to squeeze


def compare(study_dir: str | Path, out: str | Path | None = None, metrics: Sequence[str] | None = None,
            plots: bool = True, console=None, harness_metric: str = DEFAULT_METRIC, reference: str | None = None,
            level: float = LEVEL, paired_metrics: Sequence[str] | None = None) -> list[CaseSummary]:
    """Load, summarize, print, and write compare.md, compare.csv (and the PNGs) into `out`.

    Every case is set against the reference case (`reference`, a case's name or slug; default the baseline)
    seed by seed (diffexp.compare.paired): the mean difference, its `level` interval and verdict, and the
    power statement; paired_diffs.png plots them. A tune_lr study (diffexp.sweep.tune) has two views, the same
    lr and each case's best lr: each gets its paired table (diffexp.compare.views), paired.csv holds both and
    paired_diffs-<view>.png plots each. A study of cases crossed with a grid has one view per grid point, with
    tables case by grid point and grid.png (diffexp.compare.views). `paired_metrics` (--paired-metric) pairs the
    cases in those metrics too (diffexp.compare.paired_metrics).

    A study with several sizes per variant (diffexp.compare.scaling) also gets the scaling section:
    printed, appended to compare.md, scaling.csv and scaling.png. Trials evaluated with `diffexp eval harness`
    add the LM-Eval table (diffexp.compare.harness): printed, appended to compare.md, harness.csv."""
    from rich.console import Console

    console = console or Console()
    level = check_level(level)
    runs = load_study_runs(study_dir, curves=plots)
    columns = check_metrics(runs, metrics)
    recorded = runs.metric_names()
    extra = check_paired_metrics(runs, paired_metrics)
    rows = summarize(runs, columns + [m for m in [*extra, *paper_metrics(runs)] if m not in columns and m in recorded])
    reports = paired_reports(runs, rows, reference, level)
    paired = reports.get("")  # a study without views: the paired columns go in the main table
    out = Path(out) if out is not None else runs.study_dir / DEFAULT_OUT
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CompareError(f"--out {str(out)!r}: cannot create the directory ({exc.strerror or exc})") from exc
    print_report(console, runs, rows, columns, paired)
    if paired is None:
        print_views(console, runs, rows, reports)
    for view, report in reports.items():  # --paired-metric: the same pairs in other metrics
        print_paired_metrics(console, runs, view_rows(runs, rows, view) if view else rows, report, extra, view)
    checks = paper_checks(runs, rows, level)
    print_paper(console, runs, checks)
    scaling = scaling_report(runs)
    written = [out / "compare.md", out / "compare.csv"]
    markdown = render_markdown(runs, rows, columns, paired) + paper_markdown(runs, checks)
    if paired is None:
        markdown += "\n" + views_markdown(runs, rows, reports)
        write_paired_csv(out / "paired.csv", runs, rows, reports)
        written.append(out / "paired.csv")
    for view, report in reports.items():
        markdown += "\n" + paired_metrics_markdown(runs, view_rows(runs, rows, view) if view else rows, report,
                                                   extra, view)
    if scaling is not None:
        print_scaling(console, scaling)
        markdown += "\n" + render_scaling_markdown(scaling)
        write_scaling_csv(out / "scaling.csv", scaling)
        written.append(out / "scaling.csv")
    harness = harness_table(runs, harness_metric)
    if harness is not None:
        print_harness(console, harness)
        markdown += "\n" + harness_markdown(harness)
        write_harness_csv(out / "harness.csv", harness)
        written.append(out / "harness.csv")
    (out / "compare.md").write_text(markdown)
    write_csv(out / "compare.csv", runs, rows, columns, paired)
    if plots:
        colors = case_colors(runs, rows)  # one colour per case across every plot
        if plot_val_curves(runs, rows, out / "val_loss_curves.png", colors=colors):
            written.append(out / "val_loss_curves.png")
            if (note := sparse_curves_note(runs, rows)) is not None:
                console.print(f"warning: {note}", soft_wrap=True, markup=False, highlight=False)
        else:
            console.print(f"no {CURVE_TAG} curve in any complete trial: val_loss_curves.png not written",
                          soft_wrap=True, markup=False, highlight=False)
        plot_objective_bars(runs, rows, out / "objective_bars.png", colors=colors)
        written.append(out / "objective_bars.png")
        for view, report in reports.items():
            path = out / (plot_name(view) if view else "paired_diffs.png")
            if plot_paired_diffs(runs, view_rows(runs, rows, view) if view else rows, report, path, view,
                                 colors=colors):
                written.append(path)
        if plot_grid(runs, rows, out / "grid.png"):
            written.append(out / "grid.png")
        if plot_bit_widths(runs, rows, out / "bit_widths.png", colors=colors):
            written.append(out / "bit_widths.png")
        if scaling is not None:
            plot_scaling(scaling, runs.study, out / "scaling.png")
            written.append(out / "scaling.png")
    console.print("wrote " + ", ".join(str(p) for p in written), soft_wrap=True, markup=False, highlight=False)
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(allow_abbrev=False,
        prog="diffexp compare",
        description="Compare the cases of a sweep: mean ± std over seeds per case, and each case's paired "
                    "difference to a reference case seed by seed (mean, confidence interval, verdict), as a "
                    "table (printed, compare.md, compare.csv) and plots.")
    parser.add_argument("runs_dir", nargs="?", metavar="RUNS_DIR",
                        help="the study's run directory (runs/<study>/, holding sweep.json)")
    parser.add_argument("--study", help="Optuna study name (with --storage) instead of RUNS_DIR")
    parser.add_argument("--storage", help="Optuna storage of --study: an RDB URL, a .db file or a .log/.journal "
                                          "file (default: the environment variable DIFFEXP_STORAGE)")
    parser.add_argument("--out", help="output directory (default RUNS_DIR/compare/)")
    parser.add_argument("--metric", nargs="+", action="extend", metavar="NAME",
                        help="metric columns to show besides the objective (default: all recorded)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument("--harness-metric", default=DEFAULT_METRIC,
                        help="the LM-Eval metric of the harness table (default acc; e.g. acc_norm)")
    parser.add_argument("--reference", metavar="CASE",
                        help="the case every other is set against, seed by seed (name or slug; default: the "
                             "first case running the reference variant, else the first case)")
    parser.add_argument("--paired-metric", nargs="+", action="extend", metavar="NAME",
                        help="also set each case against the reference seed by seed in these metrics (e.g. "
                             "vitals/context_rms vitals/attn_sink): mean difference, interval, ratio, lower/higher")
    parser.add_argument("--level", default=str(LEVEL), metavar="P",
                        help=f"confidence level of the paired intervals and verdicts, between 0 and 1 "
                             f"(default {LEVEL})")
    return parser


def main(argv: list[str] | None = None) -> int:
    """`diffexp compare RUNS_DIR [--out DIR] [--metric NAME ...] [--no-plots] [--reference CASE] [--level P]` or
    `--study NAME [--storage URL]`: 0 on success (partial studies included); bad input raises a UserError
    (CompareError) for the caller's guard."""
    from rich.console import Console

    args = build_parser().parse_args(argv)
    level = check_level(args.level)  # a bad level fails before the study is read
    console = Console()
    if not console.is_terminal:  # piped or captured: do not squeeze the table into 80 columns
        console = Console(width=max(console.width, PIPED_WIDTH))
    compare(_study_dir(args), out=args.out, metrics=args.metric, plots=not args.no_plots, console=console,
            harness_metric=args.harness_metric, reference=args.reference, level=level,
            paired_metrics=args.paired_metric)
    return 0


def _study_dir(args: argparse.Namespace) -> Path:
    """RUNS_DIR, or the run directory the Optuna study of --study records."""
    if args.runs_dir and (args.study or args.storage):
        raise CompareError("give either RUNS_DIR or --study NAME (with --storage URL or DIFFEXP_STORAGE), not both")
    if args.runs_dir:
        return Path(args.runs_dir)
    from diffexp.sweep.storage import STORAGE_URL_ENV, resolve_url  # imports Optuna: not for a RUNS_DIR

    if args.study:
        storage, origin = resolve_url(args.storage)
        if storage is None:
            raise CompareError(f"--study {args.study!r} needs the study's storage: --storage URL, or the URL in "
                               f"the environment variable {STORAGE_URL_ENV}")
        return runs_dir_from_optuna(args.study, storage, origin)
    if args.storage:
        raise CompareError("--storage goes with --study NAME: --study NAME --storage URL")
    raise CompareError("expected RUNS_DIR (a study's run directory, runs/<study>/) "
                       f"or --study NAME with --storage URL (or {STORAGE_URL_ENV})")


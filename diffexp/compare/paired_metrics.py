"""`compare --paired-metric NAME ...`: the paired difference to the reference case in metrics besides the objective,
such as the diagnostics the DIFF V2 blog argues from (context RMS, the attention-sink score, the largest activation).

Each case minus the reference case seed by seed, as for the objective (diffexp.compare.paired), with its interval.
A diagnostic has no better direction, so the reading is "lower" or "higher" where the interval excludes 0, else
"within seed noise"; with a ratio to the reference's mean, since these quantities are compared in proportion.
"""

from __future__ import annotations

from collections.abc import Sequence

from diffexp.compare import markdown
from diffexp.compare.errors import CompareError
from diffexp.compare.paired import NOISE, REFERENCE, TOO_FEW, PairedDiff, PairedReport, paired_difference
from diffexp.compare.render import format_diff, level_text, metric_label
from diffexp.compare.stats import EMPTY, CaseSummary
from diffexp.sweep.runs import StudyRuns

LOWER, HIGHER = "lower", "higher"


def check_paired_metrics(runs: StudyRuns, names: Sequence[str] | None) -> list[str]:
    """The metrics asked for, each recorded by the study and not the objective; a CompareError otherwise."""
    names = list(dict.fromkeys(names or []))
    available = runs.metric_names()[1:]
    unknown = [n for n in names if n not in available]
    if unknown:
        raise CompareError(f"unknown --paired-metric {', '.join(map(repr, unknown))}: the metrics study "
                           f"{runs.study!r} records besides its objective {runs.objective} (whose paired table is "
                           f"always shown) are {', '.join(available) or 'none yet'}")
    return names


def reading(diff: PairedDiff) -> str:
    if diff.n < 2:
        return TOO_FEW
    return LOWER if diff.high < 0 else HIGHER if diff.low > 0 else NOISE


def metric_table(runs: StudyRuns, rows: Sequence[CaseSummary], report: PairedReport,
                 metric: str) -> tuple[list[str], list[list[str]]]:
    """(header, rows): per case its mean, Δ vs the reference, the interval, the ratio of means, the paired seeds
    and the reading."""
    ref = report.reference
    ref_mean = ref.stats[metric].mean if metric in ref.stats else None
    header = ["Case", metric_label(metric), f"Δ vs {ref.case.name}", f"{level_text(report.level)} CI",
              f"× {ref.case.name}", "Paired seeds", "Reading"]
    body = []
    for row in rows:
        mean = row.stats[metric].mean if metric in row.stats else None
        shown = EMPTY if mean is None else f"{mean:.4g}"
        if row is ref:
            body.append([row.case.name, shown, EMPTY, EMPTY, EMPTY, EMPTY, REFERENCE])
            continue
        diff = paired_difference(runs, row, ref, metric, report.level)
        interval = EMPTY if diff.n < 2 else f"[{format_diff(diff.low)}, {format_diff(diff.high)}]"
        ratio = EMPTY if mean is None or not ref_mean else f"{mean / ref_mean:.2f}"
        body.append([row.case.name, shown, format_diff(diff.mean), interval, ratio, str(diff.n), reading(diff)])
    return header, body


def note(runs: StudyRuns, report: PairedReport) -> str:
    return (f"Δ: case − {report.reference.case.name} on each seed both finished (complete trials), mean and "
            f"{level_text(report.level)} interval (Student t, n − 1 df); lower / higher: the interval excludes 0; "
            f"× {report.reference.case.name}: the ratio of the means over the complete seeds.")


def print_paired_metrics(console, runs: StudyRuns, rows: Sequence[CaseSummary], report: PairedReport,
                         metrics: Sequence[str], view: str = "") -> None:
    from rich import box
    from rich.table import Table
    from rich.text import Text

    for metric in metrics:
        header, body = metric_table(runs, rows, report, metric)
        table = Table(title=f"Paired differences in {metric}{', ' + view if view else ''}", title_justify="left",
                      box=box.SIMPLE_HEAD)
        for name in header:
            table.add_column(name, justify="left" if name in ("Case", "Reading") else "right", overflow="fold")
        for cells in body:
            table.add_row(*(Text(c) for c in cells))
        console.print(table)
    if metrics:
        console.print(Text(note(runs, report)), soft_wrap=True)


def paired_metrics_markdown(runs: StudyRuns, rows: Sequence[CaseSummary], report: PairedReport,
                            metrics: Sequence[str], view: str = "") -> str:
    lines = []
    for metric in metrics:
        header, body = metric_table(runs, rows, report, metric)
        align = ["left", *["right"] * (len(header) - 2), "left"]
        lines += [f"## Paired differences in {metric}{', ' + view if view else ''}", "",
                  *markdown.table(header, body, align), ""]
    if metrics:
        lines += [note(runs, report), ""]
    return "\n".join(lines)

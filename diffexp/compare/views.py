"""A tune_lr study's two views (diffexp.sweep.tune): every case at the same lr, and every case at its own best
lr, each with its paired differences to the reference case; and the lr tuning that picked the best lrs.

The main table lists every row once; each view gets its paired table (printed and in compare.md), its rows
in paired.csv (one per view and case) and its plot paired_diffs-<view>.png.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from diffexp.compare import markdown
from diffexp.compare.paired import PairedReport
from diffexp.compare.render import (
    PAIRED_FIELDS,
    paired_cells,
    paired_headers,
    paired_note,
    paired_record,
    power_lines,
    print_paired,
)
from diffexp.compare.stats import CaseSummary
from diffexp.sweep.runs import StudyRuns
from diffexp.sweep.spec import slugify


def view_rows(runs: StudyRuns, rows: Sequence[CaseSummary], view: str) -> list[CaseSummary]:
    by_name = {row.case.name: row for row in rows}
    return [by_name[name] for name in runs.views[view].values()]


def plot_name(view: str) -> str:
    return f"paired_diffs-{slugify(view)}.png"


def tuning_table(runs: StudyRuns) -> tuple[list[str], list[list[str]]]:
    """(header, rows): per case its mean objective at every lr tried, the spec's lr and the best."""
    tuned = runs.tuned or {}
    values = [float(v) for v in tuned.get("values", [])]
    header = ["Case", *(f"lr {v:g}" for v in values), "Spec's lr", "Best lr"]
    table = []
    for case, best in tuned.get("best", {}).items():
        means = {float(lr): m for lr, m in tuned.get("means", {}).get(case, {}).items()}
        spec_lr = tuned.get("spec_lr", {}).get(case)
        table.append([case, *(f"{means[v]:.4f}" if v in means else "—" for v in values),
                      "—" if spec_lr is None else f"{spec_lr:g}", f"{float(best):g}"])
    return header, table


def tuning_note(runs: StudyRuns) -> str:
    tuned = runs.tuned or {}
    budget = ", ".join(f"{k}={v}" for k, v in tuned.get("overrides", {}).items()) or "the spec's budget"
    return (f"Learning rate per case: mean {runs.objective} over seed(s) {', '.join(map(str, tuned.get('seeds', [])))} "
            f"at each lr on the short budget ({budget}), from {tuned.get('study_dir', '?')}; the best lr is the "
            "case's row in the \"best lr\" view.")


def print_views(console, runs: StudyRuns, rows: Sequence[CaseSummary], reports: dict[str, PairedReport]) -> None:
    from rich.table import Table
    from rich.text import Text

    header, table_rows = tuning_table(runs)
    table = Table(title=f"Learning rate per case ({runs.objective} on the short budget)", title_justify="left")
    for name in header:
        table.add_column(name, justify="left" if name == "Case" else "right", overflow="fold")
    for cells in table_rows:
        table.add_row(Text(cells[0]), *cells[1:])
    console.print(table)
    console.print(Text(tuning_note(runs)), soft_wrap=True)
    for view, report in reports.items():
        print_paired(console, runs, view_rows(runs, rows, view), report, view)


def views_markdown(runs: StudyRuns, rows: Sequence[CaseSummary], reports: dict[str, PairedReport]) -> str:
    header, table_rows = tuning_table(runs)
    lines = ["## Learning rate per case", "", *markdown.table(header, table_rows)]
    lines += ["", tuning_note(runs), ""]
    for view, report in reports.items():
        headers = ["Case", *paired_headers(report)]
        body = [[row.case.name, *paired_cells(report.of(row))] for row in view_rows(runs, rows, view)]
        lines += [f"## Paired differences, {view}", "",
                  *markdown.table(headers, body, ["left"] + ["right"] * (len(headers) - 2) + ["left"])]
        lines += ["", paired_note(runs, report), "", *(line.strip() for line in power_lines(runs, report)), ""]
    return "\n".join(lines)


def write_paired_csv(path: str | Path, runs: StudyRuns, rows: Sequence[CaseSummary],
                     reports: dict[str, PairedReport]) -> None:
    """One line per view and case: `view`, `case`, `slug` and the PAIRED_FIELDS."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["view", "case", "slug", *PAIRED_FIELDS])
        writer.writeheader()
        for view, report in reports.items():
            for row in view_rows(runs, rows, view):
                record: dict[str, Any] = {"view": view, "case": row.case.name, "slug": row.case.slug,
                                          **paired_record(report, row)}
                writer.writerow({k: "" if v is None else v for k, v in record.items()})

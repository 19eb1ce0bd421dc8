"""A study's views, each with its paired differences to the reference case in that view:
- a tune_lr study's two (diffexp.sweep.tune): every case at the same lr, and every case at its own best lr; with
  the lr tuning that picked the best lrs;
- a grid study's one per grid point (SweepSpec.grid_views): every case at that point, set against the reference
  case at the same point; with the grid tables, case by grid point: the objective and how many seeds diverged,
  and the spike counts (where a design becomes unstable, at a glance).

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
    metric_label,
    paired_cells,
    paired_headers,
    paired_note,
    paired_record,
    power_lines,
    print_paired,
)
from diffexp.compare.stats import EMPTY, CaseSummary, format_number
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


#: the spike counts a grid study also shows case by grid point, where they were recorded
GRID_DIAGNOSTICS = ("vitals/loss_spikes", "vitals/grad_spikes")


def _objective_cell(runs: StudyRuns, row: CaseSummary) -> str:
    """The mean objective over the complete seeds, and how many diverged: "2.213", "2.880 (1/3 diverged)",
    "diverged 3/3"."""
    mean = row.stats[runs.objective].mean
    if row.diverged and mean is None:
        return f"diverged {len(row.diverged)}/{row.n_expected}"
    text = EMPTY if mean is None else format_number(mean)
    return text + (f" ({len(row.diverged)}/{row.n_expected} diverged)" if row.diverged else "")


def grid_tables(runs: StudyRuns, rows: Sequence[CaseSummary]) -> list[tuple[str, str, list[str], list[list[str]]]]:
    """(title, note, header, rows) per quantity: each case a row, each grid point (view) a column."""
    by_name = {row.case.name: row for row in rows}
    points = list(runs.views)
    cases = list(runs.views[points[0]])
    quantities = [(runs.objective, runs.objective, "mean over the complete seeds; diverged seeds counted")]
    quantities += [(m, metric_label(m), "mean over the complete and diverged seeds")
                   for m in GRID_DIAGNOSTICS if all(m in row.stats for row in rows)]
    tables = []
    for metric, label, note in quantities:
        body = []
        for case in cases:
            cells = []
            for point in points:
                row = by_name[runs.views[point][case]]
                cells.append(_objective_cell(runs, row) if metric == runs.objective else
                             EMPTY if row.stats[metric].mean is None else format_number(row.stats[metric].mean))
            body.append([case, *cells])
        tables.append((f"{label} by grid point", note, ["Case", *points], body))
    return tables


def _lead_tables(runs: StudyRuns, rows: Sequence[CaseSummary]) -> list[tuple[str, str, list[str], list[list[str]]]]:
    """(title, note, header, rows) shown before the views' paired tables."""
    if runs.tuned:
        header, table_rows = tuning_table(runs)
        return [("Learning rate per case", tuning_note(runs), header, table_rows)]
    return grid_tables(runs, rows)


def print_views(console, runs: StudyRuns, rows: Sequence[CaseSummary], reports: dict[str, PairedReport]) -> None:
    from rich.table import Table
    from rich.text import Text

    for title, note, header, table_rows in _lead_tables(runs, rows):
        if runs.tuned:
            title += f" ({runs.objective} on the short budget)"
        table = Table(title=title, title_justify="left")
        for name in header:
            table.add_column(name, justify="left" if name == "Case" else "right", overflow="fold")
        for cells in table_rows:
            table.add_row(Text(cells[0]), *cells[1:])
        console.print(table)
        console.print(Text(note[:1].upper() + note[1:] + ("" if note.endswith(".") else ".")), soft_wrap=True)
    for view, report in reports.items():
        print_paired(console, runs, view_rows(runs, rows, view), report, view)


def views_markdown(runs: StudyRuns, rows: Sequence[CaseSummary], reports: dict[str, PairedReport]) -> str:
    lines = []
    for title, note, header, table_rows in _lead_tables(runs, rows):
        lines += [f"## {title}", "", *markdown.table(header, table_rows), "",
                  note[:1].upper() + note[1:] + ("" if note.endswith(".") else "."), ""]
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

"""The LM-Eval table of a study (the papers' Table 2): per case, each task's accuracy as mean ± std over
seeds (sample std), and their average, from the harness.json that `diffexp eval harness` writes into a trial's eval/.

Accuracy is LM-Eval's ``acc`` of every task (``acc_norm`` where --harness-metric asks for it). The
average covers the tasks every case has; a case missing a task shows "—" there.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from diffexp.compare import markdown
from diffexp.sweep.runs import StudyRuns

DEFAULT_METRIC = "acc"


@dataclass
class HarnessTable:
    metric: str
    tasks: list[str]
    #: case name -> task -> the values of its seeds
    values: dict[str, dict[str, list[float]]]
    unreadable: list[str]

    def cell(self, case: str, task: str) -> tuple[float, float, int] | None:
        found = self.values[case].get(task)
        if not found:
            return None
        return statistics.fmean(found), statistics.stdev(found) if len(found) > 1 else 0.0, len(found)

    def average(self, case: str) -> float | None:
        """Mean over the tasks every case has (the papers' Avg column)."""
        shared = [t for t in self.tasks if all(self.values[c].get(t) for c in self.values)]
        means = [self.cell(case, t)[0] for t in shared if self.cell(case, t)]
        return statistics.fmean(means) if shared and len(means) == len(shared) else None


def harness_table(runs: StudyRuns, metric: str = DEFAULT_METRIC) -> HarnessTable | None:
    """None when no trial of the study has been through `diffexp eval harness`."""
    from diffexp.evals.layout import HARNESS_RESULTS_FILE

    values: dict[str, dict[str, list[float]]] = {}
    tasks: list[str] = []
    unreadable: list[str] = []
    for case in runs.cases:
        per_task: dict[str, list[float]] = {}
        for trial in runs.trials_of(case):
            path = trial.path / "eval" / HARNESS_RESULTS_FILE
            if not path.is_file():
                continue
            try:
                results = json.loads(path.read_text())["tasks"]
            except (OSError, ValueError, KeyError, TypeError) as err:
                unreadable.append(f"{path}: {err}")
                continue
            for task, metrics in results.items():
                value = metrics.get(metric) if isinstance(metrics, dict) else None
                if isinstance(value, (int, float)) and math.isfinite(value):
                    per_task.setdefault(task, []).append(float(value))
                    tasks += [task] if task not in tasks else []
        values[case.name] = per_task
    if not tasks:
        return None
    return HarnessTable(metric, tasks, values, unreadable)


def _format(cell: tuple[float, float, int] | None) -> str:
    if cell is None:
        return "—"
    mean, std, n = cell
    return f"{100 * mean:.1f}" + (f" ± {100 * std:.1f}" if n > 1 else "")


def _rows(table: HarnessTable) -> list[list[str]]:
    rows = []
    for case in table.values:
        average = table.average(case)
        rows.append([case, *(_format(table.cell(case, t)) for t in table.tasks),
                     "—" if average is None else f"{100 * average:.1f}"])
    return rows


def harness_markdown(table: HarnessTable) -> str:
    header = ["Case", *table.tasks, "Avg"]
    lines = [f"## LM-Eval harness ({table.metric}, %, mean ± std over seeds)", "",
             *markdown.table(header, _rows(table))]
    return "\n".join(lines + [""] + [f"- unreadable: {item}" for item in table.unreadable]) + "\n"


def print_harness(console, table: HarnessTable) -> None:
    from rich.table import Table
    from rich.text import Text

    rich_table = Table(title=f"LM-Eval harness: {table.metric} (%), mean ± std over seeds", title_justify="left")
    rich_table.add_column("Case", overflow="fold")
    for name in [*table.tasks, "Avg"]:
        rich_table.add_column(name, justify="right", overflow="fold")
    for row in _rows(table):
        rich_table.add_row(*(Text(cell) for cell in row))
    console.print(rich_table)
    for item in table.unreadable:
        console.print(Text(f"unreadable: {item}", style="yellow"), soft_wrap=True)


def write_harness_csv(path: str | Path, table: HarnessTable) -> None:
    """One row per (case, task): mean, std and the number of seeds, in fractions (not %)."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["case", "task", "metric", "mean", "std", "seeds"])
        for case in table.values:
            for task in table.tasks:
                cell = table.cell(case, task)
                if cell is not None:
                    writer.writerow([case, task, table.metric, f"{cell[0]:.6g}", f"{cell[1]:.6g}", cell[2]])

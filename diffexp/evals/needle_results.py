"""Results of the needle retrieval grid (``diffexp.evals.needle``): accuracy per cell and method, the
papers' N/R table, the CSV, the heatmaps and the TensorBoard scalars and images."""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path

from diffexp.evals import plots

METHODS = ("greedy", "rank")  # exact match of the greedy answer; the best-ranked number in the context


@dataclass
class NeedleResults:
    """Accuracies per cell and method (long format) plus the per-question records.

    ``rows``: one dict per (context_len, depth, n_needles, n_queries, method) with ``accuracy``,
    ``correct``, ``asked`` (questions scored), ``samples`` and ``chance``.
    ``records``: one dict per (cell, sample, query): the answer, the greedy output and the ranked choice.
    """

    rows: list[dict] = field(default_factory=list)
    records: list[dict] = field(default_factory=list)

    @property
    def context_lens(self) -> list[int]:
        return sorted({r["context_len"] for r in self.rows})

    @property
    def depths(self) -> list[float]:
        return sorted({r["depth"] for r in self.rows})

    @property
    def nr(self) -> list[tuple[int, int]]:
        return sorted({(r["n_needles"], r["n_queries"]) for r in self.rows})

    @property
    def methods(self) -> list[str]:
        return [m for m in METHODS if any(r["method"] == m for r in self.rows)]

    def accuracy(self, method: str, context_len: int, depth: float, n: int, r: int) -> float:
        for row in self.rows:
            if (row["method"], row["context_len"], row["depth"], row["n_needles"], row["n_queries"]) == (
                    method, context_len, depth, n, r):
                return row["accuracy"]
        raise KeyError((method, context_len, depth, n, r))

    def mean_by_nr(self) -> dict[tuple[str, int, int], float]:
        """Mean accuracy over every (context length, depth) cell, per (method, N, R)."""
        out: dict[tuple[str, int, int], float] = {}
        for method in self.methods:
            for n, r in self.nr:
                cells = [row["accuracy"] for row in self.rows
                         if row["method"] == method and (row["n_needles"], row["n_queries"]) == (n, r)]
                out[(method, n, r)] = sum(cells) / len(cells)
        return out

    def grid(self, method: str, n: int, r: int) -> list[list[float]]:
        """Accuracy matrix: rows are context lengths, columns depths (NaN where not evaluated)."""
        values = {(row["context_len"], row["depth"]): row["accuracy"] for row in self.rows
                  if row["method"] == method and (row["n_needles"], row["n_queries"]) == (n, r)}
        return [[values.get((c, d), math.nan) for d in self.depths] for c in self.context_lens]

    def table(self) -> str:
        """Markdown table like the papers': mean accuracy per (N, R), one row per method."""
        means = self.mean_by_nr()
        header = "| method | " + " | ".join(f"N={n},R={r}" for n, r in self.nr) + " |"
        lines = [header, "|---" * (len(self.nr) + 1) + "|"]
        for method in self.methods:
            cells = " | ".join(f"{means[(method, n, r)]:.2f}" for n, r in self.nr)
            lines.append(f"| {method} | {cells} |")
        return "\n".join(lines)

    def to_csv(self, path: str | Path) -> Path:
        """Write ``rows`` (long format, one line per cell and method)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        columns = ["method", "context_len", "depth", "n_needles", "n_queries", "accuracy", "correct", "asked",
                   "samples", "chance"]
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            for row in self.rows:
                writer.writerow({k: row[k] for k in columns})
        return path

    def figures(self) -> dict[tuple[str, int, int], object]:
        """One matplotlib heatmap figure (context length x depth) per (method, N, R)."""
        return plots.needle_heatmaps(self)

    def heatmaps(self, path_prefix: str | Path) -> list[Path]:
        """Write ``<prefix>_<method>_N<n>R<r>.png`` per (method, N, R); returns the paths."""
        prefix = Path(path_prefix)
        return [plots.save_figure(fig, prefix.with_name(f"{prefix.name}_{method}_N{n}R{r}.png"), dpi=110)
                for (method, n, r), fig in self.figures().items()]

    def log_to_tensorboard(self, logger_or_writer, step: int = 0) -> None:
        """Heatmaps as images ``needle_heatmap/<method>/N<n>R<r>``, means as scalars ``needle/<method>/N<n>R<r>``.

        Accepts a ``SummaryWriter`` or a Lightning ``TensorBoardLogger`` (its ``experiment``).
        """
        writer = getattr(logger_or_writer, "experiment", logger_or_writer)
        for (method, n, r), fig in self.figures().items():
            writer.add_figure(f"needle_heatmap/{method}/N{n}R{r}", fig, global_step=step, close=True)
        for (method, n, r), value in self.mean_by_nr().items():
            writer.add_scalar(f"needle/{method}/N{n}R{r}", value, global_step=step)
        writer.flush()

"""A sweep's `paper:` block: the numbers a paper reports for the table the sweep reproduces.

    paper:
      source: "DINT (Cang et al. 2025), Table 6: 1.4B models"
      values: {DIFF: {val/loss: 3.062}, DINT: {val/loss: 3.055}}   # table row -> {metric: value}

They change nothing that runs; `compare` prints them beside the measured numbers."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

PAPER_KEYS = {"source", "values"}


def parse_paper(raw: Any, row_labels: Sequence[str], metric_known: Callable[[str], bool]) -> dict[str, Any]:
    """The checked block as {"source": str, "values": {row: {metric: float}}}; ValueError naming the bad key."""
    if not isinstance(raw, dict):
        raise ValueError(f"paper={raw!r}: expected a mapping with `source` (the paper and table) and `values`")
    unknown = sorted(set(raw) - PAPER_KEYS)
    if unknown:
        raise ValueError(f"paper: unknown key(s) {', '.join(map(repr, unknown))}; allowed: source, values")
    source = raw.get("source")
    if not isinstance(source, str) or not source.strip():
        raise ValueError(f"paper.source={source!r}: expected the paper and its table, e.g. \"DINT (2025), Table 6\"")
    values = raw.get("values")
    if not isinstance(values, dict) or not values:
        raise ValueError(f"paper.values={values!r}: expected a mapping of table rows to {{metric: value}}")
    checked: dict[str, dict[str, float]] = {}
    for row, metrics in values.items():
        if row not in row_labels:
            raise ValueError(f"paper.values[{row!r}]: not a row of this sweep; rows: {', '.join(row_labels)}")
        if not isinstance(metrics, dict) or not metrics:
            raise ValueError(f"paper.values[{row!r}]={metrics!r}: expected a mapping of metric to value")
        for metric, value in metrics.items():
            if not metric_known(str(metric)):
                raise ValueError(f"paper.values[{row!r}]: {metric!r} is not a metric trials record")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"paper.values[{row!r}][{metric!r}]={value!r}: expected a finite number")
        checked[row] = {str(m): float(v) for m, v in metrics.items()}
    return {"source": source.strip(), "values": checked}

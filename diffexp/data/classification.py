"""A real (text, label) classification dataset as a many-shot ICL task (the papers' TREC, Banking-77 and
Clinic-150, or any local table), scored by ``diffexp.evals.icl`` like the synthetic ``ICLTask``
(``diffexp.data.icl.ClassPools``: the same prompt format and tokenization).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from diffexp.data.icl import ClassPools
from diffexp.data.tables import open_table
from diffexp.data.tokenizer import ByteTokenizer
from diffexp.errors import Flag, UserError, cli_flag


@dataclass
class LabelledRows:
    """Distinct one-line texts, each with its class index into ``names`` (the label texts)."""

    source: str
    texts: list[str]
    classes: list[int]
    names: list[str]


def one_line(text: str) -> str:
    return " ".join(text.split())


def labelled_rows(spec: str, text_column: str = "text", label_column: str = "label",
                  split: str | None = None, flag: Flag = cli_flag) -> LabelledRows:
    """The (text, label) rows of a local file or Hub dataset; every problem is a UserError naming its option as
    ``flag`` writes it (``--label-column``, or ``options.label_column`` in a fit).

    Each text becomes one line and is kept once (its first row), so a test input is never also a demonstration;
    integer labels take a ``ClassLabel`` column's names where there are some."""
    table = open_table(spec, split, flag)
    texts = table.column(text_column, "text_column")
    labels = table.column(label_column, "label_column")
    class_names = table.class_names.get(label_column)
    where, text_key, label_key = table.where, flag("text_column"), flag("label_column")
    rows: dict[str, Any] = {}
    for i, (text, label) in enumerate(zip(texts, labels)):
        if label is None or isinstance(label, bool) or not isinstance(label, (int, str)):
            raise UserError(f"{label_key}={label_column!r} is invalid: row {i} of {where} holds {label!r}; "
                            "expected a class name (text) or an integer class id in every row")
        text = one_line(str(text)) if text is not None else ""
        if not text:
            raise UserError(f"{text_key}={text_column!r} is invalid: row {i} of {where} has no text; "
                            "expected text in every row")
        rows.setdefault(text, label)
    values = sorted(set(rows.values()), key=lambda v: (isinstance(v, str), v))
    if len(values) < 2:
        raise UserError(f"{where} is invalid: its {label_key}={label_column!r} has {len(values)} class(es) "
                        f"({', '.join(map(repr, values))}); expected at least 2")
    if class_names is not None:
        bad = [v for v in values if not isinstance(v, int) or not 0 <= v < len(class_names)]
        if bad:
            raise UserError(f"{label_key}={label_column!r} is invalid: {where} holds {bad[0]!r}, not one of "
                            f"its {len(class_names)} class ids")
        names = [one_line(class_names[v]) for v in values]
    else:
        names = [one_line(str(v)) for v in values]
    if len(set(names)) != len(names) or not all(names):
        raise UserError(f"{label_key}={label_column!r} is invalid: {where} has label names that are empty or "
                        f"the same once whitespace is collapsed ({names}); expected distinct names")
    index = {v: c for c, v in enumerate(values)}
    return LabelledRows(table.name, list(rows), [index[v] for v in rows.values()], names)


class ClassificationTask(ClassPools):
    """Labelled rows as pools: per class, ceil(n_tests / K) held-out test rows (chosen by ``seed``) and the rest
    demonstrations; ``tokenizer`` defaults to ``ByteTokenizer``."""

    def __init__(self, rows: LabelledRows, n_tests: int, seed: int | Sequence[int] = 0, tokenizer: Any = None) -> None:
        self.source, self.labels, self.k_classes = rows.source, list(rows.names), len(rows.names)
        self.tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        by_class: list[list[str]] = [[] for _ in rows.names]
        for text, c in zip(rows.texts, rows.classes):
            by_class[c].append(text)
        self.class_sizes = [len(texts) for texts in by_class]
        smallest = int(np.argmin(self.class_sizes))
        most_tests = self.k_classes * (self.class_sizes[smallest] - 1)
        if not 1 <= n_tests <= most_tests:
            raise ValueError(f"n_tests={n_tests} is invalid: class {self.labels[smallest]!r} has "
                             f"{self.class_sizes[smallest]} rows and each class keeps at least one for "
                             f"demonstrations; expected at most {most_tests} for {self.k_classes} classes")
        self.held_out = math.ceil(n_tests / self.k_classes)
        rng = np.random.default_rng(seed)
        self.demo_pool, self.test_pool = [], []
        for texts in by_class:
            shuffled = [texts[i] for i in rng.permutation(len(texts))]
            self.test_pool.append(shuffled[: self.held_out])
            self.demo_pool.append(shuffled[self.held_out:])

    def demos_limit(self) -> str:
        """Why max_demos is what it is, for an error message."""
        smallest = int(np.argmin(self.class_sizes))
        return (f"{self.k_classes} classes; the smallest, {self.labels[smallest]!r}, has "
                f"{self.class_sizes[smallest]} rows, {self.held_out} of them held out for tests")

"""Many-shot in-context classification (a synthetic K-class task or a real dataset), and its robustness to
demonstration order.

For each number of demonstrations, one class-balanced set (nested: a smaller n's set is part of a larger one's) is
shown in several orders per ordering scheme; each test input's prediction is the label, among the K, of highest
summed log-likelihood after the prompt. The task and its prompt format are in ``diffexp.data.icl``.
"""

from __future__ import annotations

import csv
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

# ICLDataModule is re-exported: runs saved before it moved to diffexp.data.icl name it diffexp.evals.icl.ICLDataModule
from diffexp.data.icl import ClassPools, ICLDataModule, ICLTask  # noqa: F401
from diffexp.evals import plots
from diffexp.evals.scoring import as_logits_fn, best_candidates, candidate_logprobs, evaluating, model_max_seq_len

log = logging.getLogger(__name__)

ORDERINGS = ("random", "alternating", "grouped")

Scorer = Callable[[list[list[int]], list[list[int]]], Any]  # (prompts, candidates) -> scores (P, K)


def order_demonstrations(demos: Sequence[tuple[str, int]], ordering: str,
                         rng: np.random.Generator) -> list[tuple[str, int]]:
    """The same demonstrations in another order.

    random: a uniform shuffle. alternating: round-robin over the classes (a random class order, each class's
    items shuffled; classes that run out drop out of the cycle). grouped: all items of one class, then the
    next (random class order), the worst case for recency effects."""
    demos = list(demos)
    if ordering == "random":
        return [demos[i] for i in rng.permutation(len(demos))]
    if ordering not in ORDERINGS:
        raise ValueError(f"ordering={ordering!r} is invalid: expected one of {', '.join(ORDERINGS)}")
    classes = sorted({c for _, c in demos})
    by_class = {c: [d for d in demos if d[1] == c] for c in classes}
    for c in classes:
        by_class[c] = [by_class[c][i] for i in rng.permutation(len(by_class[c]))]
    class_order = [classes[i] for i in rng.permutation(len(classes))]
    if ordering == "grouped":
        return [d for c in class_order for d in by_class[c]]
    out, depth = [], 0
    while len(out) < len(demos):
        out += [by_class[c][depth] for c in class_order if depth < len(by_class[c])]
        depth += 1
    return out


# -- scoring ---------------------------------------------------------------------------------------
def _as_scorer(model: nn.Module | Scorer, device, batch_size: int) -> Scorer:
    if isinstance(model, nn.Module):
        logits_fn = as_logits_fn(model)
        return lambda prompts, candidates: candidate_logprobs(logits_fn, prompts, candidates, device, batch_size)
    if callable(model):
        return model
    raise TypeError(f"expected an nn.Module (idx -> logits) or a scorer callable, got {type(model).__name__}")


# -- results ---------------------------------------------------------------------------------------
@dataclass
class ICLResults:
    """Accuracies per (n_demos, ordering), one per presented order of the same demonstrations.

    ``name`` prefixes the TensorBoard tags and names the files (icl for the synthetic task, icl_<dataset> for
    a dataset); ``source`` says what was classified; ``boundary_merges`` lists the labels the tokenizer
    merges with the end of the prompt (see ``ClassPools``; empty for byte and byte-level BPE tokenizers).
    """

    k_classes: int
    n_tests: int
    n_orderings: int
    max_seq_len: int | None
    accuracies: dict[tuple[int, str], list[float]] = field(default_factory=dict)
    skipped: list[dict[str, int | None]] = field(default_factory=list)
    name: str = "icl"
    source: str = "the synthetic task"
    boundary_merges: list[str] = field(default_factory=list)

    @property
    def chance(self) -> float:
        return 1.0 / self.k_classes

    @property
    def orderings(self) -> list[str]:
        return list(dict.fromkeys(o for _, o in self.accuracies))

    @property
    def n_demos(self) -> list[int]:
        return sorted({n for n, _ in self.accuracies})

    def to_rows(self) -> list[dict[str, Any]]:
        """One row per (n_demos, ordering): mean, std (population), min and max over orderings."""
        rows = []
        for n in self.n_demos:
            for ordering in self.orderings:
                accs = self.accuracies.get((n, ordering))
                if accs is None:
                    continue
                a = np.asarray(accs, dtype=np.float64)
                rows.append({"n_demos": n, "ordering": ordering, "mean": float(a.mean()), "std": float(a.std()),
                             "min": float(a.min()), "max": float(a.max()), "n_orderings": len(a),
                             "n_tests": self.n_tests})
        return rows

    def to_csv(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fields = ["n_demos", "ordering", "mean", "std", "min", "max", "n_orderings", "n_tests"]
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(self.to_rows())
        return path

    def scalars(self) -> dict[str, float]:
        """TensorBoard scalars: <name>/<ordering>/n<n> (mean accuracy), <name>_std/... and <name>_range/...
        (max - min); <name> is icl for the synthetic task."""
        out = {}
        for row in self.to_rows():
            key = f"{row['ordering']}/n{row['n_demos']}"
            out[f"{self.name}/{key}"] = row["mean"]
            out[f"{self.name}_std/{key}"] = row["std"]
            out[f"{self.name}_range/{key}"] = row["max"] - row["min"]
        return out

    def log_to_tensorboard(self, logger_or_writer: Any, step: int = 0, figure: bool = True) -> dict[str, float]:
        """Write ``scalars()`` (and the plot as a figure) to a SummaryWriter or a Lightning logger."""
        scalars = self.scalars()
        writer = getattr(logger_or_writer, "experiment", logger_or_writer)
        if hasattr(writer, "add_scalar"):
            for name, value in scalars.items():
                writer.add_scalar(name, value, step)
            if figure and hasattr(writer, "add_figure") and self.accuracies:
                writer.add_figure(f"{self.name}/accuracy_vs_demos", self.figure(), step, close=True)
            if hasattr(writer, "add_text"):
                writer.add_text(f"{self.name}/summary", "    " + self.summary().replace("\n", "\n    "), step)
            if hasattr(writer, "flush"):
                writer.flush()
        elif hasattr(logger_or_writer, "log_metrics"):
            logger_or_writer.log_metrics(scalars, step=step)
        else:
            raise TypeError(f"expected a SummaryWriter or a Lightning logger, got {type(logger_or_writer).__name__}")
        return scalars

    def summary(self) -> str:
        lines = [f"many-shot ICL on {self.source}, K={self.k_classes} (chance {self.chance:.3f}), "
                 f"{self.n_tests} tests, {self.n_orderings} orderings each",
                 f"{'n_demos':>7}  {'ordering':<12} {'mean':>6} {'std':>6} {'min':>6} {'max':>6}"]
        for r in self.to_rows():
            lines.append(f"{r['n_demos']:>7}  {r['ordering']:<12} {r['mean']:6.3f} {r['std']:6.3f} "
                         f"{r['min']:6.3f} {r['max']:6.3f}")
        for s in self.skipped:
            lines.append(f"{s['n_demos']:>7}  skipped: needs {s['tokens_needed']} tokens > max_seq_len "
                         f"{s['max_seq_len']}")
        if self.boundary_merges:
            lines.append(f"note: the tokenizer merges the end of the prompt with the labels "
                         f"{', '.join(self.boundary_merges)}; they are scored as encoded on their own")
        return "\n".join(lines)

    def figure(self):
        return plots.icl_figure(self)

    def plot(self, path: str | os.PathLike) -> Path:
        """Accuracy vs n demos (log2 axis), one line per ordering with a min-max band and ±std bars."""
        return plots.save_figure(self.figure(), path)

    def save(self, directory: str | os.PathLike, stem: str | None = None) -> dict[str, Path]:
        """``<stem>.csv``, ``<stem>.png`` and ``<stem>.txt`` (the summary) in ``directory``; stem: ``name``."""
        stem = stem or self.name
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"{stem}.txt").write_text(self.summary() + "\n")
        return {"csv": self.to_csv(directory / f"{stem}.csv"), "png": self.plot(directory / f"{stem}.png"),
                "txt": directory / f"{stem}.txt"}


# -- evaluation ------------------------------------------------------------------------------------
def evaluate_icl(model: nn.Module | Scorer, task: ClassPools, n_demos_list: Sequence[int] = (1, 4, 16, 64),
                 orderings: Sequence[str] = ("random", "alternating"), n_orderings: int = 5, n_tests: int = 50,
                 device: str | torch.device = "cpu", seed: int = 0, max_seq_len: int | None = None,
                 batch_size: int = 16, name: str = "icl", source: str = "the synthetic task") -> ICLResults:
    """Accuracy as the number of demonstrations grows, and its spread over orders of the same demonstrations.

    ``model``: an ``nn.Module`` (idx -> logits; its mode and device restored afterwards) or a scorer
    ``(prompts, candidates) -> (P, K) scores``. An n whose prompt does not fit ``max_seq_len`` (default: the
    model's) is skipped; ``seed`` fixes the demonstrations, the test inputs and the orders.
    """
    for n in n_demos_list:
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"n_demos_list contains {n!r}: expected positive integers")
    for ordering in orderings:
        if ordering not in ORDERINGS:
            raise ValueError(f"ordering={ordering!r} is invalid: expected one of {', '.join(ORDERINGS)}")
    if n_orderings < 1 or n_tests < 1:
        raise ValueError(f"n_orderings={n_orderings}, n_tests={n_tests}: expected positive integers")
    if max(n_demos_list) > task.max_demos:
        raise ValueError(f"n_demos_list contains {max(n_demos_list)}: this task has at most {task.max_demos} "
                         "class-balanced distinct demonstrations; raise group_size or words_per_input")
    if n_tests > task.max_tests:
        raise ValueError(f"n_tests={n_tests} is invalid: this task has at most {task.max_tests} class-balanced "
                         "held-out test inputs; raise group_size or words_per_input")
    if max_seq_len is None:
        max_seq_len = model_max_seq_len(model)
    results = ICLResults(task.k_classes, n_tests, n_orderings, max_seq_len, name=name, source=source)

    with evaluating(model, device):
        scorer = _as_scorer(model, device, batch_size)
        candidates = task.scored_candidate_ids()
        tests = task.tests(n_tests, seed=[seed, 1])
        queries = [task.format_query(x) for x, _ in tests]
        truth = np.array([c for _, c in tests])
        results.boundary_merges = task.boundary_merges(queries[0])
        if results.boundary_merges:
            log.warning("ICL: the tokenizer merges the end of the prompt with the labels %s; they are scored as "
                        "encoded on their own", results.boundary_merges)
        for n in sorted(set(int(n) for n in n_demos_list)):
            demos = task.demonstrations(n, seed=[seed, 2])
            prompts = {}  # every order's prompts first: whether n fits depends on the longest
            for ordering in orderings:
                for j in range(n_orderings):  # the orders depend on (seed, n, scheme, j) only
                    rng = np.random.default_rng([seed, 3, n, ORDERINGS.index(ordering), j])
                    ordered = order_demonstrations(demos, ordering, rng)
                    context = "".join(task.format_demo(x, task.labels[c]) for x, c in ordered)
                    prompts[ordering, j] = [task.scored_prompt_ids(context + q) for q in queries]
            needed = max(len(p) for rows in prompts.values() for p in rows) + max(map(len, candidates)) - 1
            if max_seq_len is not None and needed > max_seq_len:
                results.skipped.append({"n_demos": n, "tokens_needed": needed, "max_seq_len": max_seq_len})
                log.warning("ICL: n_demos=%d skipped: needs %d tokens > max_seq_len %d", n, needed, max_seq_len)
                continue
            for ordering in orderings:
                results.accuracies[(n, ordering)] = [
                    float((np.array(best_candidates(scorer(prompts[ordering, j], candidates))) == truth).mean())
                    for j in range(n_orderings)]
    return results

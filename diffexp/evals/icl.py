"""Many-shot in-context classification on a synthetic K-class task, and its robustness to demonstration order.

The papers measure accuracy as the number of demonstrations grows (TREC, Banking-77, Clinic-150) and its
spread over orderings of the same demonstrations. Those datasets need a download; offline, ``ICLTask`` is
a synthetic stand-in that a tiny byte-level model can learn.

The task (``ICLTask``)
    K classes; class c owns a hidden group of ``group_size`` random short words (1-character "words" from
    ``a-z0-9A-Z`` when they fit, else longer strings). An input is ``words_per_input`` distinct words of one
    group, so the hidden rule is "which group do the words come from". Each class has a label string (a
    3-letter word, all of equal length so that summed log-likelihoods are comparable): by default the K
    labels are always the first K of ``LABEL_POOL`` (like a real dataset's fixed label names) and only
    their assignment to the groups is random per task; ``random_label_names=True`` also draws the K names
    from the pool per task (harder: the label set itself must be read from the context).
    A prompt is demonstrations then the test input::

        input: q 7 d label: owl
        input: k a m label: fig
        input: 7 x q label:                   <- the model must continue with "owl\\n"

    Why this rule: a test input shares words with the demonstrations of its class and with no other class,
    so the label is found by matching words in context and copying the label that followed them (a
    retrieval circuit two attention layers can implement: gather each line's words onto its label slot,
    then attend from the query's label slot to the slots with matching words), and accuracy grows with the
    number of demonstrations because more of the group's words get covered. Training has to get past the
    "label prior" plateau first: a d_model 64, 2-layer baseline trained 2,400 steps on CPU (K=4,
    ``ICLDataModule`` with seq_len 256) reached a label-token loss of ln(4)/4 = 0.347 (uniform over the 4
    labels of 4 tokens each) and chance accuracy; expect to need longer (GPU) runs before in-context
    accuracy rises.
    The words, groups and label assignment are fresh per task seed, so a model trained on other seeds
    (``ICLDataModule``) can only succeed by learning in context, never by memorising the mapping. Within
    a task, the inputs (as word sets) are split into a demonstration pool and a held-out test pool: no
    test input ever appears as a demonstration.

Tokens: UTF-8 bytes (``diffexp.data.tokenizer.ByteTokenizer``, ids 0..255, vocab 257), so any model with
``vocab_size >= 256`` can be scored, e.g. the byte-level recipes. Another tokenizer (an object with
``encode``/``decode``) can be passed; prompt and label are encoded separately and concatenated.

Evaluation (``evaluate_icl``)
    For each n in ``n_demos_list``: one class-balanced demonstration set (nested: the set for a smaller n
    is contained in the set for a larger n), the SAME set presented in ``n_orderings`` orders per ordering
    scheme ("random": shuffles; "alternating": round-robin over classes in a random class order, each
    class's items shuffled; "grouped": all of one class, then the next), scored on the same ``n_tests``
    class-balanced held-out test inputs. Prediction is constrained to the K labels: each label's
    log-likelihood given the prompt (summed over the label's tokens and the closing newline) is computed
    and the best one is chosen; nothing is decoded freely. Accuracies are reported per (n, ordering) as
    mean, std (population, over orderings), min and max. An n whose prompt plus label does not fit the
    model's ``max_seq_len`` is skipped and listed in ``results.skipped``.
"""

from __future__ import annotations

import csv
import itertools
import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from diffexp.data.loader import resumable_train_loader
from diffexp.data.mqar import collate_examples
from diffexp.data.tokenizer import ByteTokenizer
from diffexp.errors import UserError
from diffexp.evals import refuse_sharded_model

log = logging.getLogger(__name__)

WORD_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"
LABEL_POOL = (
    "owl", "fig", "elk", "sea", "red", "oak", "cow", "jam", "tin", "pup", "hat", "gem", "yak", "bus", "dew", "ink",
    "vat", "zip", "log", "rum", "kit", "nut", "wax", "fox",
)  # 3 letters each, all different first letters
ORDERINGS = ("random", "alternating", "grouped")

Scorer = Callable[[list[list[int]], list[list[int]]], Any]  # (prompts, candidates) -> scores (P, K)


def _words(n: int, rng: np.random.Generator, word_len: int) -> list[str]:
    base = len(WORD_ALPHABET)
    codes = rng.choice(base**word_len, size=n, replace=False)
    out = []
    for code in codes.tolist():
        chars = []
        for _ in range(word_len):
            code, r = divmod(code, base)
            chars.append(WORD_ALPHABET[r])
        out.append("".join(chars))
    return out


class ICLTask:
    """A synthetic K-class task: hidden word groups, random label strings, demonstration and test pools.

    Args:
        k_classes: number of classes K (2..len(LABEL_POOL) unless ``labels`` are given).
        seed: int or sequence of ints; fixes the words, groups, label assignment and pools.
        group_size: words owned by each class.
        words_per_input: distinct words of one group per input.
        word_len: characters per word; None picks the shortest length with enough distinct words.
        random_label_names: draw the K label strings from LABEL_POOL per task instead of taking its first K
            (the assignment to groups is random either way).
        labels: explicit K label strings (overrides the two above); they must be distinct,
            non-empty, without whitespace, and best of equal token length (log-likelihoods are summed).
        test_fraction: share of each class's inputs (as word sets) held out for tests. Each class has
            C(group_size, words_per_input) inputs: by default 120, 60 of them for demonstrations (so
            n_demos <= 60 K) and 60 for tests.
        tokenizer: object with ``encode(str) -> list[int]`` and ``decode``; default ``ByteTokenizer``.
    """

    def __init__(self, k_classes: int, seed: int | Sequence[int] = 0, group_size: int = 10,
                 words_per_input: int = 3, word_len: int | None = None, random_label_names: bool = False,
                 labels: Sequence[str] | None = None, test_fraction: float = 0.5, tokenizer: Any = None) -> None:
        if isinstance(k_classes, bool) or not isinstance(k_classes, int) or k_classes < 2:
            raise ValueError(f"k_classes={k_classes!r} is invalid: expected an integer >= 2")
        if labels is None and k_classes > len(LABEL_POOL):
            raise ValueError(f"k_classes={k_classes} is invalid: the default label pool has {len(LABEL_POOL)} "
                             "labels; pass labels=[...] for more classes")
        if not 1 <= words_per_input <= group_size:
            raise ValueError(f"words_per_input={words_per_input} is invalid: expected 1..group_size={group_size}")
        if not 0.0 < test_fraction < 1.0:
            raise ValueError(f"test_fraction={test_fraction} is invalid: expected in (0, 1)")
        n_words = k_classes * group_size
        if word_len is None:
            word_len = 1
            while len(WORD_ALPHABET) ** word_len < n_words:
                word_len += 1
        elif word_len < 1 or len(WORD_ALPHABET) ** word_len < n_words:
            raise ValueError(f"word_len={word_len} is invalid: {k_classes} x {group_size} distinct words need "
                             f"{len(WORD_ALPHABET)} ** word_len >= {n_words}")
        self.k_classes, self.group_size, self.words_per_input = k_classes, group_size, words_per_input
        self.word_len, self.test_fraction = word_len, test_fraction
        self.tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        rng = np.random.default_rng(seed)

        words = _words(n_words, rng, word_len)
        self.groups: list[list[str]] = [words[c * group_size:(c + 1) * group_size] for c in range(k_classes)]
        self.word_class = {w: c for c, group in enumerate(self.groups) for w in group}
        if labels is None:
            names = rng.choice(len(LABEL_POOL), size=k_classes, replace=False) if random_label_names else \
                rng.permutation(k_classes)  # the first K names, assigned to the groups at random
            labels = [LABEL_POOL[i] for i in names]
        labels = [str(y) for y in labels]
        if len(labels) != k_classes or len(set(labels)) != k_classes or any(
                not y or any(ch.isspace() for ch in y) for y in labels):
            raise ValueError(f"labels={labels!r} is invalid: expected {k_classes} distinct non-empty strings "
                             "without whitespace")
        self.labels: list[str] = labels

        # inputs: word sets of one group, shown in a fixed random word order; split by set into pools
        self.demo_pool: list[list[str]] = []
        self.test_pool: list[list[str]] = []
        for group in self.groups:
            combos = list(itertools.combinations(range(group_size), words_per_input))
            rng.shuffle(combos)
            if len(combos) < 2:
                raise ValueError(f"group_size={group_size}, words_per_input={words_per_input}: a class has only "
                                 f"{len(combos)} distinct input(s); nothing to hold out")
            n_test = min(len(combos) - 1, max(1, round(test_fraction * len(combos))))
            inputs = [" ".join(group[i] for i in rng.permutation(combo)) for combo in combos]
            self.test_pool.append(inputs[:n_test])
            self.demo_pool.append(inputs[n_test:])

    @property
    def max_demos(self) -> int:
        """The most class-balanced distinct demonstrations the pools can give."""
        return self.k_classes * min(len(p) for p in self.demo_pool)

    @property
    def max_tests(self) -> int:
        return self.k_classes * min(len(p) for p in self.test_pool)

    # -- the hidden rule and the format ------------------------------------------------------------
    def label_of(self, x: str) -> int:
        """The class of an input: the group its words come from."""
        classes = {self.word_class[w] for w in x.split()}
        if len(classes) != 1:
            raise ValueError(f"input {x!r} does not come from one group")
        return classes.pop()

    @staticmethod
    def format_demo(x: str, label: str) -> str:
        return f"input: {x} label: {label}\n"

    @staticmethod
    def format_query(x: str) -> str:
        return f"input: {x} label: "

    def prompt(self, demos: Sequence[tuple[str, int]], x: str) -> str:
        return "".join(self.format_demo(d, self.labels[c]) for d, c in demos) + self.format_query(x)

    def candidate_texts(self) -> list[str]:
        """What each label continues the prompt with (its string and the closing newline)."""
        return [f"{y}\n" for y in self.labels]

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    # -- sampling ----------------------------------------------------------------------------------
    def _balanced_counts(self, n: int, rng: np.random.Generator) -> list[int]:
        counts = [n // self.k_classes] * self.k_classes
        for c in rng.permutation(self.k_classes)[: n % self.k_classes]:
            counts[c] += 1
        return counts

    def _draw(self, pools: list[list[str]], n: int, rng: np.random.Generator, what: str) -> list[tuple[str, int]]:
        counts = self._balanced_counts(n, rng)
        out = []
        for c, (pool, k) in enumerate(zip(pools, counts)):
            if k > len(pool):
                raise ValueError(f"{what}={n} is invalid: class {c} needs {k} distinct inputs but its {what} pool "
                                 f"has {len(pool)}; raise group_size or words_per_input")
            out += [(pool[i], c) for i in rng.choice(len(pool), size=k, replace=False)]
        return out

    def demonstrations(self, n: int, seed: int | Sequence[int] = 0) -> list[tuple[str, int]]:
        """n class-balanced demonstrations (input, class) from the demonstration pool, grouped by class.

        Nested in n for a fixed seed: the first items of every class's shuffled pool are used, and the
        classes that get one more item (n not a multiple of K) come first in a fixed random class order."""
        rng = np.random.default_rng(seed)
        class_order = rng.permutation(self.k_classes)
        shuffled = [[pool[i] for i in rng.permutation(len(pool))] for pool in self.demo_pool]
        counts = [n // self.k_classes] * self.k_classes
        for c in class_order[: n % self.k_classes]:
            counts[c] += 1
        out = []
        for c, k in enumerate(counts):
            if k > len(shuffled[c]):
                raise ValueError(f"n_demos={n} is invalid: class {c} needs {k} distinct demonstrations but the "
                                 f"demonstration pool has {len(shuffled[c])}; raise group_size or words_per_input")
            out += [(x, c) for x in shuffled[c][:k]]
        return out

    def tests(self, n: int, seed: int | Sequence[int] = 0) -> list[tuple[str, int]]:
        """n class-balanced held-out test inputs (input, class)."""
        return self._draw(self.test_pool, n, np.random.default_rng(seed), "n_tests")

    def sample(self, rng: np.random.Generator) -> tuple[str, int]:
        """One (input, class) with a uniform class, from either pool (for training on fresh tasks)."""
        c = int(rng.integers(self.k_classes))
        pool = self.demo_pool[c] + self.test_pool[c]
        return pool[int(rng.integers(len(pool)))], c


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
def model_max_seq_len(model: Any) -> int | None:
    """max_seq_len of a Decoder, a DiffexpLM or anything holding one; None if unknown."""
    for path in ("cfg", "arch", "model.cfg", "model.arch"):
        obj = model
        for attr in path.split("."):
            obj = getattr(obj, attr, None)
        if obj is not None and getattr(obj, "max_seq_len", None) is not None:
            return int(obj.max_seq_len)
    return None


@torch.no_grad()
def score_candidates(model: nn.Module, prompts: Sequence[Sequence[int]], candidates: Sequence[Sequence[int]],
                     device: str | torch.device = "cpu", batch_size: int = 16) -> torch.Tensor:
    """(P, K) summed log-likelihood of every candidate continuation after every prompt, under ``model``
    (``idx (B, T) -> logits (B, T, V)``). Sequences are right-padded; causality keeps padding inert."""
    seqs = [(i, j, list(p) + list(c)) for i, p in enumerate(prompts) for j, c in enumerate(candidates)]
    scores = torch.empty(len(prompts), len(candidates), dtype=torch.float64)
    order = sorted(range(len(seqs)), key=lambda s: len(seqs[s][2]))
    for start in range(0, len(order), batch_size):
        chunk = [seqs[s] for s in order[start:start + batch_size]]
        width = max(len(ids) for _, _, ids in chunk) - 1
        idx = torch.zeros(len(chunk), width, dtype=torch.long)
        for r, (_, _, ids) in enumerate(chunk):
            idx[r, : len(ids) - 1] = torch.tensor(ids[:-1])
        logp = model(idx.to(device)).float().log_softmax(dim=-1).cpu()
        for r, (i, j, ids) in enumerate(chunk):
            n_prompt = len(prompts[i])
            positions = torch.arange(n_prompt - 1, len(ids) - 1)
            targets = torch.tensor(ids[n_prompt:])
            scores[i, j] = logp[r, positions, targets].double().sum()
    return scores


def _as_scorer(model: nn.Module | Scorer, device, batch_size: int) -> Scorer:
    if isinstance(model, nn.Module):
        return lambda prompts, candidates: score_candidates(model, prompts, candidates, device, batch_size)
    if callable(model):
        return model
    raise TypeError(f"expected an nn.Module (idx -> logits) or a scorer callable, got {type(model).__name__}")


def choose_labels(scores: Any) -> list[int]:
    """Constrained choice: the index of the best-scoring label per prompt (always one of the K)."""
    scores = torch.as_tensor(np.asarray(scores, dtype=np.float64))
    if scores.ndim != 2:
        raise ValueError(f"scores must be (prompts, labels), got shape {tuple(scores.shape)}")
    return scores.argmax(dim=1).tolist()


def predict_labels(model: nn.Module | Scorer, task: ICLTask, prompts: Sequence[str], device="cpu",
                   batch_size: int = 16) -> list[str]:
    """The label string chosen for each text prompt, among ``task.labels`` only."""
    scorer = _as_scorer(model, device, batch_size)
    candidates = [task.encode(t) for t in task.candidate_texts()]
    scores = scorer([task.encode(p) for p in prompts], candidates)
    return [task.labels[i] for i in choose_labels(scores)]


# -- results ---------------------------------------------------------------------------------------
@dataclass
class ICLResults:
    """Accuracies per (n_demos, ordering), one per presented order of the same demonstrations."""

    k_classes: int
    n_tests: int
    n_orderings: int
    max_seq_len: int | None
    accuracies: dict[tuple[int, str], list[float]] = field(default_factory=dict)
    skipped: list[dict[str, int | None]] = field(default_factory=list)

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
        """TensorBoard scalars: icl/<ordering>/n<n> (mean accuracy), icl_std/... and icl_range/... (max - min)."""
        out = {}
        for row in self.to_rows():
            key = f"{row['ordering']}/n{row['n_demos']}"
            out[f"icl/{key}"] = row["mean"]
            out[f"icl_std/{key}"] = row["std"]
            out[f"icl_range/{key}"] = row["max"] - row["min"]
        return out

    def log_to_tensorboard(self, logger_or_writer: Any, step: int = 0, figure: bool = True) -> dict[str, float]:
        """Write ``scalars()`` (and the plot as a figure) to a SummaryWriter or a Lightning logger."""
        scalars = self.scalars()
        writer = getattr(logger_or_writer, "experiment", logger_or_writer)
        if hasattr(writer, "add_scalar"):
            for name, value in scalars.items():
                writer.add_scalar(name, value, step)
            if figure and hasattr(writer, "add_figure") and self.accuracies:
                writer.add_figure("icl/accuracy_vs_demos", self.figure(), step, close=True)
            if hasattr(writer, "add_text"):
                writer.add_text("icl/summary", "    " + self.summary().replace("\n", "\n    "), step)
            if hasattr(writer, "flush"):
                writer.flush()
        elif hasattr(logger_or_writer, "log_metrics"):
            logger_or_writer.log_metrics(scalars, step=step)
        else:
            raise TypeError(f"expected a SummaryWriter or a Lightning logger, got {type(logger_or_writer).__name__}")
        return scalars

    def summary(self) -> str:
        lines = [f"many-shot ICL, K={self.k_classes} (chance {self.chance:.3f}), {self.n_tests} tests, "
                 f"{self.n_orderings} orderings each",
                 f"{'n_demos':>7}  {'ordering':<12} {'mean':>6} {'std':>6} {'min':>6} {'max':>6}"]
        for r in self.to_rows():
            lines.append(f"{r['n_demos']:>7}  {r['ordering']:<12} {r['mean']:6.3f} {r['std']:6.3f} "
                         f"{r['min']:6.3f} {r['max']:6.3f}")
        for s in self.skipped:
            lines.append(f"{s['n_demos']:>7}  skipped: needs {s['tokens_needed']} tokens > max_seq_len "
                         f"{s['max_seq_len']}")
        return "\n".join(lines)

    def figure(self):
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
        rows = self.to_rows()
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for i, ordering in enumerate(self.orderings):
            r = [row for row in rows if row["ordering"] == ordering]
            x = np.array([row["n_demos"] for row in r], dtype=float)
            mean = np.array([row["mean"] for row in r])
            lo, hi = np.array([row["min"] for row in r]), np.array([row["max"] for row in r])
            std = np.array([row["std"] for row in r])
            color = colors[i % len(colors)]
            ax.fill_between(x, lo, hi, color=color, alpha=0.18, linewidth=0)
            ax.errorbar(x, mean, yerr=std, color=color, marker="o", markersize=4, capsize=3, linewidth=1.6,
                        label=ordering)
        ax.axhline(self.chance, color="0.4", linestyle="--", linewidth=1, label=f"chance 1/{self.k_classes}")
        ax.set_xscale("log", base=2)
        ticks = self.n_demos or [1]
        ax.set_xticks(ticks)
        ax.set_xticklabels([str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("demonstrations in context (n)")
        ax.set_ylabel(f"accuracy ({self.n_tests} held-out tests)")
        ax.set_title(f"Many-shot in-context classification, K={self.k_classes}\n"
                     f"lines: mean \u00b1 std, bands: min-max over {self.n_orderings} orders of the same demos",
                     fontsize=10)
        ax.grid(True, alpha=0.3)
        if self.skipped:
            skipped = ", ".join(str(s["n_demos"]) for s in self.skipped)
            ax.text(0.99, 0.01, f"skipped (context > {self.max_seq_len} tokens): n = {skipped}",
                    transform=ax.transAxes, ha="right", va="bottom", fontsize=8, color="0.3")
        if not self.accuracies:
            ax.text(0.5, 0.5, "no n fits the context", transform=ax.transAxes, ha="center")
        ax.legend(loc="best", fontsize=8, framealpha=0.85)
        fig.tight_layout()
        return fig

    def plot(self, path: str | os.PathLike) -> Path:
        """Accuracy vs n demos (log2 axis), one line per ordering with a min-max band and ±std bars."""
        import matplotlib.pyplot as plt

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig = self.figure()
        fig.savefig(path)
        plt.close(fig)
        return path

    def save(self, directory: str | os.PathLike, stem: str = "icl") -> dict[str, Path]:
        """``<stem>.csv``, ``<stem>.png`` and ``<stem>.txt`` (the summary) in ``directory``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"{stem}.txt").write_text(self.summary() + "\n")
        return {"csv": self.to_csv(directory / f"{stem}.csv"), "png": self.plot(directory / f"{stem}.png"),
                "txt": directory / f"{stem}.txt"}


# -- evaluation ------------------------------------------------------------------------------------
def evaluate_icl(model: nn.Module | Scorer, task: ICLTask, n_demos_list: Sequence[int] = (1, 4, 16, 64),
                 orderings: Sequence[str] = ("random", "alternating"), n_orderings: int = 5, n_tests: int = 50,
                 device: str | torch.device = "cpu", seed: int = 0, max_seq_len: int | None = None,
                 batch_size: int = 16) -> ICLResults:
    """Accuracy as the number of demonstrations grows, and its spread over orders of the same demonstrations.

    model: an ``nn.Module`` mapping ``idx (B, T) -> logits (B, T, V)`` (``Decoder``, ``DiffexpLM``), put in
        eval mode and moved to ``device`` for the evaluation (both restored afterwards); or a scorer
        ``(prompts: list[list[int]], candidates: list[list[int]]) -> (P, K) scores``.
    max_seq_len: the context limit; default: the model's ``max_seq_len`` (none for a bare scorer).
    seed: fixes the demonstration sets, the test inputs and the orders.
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
    results = ICLResults(task.k_classes, n_tests, n_orderings, max_seq_len)

    restore = None
    if isinstance(model, nn.Module):
        first = next(model.parameters(), None)
        restore = (model.training, first.device if first is not None else None)
        model.eval()
        if first is not None and first.device != torch.device(device):
            model.to(device)
    try:
        scorer = _as_scorer(model, device, batch_size)
        candidates = [task.encode(t) for t in task.candidate_texts()]
        tests = task.tests(n_tests, seed=[seed, 1])
        test_ids = [task.encode(task.format_query(x)) for x, _ in tests]
        truth = np.array([c for _, c in tests])
        longest_candidate = max(len(c) for c in candidates)
        for n in sorted(set(int(n) for n in n_demos_list)):
            demos = task.demonstrations(n, seed=[seed, 2])
            demo_tokens = sum(len(task.encode(task.format_demo(x, task.labels[c]))) for x, c in demos)
            needed = demo_tokens + max(len(t) for t in test_ids) + longest_candidate - 1
            if max_seq_len is not None and needed > max_seq_len:
                results.skipped.append({"n_demos": n, "tokens_needed": needed, "max_seq_len": max_seq_len})
                log.warning("ICL: n_demos=%d skipped: needs %d tokens > max_seq_len %d", n, needed, max_seq_len)
                continue
            for ordering in orderings:
                accs = []
                for j in range(n_orderings):  # the orders depend on (seed, n, scheme, j) only
                    rng = np.random.default_rng([seed, 3, n, ORDERINGS.index(ordering), j])
                    ordered = order_demonstrations(demos, ordering, rng)
                    context = task.encode("".join(task.format_demo(x, task.labels[c]) for x, c in ordered))
                    prompts = [context + t for t in test_ids]
                    predicted = np.array(choose_labels(scorer(prompts, candidates)))
                    accs.append(float((predicted == truth).mean()))
                results.accuracies[(n, ordering)] = accs
    finally:
        if restore is not None:
            training, original_device = restore
            if original_device is not None:
                model.to(original_device)
            model.train(training)
    return results


def oracle_scorer(task: ICLTask) -> Scorer:
    """Knows the hidden rule: scores 1 for the true label of the prompt's last input, 0 for the others."""
    def score(prompts, candidates):
        scores = np.zeros((len(prompts), len(candidates)))
        for i, p in enumerate(prompts):
            x = task.decode(p).rsplit("input: ", 1)[1].split(" label:")[0]
            scores[i, task.label_of(x)] = 1.0
        return scores

    return score


# -- training on fresh tasks -----------------------------------------------------------------------
class ICLEpisodes(Dataset):
    """Rows of ``seq_len + 1`` byte tokens, each many demonstrations of one fresh task, with the loss on labels."""

    def __init__(self, size: int, seq_len: int, seed: int, split: int, **task_args: Any) -> None:
        self.size, self.seq_len, self.seed, self.split = size, seq_len, seed, split
        self.task_args = task_args

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        # task seeds are sequences (seed, 1 + split, index): never the plain-int seeds of evaluation tasks
        task = ICLTask(seed=[self.seed, 1 + self.split, int(index)], **self.task_args)
        rng = np.random.default_rng([self.seed, 10 + self.split, int(index)])
        tokens: list[int] = []
        is_label: list[bool] = []
        while len(tokens) < self.seq_len + 1:
            x, c = task.sample(rng)
            head = task.encode(task.format_query(x))
            label = task.encode(task.candidate_texts()[c])
            tokens += head + label
            is_label += [False] * len(head) + [True] * len(label)
        tokens, is_label = tokens[: self.seq_len + 1], is_label[: self.seq_len + 1]
        return {"tokens": torch.tensor(tokens, dtype=torch.long),
                "loss_mask": torch.tensor(is_label[1:], dtype=torch.bool)}  # target t is tokens[t + 1]


class ICLDataModule(L.LightningDataModule):
    """Train a byte-level model to classify in context: each row is one fresh ``ICLTask`` (new words, groups
    and label assignment) with demonstrations packed up to ``seq_len + 1`` tokens; ``loss_mask`` selects the
    label tokens (label and newline) of every demonstration, so the model learns to infer labels from the
    demonstrations before them. Evaluation tasks (``ICLTask(seed=<int>)``) never occur in training.

    Args:
        k_classes: classes per task.
        seq_len: tokens the model sees per row.
        batch_size: rows per batch.
        train_size: training rows (tasks) per epoch.
        val_size: validation rows (tasks), and as many test rows; each split is its own stream of tasks.
        group_size: words per class.
        words_per_input: words per input.
        random_label_names: draw each task's label names from the pool (see ``ICLTask``).
        num_workers: DataLoader worker processes.
        seed: seeds the tasks and the shuffle order.
    """

    def __init__(self, k_classes: int = 4, seq_len: int = 512, batch_size: int = 16, train_size: int = 20_000,
                 val_size: int = 256, group_size: int = 10, words_per_input: int = 3,
                 random_label_names: bool = False, num_workers: int = 0, seed: int = 1234) -> None:
        super().__init__()
        for name, value in (("k_classes", k_classes), ("seq_len", seq_len), ("batch_size", batch_size),
                            ("train_size", train_size), ("val_size", val_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise UserError(f"data.{name}={value!r} is invalid: expected a positive integer")
        if train_size < batch_size:
            raise UserError(f"data.train_size={train_size} is invalid: must be >= data.batch_size={batch_size}")
        if num_workers < 0:
            raise UserError(f"data.num_workers={num_workers} is invalid: expected >= 0")
        self.task_args = dict(k_classes=k_classes, group_size=group_size, words_per_input=words_per_input,
                              random_label_names=random_label_names)
        try:
            ICLTask(seed=0, **self.task_args)  # validates them
        except ValueError as err:  # its messages name the argument, which is data.<argument> here
            raise UserError(f"data.{err}") from None
        self.save_hyperparameters()
        self.k_classes, self.seq_len, self.batch_size = k_classes, seq_len, batch_size
        self.train_size, self.val_size, self.num_workers, self.seed = train_size, val_size, num_workers, seed
        self.group_size, self.words_per_input = group_size, words_per_input

    @property
    def vocab_size(self) -> int:
        return ByteTokenizer.vocab_size

    def task(self, seed: int) -> ICLTask:
        """An evaluation task with this module's shape (held out from training by construction)."""
        return ICLTask(seed=seed, **self.task_args)

    def _dataset(self, split: int) -> ICLEpisodes:
        return ICLEpisodes(self.train_size if split == 0 else self.val_size, self.seq_len, self.seed, split,
                           **self.task_args)

    def describe(self) -> str:
        return (f"synthetic ICL | K={self.k_classes}, {self.group_size} words per class, {self.words_per_input} per "
                f"input | byte tokens | seq_len {self.seq_len} | train {self.train_size} val {self.val_size} tasks")

    def train_dataloader(self) -> DataLoader:
        trainer = self.trainer  # None unless attached to a Trainer
        if trainer is not None and trainer.overfit_batches > 0:
            return DataLoader(self._dataset(0), batch_size=self.batch_size, drop_last=True,
                              num_workers=self.num_workers, collate_fn=collate_examples)
        # shuffled per (seed, epoch), resumes mid-epoch like the text data
        return resumable_train_loader(self._dataset(0), trainer, self.batch_size, self.seed, self.num_workers,
                                      collate_fn=collate_examples)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self._dataset(1), batch_size=self.batch_size, num_workers=self.num_workers,
                          collate_fn=collate_examples)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self._dataset(2), batch_size=self.batch_size, num_workers=self.num_workers,
                          collate_fn=collate_examples)


class ICLEval(L.Callback):
    """Run ``evaluate_icl`` on a held-out task and log ``icl/<ordering>/n<n>`` (and spreads) to the logger;
    writes ``icl.csv``, ``icl.png`` and ``icl.txt`` under ``<log_dir>/icl/step<step>/``. Runs on global rank 0
    only, through the unwrapped module: fine for one device and DDP; under FSDP it stops at setup (use
    ``diffexp eval icl CKPT``).

    Args:
        k_classes: classes of the evaluation task.
        task_seed: seed of the evaluation task (an int: never a training task of ``ICLDataModule``).
        n_demos_list: numbers of demonstrations.
        orderings: ordering schemes (random, alternating, grouped).
        n_orderings: orders per scheme.
        n_tests: held-out test inputs.
        group_size: words per class (match the training data).
        words_per_input: words per input (match the training data).
        random_label_names: label names drawn per task (match the training data).
        every_validation: also evaluate after every validation (else only when fit ends).
    """

    def __init__(self, k_classes: int = 4, task_seed: int = 0, n_demos_list: list[int] = (1, 4, 16, 64),
                 orderings: list[str] = ("random", "alternating"), n_orderings: int = 5, n_tests: int = 50,
                 group_size: int = 10, words_per_input: int = 3, random_label_names: bool = False,
                 every_validation: bool = False) -> None:
        self.task = ICLTask(k_classes, seed=task_seed, group_size=group_size, words_per_input=words_per_input,
                            random_label_names=random_label_names)
        self.kwargs = dict(n_demos_list=tuple(n_demos_list), orderings=tuple(orderings), n_orderings=n_orderings,
                           n_tests=n_tests)
        self.every_validation = every_validation
        self.last: ICLResults | None = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        refuse_sharded_model(trainer, "ICLEval", "diffexp eval icl <run>/checkpoints/last.ckpt")

    def _run(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        results = evaluate_icl(pl_module, self.task, device=pl_module.device, **self.kwargs)
        self.last = results
        step = trainer.global_step
        for logger in trainer.loggers:
            results.log_to_tensorboard(logger, step)
        if trainer.log_dir is not None:
            results.save(Path(trainer.log_dir) / "icl" / f"step{step:06d}")
        log.info("%s", results.summary())

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.every_validation and not trainer.sanity_checking:
            self._run(trainer, pl_module)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._run(trainer, pl_module)


def chance_interval(k_classes: int, n: int, z: float = 3.0) -> tuple[float, float]:
    """A z-sigma interval around chance 1/K for an accuracy over n independent guesses."""
    p = 1.0 / k_classes
    half = z * math.sqrt(p * (1 - p) / n)
    return max(0.0, p - half), min(1.0, p + half)

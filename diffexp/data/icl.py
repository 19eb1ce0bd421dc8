"""A synthetic K-class in-context classification task (an offline stand-in for TREC, Banking-77 and Clinic-150),
and training data made of fresh tasks; the evaluation is ``diffexp.evals.icl``.

Class c owns a hidden group of random words and an input is a few words of one group, so a label is found by
matching words with the demonstrations in context; words, groups and labels are fresh per task seed, so a model
succeeds only by learning in context.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from diffexp.data.loader import resumable_train_loader
from diffexp.data.mqar import collate_examples
from diffexp.data.tokenizer import ByteTokenizer
from diffexp.errors import UserError

WORD_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"
LABEL_POOL = (
    "owl", "fig", "elk", "sea", "red", "oak", "cow", "jam", "tin", "pup", "hat", "gem", "yak", "bus", "dew", "ink",
    "vat", "zip", "log", "rum", "kit", "nut", "wax", "fox",
)  # 3 letters each, all different first letters


def _random_words(n: int, rng: np.random.Generator, word_len: int) -> list[str]:
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


class ClassPools:
    """A classification task as the many-shot ICL evaluation needs it: K labels, per class disjoint pools of
    demonstration and test inputs, the prompt format and the tokenizer (subclasses fill them).

    A prompt is encoded in one piece, without the whitespace that ends the query; each label is scored as
    `` <name>\\n`` encoded on its own, so every label follows the same prompt ids (``boundary_merges`` finds a
    tokenizer that merges across that boundary anyway).
    """

    k_classes: int
    labels: list[str]
    demo_pool: list[list[str]]
    test_pool: list[list[str]]
    tokenizer: Any

    @property
    def max_demos(self) -> int:
        """The most class-balanced distinct demonstrations the pools can give."""
        return self.k_classes * min(len(p) for p in self.demo_pool)

    @property
    def max_tests(self) -> int:
        return self.k_classes * min(len(p) for p in self.test_pool)

    # -- the format ---------------------------------------------------------------------------------
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

    # -- what is scored -----------------------------------------------------------------------------
    def scored_prompt_ids(self, prompt: str) -> list[int]:
        """A prompt's ids as scored: the text without the whitespace that ends it, encoded in one piece."""
        return self.encode(prompt.rstrip())

    def label_lead(self) -> str:
        """The whitespace that ends a query; it is scored as the start of every label."""
        query = self.format_query("x")
        return query[len(query.rstrip()):]

    def scored_candidate_ids(self) -> list[list[int]]:
        """Each label's ids as scored: the query's closing whitespace, the label, the newline."""
        return [self.encode(self.label_lead() + text) for text in self.candidate_texts()]

    def boundary_merges(self, prompt: str) -> list[str]:
        """The labels whose ids after ``prompt`` differ from the ids of prompt and label encoded as one text
        (empty for the byte tokenizer and byte-level BPEs)."""
        prompt_ids = self.scored_prompt_ids(prompt)
        return [y for y, text, ids in zip(self.labels, self.candidate_texts(), self.scored_candidate_ids())
                if self.encode(prompt.rstrip() + self.label_lead() + text) != prompt_ids + ids]

    # -- sampling ----------------------------------------------------------------------------------
    def _balanced_counts(self, n: int, rng: np.random.Generator) -> list[int]:
        counts = [n // self.k_classes] * self.k_classes
        for c in rng.permutation(self.k_classes)[: n % self.k_classes]:
            counts[c] += 1
        return counts

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
        rng = np.random.default_rng(seed)
        out = []
        for c, (pool, k) in enumerate(zip(self.test_pool, self._balanced_counts(n, rng))):
            if k > len(pool):
                raise ValueError(f"n_tests={n} is invalid: class {c} needs {k} distinct inputs but its test pool "
                                 f"has {len(pool)}; raise group_size or words_per_input")
            out += [(pool[i], c) for i in rng.choice(len(pool), size=k, replace=False)]
        return out


class ICLTask(ClassPools):
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
        test_fraction: share of each class's C(group_size, words_per_input) inputs held out for tests.
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

        words = _random_words(n_words, rng, word_len)
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

    def label_of(self, x: str) -> int:
        """The class of an input: the group its words come from (the hidden rule)."""
        classes = {self.word_class[w] for w in x.split()}
        if len(classes) != 1:
            raise ValueError(f"input {x!r} does not come from one group")
        return classes.pop()

    def sample(self, rng: np.random.Generator) -> tuple[str, int]:
        """One (input, class) with a uniform class, from either pool (for training on fresh tasks)."""
        c = int(rng.integers(self.k_classes))
        pool = self.demo_pool[c] + self.test_pool[c]
        return pool[int(rng.integers(len(pool)))], c


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
    and labels) packed with demonstrations; the loss is on the label tokens only.

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

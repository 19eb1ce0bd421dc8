"""Multi-needle retrieval (Needle-in-a-Haystack) as a trainable task: the Lightning data module and its
datasets. The samples (layout, depth, held-out split, leak checks) are ``diffexp.data.needle_samples``.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from diffexp.data.loader import resumable_train_loader
from diffexp.data.needle_samples import (
    HAYSTACKS,
    NeedleSample,
    check_split,
    make_sample,
    min_context_len,
)
from diffexp.data.needle_text import token_haystack
from diffexp.data.tokenizer import ByteTokenizer, TextTokenizer, load_tokenizer_file
from diffexp.errors import UserError


class NeedleDataset(Dataset):
    """``size`` needle samples of one split, each generated on demand from (seed, split, index).

    With several (N, R) pairs, each index draws its pair uniformly (deterministically).
    """

    def __init__(self, size: int, split: str, seed: int, context_len: int, nr: list[tuple[int, int]],
                 depth: float | None, haystack: str, loss_on: str = "answers",
                 tokenizer: TextTokenizer | None = None) -> None:
        self.size, self.split, self.seed = size, split, seed
        self.context_len, self.nr, self.depth, self.haystack = context_len, nr, depth, haystack
        self.loss_on, self.tokenizer = loss_on, tokenizer

    def __len__(self) -> int:
        return self.size

    def sample(self, index: int) -> NeedleSample:
        if not 0 <= index < self.size:
            raise IndexError(f"index {index} out of range for {self.size} {self.split} samples")
        rng = random.Random(f"needle:{self.seed}:{self.split}:{index}")
        n, r = self.nr[0] if len(self.nr) == 1 else rng.choice(self.nr)
        return make_sample(rng, self.context_len, n, r, self.depth, self.haystack, self.split,
                           tokenizer=self.tokenizer)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        sample = self.sample(index)
        mask = sample.loss_mask() if self.loss_on == "answers" else torch.ones(sample.context_len)
        return {"tokens": sample.tokens, "loss_mask": mask}


class NeedleDataModule(L.LightningDataModule):
    """Synthetic multi-needle retrieval batches generated on the fly (byte tokens, or a tokenizer.json's).

    Batches are dicts ``{"tokens": (B, context_len + 1) long, "loss_mask": (B, context_len) float}``;
    the mask is 1 exactly on the answer digits and the "." after each answer, so the loss trains
    retrieval only. Training samples use cities and numbers that are not held out; validation samples
    only held-out ones (see ``diffexp.data.needle_samples``). Per-sample metadata (spans, candidates) comes from
    ``samples(split)``, not from the batches.

    Args:
        context_len: Tokens the model reads per sample (rows hold context_len + 1 tokens).
        n_needles: N, needles per sample.
        n_queries: R <= N, cities asked for at the end of each sample.
        nr_mix: Optional list of (N, R) pairs; each sample draws one uniformly (overrides n_needles and
            n_queries), e.g. [[1, 1], [2, 2], [4, 2], [6, 2]] to train for the whole evaluation grid.
        depth: Fraction 0..1 of the haystack where the answer needles start; None draws it per sample.
        haystack: "corpus" (windows of the embedded stdlib text) or "synthetic" (repeated filler sentences).
        batch_size: Samples per batch.
        train_size: Training samples per epoch (generated from seed and index; nothing is stored).
        val_size: Validation samples (held-out cities and numbers), and as many test samples (other draws).
        num_workers: DataLoader worker processes (0 generates in the main process).
        seed: Seeds the samples and the per-epoch shuffle order.
        loss_on: the training targets: "answers" (the answer digits and their ".", retrieval only) or
            "all" (next-token loss on every token, as a language model sees the sequence: the repeated
            haystack teaches copying early, which the retrieval then builds on). Validation always scores
            the answers, so val/loss means the same either way.
        tokenizer: "byte" (vocab 257), or a tokenizer.json whose tokens the samples are written in (context
            lengths then count its tokens; see ``diffexp.data.needle_text``).
    """

    def __init__(
        self,
        context_len: int = 512,
        n_needles: int = 2,
        n_queries: int = 1,
        nr_mix: list[tuple[int, int]] | None = None,
        depth: float | None = None,
        haystack: Literal["corpus", "synthetic"] = "corpus",
        batch_size: int = 16,
        train_size: int = 100_000,
        val_size: int = 256,
        num_workers: int = 0,
        seed: int = 1234,
        loss_on: Literal["answers", "all"] = "answers",
        tokenizer: str = "byte",
    ) -> None:
        super().__init__()
        nr_mix = [list(p) for p in nr_mix] if nr_mix else nr_mix  # saved as lists: hparams.yaml is plain YAML
        self.save_hyperparameters()  # reads the arguments' current values, nr_mix included
        if loss_on not in ("answers", "all"):
            raise UserError(f"data.loss_on={loss_on!r} is invalid: expected 'answers' or 'all'")
        pairs = [tuple(p) for p in nr_mix] if nr_mix else [(n_needles, n_queries)]
        for n, r in pairs:
            name = "data.nr_mix" if nr_mix else "data.n_needles"
            if not isinstance(n, int) or n < 1:
                raise UserError(f"{name}: n_needles={n!r} is invalid: expected a positive integer")
            if not isinstance(r, int) or not 1 <= r <= n:
                raise UserError(f"{'data.nr_mix' if nr_mix else 'data.n_queries'}: n_queries={r!r} is invalid: "
                                 f"expected 1 <= n_queries <= n_needles={n}")
            if context_len < min_context_len(n, r):
                raise UserError(f"data.context_len={context_len} is too short for N={n} needles and R={r} "
                                 f"queries: expected >= {min_context_len(n, r)}")
        if depth is not None and not 0.0 <= depth <= 1.0:
            raise UserError(f"data.depth={depth!r} is invalid: expected a fraction in [0, 1] or null (random)")
        if haystack not in HAYSTACKS:
            raise UserError(f"data.haystack={haystack!r} is invalid: expected one of {', '.join(HAYSTACKS)}")
        for name, value in (("batch_size", batch_size), ("train_size", train_size), ("val_size", val_size)):
            if value <= 0:
                raise UserError(f"data.{name}={value!r} is invalid: expected a positive integer")
        if train_size < batch_size:
            raise UserError(f"data.train_size={train_size} is invalid: expected >= data.batch_size={batch_size}")
        if num_workers < 0:
            raise UserError(f"data.num_workers={num_workers!r} is invalid: expected >= 0")
        self.context_len, self.nr, self.depth, self.haystack = context_len, pairs, depth, haystack
        self.batch_size, self.train_size, self.val_size = batch_size, train_size, val_size
        self.num_workers, self.seed, self.loss_on = num_workers, seed, loss_on
        if tokenizer == "byte":
            self.tokenizer: TextTokenizer = ByteTokenizer()
        elif Path(tokenizer).is_file():
            self.tokenizer = load_tokenizer_file(tokenizer, tokenizer)
        else:
            raise UserError(f"data.tokenizer={tokenizer!r} is invalid: no such file; expected 'byte' or a "
                            "tokenizer.json")

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def seq_len(self) -> int:
        return self.context_len

    def dataset(self, split: str) -> NeedleDataset:
        check_split(split)
        size = self.train_size if split == "train" else self.val_size
        loss_on = self.loss_on if split == "train" else "answers"
        return NeedleDataset(size, split, self.seed, self.context_len, self.nr, self.depth, self.haystack, loss_on,
                             self.tokenizer)

    def samples(self, split: str = "val", start: int = 0, count: int | None = None) -> Iterator[NeedleSample]:
        """The samples of a split with their metadata, in index order (the same as the batches)."""
        dataset = self.dataset(split)
        stop = len(dataset) if count is None else min(len(dataset), start + count)
        for index in range(start, stop):
            yield dataset.sample(index)

    def describe(self) -> str:
        pairs = ", ".join(f"N={n} R={r}" for n, r in self.nr)
        depth = "random" if self.depth is None else f"{self.depth:g}"
        tokens = f"{self.tokenizer.identity} tokens"
        return (f"needles ({pairs}) in a {self.haystack} haystack | context {self.context_len} {tokens} | "
                f"answer depth {depth} | train {self.train_size}, val {self.val_size} samples (held-out cities "
                f"and numbers) | training loss on {self.loss_on}")

    def setup(self, stage: str | None = None) -> None:
        token_haystack(self.haystack, "train", self.tokenizer)  # load the corpus once, before workers fork

    def train_dataloader(self) -> DataLoader:
        trainer = self.trainer
        dataset = self.dataset("train")
        if trainer is not None and trainer.overfit_batches > 0:
            return self._ordered_loader(dataset, drop_last=True)
        return resumable_train_loader(dataset, trainer, self.batch_size, self.seed, self.num_workers,
                                      collate_fn=default_collate)

    def val_dataloader(self) -> DataLoader:
        return self._ordered_loader(self.dataset("val"), drop_last=False)

    def test_dataloader(self) -> DataLoader:
        return self._ordered_loader(self.dataset("test"), drop_last=False)

    def _ordered_loader(self, dataset: NeedleDataset, drop_last: bool) -> DataLoader:
        return DataLoader(dataset, batch_size=self.batch_size, shuffle=False, drop_last=drop_last,
                          num_workers=self.num_workers, persistent_workers=self.num_workers > 0,
                          pin_memory=torch.cuda.is_available())

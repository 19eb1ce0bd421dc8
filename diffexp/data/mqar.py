"""Multi-query associative recall (MQAR; zoology, Arora et al. 2023) as a Lightning data module.

A row, as zoology's ``multiquery_ar`` builds it: N key-value pairs, then every key queried once, followed by its
value, at power-law distributed gaps among random filler. ``loss_mask`` marks the positions whose target is a
queried value, so only the recalls are trained and scored. Examples are made on the fly from (seed, split, index).
"""

from __future__ import annotations

from collections.abc import Sequence

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from diffexp.data.loader import resumable_train_loader, training_order_seed
from diffexp.errors import UserError

SPLITS = {"train": 0, "val": 1, "test": 2}


def power_law_gap_probs(space: int, power_a: float) -> np.ndarray:
    """Zoology's query-gap distribution over gaps 0..space-1: p_i ~ a * (i + 1) ** (a - 1)."""
    p = power_a * np.arange(1, space + 1, dtype=np.float64) ** (power_a - 1)
    return p / p.sum()


def mqar_example(rng: np.random.Generator, vocab_size: int, seq_len: int, num_kv_pairs: int,
                 gap_probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One MQAR row: tokens (seq_len + 1,) int64 and loss_mask (seq_len,) bool."""
    n, half = num_kv_pairs, vocab_size // 2
    context = 2 * n
    keys = rng.choice(np.arange(1, half), size=n, replace=False)
    values = rng.choice(np.arange(half, vocab_size), size=n, replace=False)
    gaps = rng.choice(len(gap_probs), size=n, replace=False, p=gap_probs)

    tokens = rng.integers(0, vocab_size, size=seq_len + 1, dtype=np.int64)  # filler
    tokens[0:context:2] = keys
    tokens[1:context:2] = values
    query_pos = context + 2 * gaps
    tokens[query_pos] = keys
    tokens[query_pos + 1] = values  # zoology keeps it in the label only; a next-token target reads it here
    mask = np.zeros(seq_len, dtype=bool)
    mask[query_pos] = True  # the target of position q is tokens[q + 1], the queried value
    return tokens, mask


class MQARDataset(Dataset):
    """``size`` MQAR examples of one split, each a dict {"tokens": (T + 1,), "loss_mask": (T,)}."""

    def __init__(self, size: int, vocab_size: int, seq_len: int, num_kv_pairs: int, power_a: float,
                 seed: int, split: str = "train") -> None:
        self.size, self.vocab_size, self.seq_len = size, vocab_size, seq_len
        self.num_kv_pairs, self.seed, self.split_code = num_kv_pairs, seed, SPLITS[split]
        self.gap_probs = power_law_gap_probs((seq_len - 2 * num_kv_pairs) // 2, power_a)

    def __len__(self) -> int:
        return self.size

    def example(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        if not 0 <= index < self.size:
            raise IndexError(f"index {index} out of range for {self.size} examples")
        rng = np.random.default_rng([self.seed, self.split_code, int(index)])
        return mqar_example(rng, self.vocab_size, self.seq_len, self.num_kv_pairs, self.gap_probs)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tokens, mask = self.example(index)
        return {"tokens": torch.from_numpy(tokens), "loss_mask": torch.from_numpy(mask)}

    def __getitems__(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        rows = [self.example(i) for i in indices]
        return {"tokens": torch.from_numpy(np.stack([t for t, _ in rows])),
                "loss_mask": torch.from_numpy(np.stack([m for _, m in rows]))}


def collate_examples(batch) -> dict[str, torch.Tensor]:
    """``MQARDataset.__getitems__`` already returns the batch dict; lists of dicts get stacked."""
    if isinstance(batch, dict):
        return batch
    return {key: torch.stack([item[key] for item in batch]) for key in batch[0]}


class MQARDataModule(L.LightningDataModule):
    """Multi-query associative recall batches (zoology): ``{"tokens": (B, T + 1), "loss_mask": (B, T)}``.

    Args:
        vocab_size: Token ids 0..vocab_size-1; keys come from [1, vocab_size // 2), values from
            [vocab_size // 2, vocab_size). Zoology uses 8192 (large vocabularies separate architectures).
        seq_len: Tokens the model sees per example (rows hold seq_len + 1 tokens); at least 4 * num_kv_pairs.
        num_kv_pairs: Key-value pairs per example; every key is queried once.
        train_size: Training examples per epoch (generated on the fly, indices 0..train_size-1).
        val_size: Validation examples, and as many test examples; each split is its own stream, disjoint
            from training.
        batch_size: Examples per batch.
        power_a: Zoology's power-law parameter of the query gaps (0.01: queries mostly near the
            key-value context; 1.0: uniform gaps).
        num_workers: DataLoader worker processes (0 generates in the main process).
        seed: Seeds the examples (with the split and the index).
        order_seed: Seeds the training order; None: the run's seed (seed_everything), else ``seed``, so a sweep's
            seeds vary the order while the cases of one seed read the same batches.
    """

    def __init__(
        self,
        vocab_size: int = 8192,
        seq_len: int = 256,
        num_kv_pairs: int = 16,
        train_size: int = 100_000,
        val_size: int = 3_000,
        batch_size: int = 64,
        power_a: float = 0.01,
        num_workers: int = 0,
        seed: int = 1234,
        order_seed: int | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("seq_len", seq_len), ("num_kv_pairs", num_kv_pairs),
                            ("train_size", train_size), ("val_size", val_size), ("batch_size", batch_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise UserError(f"data.{name}={value!r} is invalid: expected a positive integer")
        if seq_len < 4 * num_kv_pairs:
            raise UserError(
                f"data.seq_len={seq_len} is invalid: {num_kv_pairs} key-value pairs need 2 * {num_kv_pairs} "
                f"context tokens plus room for {num_kv_pairs} distinct query slots, so seq_len >= "
                f"4 * num_kv_pairs = {4 * num_kv_pairs}; raise seq_len or lower num_kv_pairs"
            )
        if vocab_size // 2 - 1 < num_kv_pairs or vocab_size - vocab_size // 2 < num_kv_pairs:
            raise UserError(
                f"data.vocab_size={vocab_size} is invalid: {num_kv_pairs} distinct keys from "
                f"[1, vocab_size // 2) and values from [vocab_size // 2, vocab_size) need vocab_size >= "
                f"{2 * num_kv_pairs + 2}"
            )
        if not (isinstance(power_a, (int, float)) and power_a > 0 and np.isfinite(power_a)):
            raise UserError(f"data.power_a={power_a!r} is invalid: expected a positive number (zoology: 0.01)")
        if train_size < batch_size:
            raise UserError(f"data.train_size={train_size} is invalid: must be >= data.batch_size={batch_size}")
        if num_workers < 0:
            raise UserError(f"data.num_workers={num_workers} is invalid: expected >= 0")
        self.save_hyperparameters()
        self._vocab_size = vocab_size
        self.seq_len, self.num_kv_pairs = seq_len, num_kv_pairs
        self.train_size, self.val_size, self.batch_size = train_size, val_size, batch_size
        self.power_a, self.num_workers, self.seed = float(power_a), num_workers, seed
        self.order_seed = training_order_seed(order_seed, seed)

    @property
    def vocab_size(self) -> int:
        """Linked to the model's vocab_size by the CLI."""
        return self._vocab_size

    def dataset(self, split: str) -> MQARDataset:
        size = self.train_size if split == "train" else self.val_size
        return MQARDataset(size, self._vocab_size, self.seq_len, self.num_kv_pairs, self.power_a, self.seed, split)

    def describe(self) -> str:
        return (f"MQAR (zoology) | vocab {self._vocab_size} | seq_len {self.seq_len} | "
                f"{self.num_kv_pairs} kv pairs | power_a {self.power_a} | train {self.train_size} | "
                f"val {self.val_size} examples | chance {1 / (self._vocab_size - self._vocab_size // 2):.2e}")

    def train_dataloader(self) -> DataLoader:
        trainer = self.trainer  # None unless attached to a Trainer
        if trainer is not None and trainer.overfit_batches > 0:
            return self._ordered_loader("train", drop_last=True)
        return resumable_train_loader(self.dataset("train"), trainer, self.batch_size, self.order_seed,
                                      self.num_workers, collate_fn=collate_examples)

    def val_dataloader(self) -> DataLoader:
        return self._ordered_loader("val", drop_last=False)

    def test_dataloader(self) -> DataLoader:
        return self._ordered_loader("test", drop_last=False)

    def _ordered_loader(self, split: str, drop_last: bool) -> DataLoader:
        return DataLoader(self.dataset(split), batch_size=self.batch_size, shuffle=False, drop_last=drop_last,
                          num_workers=self.num_workers, collate_fn=collate_examples,
                          pin_memory=torch.cuda.is_available())

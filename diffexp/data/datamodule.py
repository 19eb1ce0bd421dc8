"""``TextDataModule``: token shards -> rows of ``seq_len + 1`` token ids -> batches.

``data.source`` is a directory ``diffexp data prepare`` wrote, read as it is, or a raw source prepared once into
``cache_dir/prepared/<key>/`` (keyed by its files and the preparation settings) and reused.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shlex
import sys
from contextlib import contextmanager
from functools import cached_property
from pathlib import Path
from typing import Literal

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader

from diffexp.data import checks, sources
from diffexp.data.loader import PackedRows, collate_rows, resumable_train_loader, training_order_seed
from diffexp.data.prepare import BPE_SAMPLE_CHARS, SETTINGS, Plan, check_settings, prepare
from diffexp.data.prepared import Prepared, open_prepared
from diffexp.data.shards import MANIFEST
from diffexp.data.splits import unit_splits
from diffexp.data.tokenizer import TextTokenizer
from diffexp.data.units import plan_units, unit_documents
from diffexp.errors import UserError

log = logging.getLogger(__name__)

CACHE_FORMAT = 3  # bump when the prepared layout or the split rule changes (3: token shards, split by hash)
SPLITS = ("train", "val", "test")
# settings a prepared directory fixes itself (its manifest), so they are not read with one
FIXED_BY_PREPARATION = {"text_field": "text", "tokenizer": "byte", "bpe_vocab_size": 4096, "val_fraction": 0.05,
                        "test_fraction": 0.05, "max_chars": None}


def _short_hash(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:16]


def launched_externally() -> int | None:
    """The world size when torchrun / srun started this process together with others (None otherwise)."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    return world if world > 1 and "LOCAL_RANK" in os.environ else None


class TextDataModule(L.LightningDataModule):
    """Language-modelling batches from a prepared directory, the stdlib corpus, local files or a Hub dataset.

    Batches are ``(batch_size, seq_len + 1)`` long tensors; the train loader resumes mid-epoch.

    Args:
        source: a directory written by `diffexp data prepare` (its manifest fixes the tokenizer and the
            splits: text_field, tokenizer, bpe_vocab_size, val_fraction, test_fraction and max_chars are not
            read), "stdlib" (the Python standard library sources shipped with the interpreter; no download), a
            local .txt/.jsonl/.json/.parquet file, a directory or glob of them, or "hf:<name>" /
            "hf:<name>:<config>" for a Hugging Face Hub dataset (needs network). A raw source is prepared into
            cache_dir on first use.
        text_field: Column holding the text in .json/.jsonl/.parquet and Hub datasets.
        tokenizer: "byte" (UTF-8 bytes + end-of-document id, vocab 257), "bpe" (byte-level BPE trained on up
            to 32 M characters of training documents and cached), a path to a tokenizer.json file, or a Hub
            tokenizer name (needs network).
        bpe_vocab_size: Target vocabulary size when ``tokenizer="bpe"`` (at least 257).
        seq_len: Tokens the model sees per row; rows hold ``seq_len + 1`` tokens.
        batch_size: Rows per batch; "auto" (``diffexp fit`` on one GPU, with global_batch.rows): the largest
            micro-batch the memory estimate fits, the accumulation following (docs/gpu.md).
        val_fraction: Fraction of documents held out for validation, in (0, 1), chosen by a hash of each
            document's text keyed by seed.
        test_fraction: Fraction of documents held out for ``diffexp test``, disjoint from the validation
            ones, in [0, 1) (0: no test split).
        max_chars: Cap on corpus characters (documents in order, the last one truncated).
            None means everything, except for "stdlib" where it means 8 M characters.
        num_workers: DataLoader worker processes (0 loads in the main process).
        cache_dir: Directory for prepared raw sources and Hub downloads.
        seed: Seeds the held-out split of a raw source (and the BPE training sample); fixed across a sweep's seeds.
        order_seed: Seeds the training order (epoch e is a permutation seeded by ``order_seed + e``). None: the
            run's seed (``seed_everything``), so a sweep's seeds vary the order while every case at one seed reads
            the same batches; ``data.seed`` when no run seed is set.
    """

    def __init__(
        self,
        source: str = "stdlib",
        text_field: str = "text",
        tokenizer: str = "byte",
        bpe_vocab_size: int = 4096,
        seq_len: int = 256,
        batch_size: int | Literal["auto"] = 16,
        val_fraction: float = 0.05,
        test_fraction: float = 0.05,
        max_chars: int | None = None,
        num_workers: int = 0,
        cache_dir: str = ".cache/diffexp",
        seed: int = 1234,
        order_seed: int | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        # Validate everything up front so a bad config fails before any data work or model building starts.
        if seq_len <= 0:
            raise UserError(f"data.seq_len={seq_len}: must be a positive integer")
        if batch_size == "auto":  # diffexp fit replaces it by a number before building (training.auto_batch)
            raise UserError("data.batch_size=auto: only `diffexp fit` sizes the micro-batch (on one GPU, from its "
                            "free memory); a TextDataModule built in Python needs a number")
        if batch_size <= 0:
            raise UserError(f"data.batch_size={batch_size}: must be a positive integer")
        if num_workers < 0:
            raise UserError(f"data.num_workers={num_workers}: must be >= 0")
        self.text_field = text_field
        self.tokenizer_spec = tokenizer
        self.bpe_vocab_size = bpe_vocab_size
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.max_chars = max_chars
        self.num_workers = num_workers
        self.cache_dir = Path(cache_dir).expanduser()
        self.seed = seed
        self.order_seed = training_order_seed(order_seed, seed)
        self.prepared_source = self._prepared_source(source)
        if self.prepared_source is None:
            self._check_raw_settings(source)

        self.tokenizer_trained = False  # True when this instance trained the BPE (not loaded it)
        self.prepared_from_cache: bool | None = None  # set once the data is prepared or found
        self.train_rows = self.val_rows = self.test_rows = None
        self.meta: dict = {}

    def _prepared_source(self, source: str) -> Path | None:
        path = Path(source).expanduser()
        if not (path.is_dir() and ((path / MANIFEST).is_file() or (path / SETTINGS).is_file())):
            return None
        unread = {key: self.hparams[key] for key, default in FIXED_BY_PREPARATION.items()
                  if self.hparams[key] != default}
        if unread:
            settings = ", ".join(f"data.{key}={value!r}" for key, value in unread.items())
            print(f"warning: data.source={source!r} is a prepared directory, whose manifest fixes the tokenizer and "
                  f"the splits: {settings} is not read", file=sys.stderr)
        self.source = sources.Source(source, "prepared")
        return path

    def _check_raw_settings(self, source: str) -> None:
        self.source = sources.resolve_source(source)
        tokenizer_file = checks.tokenizer_path(self.tokenizer_spec)
        check_settings(self.tokenizer_spec, self.bpe_vocab_size, self.val_fraction, self.test_fraction,
                       self.max_chars)
        sources.check_source(self.source, self.text_field)  # a prefix of each file: empty, binary, not UTF-8, no field
        self._tokenizer_identity = self.tokenizer_spec
        if self.tokenizer_spec not in ("byte", "bpe"):  # a bad file or name fails here; its content is its identity
            from diffexp.data.tokenizer import load_named_tokenizer

            named = str(tokenizer_file) if tokenizer_file is not None else self.tokenizer_spec
            text = load_named_tokenizer(named, "data.tokenizer")[1]
            self._tokenizer_identity = f"file-{hashlib.sha256(text.encode()).hexdigest()[:16]}"

    # ----------------------------------------------------------------- preparation

    def _plan(self) -> Plan:
        return Plan(self.source, self.text_field, self.max_chars, self.tokenizer_spec, self.bpe_vocab_size,
                    BPE_SAMPLE_CHARS, self.seed, self.val_fraction, self.test_fraction,
                    hf_cache_dir=str(self.cache_dir / "hf_datasets"))

    @property
    def prepared_dir(self) -> Path:
        """The prepared directory training reads: the source itself, or this raw source's cache entry."""
        if self.prepared_source is not None:
            return self.prepared_source
        bpe = (self.bpe_vocab_size, BPE_SAMPLE_CHARS) if self.tokenizer_spec == "bpe" else None
        key = _short_hash(CACHE_FORMAT, sources.fingerprint(self.source), self.text_field, self.max_chars,
                          self.val_fraction, self.test_fraction, self.seed, self._tokenizer_identity, bpe)
        return self.cache_dir / "prepared" / key

    def prepare_command(self, directory: str | None = None) -> str:
        """The `diffexp data prepare` command that makes this raw source's cache entry (OUT: ``directory``, by
        default the cache entry itself)."""
        from argparse import Namespace

        from diffexp.data.cli import canonical_command

        args = Namespace(source=self.source.spec, tokenizer=self.tokenizer_spec, bpe_vocab_size=self.bpe_vocab_size,
                         bpe_sample_chars=None, text_field=self.text_field, max_chars=self.max_chars, seed=self.seed,
                         val_fraction=self.val_fraction, test_fraction=self.test_fraction, shard_tokens=None,
                         unit_mb=None)
        return canonical_command(args).replace("{directory}", directory or shlex.quote(str(self.prepared_dir)))

    def ensure_prepared(self) -> None:
        """Prepare a raw source into the cache unless it is there. Run before any other process starts: a
        process that torchrun or srun started beside others refuses instead, with the command to run first."""
        directory = self.prepared_dir
        self.prepared_from_cache = (directory / MANIFEST).is_file()
        if self.prepared_source is not None or self.prepared_from_cache:
            return
        world = launched_externally()
        if world is not None:
            raise UserError(
                f"data.source={self.source.spec!r} is not prepared yet, and this is one of {world} processes a "
                "launcher (torchrun, srun) started: preparing it here would hold every other process at a barrier. "
                f"Prepare it once, then launch again:\n  {self.prepare_command()}\n(or prepare into a directory of "
                "your choice with `diffexp data prepare` and train with --data.source DIR)")
        with _cache_entry_lock(directory):  # runs sharing a cache (a sweep's trials) prepare it once
            self.prepared_from_cache = (directory / MANIFEST).is_file()
            if self.prepared_from_cache:
                return
            log.info("preparing %s with tokenizer %s into %s", self.source.spec, self.tokenizer_spec, directory)
            prepare(self._plan(), directory, progress=True, command=self.prepare_command("{directory}"))
        self.tokenizer_trained = self.tokenizer_spec == "bpe"

    @cached_property
    def prepared(self) -> Prepared:
        """The prepared data, checked: sizes in every process, SHA-256 once per machine (its first process)."""
        self.ensure_prepared()
        directory = self.prepared_dir
        if self.prepared_source is None:
            log.info("reusing prepared %s", directory) if self.prepared_from_cache else None
            rebuild = f"delete {directory} and run again: it is prepared anew"
            key = "data.cache_dir"
        else:
            rebuild, key = None, "data.source"
        checksums = int(os.environ.get("LOCAL_RANK", "0") or 0) == 0
        return open_prepared(directory, key, checksums=checksums, rebuild=rebuild)

    @property
    def tokenizer(self) -> TextTokenizer:
        return self.prepared.tokenizer

    @property
    def vocab_size(self) -> int:
        """Vocabulary size for the model's embedding (prepares the data on first access)."""
        return self.tokenizer.vocab_size

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_id

    # ----------------------------------------------------------------- documents (small corpora, evaluations)

    def documents(self) -> list[str]:
        """Every document of a raw source, in order (reads it whole: for small corpora)."""
        if self.prepared_source is not None:
            raise UserError(f"data.source={self.source.spec!r} is a prepared directory: its documents are read per "
                            "split (splits())")
        hf_cache = str(self.cache_dir / "hf_datasets")
        units = plan_units(self.source, self.text_field, self.max_chars, hf_cache)
        documents = [text for unit in units for text in unit_documents(unit, self.source, self.text_field, hf_cache)]
        if not documents:
            field = "" if self.source.kind == "stdlib" else f" (data.text_field={self.text_field!r})"
            raise UserError(f"data.source={self.source.spec!r}: no text at all: every document{field} is "
                            "empty or whitespace; expected text to train on")
        return documents

    def splits(self) -> dict[str, list[str]]:
        """Train, validation and test documents (disjoint; the same rule the preparation applies)."""
        if self.prepared_source is not None:
            return {split: list(self.prepared.texts(split)) for split in SPLITS}
        plan = self._plan()
        plan.plan()  # an empty corpus is refused here, as too few documents to split
        found: dict[str, list[str]] = {split: [] for split in SPLITS}
        for unit in plan.units:
            for split, text in unit_splits(unit, self.source, self.text_field, plan.hf_cache_dir, self.seed,
                                           self.val_fraction, self.test_fraction, plan.overrides):
                found[split].append(text)
        return found

    def split(self) -> tuple[list[str], list[str]]:
        """Train and validation documents (see ``splits`` for the test documents too)."""
        splits = self.splits()
        return splits["train"], splits["val"]

    # ----------------------------------------------------------------- rows

    def prepare_data(self) -> None:
        """Prepare or find the data and check it (the first process of each machine)."""
        self.prepared  # noqa: B018

    def setup(self, stage: str | None = None) -> None:
        if self.train_rows is not None:
            return
        prepared = self.prepared
        self.train_rows, self.val_rows, self.test_rows = (prepared.rows(split, self.seq_len) for split in SPLITS)
        self.train_rows.identity = f"{prepared.identity}-{self.seq_len}"  # a resume checks it trains on these
        splits = prepared.manifest["splits"]
        self.meta = {"source": self.source.spec, "tokenizer": prepared.tokenizer.identity, "seq_len": self.seq_len,
                     **{split: {"documents": splits[split]["documents"], "tokens": splits[split]["tokens"],
                                "rows": len(rows)}
                        for split, rows in zip(SPLITS, (self.train_rows, self.val_rows, self.test_rows))}}
        self._check_enough_rows()

    def _check_enough_rows(self) -> None:
        assert self.train_rows is not None and self.val_rows is not None
        hint = "lower data.seq_len or data.batch_size, or use more data (data.max_chars)"
        if len(self.train_rows) < self.batch_size:
            raise UserError(
                f"data.batch_size={self.batch_size}: the training split has only {len(self.train_rows)} rows "
                f"of {self.seq_len + 1} tokens; {hint}"
            )
        if len(self.val_rows) == 0:
            raise UserError(
                f"data.val_fraction={self.val_fraction}: the validation split has fewer than "
                f"{self.seq_len + 1} tokens ({self.meta['val']['tokens']}); raise it, or {hint}"
            )

    def describe(self) -> str:
        """One line for logs: source, tokenizer, documents / tokens / rows per split."""
        if not self.meta:
            return f"{self.source.spec} (not set up yet)"
        parts = " | ".join(
            f"{name} {m['documents']} docs, {m['tokens']:,} tokens, {m['rows']} rows"
            for name in SPLITS if (m := self.meta[name])["documents"]
        )
        tokenizer = f"tokenizer {self.tokenizer.identity} (vocab {self.vocab_size})"
        return f"{self.source.spec} | {tokenizer} | {parts} | rows of {self.seq_len + 1} tokens"

    # ----------------------------------------------------------------- dataloaders

    def train_dataloader(self) -> DataLoader:
        self.setup("fit")
        trainer = self.trainer  # None unless attached to a Trainer
        if trainer is not None and trainer.overfit_batches > 0:
            # Lightning wants a fixed sequential order when overfitting (it would otherwise try to
            # rebuild the loader with a SequentialSampler); resuming is moot there.
            return self._ordered_loader(self.train_rows, drop_last=True)
        return resumable_train_loader(PackedRows(self.train_rows), trainer, self.batch_size, self.order_seed,
                                      self.num_workers)

    def val_dataloader(self) -> DataLoader:
        self.setup("validate")
        return self._ordered_loader(self.val_rows, drop_last=False)

    def test_dataloader(self) -> DataLoader:
        self.setup("test")
        assert self.test_rows is not None
        if self.prepared.manifest["split"]["test_fraction"] == 0:
            raise UserError("data.test_fraction=0: this data has no test split; set it above 0 (e.g. 0.05)")
        if len(self.test_rows) == 0:
            raise UserError(
                f"data.test_fraction={self.test_fraction}: the test split has fewer than {self.seq_len + 1} tokens "
                f"({self.meta['test']['tokens']}); raise data.test_fraction, lower data.seq_len or use more data"
            )
        return self._ordered_loader(self.test_rows, drop_last=False)

    def _ordered_loader(self, rows: np.ndarray, drop_last: bool) -> DataLoader:
        return DataLoader(
            PackedRows(rows),
            batch_size=self.batch_size,
            shuffle=False,
            drop_last=drop_last,
            num_workers=self.num_workers,
            collate_fn=collate_rows,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=self.num_workers > 0,
        )


@contextmanager
def _cache_entry_lock(directory: Path):
    """Hold the cache entry's lock file; another process preparing the same entry is waited for, and said so."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    with open(directory.with_name(directory.name + ".lock"), "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process preparing %s", directory)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)

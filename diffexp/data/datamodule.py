"""``TextDataModule``: documents -> tokenizer -> packed rows of ``seq_len + 1`` token ids -> batches.

Expensive steps are cached under ``cache_dir`` and reused by later runs:

* ``tokenizers/bpe-<key>.json``: the BPE trained on the training split
  (key: source fingerprint, text field, ``max_chars``, split, ``bpe_vocab_size``);
* ``packed/<key>/{train,val,test}.npy`` + ``meta.json``: the packed rows
  (key: the same corpus identity, the tokenizer identity and ``seq_len``).

Cache keys use file paths, sizes and mtimes, so editing a data file invalidates them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from functools import cached_property
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader

from diffexp.data import checks, sources
from diffexp.data.loader import PackedRows, collate_rows, resumable_train_loader
from diffexp.data.packing import encode_documents, held_out_split, pack_rows, save_atomic
from diffexp.data.tokenizer import ByteTokenizer, TextTokenizer, load_or_train_bpe, load_tokenizer_file
from diffexp.errors import UserError

log = logging.getLogger(__name__)

CACHE_FORMAT = 2  # bump when the cached layout or packing rules change (2: a test split of its own)


SPLITS = ("train", "val", "test")


def _short_hash(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:16]


class TextDataModule(L.LightningDataModule):
    """Language-modelling batches from the stdlib corpus, local files or a Hub dataset.

    Batches are ``torch.long`` tensors of shape ``(batch_size, seq_len + 1)``; the model uses
    ``batch[:, :-1]`` as inputs and ``batch[:, 1:]`` as targets. Every document is followed by
    the tokenizer's end-of-document id. The train loader is resumable mid-epoch (its state is
    saved in Lightning checkpoints); validation and test read their own held-out documents, in order.

    Args:
        source: "stdlib" (the Python standard library sources shipped with the interpreter; no
            download), a local .txt/.jsonl/.json/.parquet file, a directory or glob of them, or
            "hf:<name>" / "hf:<name>:<config>" for a Hugging Face Hub dataset (needs network).
        text_field: Column holding the text in .json/.jsonl/.parquet and Hub datasets.
        tokenizer: "byte" (UTF-8 bytes + end-of-document id, vocab 257), "bpe" (byte-level BPE
            trained on the training split and cached), or a path to a tokenizer.json file.
        bpe_vocab_size: Target vocabulary size when ``tokenizer="bpe"`` (at least 257).
        seq_len: Tokens the model sees per row; rows hold ``seq_len + 1`` tokens.
        batch_size: Rows per batch.
        val_fraction: Fraction of documents held out for validation, in (0, 1).
        test_fraction: Fraction of documents held out for ``diffexp test``, disjoint from the validation
            ones, in [0, 1) (0: no test split).
        max_chars: Cap on corpus characters (documents in order, the last one truncated).
            None means everything, except for "stdlib" where it means 8 M characters.
        num_workers: DataLoader worker processes (0 loads in the main process).
        cache_dir: Directory for the trained tokenizer, packed rows and Hub downloads.
        seed: Seeds the train/val document split and the per-epoch shuffle order.
    """

    def __init__(
        self,
        source: str = "stdlib",
        text_field: str = "text",
        tokenizer: str = "byte",
        bpe_vocab_size: int = 4096,
        seq_len: int = 256,
        batch_size: int = 16,
        val_fraction: float = 0.05,
        test_fraction: float = 0.05,
        max_chars: int | None = None,
        num_workers: int = 0,
        cache_dir: str = ".cache/diffexp",
        seed: int = 1234,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        # Validate everything up front so a bad config fails before any data work or model building starts.
        self.source = sources.resolve_source(source)
        tokenizer_file = checks.tokenizer_path(tokenizer)
        if tokenizer == "bpe" and bpe_vocab_size < 257:
            raise UserError(
                f"data.bpe_vocab_size={bpe_vocab_size}: must be >= 257 (256 byte symbols + <|endoftext|>)"
            )
        if seq_len <= 0:
            raise UserError(f"data.seq_len={seq_len}: must be a positive integer")
        if batch_size <= 0:
            raise UserError(f"data.batch_size={batch_size}: must be a positive integer")
        if not 0.0 < val_fraction < 1.0:
            raise UserError(f"data.val_fraction={val_fraction}: must be strictly between 0 and 1")
        if not 0.0 <= test_fraction < 1.0 or val_fraction + test_fraction >= 1.0:
            raise UserError(f"data.test_fraction={test_fraction}: must be in [0, 1) and leave documents for "
                            f"training beside data.val_fraction={val_fraction}")
        if max_chars is not None and max_chars <= 0:
            raise UserError(f"data.max_chars={max_chars}: must be a positive integer or None")
        if num_workers < 0:
            raise UserError(f"data.num_workers={num_workers}: must be >= 0")
        sources.check_source(self.source, text_field)  # a prefix of each file: empty, binary, not UTF-8, no field
        # Loaded now (it is needed anyway for the vocabulary size), so a bad file fails here.
        self._file_tokenizer = load_tokenizer_file(tokenizer_file, tokenizer) if tokenizer_file else None

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

        self.tokenizer_trained = False  # True when this instance trained the BPE (not loaded it)
        self.packed_from_cache: bool | None = None  # set by prepare_data/setup
        self.train_rows: np.ndarray | None = None
        self.val_rows: np.ndarray | None = None
        self.test_rows: np.ndarray | None = None
        self.meta: dict = {}
        self._documents: list[str] | None = None

    # ----------------------------------------------------------------- corpus and tokenizer

    @cached_property
    def corpus_key(self) -> str:
        """Identity of the documents and their split (cheap: no file contents are read)."""
        return _short_hash(
            CACHE_FORMAT, sources.fingerprint(self.source), self.text_field, self.max_chars,
            self.val_fraction, self.test_fraction, self.seed,
        )  # fmt: skip

    def documents(self) -> list[str]:
        """All documents of the (capped) corpus, loaded once per instance."""
        if self._documents is None:
            log.info("loading documents from %s", self.source.spec)
            hf_cache = str(self.cache_dir / "hf_datasets")
            self._documents = sources.load_documents(self.source, self.text_field, self.max_chars, hf_cache)
            if not self._documents:
                field = "" if self.source.kind == "stdlib" else f" (data.text_field={self.text_field!r})"
                raise UserError(f"data.source={self.source.spec!r}: no text at all: every document{field} is "
                                "empty or whitespace; expected text to train on")
        return self._documents

    def splits(self) -> dict[str, list[str]]:
        """Train, validation and test documents (disjoint; deterministic given ``seed``)."""
        documents = self.documents()
        try:
            ids = held_out_split(len(documents), self.val_fraction, self.test_fraction, self.seed)
        except ValueError as error:
            hint = "raise data.max_chars" if self.max_chars else "add text; .txt files split at blank lines"
            raise UserError(f"data.source={self.source.spec!r}: {error} ({hint})") from None
        return {name: [documents[i] for i in part] for name, part in zip(SPLITS, ids, strict=True)}

    def split(self) -> tuple[list[str], list[str]]:
        """Train and validation documents (see ``splits`` for the test documents too)."""
        splits = self.splits()
        return splits["train"], splits["val"]

    @cached_property
    def tokenizer(self) -> TextTokenizer:
        """The tokenizer; for "bpe" trained on the training split on first use, then cached."""
        if self.tokenizer_spec == "byte":
            return ByteTokenizer()
        if self._file_tokenizer is not None:
            return self._file_tokenizer
        key = _short_hash(self.corpus_key, self.bpe_vocab_size)
        path = self.cache_dir / "tokenizers" / f"bpe-{key}.json"

        def training_texts() -> list[str]:
            log.info("training a %d-token byte-level BPE on the training split", self.bpe_vocab_size)
            return self.splits()["train"]

        tokenizer, self.tokenizer_trained = load_or_train_bpe(
            path, training_texts, self.bpe_vocab_size, f"bpe-{key}"
        )
        if not self.tokenizer_trained:
            log.info("reusing cached tokenizer %s", path)
        return tokenizer

    @property
    def vocab_size(self) -> int:
        """Vocabulary size for the model's embedding (may train/load the BPE on first access)."""
        return self.tokenizer.vocab_size

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_id

    # ----------------------------------------------------------------- packed rows

    @property
    def packed_dir(self) -> Path:
        return self.cache_dir / "packed" / _short_hash(self.corpus_key, self.tokenizer.identity, self.seq_len)

    def prepare_data(self) -> None:
        """Tokenize and pack into ``cache_dir`` unless a matching cache exists (rank 0 only under DDP)."""
        self._build_or_load()

    def setup(self, stage: str | None = None) -> None:
        if self.train_rows is None:
            self._build_or_load()

    def _build_or_load(self) -> None:
        directory = self.packed_dir
        meta_path = directory / "meta.json"
        self.packed_from_cache = meta_path.is_file()  # meta.json is written last: its presence means complete
        if self.packed_from_cache:
            log.info("reusing cached packed rows %s", directory)
        else:
            log.info(
                "tokenizing %s with %s into rows of %d tokens",
                self.source.spec,
                self.tokenizer.identity,
                self.seq_len + 1,
            )
            self._tokenize_and_pack(directory)
        self.meta = json.loads(meta_path.read_text())
        # Memory-mapped: cheap to open, shared by forked DataLoader workers.
        self.train_rows = np.load(directory / "train.npy", mmap_mode="r")
        self.val_rows = np.load(directory / "val.npy", mmap_mode="r")
        self.test_rows = np.load(directory / "test.npy", mmap_mode="r")
        self._check_enough_rows()

    def _tokenize_and_pack(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        meta = {"source": self.source.spec, "tokenizer": self.tokenizer.identity, "seq_len": self.seq_len}
        for name, docs in self.splits().items():
            stream = encode_documents(docs, self.tokenizer)
            rows = pack_rows(stream, self.seq_len)
            save_atomic(directory / f"{name}.npy", rows)
            meta[name] = {"documents": len(docs), "tokens": int(len(stream)), "rows": int(len(rows))}
        tmp = directory / f"meta.json.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(meta, indent=2))
        tmp.replace(directory / "meta.json")
        self._documents = None  # packed now: drop the text rather than copy it into forked workers

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
        return resumable_train_loader(PackedRows(self.train_rows), trainer, self.batch_size, self.seed,
                                      self.num_workers)

    def val_dataloader(self) -> DataLoader:
        self.setup("validate")
        return self._ordered_loader(self.val_rows, drop_last=False)

    def test_dataloader(self) -> DataLoader:
        self.setup("test")
        assert self.test_rows is not None
        if self.test_fraction == 0:
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

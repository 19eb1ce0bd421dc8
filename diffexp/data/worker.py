"""What one preparation process does with a unit: read it, split and tokenize its documents, write its shards,
then record it (``units/<index>.json``) once its shards are on disk. Imports no torch: it runs in the spawned
worker processes of ``diffexp data prepare``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from diffexp.data import sources
from diffexp.data.shards import SPLITS, PieceWriter, write_json
from diffexp.data.splits import unit_splits
from diffexp.data.units import Unit

BATCH_CHARS = 1 << 20  # documents tokenized together


def _libc_malloc_trim():
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return None


_MALLOC_TRIM = _libc_malloc_trim()


def release_memory() -> None:
    """Give the freed memory of a batch back to the system: the tokenizer's per-batch encodings are freed into
    malloc's arenas, which would otherwise keep each process at its largest batch's high-water mark and more."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


@dataclass
class Job:
    """What a process needs to prepare units: sent once to each worker."""

    out: str
    source: sources.Source
    text_field: str
    hf_cache_dir: str
    tokenizer_json: str | None  # None: the byte tokenizer
    eos_id: int
    dtype: str
    seed: int
    val_fraction: float
    test_fraction: float
    overrides: dict[float, str]
    shard_tokens: int
    settings: dict | None = None  # the preparation's settings (unit_settings), kept in each unit's record


WORKER: dict = {}


def init_worker(job: Job, progress, single_threaded: bool) -> None:
    if single_threaded:  # one process per core: the tokenizer's own thread pool would oversubscribe them
        os.environ["RAYON_NUM_THREADS"] = "1"
    encode = None
    if job.tokenizer_json is not None:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_str(job.tokenizer_json)

        def encode(texts: list[str]) -> list[list[int]]:
            return [e.ids for e in tokenizer.encode_batch_fast(texts, add_special_tokens=False)]
    WORKER.update(job=job, encode=encode, progress=progress)


def _token_ids(texts: list[str], encode, eos_id: int, dtype: np.dtype) -> np.ndarray:
    """The documents' ids, each followed by ``eos_id``, as one array."""
    if encode is None:  # the byte tokenizer: UTF-8 bytes are the ids
        encoded = [text.encode("utf-8") for text in texts]
        ends = np.cumsum(np.fromiter(map(len, encoded), np.int64, len(encoded)) + 1) - 1
        ids = np.empty(int(ends[-1]) + 1 if len(ends) else 0, dtype=dtype)
        is_text = np.ones(len(ids), dtype=bool)
        is_text[ends] = False
        ids[is_text] = np.frombuffer(b"".join(encoded), dtype=np.uint8)
        ids[ends] = eos_id
        return ids
    flat: list[int] = []
    for ids in encode(texts):
        flat.extend(ids)
        flat.append(eos_id)
    return np.array(flat, dtype=dtype)


def prepare_unit(unit: Unit) -> dict:
    """Read, split, tokenize and write one unit; its record once its shards are on disk."""
    job, encode, progress = WORKER["job"], WORKER["encode"], WORKER["progress"]
    out, dtype = Path(job.out), np.dtype(job.dtype)
    writers = {split: PieceWriter(out / "shards", f"{split}-{unit.index:06d}", dtype, job.eos_id, job.shard_tokens)
               for split in SPLITS}
    reported = 0

    def flush(batch: dict[str, list[str]], chars: int) -> None:
        nonlocal reported
        tokens = 0
        for split, texts in batch.items():
            if texts:
                ids = _token_ids(texts, encode, job.eos_id, dtype)
                writers[split].write(ids)
                tokens += len(ids)
        release_memory()
        if progress is not None:
            progress.put((sum(map(len, batch.values())), chars, tokens))
            reported += chars

    batch: dict[str, list[str]] = {split: [] for split in SPLITS}
    chars = 0
    for split, text in unit_splits(unit, job.source, job.text_field, job.hf_cache_dir, job.seed, job.val_fraction,
                                   job.test_fraction, job.overrides):
        batch[split].append(text)
        chars += len(text)
        if chars >= BATCH_CHARS:
            flush(batch, chars)
            batch, chars = {split: [] for split in SPLITS}, 0
    flush(batch, chars)
    if progress is not None and unit.size > reported:  # the bar counts source bytes: end on the unit's size
        progress.put((0, unit.size - reported, 0))
    record = {"unit": unit.to_json(), "splits": {split: writers[split].close() for split in SPLITS}}
    if job.settings is not None:  # what `join` checks against, whichever directory the record is copied into
        record["settings"] = job.settings
    write_json(out / "units" / f"{unit.index:06d}.json", record)
    return record


def finished(out: Path, unit: Unit) -> bool:
    """A unit whose record is written and whose pieces are all there at their size."""
    path = out / "units" / f"{unit.index:06d}.json"
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    if record.get("unit") != unit.to_json():
        return False
    pieces = [p for split in SPLITS for p in record["splits"][split]]
    return all((out / p["file"]).is_file() and (out / p["file"]).stat().st_size == p["bytes"] for p in pieces)

"""Turning documents into fixed-length training rows, and caching the result on disk.

Each document is tokenized and followed by the end-of-document id; the documents are
concatenated into one token stream, which is cut into non-overlapping rows of ``seq_len + 1``
tokens (inputs are ``row[:-1]``, targets ``row[1:]``). The incomplete tail is dropped.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from diffexp.data.tokenizer import TextTokenizer


def split_documents(num_documents: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic train/val split of document indices (each kept in corpus order).

    At least one document goes to each side, so ``num_documents`` must be >= 2.
    """
    train, val, _ = held_out_split(num_documents, val_fraction, 0.0, seed)
    return train, val


def held_out_split(num_documents: int, val_fraction: float, test_fraction: float,
                   seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Deterministic train/val/test split of document indices (each kept in corpus order).

    The validation documents are the ones ``split_documents`` holds out with the same seed; the test
    documents come next in the same permutation, so no document is in two splits. Train and val get at
    least one document each, and test too unless ``test_fraction`` is 0.
    """
    needed = 3 if test_fraction > 0 else 2
    if num_documents < needed:
        splits = "train/val/test" if test_fraction > 0 else "train/val"
        raise ValueError(f"need at least {needed} documents to split into {splits}, got {num_documents}")
    num_val = min(max(1, round(num_documents * val_fraction)), num_documents - needed + 1)
    num_test = 0 if test_fraction == 0 else min(max(1, round(num_documents * test_fraction)),
                                                 num_documents - 1 - num_val)
    order = np.random.default_rng(seed).permutation(num_documents)
    held_out = num_val + num_test
    return np.sort(order[held_out:]), np.sort(order[:num_val]), np.sort(order[num_val:held_out])


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype holding every id: halves the cache size for vocabularies <= 65536."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def encode_documents(documents: Sequence[str], tokenizer: TextTokenizer, chunk_size: int = 512) -> np.ndarray:
    """One token stream: each document's ids followed by ``tokenizer.eos_id``."""
    dtype = token_dtype(tokenizer.vocab_size)
    eos = np.array([tokenizer.eos_id], dtype=dtype)
    pieces: list[np.ndarray] = []
    for start in range(0, len(documents), chunk_size):  # chunks let the Rust tokenizer use all cores
        for ids in tokenizer.encode_batch(documents[start : start + chunk_size]):
            pieces += [ids.astype(dtype), eos]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)


def pack_rows(stream: np.ndarray, seq_len: int) -> np.ndarray:
    """View ``stream`` as rows of ``seq_len + 1`` tokens, dropping the incomplete tail."""
    row_len = seq_len + 1
    num_rows = len(stream) // row_len
    return stream[: num_rows * row_len].reshape(num_rows, row_len)


def save_atomic(path: Path, array: np.ndarray) -> None:
    """Write ``array`` as ``.npy`` via a temp file + rename so readers never see partial files."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        np.save(f, array)
    os.replace(tmp, path)

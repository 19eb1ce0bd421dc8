"""`diffexp test` scores rows of its own: never the validation rows, never training documents."""

from __future__ import annotations

import numpy as np
import torch

from diffexp.data import TextDataModule
from diffexp.data.packing import encode_documents, held_out_split, pack_rows


def rows(loader) -> set[bytes]:
    return {row.numpy().tobytes() for batch in loader
            for row in (batch["tokens"] if isinstance(batch, dict) else batch)}


def test_held_out_split_gives_test_documents_of_their_own():
    train, val, test = held_out_split(100, 0.1, 0.05, seed=1)
    assert (len(val), len(test)) == (10, 5)
    assert sorted([*train, *val, *test]) == list(range(100))  # each document in exactly one split
    assert np.array_equal(val, held_out_split(100, 0.1, 0.0, seed=1)[1])  # val unchanged by the test split


def test_text_test_rows_are_the_test_documents_not_the_validation_rows(tmp_path):
    settings = {"max_chars": 40_000, "seq_len": 31, "batch_size": 4, "cache_dir": str(tmp_path / "cache")}
    dm = TextDataModule(**settings)
    dm.setup("test")
    test_rows, val_rows = rows(dm.test_dataloader()), rows(dm.val_dataloader())
    assert test_rows and val_rows and test_rows.isdisjoint(val_rows)
    test_documents = dm.splits()["test"]
    expected = pack_rows(encode_documents(test_documents, dm.tokenizer), dm.seq_len)
    assert torch.equal(torch.cat(list(dm.test_dataloader())), torch.from_numpy(expected.astype(np.int64)))

    cached = TextDataModule(**settings)  # the test rows are cached with the others
    cached.setup("test")
    assert cached.packed_from_cache and np.array_equal(cached.test_rows, dm.test_rows)


def test_synthetic_test_batches_are_not_the_validation_batches():
    from diffexp.data.icl import ICLDataModule
    from diffexp.data.needle import NeedleDataModule

    for dm in (NeedleDataModule(context_len=256, haystack="synthetic", batch_size=4, train_size=4, val_size=8),
               ICLDataModule(seq_len=64, batch_size=4, train_size=4, val_size=8)):
        test_rows, val_rows = rows(dm.test_dataloader()), rows(dm.val_dataloader())
        assert len(test_rows) == len(val_rows) == 8 and test_rows.isdisjoint(val_rows), type(dm).__name__

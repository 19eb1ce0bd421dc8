"""`diffexp test` scores rows of its own: never the validation rows, never training documents."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from diffexp.data import TextDataModule
from diffexp.data.splits import split_of
from diffexp.errors import UserError
from tests.helpers import encode_documents


def pack_rows(stream: np.ndarray, seq_len: int) -> np.ndarray:
    rows = len(stream) // (seq_len + 1)
    return stream[: rows * (seq_len + 1)].reshape(rows, seq_len + 1)


def rows(loader) -> set[bytes]:
    return {row.numpy().tobytes() for batch in loader
            for row in (batch["tokens"] if isinstance(batch, dict) else batch)}


def test_documents_are_held_out_by_their_text_alone():
    texts = [f"document {i}: some text" for i in range(4000)]
    splits = [split_of(text, 1, 0.1, 0.05) for text in texts]
    assert 340 < splits.count("val") < 460 and 150 < splits.count("test") < 250  # the fractions, within 3 sigma
    assert splits == [split_of(text, 1, 0.1, 0.05) for text in reversed(texts)][::-1]  # not by position
    val = [text for text, split in zip(texts, splits) if split == "val"]
    assert all(split_of(text, 1, 0.1, 0.0) == "val" for text in val)  # val unchanged by the test split
    assert splits != [split_of(text, 2, 0.1, 0.05) for text in texts]  # keyed by the seed


def test_a_small_corpus_still_holds_out_one_document_each_or_says_it_is_too_small(tmp_path):
    corpus = tmp_path / "three.jsonl"
    corpus.write_text("".join(f'{{"text": "document {i} " }}\n' for i in range(3)))
    dm = TextDataModule(source=str(corpus), seq_len=3, batch_size=1, cache_dir=str(tmp_path / "cache"))
    assert [len(docs) for docs in dm.splits().values()] == [1, 1, 1]
    dm.setup("fit")
    assert [dm.meta[split]["documents"] for split in ("train", "val", "test")] == [1, 1, 1]
    corpus.write_text('{"text": "one"}\n{"text": "two"}\n')
    with pytest.raises(UserError, match="need at least 3 documents to split into train/val/test, got 2"):
        TextDataModule(source=str(corpus), cache_dir=str(tmp_path / "cache")).setup("fit")


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
    assert cached.prepared_from_cache and np.array_equal(cached.test_rows[:], dm.test_rows[:])


def test_synthetic_test_batches_are_not_the_validation_batches():
    from diffexp.data.icl import ICLDataModule
    from diffexp.data.needle import NeedleDataModule

    for dm in (NeedleDataModule(context_len=256, haystack="synthetic", batch_size=4, train_size=4, val_size=8),
               ICLDataModule(seq_len=64, batch_size=4, train_size=4, val_size=8)):
        test_rows, val_rows = rows(dm.test_dataloader()), rows(dm.val_dataloader())
        assert len(test_rows) == len(val_rows) == 8 and test_rows.isdisjoint(val_rows), type(dm).__name__


# -- real corpora: every layout splits by document, and a preparation is never read as corpus ------------------
def _paragraph(i: int) -> str:
    return f"Paragraph {i} of the corpus: a few words that make it a document of its own, {i * 7919 % 1000}."


LAYOUTS = {
    "one document per .txt file": lambda root: [(root / f"doc{i:02d}.txt").write_text(_paragraph(i) + "\n")
                                                for i in range(40)],
    "many documents per .txt file": lambda root: [(root / f"part{k}.txt").write_text(
        "\n\n".join(_paragraph(i) for i in range(k * 20, k * 20 + 20)) + "\n") for k in range(2)],
    "JSON lines shards": lambda root: [(root / f"shard{k}.jsonl").write_text(
        "".join(json.dumps({"text": _paragraph(i)}) + "\n" for i in range(k * 8, k * 8 + 8))) for k in range(5)],
}


def _prepare(source, out, capsys) -> dict:
    from diffexp.cli import main

    with pytest.raises(SystemExit) as done:
        main(["data", "prepare", str(source), str(out), "--no-progress", "--num-proc", "1"])
    assert done.value.code in (0, None), capsys.readouterr().err
    return json.loads((out / "manifest.json").read_text())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_corpus_splits_by_document_whatever_its_file_layout(layout, tmp_path, capsys):
    """Forty documents, laid out one per file, many per file or as JSON lines shards: each is one document, and
    validation and test hold at least one each (at 5% each, forty documents may hold none by their scores)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    LAYOUTS[layout](corpus)
    splits = _prepare(corpus, tmp_path / "prepared", capsys)["splits"]
    assert sum(split["documents"] for split in splits.values()) == 40
    assert splits["val"]["documents"] >= 1 and splits["test"]["documents"] >= 1


def test_out_inside_source_is_refused_and_a_preparation_inside_a_source_is_never_read(tmp_path, capsys):
    from tests.helpers import exit_code

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    LAYOUTS["one document per .txt file"](corpus)
    before = sorted(corpus.rglob("*"))
    assert exit_code(["data", "prepare", str(corpus), str(corpus / "prepared")]) == 2
    message = " ".join(capsys.readouterr().err.split())
    assert f"OUT='{corpus / 'prepared'}' is invalid: it lies inside SOURCE='{corpus}'" in message
    assert "expected a directory outside it" in message and "Traceback" not in message
    assert sorted(corpus.rglob("*")) == before  # nothing written
    # a preparation put inside the source anyway (copied there, or made by an older diffexp) is left out, said so
    made = _prepare(corpus, tmp_path / "prepared", capsys)
    import shutil

    shutil.copytree(tmp_path / "prepared", corpus / "prepared")
    again = _prepare(corpus, tmp_path / "again", capsys)
    assert f"left out {corpus / 'prepared'}: a preparation" in capsys.readouterr().err
    assert again["splits"] == made["splits"] and again["source"]["fingerprint"] == made["source"]["fingerprint"]

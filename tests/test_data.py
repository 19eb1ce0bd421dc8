"""Data layer: embedded corpus, tokenizers, packing, caching, validation and resumable loading."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from diffexp.data import TextDataModule
from diffexp.data.corpus import load_stdlib_corpus, stdlib_root, stdlib_source_files
from diffexp.data.loader import ResumableDataLoader
from diffexp.data.tokenizer import ByteTokenizer
from tests.helpers import encode_documents

SMALL = {"max_chars": 40_000, "seq_len": 31, "batch_size": 4}


def make_dm(tmp_path: Path, **overrides) -> TextDataModule:
    return TextDataModule(**{**SMALL, "cache_dir": str(tmp_path / "cache"), **overrides})


def take(loader, n: int) -> list[torch.Tensor]:
    """The next ``n`` batches, continuing into new epochs (new ``iter()`` calls) as needed."""
    batches: list[torch.Tensor] = []
    while len(batches) < n:
        for batch in loader:
            batches.append(batch)
            if len(batches) == n:
                break
    return batches


# ----------------------------------------------------------------------------- corpus


def test_stdlib_corpus_is_real_deterministic_and_capped():
    documents = load_stdlib_corpus(max_chars=30_000)
    assert len(documents) >= 2
    assert sum(map(len, documents)) == 30_000
    text = "".join(documents)
    assert "def " in text and "import " in text  # real Python source
    assert documents == load_stdlib_corpus(max_chars=30_000)

    files = stdlib_source_files()
    relative = [p.relative_to(stdlib_root()).as_posix() for p in files]
    assert relative == sorted(relative)
    assert not any(
        part in {"site-packages", "test", "tests", "idlelib"} for r in relative for part in r.split("/")
    )


# ----------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip():
    tokenizer = ByteTokenizer()
    text = "def f(x):\n    return 'héllo ✓'\n"
    ids = tokenizer.encode(text)
    assert max(ids) < 256 and tokenizer.vocab_size == 257 and tokenizer.eos_id == 256
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids + [tokenizer.eos_id]) == text  # the separator is not rendered


def test_bpe_trains_round_trips_and_is_cached(tmp_path):
    dm = make_dm(tmp_path, tokenizer="bpe", bpe_vocab_size=400)
    assert 257 < dm.vocab_size <= 400
    assert dm.tokenizer_trained
    (saved,) = (tmp_path / "cache" / "prepared").glob("*/tokenizer.json")
    mtime = saved.stat().st_mtime_ns

    text = "class Spam(Eggs):\n    def __init__(self):  # naïve ✓\n        pass\n"
    ids = dm.tokenizer.encode(text)
    assert len(ids) < len(text.encode())  # merges were learned
    assert dm.tokenizer.decode(ids) == text

    again = make_dm(tmp_path, tokenizer="bpe", bpe_vocab_size=400)
    assert again.vocab_size == dm.vocab_size
    assert not again.tokenizer_trained
    assert saved.stat().st_mtime_ns == mtime
    assert again.tokenizer.encode(text) == ids

    # The saved file is also usable directly as a tokenizer path.
    from_file = make_dm(tmp_path, tokenizer=str(saved))
    assert from_file.vocab_size == dm.vocab_size and from_file.tokenizer.encode(text) == ids


# ----------------------------------------------------------------------------- packing and splitting


def test_packed_rows_are_the_token_stream(tmp_path):
    dm = make_dm(tmp_path)
    dm.setup("fit")
    train_docs, val_docs = dm.split()
    for rows, docs in ((dm.train_rows, train_docs), (dm.val_rows, val_docs)):
        assert rows.shape[1] == dm.seq_len + 1
        stream = encode_documents(docs, dm.tokenizer)
        assert np.array_equal(np.asarray(rows).reshape(-1), stream[: rows.shape[0] * rows.shape[1]])
        assert (stream == dm.eos_id).sum() == len(docs)  # one separator after every document

    batch = next(iter(dm.train_dataloader()))
    assert batch.dtype == torch.long and batch.shape == (dm.batch_size, dm.seq_len + 1)
    val_batches = list(dm.val_dataloader())
    assert sum(len(b) for b in val_batches) == len(dm.val_rows)  # drop_last=False
    assert torch.equal(torch.cat(val_batches), torch.from_numpy(np.asarray(dm.val_rows, dtype=np.int64)))
    assert "train" in dm.describe() and "rows" in dm.describe()


def test_datamodule_split_disjoint(tmp_path):
    dm = make_dm(tmp_path)
    train_docs, val_docs, test_docs = dm.splits().values()
    assert train_docs and val_docs and test_docs
    assert len(train_docs) + len(val_docs) + len(test_docs) == len(dm.documents())
    assert set(train_docs).isdisjoint(val_docs) and set(test_docs).isdisjoint([*train_docs, *val_docs])


# ----------------------------------------------------------------------------- local files


def paragraphs(n: int) -> list[str]:
    return [f"Paragraph {i}: the quick brown fox jumps over the lazy dog {i * i} times." for i in range(n)]


def test_local_txt_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(paragraphs(40)) + "\n")
    dm = make_dm(tmp_path, source=str(path), max_chars=None, seq_len=15)
    assert dm.documents() == paragraphs(40)  # one document per paragraph
    dm.setup("fit")
    assert next(iter(dm.train_dataloader())).shape == (4, 16)
    assert sum(dm.meta[split]["documents"] for split in ("train", "val", "test")) == 40


def test_local_jsonl_with_text_field_and_glob(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for part in range(2):
        lines = [json.dumps({"id": i, "body": p}) for i, p in enumerate(paragraphs(20))]
        (data / f"part{part}.jsonl").write_text("\n".join(lines) + "\n")
    for source in (str(data / "part0.jsonl"), str(data), str(data / "*.jsonl")):
        dm = make_dm(tmp_path, source=source, text_field="body", max_chars=None, seq_len=15)
        assert dm.documents()[:20] == paragraphs(20)
        dm.setup("fit")
        assert next(iter(dm.val_dataloader())).shape[1] == 16

    with pytest.raises(ValueError, match="data.text_field='missing'"):
        make_dm(tmp_path, source=str(data), text_field="missing").documents()


def test_local_parquet_file(tmp_path):
    pyarrow_parquet = pytest.importorskip("pyarrow.parquet")
    import pyarrow

    path = tmp_path / "corpus.parquet"
    pyarrow_parquet.write_table(pyarrow.table({"text": paragraphs(30)}), path)
    dm = make_dm(tmp_path, source=str(path), max_chars=None, seq_len=15)
    assert dm.documents() == paragraphs(30)


def test_hub_source_streams_until_max_chars(tmp_path, monkeypatch):
    """The ``hf:<name>:<config>`` path, with ``datasets.load_dataset`` faked (tests run offline)."""
    import datasets

    calls = []

    def fake_load_dataset(name, config, split, streaming, cache_dir):
        calls.append((name, config, split, streaming))
        return ({"body": text, "other": 1} for text in paragraphs(1000))

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    dm = make_dm(tmp_path, source="hf:someone/corpus:en", text_field="body", max_chars=3_000, seq_len=15)
    documents = dm.documents()
    assert set(calls) == {("someone/corpus", "en", "train", True)}  # streamed: read up to the cap only
    assert sum(map(len, documents)) == 3_000 and documents[0] == paragraphs(1)[0]
    dm.setup("fit")
    assert next(iter(dm.train_dataloader())).shape == (4, 16)


def test_a_hub_dataset_is_prepared_one_unit_per_dataset_shard(tmp_path, monkeypatch):
    """Uncapped, each of the dataset's shards (its files) is a unit a process streams on its own."""
    import datasets

    from diffexp.data import sources
    from diffexp.data.prepare import Plan, prepare

    def shard_texts(shards):
        for shard in shards:
            for i in range(40):
                yield {"text": f"shard {shard} document {i}: " + "words " * (i % 7 + 1)}

    def fake_load_dataset(name, config, split, streaming, cache_dir):
        return datasets.IterableDataset.from_generator(shard_texts, gen_kwargs={"shards": [0, 1, 2]})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    plan = Plan(sources.resolve_source("hf:someone/corpus"), "text", None, "byte", 4096, 1000, 1234, 0.1, 0.1)
    result = prepare(plan, tmp_path / "out", num_proc=1, progress=False)
    assert [unit.kind for unit in plan.units] == ["hub"] * 3
    splits = result.manifest["splits"]
    assert sum(split["documents"] for split in splits.values()) == 120
    assert [p["file"] for p in splits["train"]["pieces"]] == [f"shards/train-00000{k}-000.bin" for k in range(3)]


# ----------------------------------------------------------------------------- preprocessing cache


def test_prepared_data_is_reused_for_any_seq_len(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="diffexp.data")
    first = make_dm(tmp_path)
    first.setup("fit")
    assert first.prepared_from_cache is False
    assert "preparing" in caplog.text
    shards = sorted(first.prepared_dir.glob("shards/*.bin"))
    mtimes = [p.stat().st_mtime_ns for p in shards]

    caplog.clear()
    second = make_dm(tmp_path)
    second.setup("fit")
    assert second.prepared_from_cache is True
    assert "reusing prepared" in caplog.text
    assert [p.stat().st_mtime_ns for p in shards] == mtimes
    assert np.array_equal(first.train_rows[:], second.train_rows[:])

    longer = make_dm(tmp_path, seq_len=SMALL["seq_len"] * 2 + 1)  # the same tokens, cut into longer rows
    longer.setup("fit")
    assert longer.prepared_from_cache is True and longer.prepared_dir == first.prepared_dir
    tokens = [np.asarray(dm.train_rows).reshape(-1)[:1000] for dm in (longer, first)]
    assert np.array_equal(*tokens)


def test_editing_a_data_file_invalidates_the_cache(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(paragraphs(40)))
    make_dm(tmp_path, source=str(path), seq_len=15).setup("fit")
    path.write_text("\n\n".join(paragraphs(41)))
    edited = make_dm(tmp_path, source=str(path), seq_len=15)
    edited.setup("fit")
    assert edited.prepared_from_cache is False


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("overrides", "bad_value"),
    [
        ({"source": "/no/such/dir/corpus.txt"}, "'/no/such/dir/corpus.txt'"),
        ({"source": "/no/such/dir/*.jsonl"}, "'/no/such/dir/*.jsonl'"),
        ({"tokenizer": "wordpiece"}, "'wordpiece'"),
        ({"seq_len": 0}, "data.seq_len=0"),
        ({"seq_len": -4}, "data.seq_len=-4"),
        ({"batch_size": 0}, "data.batch_size=0"),
        ({"val_fraction": 0.0}, "data.val_fraction=0.0"),
        ({"val_fraction": 1.0}, "data.val_fraction=1.0"),
        ({"val_fraction": 1.5}, "data.val_fraction=1.5"),
        ({"tokenizer": "bpe", "bpe_vocab_size": 100}, "data.bpe_vocab_size=100"),
    ],
)
def test_invalid_arguments_fail_fast_naming_the_value(tmp_path, overrides, bad_value):
    with pytest.raises(ValueError, match=re.escape(bad_value)) as error:
        make_dm(tmp_path, **overrides)
    assert "expected" in str(error.value) or "must" in str(error.value)
    assert not (tmp_path / "cache").exists()  # failed before doing any work


def test_missing_source_message_lists_the_alternatives(tmp_path):
    with pytest.raises(ValueError) as error:
        make_dm(tmp_path, source="/x/y.txt")
    assert str(error.value) == (
        "data.source='/x/y.txt': no such file or directory; expected 'stdlib', 'hf:<name>', "
        "or an existing .txt/.jsonl/.json/.parquet file, directory or glob"
    )


def test_too_little_data_for_a_batch_is_explained(tmp_path):
    dm = make_dm(tmp_path, max_chars=20_000, seq_len=255, batch_size=512)
    with pytest.raises(ValueError, match="data.batch_size=512"):
        dm.setup("fit")


# ----------------------------------------------------------------------------- resumable training order


@pytest.fixture(scope="module")
def resume_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("resume")


def train_loader(cache: Path, **overrides):
    dm = make_dm(cache, max_chars=12_000, **overrides)
    dm.setup("fit")
    return dm.train_dataloader()


def test_train_order_depends_only_on_seed_and_epoch(resume_cache):
    loader = train_loader(resume_cache)
    n = len(loader)
    epoch0, epoch1 = take(loader, n), take(loader, n)
    assert not torch.equal(torch.cat(epoch0), torch.cat(epoch1))  # reshuffled every epoch
    for epoch in (epoch0, epoch1):  # each epoch is a permutation: no row twice
        rows = {tuple(row.tolist()) for batch in epoch for row in batch}
        assert len(rows) == n * loader.batch_size
    assert torch.equal(torch.cat(take(train_loader(resume_cache), 2 * n)), torch.cat(epoch0 + epoch1))
    other_seed = take(train_loader(resume_cache, seed=7), n)
    assert not torch.equal(torch.cat(other_seed), torch.cat(epoch0))


def test_ranks_get_disjoint_equal_shares(resume_cache):
    dm = make_dm(resume_cache, max_chars=12_000)
    dm.setup("fit")
    dataset = dm.train_dataloader().dataset
    shares = []
    for rank in range(2):
        loader = ResumableDataLoader(dataset, batch_size=4, seed=dm.seed, num_replicas=2, rank=rank)
        shares.append({tuple(row.tolist()) for batch in loader for row in batch})
    assert len(shares[0]) == len(shares[1]) > 0 and shares[0].isdisjoint(shares[1])


@pytest.mark.parametrize("stop_at", ["early", "mid", "end_of_epoch", "next_epoch"])
def test_resume_continues_with_the_next_batch(resume_cache, stop_at):
    n = len(train_loader(resume_cache))
    consumed = {"early": 1, "mid": n // 2, "end_of_epoch": n, "next_epoch": n + 3}[stop_at]
    total = 2 * n + 2
    uninterrupted = take(train_loader(resume_cache), total)

    interrupted = train_loader(resume_cache)
    before = take(interrupted, consumed)
    state = interrupted.state_dict()
    assert state["epoch"] == (1 if stop_at == "next_epoch" else 0)
    assert json.loads(json.dumps(state)) == state  # plain data, checkpoint friendly

    resumed = train_loader(resume_cache)
    resumed.load_state_dict(state)
    after = take(resumed, total - consumed)
    assert all(torch.equal(a, b) for a, b in zip(before + after, uninterrupted, strict=True))


def test_worker_prefetching_does_not_count_as_consumed(resume_cache):
    uninterrupted = take(train_loader(resume_cache), 8)
    loader = train_loader(resume_cache, num_workers=2)
    iterator = iter(loader)
    before = [next(iterator) for _ in range(3)]  # workers have prefetched more than this by now
    state = loader.state_dict()
    assert state["rows_served"] == 3 * loader.batch_size
    del iterator

    resumed = train_loader(resume_cache, num_workers=2)
    resumed.load_state_dict(state)
    after = take(resumed, 5)
    assert all(torch.equal(a, b) for a, b in zip(before + after, uninterrupted, strict=True))


def test_lightning_set_epoch_after_a_finished_epoch_starts_that_epoch(resume_cache):
    """Lightning resumes a checkpoint from an epoch's end by loading the state, then set_epoch(next)."""
    n = len(train_loader(resume_cache))
    reference = take(train_loader(resume_cache), 2 * n)
    loader = train_loader(resume_cache)
    loader.load_state_dict({**loader.state_dict(), "epoch": 0, "rows_served": (n - 2) * loader.batch_size})
    iterator = iter(loader)  # Lightning creates the iterator before calling set_epoch
    loader.sampler.set_epoch(1)
    assert torch.equal(next(iterator), reference[n])


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
@pytest.mark.filterwarnings("ignore:You passed in a `val_dataloader`")
def test_lightning_resume_from_mid_epoch_and_epoch_end_checkpoints(resume_cache, tmp_path):
    """End to end with Lightning's stateful-dataloader protocol: resumed runs see the same batches."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    class RecordBatches(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))
            self.seen: list[torch.Tensor] = []

        def training_step(self, batch, batch_idx):
            self.seen.append(batch)
            return self.weight.square().sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def fit(ckpt_path=None, callbacks=()):
        module = RecordBatches()
        trainer = L.Trainer(
            max_epochs=2, limit_train_batches=5, accelerator="cpu", logger=False, enable_progress_bar=False,
            enable_model_summary=False, enable_checkpointing=bool(callbacks), callbacks=list(callbacks),
            default_root_dir=tmp_path,
        )  # fmt: skip
        trainer.fit(module, make_dm(resume_cache, max_chars=12_000), ckpt_path=ckpt_path)
        return module.seen

    checkpoints = ModelCheckpoint(
        dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1, filename="{step}"
    )
    full = fit(callbacks=[checkpoints])
    assert len(full) == 10
    # step 3: mid-epoch; step 5: after the last batch of a (limit-shortened) epoch; step 7: mid second epoch
    for step in (3, 5, 7):
        resumed = fit(ckpt_path=tmp_path / "ckpt" / f"step={step}.ckpt")
        assert len(resumed) == len(full) - step
        assert all(torch.equal(a, b) for a, b in zip(resumed, full[step:], strict=True))

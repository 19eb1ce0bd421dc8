"""`diffexp data prepare | join | inspect`: a corpus becomes token shards once; a kill, a full disk or a split
across machines changes nothing in the result; every storage fault is found before training."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from diffexp.bench.data import synthetic_corpus
from diffexp.cli import main
from diffexp.data.prepared import open_prepared
from diffexp.data.tokenizer import ByteTokenizer
from diffexp.errors import UserError
from tests.helpers import one_thread_env

UNIT_MB = "0.25"  # small units: a 3 MB corpus becomes a dozen units of work


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return synthetic_corpus(tmp_path_factory.mktemp("corpus") / "corpus.jsonl", 3)


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory, corpus) -> Path:
    from diffexp.data.tokenizer import train_bpe

    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()[:50]]
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    train_bpe(texts, 400).save(str(path))
    return path


def prepare_args(corpus: Path, out: Path, *extra: str) -> list[str]:
    return ["data", "prepare", str(corpus), str(out), "--unit-mb", UNIT_MB, "--shard-tokens", "100000",
            "--no-progress", *extra]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus, tokenizer_file) -> Path:
    """One uninterrupted preparation on one machine, in this process."""
    out = tmp_path_factory.mktemp("reference") / "prepared"
    with pytest.raises(SystemExit) as done:
        main(prepare_args(corpus, out, "--tokenizer", str(tokenizer_file), "--num-proc", "1"))
    assert done.value.code == 0
    return out


def files(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def assert_identical(a: Path, b: Path) -> None:
    left, right = files(a), files(b)
    assert left.keys() == right.keys()
    for name in left:
        assert left[name] == right[name], name


def test_shards_hold_each_split_as_its_documents_tokens_in_corpus_order(reference, corpus):
    manifest = json.loads((reference / "manifest.json").read_text())
    prepared = open_prepared(reference, "DIR")
    documents = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    texts = {split: list(prepared.texts(split)) for split in ("train", "val", "test")}
    assert sum(map(len, texts.values())) == len(documents)
    assert texts["val"] and texts["test"]
    # each split keeps corpus order; each document is decoded back exactly
    for split, decoded in texts.items():
        positions = [documents.index(text) for text in decoded]
        assert positions == sorted(positions), split
        assert manifest["splits"][split]["documents"] == len(decoded)
    # pieces are bounded, checksummed and add up to the split
    for split in manifest["splits"].values():
        assert all(0 < piece["tokens"] <= 100_000 for piece in split["pieces"])
        assert sum(piece["tokens"] for piece in split["pieces"]) == split["tokens"]
    assert len(manifest["splits"]["train"]["pieces"]) > 12  # several units, several pieces
    # rows are the stream cut into seq_len + 1, across piece boundaries
    stream = np.concatenate([np.fromfile(reference / p["file"], dtype=manifest["dtype"])
                             for p in manifest["splits"]["train"]["pieces"]])
    rows = prepared.rows("train", 99)
    assert rows.shape == (len(stream) // 100, 100)
    assert np.array_equal(rows[:], stream[: rows.shape[0] * 100].reshape(-1, 100))
    picked = np.array([len(rows) - 1, 0, 7, 1234])
    assert np.array_equal(rows[picked], stream[: rows.shape[0] * 100].reshape(-1, 100)[picked])


def test_many_processes_and_parts_on_several_machines_give_the_same_bytes(reference, corpus, tokenizer_file,
                                                                         tmp_path):
    pooled = tmp_path / "pooled"
    with pytest.raises(SystemExit):
        main(prepare_args(corpus, pooled, "--tokenizer", str(tokenizer_file), "--num-proc", "2"))
    assert_identical(reference, pooled)

    # three machines, each with its own directory; their outputs copied into one, then joined
    machines = [tmp_path / f"machine{i}" for i in range(3)]
    for part, directory in enumerate(machines):
        with pytest.raises(SystemExit):
            main(prepare_args(corpus, directory, "--tokenizer", str(tokenizer_file), "--num-proc", "1",
                              "--part", str(part), "--of", "3"))
        assert not (directory / "manifest.json").exists()
    joined = machines[0]
    for other in machines[1:]:
        shutil.copytree(other, joined, dirs_exist_ok=True)
    with pytest.raises(SystemExit) as done:
        main(["data", "join", str(joined)])
    assert done.value.code == 0
    assert_identical(reference, joined)


def test_join_names_the_unfinished_units(corpus, tokenizer_file, tmp_path, capsys):
    out = tmp_path / "half"
    with pytest.raises(SystemExit):
        main(prepare_args(corpus, out, "--tokenizer", str(tokenizer_file), "--num-proc", "1", "--part", "0",
                          "--of", "2"))
    assert "diffexp data join" in capsys.readouterr().out
    with pytest.raises(SystemExit) as error:
        main(["data", "join", str(out)])
    assert error.value.code == 2
    assert "units are not finished" in capsys.readouterr().err


KILL_AT_PIECE = """
import os, signal, sys
from diffexp.data import shards
finish, count = shards.PieceWriter._finish, [0]
def finish_then_die(self):
    finish(self)
    count[0] += 1
    if count[0] == int(sys.argv[1]):
        os.kill(os.getpid(), signal.SIGKILL)  # mid-unit: some pieces renamed, its record not written
shards.PieceWriter._finish = finish_then_die
from diffexp.cli import main
main(sys.argv[2:])
"""


def test_kill_9_mid_unit_then_the_same_command_ends_byte_identical(reference, corpus, tokenizer_file, tmp_path):
    out = tmp_path / "killed"
    args = prepare_args(corpus, out, "--tokenizer", str(tokenizer_file), "--num-proc", "1")
    killed = subprocess.run([sys.executable, "-c", KILL_AT_PIECE, "9", *args], env=one_thread_env(),
                            capture_output=True)
    assert killed.returncode == -signal.SIGKILL
    records = list((out / "units").glob("*.json"))
    assert 0 < len(records) < 12 and not (out / "manifest.json").exists()
    rerun = subprocess.run([sys.executable, "-m", "diffexp", *args], env=one_thread_env(), capture_output=True,
                           text=True)
    assert rerun.returncode == 0, rerun.stderr
    assert f"{len(records)} already finished" in rerun.stdout
    assert_identical(reference, out)


def test_kill_9_of_a_process_pool_then_rerun_ends_byte_identical(reference, corpus, tokenizer_file, tmp_path):
    out = tmp_path / "pool-killed"
    args = prepare_args(corpus, out, "--tokenizer", str(tokenizer_file), "--num-proc", "2")
    proc = subprocess.Popen([sys.executable, "-m", "diffexp", *args], env=one_thread_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while not list((out / "units").glob("*.json")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "manifest.json").exists(), "finished before the kill: the corpus is too small to test this"
    rerun = subprocess.run([sys.executable, "-m", "diffexp", *args], env=one_thread_env(), capture_output=True,
                           text=True)
    assert rerun.returncode == 0, rerun.stderr
    assert_identical(reference, out)


def test_a_full_disk_keeps_the_finished_units_says_so_and_a_rerun_continues(reference, corpus, tokenizer_file,
                                                                           tmp_path, monkeypatch, capsys):
    from diffexp.data import shards

    out = tmp_path / "full"
    args = prepare_args(corpus, out, "--tokenizer", str(tokenizer_file), "--num-proc", "1")
    budget = [1_000_000]  # bytes the disk takes before it is full

    class FillingFile:
        def __init__(self, real):
            self.real = real

        def write(self, data):
            budget[0] -= len(data)
            if budget[0] < 0:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.real.write(data)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.real.close()

        def __getattr__(self, name):
            return getattr(self.real, name)

    monkeypatch.setattr(shards, "open", lambda path, mode: FillingFile(open(path, mode)), raising=False)
    with pytest.raises(SystemExit) as error:
        main(args)
    err = capsys.readouterr().err
    assert error.value.code == 2 and "Traceback" not in err
    assert f"the disk holding {out} is full" in err and "GiB free" in err and "run the same command again" in err
    finished = len(list((out / "units").glob("*.json")))
    assert 0 < finished < 12 and f"{finished} of" in err
    assert not list(out.rglob(".*.tmp"))  # no half-written file left behind
    monkeypatch.undo()
    with pytest.raises(SystemExit) as done:
        main(args)
    assert done.value.code == 0
    assert_identical(reference, out)


def test_a_disk_full_write_removes_its_temporary_file(tmp_path, monkeypatch):
    from diffexp.data import shards

    writer = shards.PieceWriter(tmp_path, "train-000000", np.dtype(np.uint16), 256, 1000)
    writer.write(np.arange(10))

    class FullFile:
        def __init__(self, real):
            self.real = real

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.real, name)

    writer._file = FullFile(writer._file)
    with pytest.raises(shards.DiskFull) as full:
        writer.write(np.arange(10))
    assert full.value.path == tmp_path / "train-000000-000.bin"
    assert list(tmp_path.iterdir()) == []


def test_a_rerun_with_other_settings_is_refused_and_other_files_are_never_written_over(reference, corpus, tmp_path,
                                                                                       capsys):
    copy = tmp_path / "copy"
    shutil.copytree(reference, copy)
    with pytest.raises(SystemExit) as error:
        main(prepare_args(corpus, copy, "--tokenizer", "byte"))
    assert error.value.code == 2
    assert "holds a preparation made with other settings: --tokenizer=" in capsys.readouterr().err
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit):
        main(prepare_args(corpus, other))
    assert "holds other files and no preparation" in capsys.readouterr().err
    assert [p.name for p in other.iterdir()] == ["notes.txt"]


def test_inspect_prints_the_figures_and_decoded_samples(reference, capsys):
    with pytest.raises(SystemExit) as done:
        main(["data", "inspect", str(reference), "--samples", "1", "--verify"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    manifest = json.loads((reference / "manifest.json").read_text())
    assert f"{manifest['splits']['train']['tokens']:,} tokens" in out
    assert "--- train document 0" in out and "--- val document 0" in out and "--- test document 0" in out


@pytest.mark.parametrize("fault", ["truncated", "corrupted", "missing", "tokenizer", "manifest"])
def test_storage_faults_are_found_before_training_with_the_file_and_the_rebuild_command(reference, tmp_path, fault):
    broken = tmp_path / "broken"
    shutil.copytree(reference, broken)
    manifest = json.loads((broken / "manifest.json").read_text())
    shard = broken / manifest["splits"]["train"]["pieces"][3]["file"]
    if fault == "truncated":
        shard.write_bytes(shard.read_bytes()[:-10])
    elif fault == "corrupted":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
    elif fault == "missing":
        shard.unlink()
    elif fault == "tokenizer":
        tokenizer = json.loads((broken / "tokenizer.json").read_text())
        tokenizer["added_tokens"][0]["content"] = "<|other|>"
        (broken / "tokenizer.json").write_text(json.dumps(tokenizer))
    else:
        (broken / "manifest.json").write_text("{")
    with pytest.raises(UserError) as error:
        open_prepared(broken, "data.source")
    message = str(error.value)
    named = {"tokenizer": "tokenizer.json", "manifest": "manifest.json"}.get(fault, str(shard))
    assert named in message
    assert {"truncated": "truncated", "corrupted": "corrupted", "missing": "missing",
            "tokenizer": "not the tokenizer these shards were made with", "manifest": "damaged"}[fault] in message
    assert "diffexp data prepare" in message  # the command that rebuilds it


def test_bad_prepare_arguments_name_the_flag_before_any_work(corpus, tmp_path, capsys):
    out = tmp_path / "never"
    for args, expected in ((["--part", "2", "--of", "2"], "--part=2 is invalid"),
                           (["--tokenizer", "bpe", "--bpe-vocab-size", "100"], "--bpe-vocab-size=100 is invalid"),
                           (["--num-proc", "0"], "--num-proc=0 is invalid"),
                           (["--tokenizer", "no/such/tokenizer.json"], "--tokenizer='no/such/tokenizer.json'"),
                           (["--text-field", "body"], "--text-field='body'")):
        with pytest.raises(SystemExit) as error:
            main(["data", "prepare", str(corpus), str(out), *args])
        assert error.value.code == 2
        assert expected in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["data", "prepare", str(tmp_path / "none.jsonl"), str(out)])
    assert "SOURCE=" in capsys.readouterr().err
    assert not out.exists()


def test_the_byte_tokenizer_shards_are_the_utf8_bytes(tmp_path):
    corpus = tmp_path / "c.jsonl"
    texts = [f"document {i}: caf\u00e9 \u2603 {'x' * i}" for i in range(60)]
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    with pytest.raises(SystemExit):
        main(["data", "prepare", str(corpus), str(tmp_path / "out"), "--no-progress"])
    prepared = open_prepared(tmp_path / "out", "DIR")
    decoded = [t for split in ("train", "val", "test") for t in prepared.texts(split)]
    assert sorted(decoded) == sorted(texts)
    train = np.concatenate([prepared.stream("train").read(0, len(prepared.stream("train")))])
    expected = b"".join(t.encode() + b"\x00" for t in prepared.texts("train"))
    ids = np.frombuffer(expected, np.uint8).astype(np.int64)
    ids[ids == 0] = ByteTokenizer.eos_id
    assert np.array_equal(train, ids)


def test_a_vocabulary_beyond_65536_is_written_as_uint32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(70_000)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", *words])}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(tmp_path / "big.json"))
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"w{i} w{69_990 + i % 10} w{i * 7}"}) + "\n" for i in range(50)))
    with pytest.raises(SystemExit):
        main(["data", "prepare", str(corpus), str(tmp_path / "out"), "--tokenizer", str(tmp_path / "big.json"),
              "--no-progress"])
    prepared = open_prepared(tmp_path / "out", "DIR")
    assert prepared.manifest["dtype"] == "uint32" and prepared.tokenizer.vocab_size == 70_002  # + end of document
    stream = prepared.stream("train")
    train = stream.read(0, len(stream))
    assert train.dtype == np.uint32 and train.max() > 65_535
    assert "w69995" in "".join(prepared.texts("train")) + "".join(prepared.texts("val")) + "".join(
        prepared.texts("test"))


def test_a_hub_tokenizer_name_offline_is_refused_at_once(corpus, tmp_path, monkeypatch, capsys):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    started = time.monotonic()
    with pytest.raises(SystemExit) as error:
        main(["data", "prepare", str(corpus), str(tmp_path / "out"), "--tokenizer", "diffexp-tests/no-such-tokenizer"])
    err = capsys.readouterr().err
    assert error.value.code == 2 and time.monotonic() - started < 10
    assert "--tokenizer='diffexp-tests/no-such-tokenizer': not a local file, and no Hub tokenizer" in err
    assert not (tmp_path / "out").exists()

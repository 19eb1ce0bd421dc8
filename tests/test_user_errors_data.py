"""Bad data files and tokenizers stop in TextDataModule.__init__ with a UserError naming the key and the file."""

from __future__ import annotations

import json
import os
import re

import pytest

from diffexp.data import TextDataModule
from diffexp.errors import UserError

PARAGRAPHS = "\n\n".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog." for i in range(40))


def make_dm(tmp_path, **overrides) -> TextDataModule:
    return TextDataModule(**{"seq_len": 15, "batch_size": 2, "cache_dir": str(tmp_path / "cache"), **overrides})


def random_bytes(n: int) -> bytes:
    data = bytearray(os.urandom(n))
    data[n // 2] = 0  # random data holds NUL bytes; make sure this one does
    return bytes(data)


def write(path, content: bytes | str):
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


def parquet(path, **columns):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow

    pq.write_table(pyarrow.table(columns), path)
    return path


# (file name, content or a writer, overrides, key named, words the message must hold)
CASES = {
    "empty txt": ("corpus.txt", b"", {}, "data.source", "is empty"),
    "whitespace only": ("corpus.txt", "\n\n  \n\t\n", {}, "data.source", "no text"),
    "random bytes named .txt": ("corpus.txt", random_bytes(4000), {}, "data.source", "binary"),
    "random bytes named .jsonl": ("corpus.jsonl", random_bytes(4000), {}, "data.source", "binary"),
    "random bytes named .parquet": ("corpus.parquet", random_bytes(4000), {}, "data.source", "not a Parquet file"),
    "latin-1 text": ("corpus.txt", ("caf\xe9 au lait\n\n" * 50).encode("latin-1"), {}, "data.source", "not UTF-8"),
    "plain text named .jsonl": ("corpus.jsonl", PARAGRAPHS, {}, "data.source", "not JSON lines"),
    "broken JSON line": ("corpus.jsonl", '{"text": "a"}\n{"text": "b"\n', {}, "data.source", "line 2"),
    "missing jsonl field": ("corpus.jsonl", "".join(json.dumps({"body": "x", "id": i}) + "\n" for i in range(9)),
                            {"text_field": "text"}, "data.text_field", "'body', 'id'"),
    "non-text jsonl field": ("corpus.jsonl", '{"text": 5}\n{"text": 6}\n', {}, "data.text_field", "int"),
    "empty field everywhere": ("corpus.jsonl", '{"text": ""}\n{"text": null}\n', {}, "data.source", "no text"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_data_file_is_a_user_error_naming_key_file_and_problem(tmp_path, case):
    name, content, overrides, key, problem = CASES[case]
    path = write(tmp_path / name, content)
    with pytest.raises(UserError) as error:
        make_dm(tmp_path, source=str(path), **overrides).documents()  # most fail in __init__ already
    message = str(error.value)
    assert message.startswith(f"{key}="), message
    assert str(path) in message and problem in message, message
    assert "\n" not in message.strip()  # one paragraph


@pytest.mark.parametrize("case", ["empty txt", "random bytes named .txt", "random bytes named .parquet",
                                  "latin-1 text", "missing jsonl field"])
def test_bad_files_fail_in_init_before_any_work(tmp_path, case):
    name, content, overrides, _, _ = CASES[case]
    path = write(tmp_path / name, content)
    with pytest.raises(UserError):
        make_dm(tmp_path, source=str(path), **overrides)
    assert not (tmp_path / "cache").exists()


def test_parquet_without_the_text_column_lists_the_columns(tmp_path):
    path = parquet(tmp_path / "corpus.parquet", body=["a b c", "d e f"], id=[1, 2])
    with pytest.raises(UserError, match=re.escape("data.text_field='text'")) as error:
        make_dm(tmp_path, source=str(path))
    assert str(path) in str(error.value) and "'body', 'id'" in str(error.value)


def test_a_bad_file_in_a_directory_is_named_and_empty_files_are_skipped(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    write(data / "a.txt", PARAGRAPHS)
    write(data / "empty.txt", b"")  # adds no documents, no error
    assert len(make_dm(tmp_path, source=str(data)).documents()) == 40
    write(data / "z.txt", random_bytes(2000))
    with pytest.raises(UserError, match=re.escape(str(data / "z.txt"))):
        make_dm(tmp_path, source=str(data))


def test_an_error_past_the_sniffed_prefix_still_names_the_file(tmp_path):
    """Non-UTF-8 bytes beyond the prefix the checks read: the reader fails later, with the same kind of message."""
    path = write(tmp_path / "corpus.txt", ((PARAGRAPHS + "\n\n") * 100 + "na\xefve\n").encode("latin-1"))
    assert path.stat().st_size > 64 * 1024
    dm = make_dm(tmp_path, source=str(path))  # the prefix is fine
    with pytest.raises(UserError) as error:
        dm.documents()
    assert str(error.value).startswith("data.source=") and str(path) in str(error.value)
    assert "not UTF-8" in str(error.value)


@pytest.mark.parametrize(("content", "problem"), [
    ('{"a": 1}', "not a Hugging Face tokenizer.json"),
    (b"\x00\x01\x02binary", "not a Hugging Face tokenizer.json"),
])
def test_tokenizer_file_that_is_not_a_tokenizer_json(tmp_path, content, problem):
    corpus = write(tmp_path / "corpus.txt", PARAGRAPHS)
    path = write(tmp_path / "tok.json", content)
    with pytest.raises(UserError) as error:
        make_dm(tmp_path, source=str(corpus), tokenizer=str(path))
    message = str(error.value)
    assert message.startswith(f"data.tokenizer={str(path)!r}") and problem in message
    assert "'byte', 'bpe'" in message


def test_tokenizer_path_problems(tmp_path):
    corpus = write(tmp_path / "corpus.txt", PARAGRAPHS)
    with pytest.raises(UserError, match="no such file"):
        make_dm(tmp_path, source=str(corpus), tokenizer=str(tmp_path / "missing" / "tokenizer.json"))
    (tmp_path / "model").mkdir()
    write(tmp_path / "model" / "tokenizer.json", "{}")
    with pytest.raises(UserError, match="is a directory.*did you mean"):
        make_dm(tmp_path, source=str(corpus), tokenizer=str(tmp_path / "model"))


def test_fit_on_a_binary_file_stops_with_one_paragraph_and_exit_2(tmp_path, monkeypatch, capsys):
    from diffexp.cli import main

    monkeypatch.chdir(tmp_path)
    path = write(tmp_path / "corpus.txt", random_bytes(4000))
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--data.source", str(path), "--data.cache_dir", str(tmp_path / "cache"),
              "--trainer.max_steps", "1"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert "data.source=" in err and str(path) in err and "binary" in err
    assert "Traceback" not in err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "cache").exists()

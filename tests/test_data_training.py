"""Training reads prepared shards: a prepared directory as data.source, raw sources prepared through the same
code before any other process starts, and storage faults stopped before the first step."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import numpy as np
import pytest

from diffexp.cli import main
from diffexp.data import TextDataModule
from tests.helpers import scalars, write_recipe


@pytest.fixture
def prepared(tmp_path) -> Path:
    """The embedded corpus (60K characters, as write_recipe's data) prepared with `diffexp data prepare`."""
    out = tmp_path / "prepared"
    with pytest.raises(SystemExit) as done:
        main(["data", "prepare", "stdlib", str(out), "--max-chars", "60000", "--seed", "1234", "--no-progress"])
    assert done.value.code == 0
    return out


def test_fit_on_a_prepared_directory_trains_on_the_same_rows_as_on_its_raw_source(tmp_path, prepared, monkeypatch,
                                                                                 capsys):
    monkeypatch.chdir(tmp_path)
    recipe = write_recipe(tmp_path, max_steps=6)
    raw = TextDataModule(source="stdlib", seq_len=32, batch_size=4, max_chars=60_000,
                         cache_dir=str(tmp_path / "cache"))
    from_directory = TextDataModule(source=str(prepared), seq_len=32, batch_size=4)
    raw.setup("fit")
    from_directory.setup("fit")
    assert np.array_equal(raw.train_rows[:], from_directory.train_rows[:])
    assert np.array_equal(raw.val_rows[:], from_directory.val_rows[:])

    main(["fit", "--config", str(recipe), "--data.source", str(prepared), "--data.max_chars", "null",
          "--data.tokenizer", "bpe"])
    err = capsys.readouterr().err
    assert "is a prepared directory, whose manifest fixes the tokenizer and the splits: data.tokenizer='bpe' is " \
           "not read" in err
    logged = scalars(tmp_path / "runs/run/version_0")
    assert len(logged["train/loss"]) == 3 and logged["val/loss"]


def test_a_process_started_by_torchrun_refuses_an_unprepared_source_with_the_command_that_prepares_it(
        tmp_path, monkeypatch):
    from diffexp.errors import UserError

    settings = {"source": "stdlib", "max_chars": 30_000, "tokenizer": "bpe", "bpe_vocab_size": 300,
                "cache_dir": str(tmp_path / "cache"), "seq_len": 16, "batch_size": 2}
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "3")
    with pytest.raises(UserError) as error:
        TextDataModule(**settings).vocab_size  # noqa: B018  (the model's link reads it before any process group)
    message = str(error.value)
    assert "one of 8 processes a launcher (torchrun, srun) started" in message
    assert not (tmp_path / "cache" / "prepared").exists() or not list((tmp_path / "cache" / "prepared").iterdir())
    command = next(line.strip() for line in message.splitlines() if line.strip().startswith("diffexp data prepare"))
    with pytest.raises(SystemExit) as done:
        main(shlex.split(command)[1:] + ["--no-progress"])
    assert done.value.code == 0
    found = TextDataModule(**settings)
    assert found.vocab_size == 300 and found.prepared_from_cache  # the command filled exactly this cache entry


@pytest.mark.parametrize("fault", ["truncated", "corrupted"])
def test_a_damaged_cache_stops_fit_before_training_naming_the_file(tmp_path, monkeypatch, capsys, fault):
    monkeypatch.chdir(tmp_path)
    recipe = write_recipe(tmp_path, max_steps=2)
    dm = TextDataModule(source="stdlib", seq_len=32, batch_size=4, max_chars=60_000, cache_dir=str(tmp_path / "cache"))
    dm.setup("fit")
    manifest = json.loads((dm.prepared_dir / "manifest.json").read_text())
    shard = dm.prepared_dir / manifest["splits"]["train"]["pieces"][0]["file"]
    data = bytearray(shard.read_bytes())
    if fault == "truncated":
        del data[-7:]
    else:
        data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(SystemExit) as error:
        main(["fit", "--config", str(recipe)])
    err = capsys.readouterr().err
    assert error.value.code == 2 and "Traceback" not in err
    assert str(shard) in err and f"delete {dm.prepared_dir} and run again" in err
    assert not (tmp_path / "runs").exists()  # stopped before the run directory was made


def test_a_resume_on_data_prepared_again_is_refused(tmp_path, prepared, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    recipe = write_recipe(tmp_path, max_steps=4)
    schedule = ["--data.source", str(prepared), "--data.max_chars", "null", "--model.optim.schedule_steps", "8"]
    main(["fit", "--config", str(recipe), *schedule])
    shutil.rmtree(prepared)  # prepared again with another split seed: other documents in training
    with pytest.raises(SystemExit):
        main(["data", "prepare", "stdlib", str(prepared), "--max-chars", "60000", "--seed", "7", "--no-progress"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as error:
        main(["fit", "--config", str(recipe), *schedule, "--trainer.max_steps", "8", "--ckpt_path", "last"])
    err = capsys.readouterr().err
    assert error.value.code == 2 and "Traceback" not in err
    assert "was prepared again since the checkpoint's run read it" in err  # found before the run is touched

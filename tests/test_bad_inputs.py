"""Bad inputs to the data, training, sweep and evaluation commands are refused before any file is written: one
paragraph naming the key as the user writes it, the bad value and what is allowed, exit code 2, no traceback,
and every directory as it was."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffexp.cli import main

SMALL = ["--max-chars", "60000", "--no-progress", "--num-proc", "1"]  # the embedded corpus's first 60K characters


def tree(directory: Path) -> dict[str, tuple[int, int] | None]:
    """Every file under ``directory`` with its size and modification time (what a write changes), and every
    directory (a writability probe's file, made and removed, changes a directory's time and nothing else)."""
    return {p.relative_to(directory).as_posix(): None if p.is_dir() else (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*"))}


def refused(args: list[str], capsys, *words: str) -> str:
    """`diffexp ARGS` exits 2 with one paragraph holding every one of ``words``, and no traceback; the message."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        main(args)
    err = capsys.readouterr().err
    assert done.value.code == 2, err
    assert "Traceback" not in err, err
    message = err.split("error: ", 1)[1].split("(DIFFEXP_DEBUG=1", 1)[0].strip()
    assert "\n" not in message, message
    for word in words:
        assert word in message, message
    return message


def prepare(source: str, out: Path, *extra: str) -> None:
    with pytest.raises(SystemExit) as done:
        main(["data", "prepare", source, str(out), *SMALL, *extra])
    assert done.value.code == 0


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """The embedded corpus's first 60K characters as byte-token shards."""
    out = tmp_path_factory.mktemp("prepared") / "stdlib"
    prepare("stdlib", out)
    return out


# -- diffexp data prepare ------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra, named", [
    (["--tokenizer", "bpe", "--bpe-vocab-size", "300"], "--tokenizer='byte' there, 'bpe' now"),
    (["--seed", "5"], "--seed=1234 there, 5 now"),
    (["--max-chars", "70000"], "--max-chars=60000 there, 70000 now"),
    (["--val-fraction", "0.1"], "--val-fraction=0.05 there, 0.1 now"),
])
def test_a_rerun_of_prepare_with_other_settings_names_the_setting_and_both_values(prepared, capsys, extra, named):
    before = tree(prepared)
    refused(["data", "prepare", "stdlib", str(prepared), *SMALL, *extra], capsys, f"OUT={str(prepared)!r}", named,
            "rerun with the values there, or prepare into a new directory")
    assert tree(prepared) == before


# -- diffexp data join ---------------------------------------------------------------------------------------
def test_join_of_parts_prepared_with_another_tokenizer_names_it_and_writes_no_manifest(tmp_path, capsys):
    """Two machines, each its part, one with the byte tokenizer and one with a BPE; copied together (the last
    copy's prepare.json and tokenizer.json win) and joined."""
    parts = [tmp_path / "part0", tmp_path / "part1"]
    prepare("stdlib", parts[0], "--unit-mb", "0.01", "--part", "0", "--of", "2")
    prepare("stdlib", parts[1], "--unit-mb", "0.01", "--part", "1", "--of", "2", "--tokenizer", "bpe",
            "--bpe-vocab-size", "300")
    import shutil

    shutil.copytree(parts[1], parts[0], dirs_exist_ok=True)
    before = tree(parts[0])
    refused(["data", "join", str(parts[0])], capsys, f"OUT={str(parts[0])!r}", "units were prepared with other "
            "settings", "--tokenizer='bpe' in prepare.json, 'byte' in units 0, 1", "--tokenizer bpe")
    assert tree(parts[0]) == before and not (parts[0] / "manifest.json").exists()


# -- a BPE's vocabulary: one rule for data prepare, fit and bench data -----------------------------------------
@pytest.mark.parametrize("command", ["data prepare", "bench data"])
def test_a_bpe_vocabulary_prepare_refuses_is_refused_by_bench_data_alike(tmp_path, capsys, command):
    out = tmp_path / "out"
    args = {"data prepare": ["data", "prepare", "stdlib", str(out), "--tokenizer", "bpe", *SMALL],
            "bench data": ["bench", "data", "--sizes-mb", "1", "--work-dir", str(out), "--json",
                           str(tmp_path / "results.json")]}[command]
    refused([*args, "--bpe-vocab-size", "100"], capsys, "--bpe-vocab-size=100 is invalid: expected an integer of "
            "at least 257 (256 byte symbols + <|endoftext|>)")
    assert list(tmp_path.iterdir()) == []


# -- a checkpoint whose prepared data was prepared again in place ---------------------------------------------
@pytest.fixture(scope="module")
def trained_on_prepared(tmp_path_factory) -> Path:
    """A directory holding `prep/` (prepared shards) and `runs/run/version_0/` (4 steps of `diffexp fit` on them)."""
    from tests.helpers import run_cli, write_recipe

    directory = tmp_path_factory.mktemp("trained")
    prepare("stdlib", directory / "prep")
    recipe = write_recipe(directory, name="run", max_steps=4)
    recipe.write_text(recipe.read_text().replace("source: stdlib", "source: prep"))
    run_cli(["fit", "--config", str(recipe)], cwd=directory)
    assert (directory / "runs/run/version_0/checkpoints/last.ckpt").is_file()
    return directory


@pytest.fixture
def prepared_again(trained_on_prepared, tmp_path, monkeypatch) -> Path:
    """A copy of ``trained_on_prepared`` (as the working directory) whose prep/ was deleted and prepared again
    with another split seed: the same name, other tokens in each split."""
    import shutil

    shutil.copytree(trained_on_prepared, tmp_path / "work")
    monkeypatch.chdir(tmp_path / "work")
    shutil.rmtree("prep")
    prepare("stdlib", Path("prep"), "--seed", "5")
    return tmp_path / "work"


RUN = "runs/run/version_0"


@pytest.mark.parametrize("subcommand", ["fit", "validate", "test"])
def test_a_resume_or_evaluation_on_data_prepared_again_is_refused_before_the_run_is_touched(prepared_again, capsys,
                                                                                          subcommand):
    before = tree(prepared_again)
    refused([subcommand, "--config", f"{RUN}/config.yaml", "--ckpt_path", f"{RUN}/checkpoints/last.ckpt"], capsys,
            "data.source='prep' was prepared again since the checkpoint's run read it", "data identity",
            "--model.init_from" if subcommand == "fit" else "restore that preparation")
    assert tree(prepared_again) == before  # no events file, no config.resumed-*.yaml, no eval/


def test_eval_nll_on_the_validation_split_of_data_prepared_again_is_refused(prepared_again, capsys):
    before = tree(prepared_again)
    refused(["eval", "nll", f"{RUN}/checkpoints/last.ckpt", "--documents", "1"], capsys,
            "the checkpoint's data.source='prep' was prepared again", "its validation split is not the documents "
            "that run held out", "--text-file")
    assert tree(prepared_again) == before


def test_eval_nll_on_the_data_the_run_read_still_works(trained_on_prepared, tmp_path, monkeypatch, capsys):
    import shutil

    shutil.copytree(trained_on_prepared, tmp_path / "work")
    monkeypatch.chdir(tmp_path / "work")
    with pytest.raises(SystemExit) as done:
        main(["eval", "nll", f"{RUN}/checkpoints/last.ckpt", "--documents", "1", "--out", "nll"])
    assert done.value.code == 0, capsys.readouterr().err
    assert (tmp_path / "work/nll/nll-ctx32.json").is_file()

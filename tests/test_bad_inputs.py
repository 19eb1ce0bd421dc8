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


def refused(args: list[str], capsys, *words: str, lines: bool = False) -> str:
    """`diffexp ARGS` exits 2 with one paragraph (``lines``: a list of them, a sweep's rows) holding every one of
    ``words``, and no traceback; the message."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        main(args)
    err = capsys.readouterr().err
    assert done.value.code == 2, err
    assert "Traceback" not in err, err
    message = err.split("error: ", 1)[1].split("(DIFFEXP_DEBUG=1", 1)[0].strip()
    assert lines or "\n" not in message, message
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


# -- model.init_from: refused before the run directory exists ------------------------------------------------
def tiny_llama(directory: Path, safe: bool) -> Path:
    """A Hugging Face Llama directory of diffexp's tiny baseline shape; ``safe``: safetensors, else only
    pytorch_model.bin (PyTorch pickle weights)."""
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                      rms_norm_eps=1e-5, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    if not safe:  # as older transformers wrote it (today's writes safetensors only)
        from safetensors.torch import load_file

        torch.save(load_file(directory / "model.safetensors"), directory / "pytorch_model.bin")
        (directory / "model.safetensors").unlink()
    return directory


TINY_BASELINE = ["--model.arch.attention", "baseline", "--model.arch.d_model", "32", "--model.arch.n_layers", "2",
                 "--model.arch.n_heads", "2", "--model.arch.ffn_hidden", "64", "--model.arch.max_seq_len", "64",
                 "--data.seq_len", "32", "--data.max_chars", "60000", "--trainer.max_steps", "2"]


def test_init_from_an_hf_directory_of_pickle_weights_is_refused_before_the_run_with_a_conversion_that_works(
        tmp_path, monkeypatch, capsys):
    from diffexp.training.warm_start import check_init_from

    monkeypatch.chdir(tmp_path)
    hf = tiny_llama(tmp_path / "llama", safe=False)
    assert (hf / "pytorch_model.bin").is_file() and not (hf / "model.safetensors").exists()
    message = refused(["fit", *TINY_BASELINE, "--model.init_from", str(hf)], capsys,
                      f"model.init_from={str(hf)!r}", "pytorch_model.bin (PyTorch pickle weights)",
                      "diffexp reads safetensors only", "save_pretrained")
    assert not (tmp_path / "runs").exists() and not (tmp_path / ".cache").exists()
    convert = message.split("give the new directory: ", 1)[1]
    assert convert.startswith("python -c ")
    import subprocess
    import sys

    from tests.helpers import subprocess_env

    subprocess.run([sys.executable, "-c", convert[len("python -c "):].strip('"')], check=True, env=subprocess_env())
    from diffexp.model.config import ModelConfig

    arch = ModelConfig(attention="baseline", vocab_size=257, d_model=32, n_layers=2, n_heads=2, ffn_hidden=64,
                       max_seq_len=64)
    from dataclasses import asdict

    assert check_init_from(f"{hf}-safetensors", asdict(arch), {}) == Path(f"{hf}-safetensors")


@pytest.mark.parametrize("damage", ["no weights", "index names a missing shard"])
def test_init_from_an_hf_directory_without_its_weights_is_refused_before_the_run(tmp_path, monkeypatch, capsys,
                                                                                 damage):
    monkeypatch.chdir(tmp_path)
    hf = tiny_llama(tmp_path / "llama", safe=True)
    if damage == "no weights":
        (hf / "model.safetensors").unlink()
        words = "no model.safetensors (or model.safetensors.index.json)"
    else:
        (hf / "model.safetensors").rename(hf / "model-00001-of-00002.safetensors")
        (hf / "model.safetensors.index.json").write_text('{"weight_map": {"a": "model-00001-of-00002.safetensors", '
                                                         '"b": "model-00002-of-00002.safetensors"}}')
        words = "names model-00002-of-00002.safetensors, which is not there"
    refused(["fit", *TINY_BASELINE, "--model.init_from", str(hf)], capsys, f"model.init_from={str(hf)!r}", words)
    assert not (tmp_path / "runs").exists()


TINY_DIFF_V2 = ["--model.arch.attention", "diff_v2", "--model.arch.d_model", "32", "--model.arch.n_layers", "2",
                "--model.arch.n_heads", "2", "--model.arch.max_seq_len", "256", "--data.seq_len", "32",
                "--trainer.max_steps", "2"]


@pytest.mark.parametrize("data", ["prepared", "raw"])
def test_init_from_a_checkpoint_of_another_tokenizer_is_refused_before_the_run_with_advice_that_works(
        bpe_checkpoint, prepared, tmp_path, monkeypatch, capsys, data):
    """A BPE checkpoint, this run on byte tokens: a prepared directory (whose tokenizer data.tokenizer cannot
    change) or the raw embedded corpus. Following the advice gives a run the check lets through."""
    import shlex
    from dataclasses import asdict

    from diffexp.model.config import ModelConfig
    from diffexp.training.warm_start import check_init_from

    monkeypatch.chdir(tmp_path)
    source = ["--data.source", str(prepared)] if data == "prepared" else ["--data.max_chars", "60000"]
    advice = {"prepared": "--data.source NEWDIR", "raw": "train with --data.tokenizer DIR/tokenizer.json"}[data]
    message = refused(["fit", *TINY_DIFF_V2, *source, "--model.init_from", str(bpe_checkpoint)], capsys,
                      f"model.init_from={str(bpe_checkpoint)!r}", "another tokenizer", "bpe300-", "against byte",
                      f"`diffexp export {bpe_checkpoint} DIR` writes the checkpoint's tokenizer", advice)
    assert not (tmp_path / "runs").exists() and not (tmp_path / ".cache").exists()
    with pytest.raises(SystemExit):
        main(["export", str(bpe_checkpoint), "DIR"])
    arch = asdict(ModelConfig(attention="diff_v2", vocab_size=300, d_model=32, n_layers=2, n_heads=2,
                              max_seq_len=256))
    if data == "prepared":
        command = shlex.split(message.split("prepared directory: its manifest fixes the tokenizer, data.tokenizer is "
                                            "not read): `", 1)[1].split("`", 1)[0])
        assert command[:3] == ["diffexp", "data", "prepare"] and "NEWDIR" in command
        with pytest.raises(SystemExit) as done:
            main([*command[1:], "--no-progress"])
        assert done.value.code == 0
        data_args = {"source": "NEWDIR"}
    else:
        data_args = {"source": "stdlib", "max_chars": 60000, "tokenizer": "DIR/tokenizer.json"}
    assert check_init_from(str(bpe_checkpoint), arch, data_args) == bpe_checkpoint


# -- a sweep's data: checked before any trial starts -------------------------------------------------------------
@pytest.mark.parametrize("source", ["unfinished part", "missing file"])
def test_a_sweep_on_data_fit_would_refuse_starts_no_trial(tmp_path, capsys, source):
    from tests.helpers import write_spec

    if source == "unfinished part":
        data = tmp_path / "part0"
        prepare("stdlib", data, "--unit-mb", "0.01", "--part", "0", "--of", "2")
        words = [f"data.source={str(data)!r} is invalid: the preparation there is unfinished", "diffexp data join"]
    else:
        data = tmp_path / "corpus.jsonl"
        words = [f"data.source={str(data)!r}: no such file or directory"]
    spec = write_spec(tmp_path, "bad-data", overrides={"data.source": str(data), "data.seq_len": 32,
                                                        "trainer.max_steps": 2})
    before = tree(tmp_path)
    refused(["sweep", "--config", str(spec)], capsys, "2 of 2 trial configurations would be refused by `diffexp "
            "fit`; nothing was started or written", "- every row: ", *words, lines=True)
    assert tree(tmp_path) == before and not (tmp_path / "runs").exists()

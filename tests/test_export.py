"""`diffexp export`: a .ckpt or a sharded checkpoint becomes one model directory that every command reads."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from diffexp.checkpoint_io import read_checkpoint
from diffexp.cli import main
from diffexp.model.config import ModelConfig
from tests.helpers import save_untrained_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A byte-vocabulary DINT with tied embeddings (safetensors refuses shared storage unless handled)."""
    path = tmp_path_factory.mktemp("run") / "last.ckpt"
    torch.manual_seed(0)
    save_untrained_checkpoint(ModelConfig(attention="dint", vocab_size=257, d_model=32, n_layers=2, n_heads=2,
                                          max_seq_len=64, tie_embeddings=True), path)
    return path


def run(args, capsys):
    with pytest.raises(SystemExit) as done:
        main(args)
    captured = capsys.readouterr()
    return done.value.code, captured.out, captured.err


def sharded_copy(ckpt, directory):
    """The layout Lightning's FSDP strategy writes: DCP shards of {"model": state_dict} plus meta.pt."""
    import torch.distributed.checkpoint as dcp

    full = torch.load(ckpt, weights_only=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": full["state_dict"]}, checkpoint_id=directory, no_dist=True)
    torch.save({k: v for k, v in full.items() if k != "state_dict"}, directory / "meta.pt")
    return directory


@pytest.mark.parametrize("weights_format", ["safetensors", "torch"])
def test_export_round_trips_weights_and_hyperparameters(ckpt, tmp_path, capsys, weights_format):
    out = tmp_path / "model"
    code, printed, _ = run(["export", str(ckpt), str(out), "--format", weights_format], capsys)
    assert code == 0 and str(out) in printed
    config = json.loads((out / "config.json").read_text())
    assert config["hyper_parameters"]["arch"]["attention"] == "dint" and config["tokenizer"] is None
    original, exported = read_checkpoint(ckpt), read_checkpoint(out)
    assert exported["state_dict"].keys() == original["state_dict"].keys()
    assert all(torch.equal(exported["state_dict"][k], v) for k, v in original["state_dict"].items())
    assert exported["hyper_parameters"]["arch"] == original["hyper_parameters"]["arch"]
    assert not list(tmp_path.glob(".model.*"))  # no staging directory left behind
    modes = {path.name: path.stat().st_mode & 0o777 for path in out.iterdir()}
    assert len(set(modes.values())) == 1, modes  # the weights as readable as the config beside them


def test_generate_reads_the_checkpoint_the_export_and_the_shards_alike(ckpt, tmp_path, capsys):
    out = tmp_path / "model"
    assert run(["export", str(ckpt), str(out)], capsys)[0] == 0
    shards = sharded_copy(ckpt, tmp_path / "sharded.ckpt")
    exported_shards = tmp_path / "from-shards"
    assert run(["export", str(shards), str(exported_shards)], capsys)[0] == 0
    texts = set()
    for source in (ckpt, out, shards, exported_shards):
        code, text, err = run(["generate", str(source), "--prompt", "hello", "--max-new-tokens", "12",
                               "--seed", "3", "--device", "cpu"], capsys)
        assert code == 0, err
        texts.add(text)
    assert len(texts) == 1


def test_a_bpe_model_exports_with_its_tokenizer(bpe_checkpoint, tmp_path, capsys):
    """The BPE travels as tokenizer.json, and the export decodes exactly as its checkpoint."""
    from tokenizers import Tokenizer

    out = tmp_path / "bpe-model"
    assert run(["export", str(bpe_checkpoint), str(out)], capsys)[0] == 0
    saved = torch.load(bpe_checkpoint, weights_only=False)["diffexp_tokenizer"]
    assert Tokenizer.from_file(str(out / "tokenizer.json")).to_str() == Tokenizer.from_str(saved["json"]).to_str()
    texts = set()
    for source in (bpe_checkpoint, out):
        code, text, err = run(["generate", str(source), "--prompt", "def main(", "--max-new-tokens", "8",
                               "--temperature", "0", "--device", "cpu"], capsys)
        assert code == 0, err
        texts.add(text)
    assert len(texts) == 1 and texts.pop().strip()


def test_eval_reads_an_exported_model(ckpt, tmp_path, capsys):
    out = tmp_path / "model"
    assert run(["export", str(ckpt), str(out)], capsys)[0] == 0
    code, printed, err = run(["eval", "mqar", str(out), "--seq-len", "32", "--num-kv-pairs", "2", "--samples", "4",
                              "--device", "cpu", "--out", str(tmp_path / "eval")], capsys)
    assert code == 0, err
    assert (tmp_path / "eval").is_dir() and '"mqar/accuracy"' in printed


def test_export_never_overwrites_and_names_bad_input(ckpt, tmp_path, capsys):
    existing = tmp_path / "taken"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    code, _, err = run(["export", str(ckpt), str(existing)], capsys)
    assert code == 2 and "OUT=" in err and "exists" in err and (existing / "keep.txt").read_text() == "mine"
    code, _, err = run(["export", str(tmp_path / "missing.ckpt"), str(tmp_path / "new")], capsys)
    assert code == 2 and "CKPT=" in err and "no such file" in err and not (tmp_path / "new").exists()
    (tmp_path / "a-file").write_text("x")
    code, _, err = run(["export", str(ckpt), str(tmp_path / "a-file" / "sub" / "out")], capsys)
    assert code == 2 and "'" + str(tmp_path / "a-file") + "' is a file, not a directory" in err
    assert "Traceback" not in err and (tmp_path / "a-file").read_text() == "x"
    code, _, err = run(["export", str(tmp_path / "missing.ckpt"), str(tmp_path / "new" / "deep" / "out")], capsys)
    assert code == 2 and not (tmp_path / "new").exists()  # refused: no parent made


def test_export_makes_missing_parents(ckpt, tmp_path, capsys):
    """As the README's `diffexp export ... exported/diff_v1-hf` on a fresh clone: `exported/` is made."""
    code, _, err = run(["export", str(ckpt), str(tmp_path / "exported" / "deep" / "model")], capsys)
    assert code == 0, err
    assert (tmp_path / "exported" / "deep" / "model" / "model.safetensors").is_file()


def test_a_damaged_export_is_a_clear_error(ckpt, tmp_path, capsys):
    out = tmp_path / "model"
    assert run(["export", str(ckpt), str(out)], capsys)[0] == 0
    weights = out / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    code, _, err = run(["generate", str(out), "--prompt", "x", "--device", "cpu"], capsys)
    assert code == 2 and "model.safetensors" in err and "Traceback" not in err
    (out / "config.json").write_text("{not json")
    code, _, err = run(["generate", str(out), "--prompt", "x", "--device", "cpu"], capsys)
    assert code == 2 and "config.json" in err


def test_an_export_names_its_run_and_weights_and_no_local_path(tmp_path, capsys):
    """config.json carries what identifies the run (name/version, checkpoint file, the weights' SHA-256), and no
    path of the machine it was made on: an export is meant to be shared."""
    import hashlib

    ckpt = tmp_path / "runs/tiny/diff_v1/version_3/checkpoints/last.ckpt"
    ckpt.parent.mkdir(parents=True)
    save_untrained_checkpoint(ModelConfig(attention="diff_v1", vocab_size=257, d_model=32, n_layers=1, n_heads=2,
                                          max_seq_len=64), ckpt)
    checkpoint = torch.load(ckpt, weights_only=True)  # as a run on a local corpus, from a local checkpoint, saves it
    checkpoint["datamodule_hyper_parameters"] = {"source": str(tmp_path / "corpus"), "seq_len": 64,
                                                 "cache_dir": str(tmp_path / ".cache/diffexp")}
    checkpoint["hyper_parameters"]["init_from"] = str(tmp_path / "runs/pre/version_0/checkpoints/last.ckpt")
    torch.save(checkpoint, ckpt)
    out = tmp_path / "exported"
    assert run(["export", str(ckpt), str(out)], capsys)[0] == 0
    text = (out / "config.json").read_text()
    config = json.loads(text)
    assert config["datamodule_hyper_parameters"] == {"source": "corpus", "seq_len": 64}  # the corpus by name
    assert config["hyper_parameters"]["init_from"] == "last.ckpt"
    source = json.loads(text)["source"]
    assert source == {"run": "diff_v1/version_3", "checkpoint": "last.ckpt",
                      "weights_sha256": hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()}
    assert str(tmp_path) not in text and str(tmp_path.resolve()) not in text

"""model.init_from: a new run starts from another run's weights (long-context extension), with a fresh
optimizer and schedule, and refuses a checkpoint whose architecture differs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from diffexp.cli import main
from diffexp.training.module import warmup_cosine
from tests.helpers import scalars, write_recipe


def save_weights_at_start(path: Path) -> str:
    spec = {"class_path": "tests.helpers.SaveWeightsAtStart", "init_args": {"path": str(path)}}
    return f"--trainer.callbacks+={json.dumps(spec)}"


def extend_args(recipe: Path, *extra: str) -> list[str]:
    """The pretraining recipe, continued at twice the length with a larger RoPE base, in its own experiment."""
    return ["fit", "--config", str(recipe), "--model.init_from", "runs/run", "--model.arch.max_seq_len", "64",
            "--model.arch.rope_theta", "40000", "--data.seq_len", "64", "--trainer.max_steps", "4",
            "--trainer.logger.init_args.name", "long", *extra]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A 4-step DIFF V1 run with max_seq_len 32 (runs/run/version_0)."""
    root = tmp_path_factory.mktemp("warm")
    recipe = write_recipe(root, attention="diff_v1", max_steps=4)
    text = recipe.read_text().replace("arch: {attention: diff_v1,", "arch: {attention: diff_v1, max_seq_len: 32,")
    recipe.write_text(text)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        main(["fit", "--config", str(recipe)])
    return root, recipe


def test_extension_starts_from_the_weights_with_a_fresh_optimizer(pretrained, monkeypatch):
    root, recipe = pretrained
    monkeypatch.chdir(root)
    start = root / "start.pt"
    main(extend_args(recipe, save_weights_at_start(start)))
    saved = torch.load(root / "runs/run/version_0/checkpoints/last.ckpt", weights_only=True)
    initial = torch.load(start, weights_only=True)
    assert initial.keys() == saved["state_dict"].keys()
    for name, tensor in saved["state_dict"].items():  # every weight, bit for bit
        assert torch.equal(initial[name], tensor), name
    run = root / "runs/long/version_0"
    extended = torch.load(run / "checkpoints/last.ckpt", weights_only=True)
    # a new run: its own step count, and a warmup that starts again from zero
    assert extended["global_step"] == 4
    assert extended["hyper_parameters"]["arch"]["max_seq_len"] == 64
    assert extended["hyper_parameters"]["arch"]["rope_theta"] == 40000
    lr = dict(scalars(run)["train/lr"])
    assert lr[2] == pytest.approx(3e-3 * warmup_cosine(1, 2, 4, 0.1), rel=1e-5)  # the 2nd step's
    # and it trained: the weights moved from the starting point
    assert any(not torch.equal(extended["state_dict"][k], v) for k, v in saved["state_dict"].items())


def test_without_init_from_the_weights_are_fresh(pretrained, monkeypatch):
    """The flag really changes the model: the same command without it starts from the random init."""
    root, recipe = pretrained
    monkeypatch.chdir(root)
    start = root / "start-fresh.pt"
    args = [a for a in extend_args(recipe, save_weights_at_start(start)) if a not in ("--model.init_from", "runs/run")]
    main(args)
    saved = torch.load(root / "runs/run/version_0/checkpoints/last.ckpt", weights_only=True)["state_dict"]
    initial = torch.load(start, weights_only=True)
    assert not torch.equal(initial["model.embed.weight"], saved["model.embed.weight"])


@pytest.mark.parametrize("flags,named", [
    (["--model.arch.n_layers", "3"], "model.arch.n_layers: checkpoint 2, this config 3"),
    (["--model.arch.attention", "dint"], "model.arch.attention: checkpoint 'diff_v1', this config 'dint'"),
    (["--model.arch.head_norm", "false"], "model.arch.head_norm: checkpoint True, this config False"),
    (["--data.tokenizer", "bpe"], "data.tokenizer: checkpoint 'byte', this config 'bpe'"),
])
def test_a_different_architecture_is_refused_before_any_work(pretrained, monkeypatch, capsys, flags, named):
    root, recipe = pretrained
    monkeypatch.chdir(root)
    before = sorted(p.name for p in (root / "runs").iterdir())
    with pytest.raises(SystemExit) as done:
        main(extend_args(recipe, *flags, "--trainer.logger.init_args.name", "refused"))
    err = capsys.readouterr().err
    assert done.value.code == 2 and "Traceback" not in err
    assert "model.init_from='runs/run'" in err and named in err
    assert sorted(p.name for p in (root / "runs").iterdir()) == before  # no run directory was made


def test_a_missing_checkpoint_is_named(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    recipe = write_recipe(tmp_path, attention="baseline", max_steps=2)
    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", str(recipe), "--model.init_from", "runs/nothing-here"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "model.init_from='runs/nothing-here' is invalid: no such file" in err
    assert not (tmp_path / "runs").exists()

"""checkpoint.* settings that switch saving off, or contradict each other.

Contradictions (and the values Lightning's ModelCheckpoint refuses with a traceback) are refused before any work, one
paragraph naming the key; settings that leave a run that cannot be resumed are legitimate for a throw-away run, so a
fit goes on after one `warning: ...` line that says so.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from diffexp.cli import main
from diffexp.training.cli import parse_config
from diffexp.training.preflight import validate_fit_config
from tests.helpers import write_recipe

# (id, arguments after `diffexp fit --config RECIPE`, fragments of the message); the recipe saves every 4 steps
REFUSED = [
    ("top-k-below-minus-one", ["--checkpoint.save_top_k", "-2"], ["checkpoint.save_top_k=-2", "-1"]),
    ("every-n-steps-negative", ["--checkpoint.every_n_train_steps", "-1"], ["checkpoint.every_n_train_steps=-1"]),
    ("every-n-epochs-negative", ["--checkpoint.every_n_epochs", "-1"], ["checkpoint.every_n_epochs=-1"]),
    ("time-and-step-triggers", ["--checkpoint.train_time_interval", "00:30:00"],
     ["checkpoint.every_n_train_steps=4 and checkpoint.train_time_interval=0:30:00", "one trigger",
      "--checkpoint.every_n_train_steps 0"]),
    ("epoch-and-step-triggers", ["--checkpoint.every_n_epochs", "1"],
     ["checkpoint.every_n_train_steps=4 and checkpoint.every_n_epochs=1", "--checkpoint.every_n_train_steps 0"]),
    ("top-k-without-monitor", ["--checkpoint.save_top_k", "3", "--checkpoint.monitor", "null"],
     ["checkpoint.save_top_k=3", "checkpoint.monitor"]),
]

# (id, arguments, fragments of the one warning line, or None: no warning)
WARNED = [
    ("nothing-saved", ["--checkpoint.save_last", "false", "--checkpoint.save_top_k", "0"],
     ["checkpoint.save_last=false and checkpoint.save_top_k=0", "saves no checkpoint", "cannot be resumed"]),
    ("nothing-saved-no-validation", ["--checkpoint.save_last", "false", "--trainer.limit_val_batches", "0"],
     ["checkpoint.save_last=false and no validation", "saves no checkpoint", "cannot be resumed"]),
    ("checkpointing-off", ["--trainer.enable_checkpointing", "false"],
     ["trainer.enable_checkpointing=false", "saves no checkpoint", "cannot be resumed"]),
    ("no-last-ckpt", ["--checkpoint.save_last", "false"],
     ["checkpoint.save_last=false", "cannot be resumed with --ckpt_path last", "by its path"]),
    ("no-step-trigger", ["--checkpoint.every_n_train_steps", "0"],
     ["checkpoint.every_n_train_steps=0", "only when training ends", "cannot be resumed"]),
    ("step-trigger-past-the-end", ["--checkpoint.every_n_train_steps", "100"],
     ["checkpoint.every_n_train_steps=100 is not below trainer.max_steps=12", "only when training ends"]),
    ("defaults", [], None),
    ("by-time", ["--checkpoint.every_n_train_steps", "0", "--checkpoint.train_time_interval", "00:30:00"], None),
    ("by-epoch", ["--checkpoint.every_n_train_steps", "0", "--checkpoint.every_n_epochs", "1"], None),
    ("lightning-default-trigger", ["--checkpoint.every_n_train_steps", "null"], None),  # once per epoch
]


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Path:
    return write_recipe(tmp_path_factory.mktemp("ckpt-settings"), attention="baseline", max_steps=12)


@pytest.mark.parametrize("args, fragments", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
@pytest.mark.parametrize("subcommand", ["fit", "validate"])
def test_contradictory_settings_are_refused_before_work(recipe, monkeypatch, capsys, subcommand, args, fragments):
    monkeypatch.chdir(recipe.parent)
    with pytest.raises(SystemExit) as exit_:
        main([subcommand, "--config", str(recipe), *args])
    assert exit_.value.code == 2
    text = capsys.readouterr().err
    assert "Traceback" not in text
    message = text[text.find("error:"):]
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert not (recipe.parent / "runs").exists()


@pytest.mark.parametrize("args, fragments", [c[1:] for c in WARNED], ids=[c[0] for c in WARNED])
def test_settings_that_leave_a_run_unresumable_warn_in_one_line(recipe, capsys, args, fragments):
    capsys.readouterr()
    validate_fit_config(parse_config(["--config", str(recipe), *args]), "fit")
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    if fragments is None:
        assert warnings == []
        return
    assert len(warnings) == 1, warnings
    for fragment in fragments:
        assert fragment in warnings[0], f"{fragment!r} not in {warnings[0]!r}"
    # evaluating a checkpoint saves nothing: nothing to warn about
    validate_fit_config(parse_config(["--config", str(recipe), *args], "validate"), "validate")
    assert "warning:" not in capsys.readouterr().err


@pytest.mark.parametrize("args", [["--trainer.enable_checkpointing", "false"],
                                  ["--checkpoint.save_last", "false", "--checkpoint.save_top_k", "0"]],
                         ids=["checkpointing-off", "nothing-saved"])
def test_a_run_that_saves_nothing_trains_and_says_so(tmp_path, monkeypatch, capsys, args):
    monkeypatch.chdir(tmp_path)
    recipe = write_recipe(tmp_path, attention="baseline", max_steps=6)
    main(["fit", "--config", str(recipe), *args])
    out = capsys.readouterr()
    assert "cannot be resumed" in out.err
    assert "last checkpoint -" in out.out and "resume " not in out.out
    run = tmp_path / "runs/run/version_0"
    assert (run / "config.yaml").is_file()
    assert not list(run.rglob("*.ckpt"))

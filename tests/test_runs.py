"""Run directories and checkpoints a user can trust: the best file, distinct runs, eval directories,
logs that survive a kill, plain-YAML configs."""

from __future__ import annotations

import re
import shutil
import threading
from pathlib import Path

import pytest
import torch
import yaml

from diffexp.cli import DiffexpCLI, main
from diffexp.data import TextDataModule
from diffexp.training import DiffexpLM
from diffexp.training.runs import reserve_version
from tests.helpers import run_cli, scalars, write_recipe


def cli(args: list[str]) -> DiffexpCLI:
    return DiffexpCLI(DiffexpLM, TextDataModule, auto_configure_optimizers=False, args=args)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """One 11-step run validated every 3 steps and at its end (4 validations), checkpoints every 4."""
    tmp = tmp_path_factory.mktemp("finished")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp)
        main(["fit", "--config", str(write_recipe(tmp, max_steps=11)), "--trainer.val_check_interval", "3"])
    return tmp


@pytest.mark.slow
def test_best_checkpoint_holds_the_weights_of_the_best_validation(finished_run, monkeypatch):
    monkeypatch.chdir(finished_run)
    run = finished_run / "runs/run/version_0"
    val_loss = scalars(run)["val/loss"]
    assert len(val_loss) == 4
    best_step, best = min(val_loss, key=lambda point: point[1])
    (best_file,) = (p for p in run.glob("checkpoints/*.ckpt") if p.name != "last.ckpt")
    step, value = re.fullmatch(r"step(\d+)-val([\d.]+)\.ckpt", best_file.name).groups()
    # named by that validation: after N optimizer steps, logged at step N as every validation is
    assert int(step) == best_step and value == f"{best:.3f}"
    assert torch.load(best_file, weights_only=True)["global_step"] == int(step)
    validated = cli(["validate", "--config", str(finished_run / "run.yaml"), "--ckpt_path", str(best_file)])
    assert validated.trainer.callback_metrics["val/loss"].item() == pytest.approx(best, rel=1e-6)


@pytest.mark.slow
def test_validate_and_test_log_into_the_run_they_evaluate(finished_run, monkeypatch):
    monkeypatch.chdir(finished_run)
    recipe, experiment = str(finished_run / "run.yaml"), finished_run / "runs/run"
    last = experiment / "version_0/checkpoints/last.ckpt"
    before = set(experiment.glob("**/eval/*"))
    for subcommand, metric in (("validate", "val/loss"), ("test", "test/loss")):
        cli([subcommand, "--config", recipe, "--ckpt_path", str(last)])
        (new,) = set(experiment.glob(f"version_0/eval/{subcommand}-*")) - before
        assert metric in scalars(new) and (new / "config.yaml").is_file()
    elsewhere = finished_run / "elsewhere.ckpt"  # a checkpoint outside any run
    shutil.copy(last, elsewhere)
    cli(["validate", "--config", recipe, "--ckpt_path", str(elsewhere)])
    (new,) = set(experiment.glob("eval/validate-*")) - before
    assert "val/loss" in scalars(new)
    assert sorted(p.name for p in experiment.iterdir()) == ["eval", "version_0"]  # no run-like version_1


@pytest.mark.slow
def test_saved_configs_load_with_yaml_safe_load(finished_run):
    run = finished_run / "runs/run/version_0"
    config, hparams = (yaml.safe_load((run / name).read_text()) for name in ("config.yaml", "hparams.yaml"))
    assert config["model"]["optim"]["betas"] == [0.9, 0.95]
    assert hparams["optim"]["betas"] == [0.9, 0.95]


def test_runs_started_together_get_their_own_directories(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe = str(write_recipe(tmp_path))
    # two runs of one name, both built before either has written anything
    first, second = (DiffexpCLI(DiffexpLM, TextDataModule, run=False, auto_configure_optimizers=False,
                                args=["--config", recipe]) for _ in range(2))
    assert first.trainer.log_dir != second.trainer.log_dir
    assert sorted(p.name for p in (tmp_path / "runs/run").iterdir()) == ["version_0", "version_1"]

    versions, start = [], threading.Barrier(8)

    def reserve() -> None:
        start.wait()
        versions.append(reserve_version(tmp_path / "together"))

    threads = [threading.Thread(target=reserve) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(versions) == list(range(8))


@pytest.mark.heavy  # several fits killed at checkpoints (about 40 s); test_training.py kills and resumes one
def test_logs_are_complete_after_kills_right_after_checkpoints(tmp_path):
    """Killed right after last.ckpt at step 6 (a validation step), then at step 8 (between validations),
    resumed each time: every planned train/loss and val/loss point is logged, once."""
    recipe = str(write_recipe(tmp_path))
    plan = ["--trainer.val_check_interval", "3", "--checkpoint.every_n_train_steps", "2"]  # logs every 2 steps

    def kill_after(step: int) -> str:
        return ('--trainer.callbacks+={"class_path": "tests.helpers.KillAfterCheckpoint", '
                f'"init_args": {{"step": {step}}}}}')

    first = run_cli(["fit", "--config", recipe, *plan, kill_after(6)], tmp_path, check=False)
    checkpoints = tmp_path / "runs/run/version_0/checkpoints"
    orphan = checkpoints / ".last.ckpt.k1ll3d.tmp"  # what a kill during a save leaves
    orphan.write_bytes(b"partial")
    second = run_cli(["fit", "--config", recipe, *plan, "--ckpt_path", "last", kill_after(8)], tmp_path, check=False)
    orphan_removed = not orphan.exists()
    run_cli(["fit", "--config", recipe, *plan, "--ckpt_path", "last"], tmp_path)

    logged = scalars(tmp_path / "runs/run/version_0")
    for tag, steps in (("train/loss", [2, 4, 6, 8, 10, 12]), ("val/loss", [2, 5, 8, 11])):
        assert sorted({step for step, _ in logged[tag]}) == steps, tag
        for step in steps:
            assert len({value for s, value in logged[tag] if s == step}) == 1, (tag, step)
    assert (first.returncode, second.returncode) == (-9, -9)  # both kills happened
    assert orphan_removed  # by the resumed run
    assert torch.load(checkpoints / "last.ckpt", weights_only=True)["global_step"] == 12
    assert not list(checkpoints.glob("*.tmp"))


def test_a_new_run_refused_at_setup_leaves_no_run_directory(tmp_path):
    """An evaluation callback whose options are checked at setup (its text file does not exist), after the run's
    version_0 was reserved: the fit refuses in one line, and neither version_0 nor any file of it remains."""
    recipe = str(write_recipe(tmp_path, max_steps=2))
    evaluate = ('--trainer.callbacks+={"class_path": "diffexp.evals.Evaluate", "init_args": {"evaluation": '
                f'"outliers", "options": {{"text_file": ["{tmp_path / "missing.txt"}"]}}}}}}')
    refused = run_cli(["fit", "--config", recipe, evaluate], tmp_path, check=False)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "options.text_file=" in refused.stderr and "no such file" in refused.stderr, refused.stderr[-2000:]
    assert "Traceback" not in refused.stderr
    assert (tmp_path / "cache").is_dir()  # it got as far as preparing the data: version_0 had been reserved
    assert not list((tmp_path / "runs").rglob("version_*"))

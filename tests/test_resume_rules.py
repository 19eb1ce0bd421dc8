"""A resume does exactly what the saved run did, or refuses; extending a run is explicit."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from diffexp.cli import main
from diffexp.training.module import warmup_cosine

sys.path.insert(0, str(Path(__file__).parent))
from test_training import scalars, write_recipe  # noqa: E402


@pytest.mark.slow
def test_extending_max_steps_keeps_the_saved_schedule(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    recipe = write_recipe(tmp_path, attention="baseline", max_steps=6)
    main(["fit", "--config", str(recipe)])
    run = tmp_path / "runs/run/version_0"
    capsys.readouterr()

    # a bigger max_steps alone would stretch the cosine under steps already taken: refused, with the fix
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(recipe), "--trainer.max_steps", "10", "--ckpt_path", "last"])
    assert "--model.optim.schedule_steps 6" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "runs/run").iterdir()) == ["version_0"]

    main(["fit", "--config", str(recipe), "--trainer.max_steps", "10", "--model.optim.schedule_steps", "6",
          "--ckpt_path", "last"])
    assert torch.load(run / "checkpoints/last.ckpt", weights_only=True)["global_step"] == 10
    lr = dict(scalars(run)["lr"])
    peak, warmup, floor = 3e-3, 2, 0.1
    for step in (1, 3, 5):  # the original run's steps, logged before the resume
        assert lr[step] == pytest.approx(peak * warmup_cosine(step, warmup, 6, floor), rel=1e-5)
    for step in (7, 9):  # past the planned end the lr stays at its final value
        assert lr[step] == pytest.approx(peak * floor, rel=1e-5)
    saved = (run / next(p.name for p in run.iterdir() if p.name.startswith("config.resumed-"))).read_text()
    assert "schedule_steps: 6" in saved and "max_steps: 10" in saved


def test_resume_with_the_saved_config_is_accepted(tmp_path, monkeypatch):
    """The command the refusal prints resumes the run."""
    monkeypatch.chdir(tmp_path)
    recipe = write_recipe(tmp_path, attention="diff_v2", max_steps=4)
    main(["fit", "--config", str(recipe)])
    run = tmp_path / "runs/run/version_0"
    main(["fit", "--config", str(run / "config.yaml"), "--ckpt_path", str(run / "checkpoints/last.ckpt")])
    assert sorted(p.name for p in (tmp_path / "runs/run").iterdir()) == ["version_0"]


@pytest.mark.slow
def test_lr_override_on_resume_is_honoured_and_recorded(tmp_path, monkeypatch, capsys):
    """A changed model.optim.lr on resume is applied from the resumed step on, announced, and the saved
    config, the hparams and the logged lr all say the same."""
    import yaml

    monkeypatch.chdir(tmp_path)
    recipe = write_recipe(tmp_path, attention="baseline", max_steps=8)
    main(["fit", "--config", str(recipe), "--trainer.max_steps", "4", "--model.optim.schedule_steps", "8"])
    capsys.readouterr()
    import time

    resumed_at = time.time()
    main(["fit", "--config", str(recipe), "--trainer.max_steps", "8", "--model.optim.schedule_steps", "8",
          "--model.optim.lr", "1e-3", "--ckpt_path", "last"])
    assert "model.optim.lr: checkpoint 0.003, this config 0.001" in capsys.readouterr().err
    run = tmp_path / "runs/run/version_0"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run)).Reload().Scalars("lr")
    before = [e.value for e in events if e.wall_time < resumed_at]
    after = [e.value for e in events if e.wall_time >= resumed_at]
    assert before and after
    assert before[0] == pytest.approx(3e-3 * warmup_cosine(1, 2, 8, 0.1), rel=1e-5)
    new_schedule = [1e-3 * warmup_cosine(step, 2, 8, 0.1) for step in range(4, 8)]
    for value in after:  # the new peak under the same schedule, for every step after the resume
        assert any(value == pytest.approx(v, rel=1e-5) for v in new_schedule), (value, new_schedule)
    resumed = next(p for p in run.iterdir() if p.name.startswith("config.resumed-"))
    assert yaml.safe_load(resumed.read_text())["model"]["optim"]["lr"] == 1e-3
    assert yaml.safe_load((run / "hparams.yaml").read_text())["optim"]["lr"] == 1e-3

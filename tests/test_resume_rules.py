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

"""A resume does exactly what the saved run did, or refuses; extending a run is explicit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffexp.cli import main
from diffexp.training.module import warmup_cosine
from tests.helpers import scalars, write_recipe


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
    lr = dict(scalars(run)["train/lr"])
    peak, warmup, floor = 3e-3, 2, 0.1
    for step in (2, 4, 6):  # the original run's steps, logged before the resume, at the steps done after each
        assert lr[step] == pytest.approx(peak * warmup_cosine(step - 1, warmup, 6, floor), rel=1e-5)
    after = [step for step in lr if step > 6]  # the steps Lightning logs after the resume, and the last one
    assert 10 in after and len(after) >= 2
    for step in after:  # past the planned end the lr stays at its final value
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

    events = EventAccumulator(str(run)).Reload().Scalars("train/lr")
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


def _as_if_written_before(run: Path, arch_keys=("lowrank_scope",), ar_hit_keys=("exclude_frequent",)) -> Path:
    """Strip the keys added since from a run's last.ckpt and config.yaml, as the older diffexp wrote them."""
    import yaml

    path = run / "checkpoints/last.ckpt"
    ckpt = torch.load(path, weights_only=True)
    for section, keys in (("arch", arch_keys), ("ar_hit", ar_hit_keys)):
        for key in keys:
            del ckpt["hyper_parameters"][section][key]
    torch.save(ckpt, path)
    config = yaml.safe_load((run / "config.yaml").read_text())
    for section, keys in (("arch", arch_keys), ("ar_hit", ar_hit_keys)):
        for key in keys:
            del config["model"][section][key]
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    return path


def test_checkpoint_from_before_lowrank_scope_and_exclude_frequent_keeps_its_meaning(tmp_path, monkeypatch, capsys):
    """A Shared DIFF checkpoint written before model.arch.lowrank_scope and model.ar_hit.exclude_frequent
    existed had per-head updates and counted every repeated bigram as an AR-Hit. Read today, it still does:
    evaluation rebuilds the per-head model, and a resume under today's defaults (layer scope, frequent
    bigrams excluded) is refused with the command that resumes it as it was, which then runs."""
    from diffexp.checkpoint_io import read_checkpoint
    from diffexp.evals.common import load_model

    monkeypatch.chdir(tmp_path)
    recipe = write_recipe(tmp_path, attention="shared_diff", max_steps=4)
    main(["fit", "--config", str(recipe), "--model.arch.lowrank_scope", "head",
          "--model.ar_hit.exclude_frequent", "false"])
    run = tmp_path / "runs/run/version_0"
    ckpt_path = _as_if_written_before(run)

    checkpoint = read_checkpoint(ckpt_path)
    assert checkpoint["hyper_parameters"]["arch"]["lowrank_scope"] == "head"
    assert checkpoint["hyper_parameters"]["ar_hit"]["exclude_frequent"] is False
    model = load_model(checkpoint, str(ckpt_path), "cpu")  # the per-head weights fit
    assert model.arch.lowrank_scope == "head" and model.ar_hit.threshold() is None

    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(run / "config.yaml"), "--ckpt_path", str(ckpt_path)])
    err = capsys.readouterr().err
    assert "model.arch.lowrank_scope: checkpoint 'head', this config 'layer'" in err
    assert "model.ar_hit.exclude_frequent: checkpoint False, this config True" in err
    fix = f"--config {run / 'config.yaml'} --model.arch.lowrank_scope head --model.ar_hit.exclude_frequent false"
    assert fix in " ".join(err.split())
    main(["fit", "--config", str(run / "config.yaml"), "--model.arch.lowrank_scope", "head",
          "--model.ar_hit.exclude_frequent", "false", "--trainer.max_steps", "4", "--ckpt_path", str(ckpt_path)])


def test_old_checkpoint_of_a_variant_without_lowrank_scope_resumes_under_todays_defaults(tmp_path, monkeypatch):
    """lowrank_scope meant nothing to a DIFF V1 run, so it pins nothing; an old run that excluded frequent
    bigrams (a threshold given) keeps doing so under today's exclude_frequent default."""
    monkeypatch.chdir(tmp_path)
    recipe = write_recipe(tmp_path, attention="diff_v1", max_steps=4)
    main(["fit", "--config", str(recipe), "--model.ar_hit.min_count", "3"])
    run = tmp_path / "runs/run/version_0"
    ckpt_path = _as_if_written_before(run)
    main(["fit", "--config", str(run / "config.yaml"), "--ckpt_path", str(ckpt_path)])


def test_checkpoint_with_dints_scalar_gamma_resumes_and_ends_on_the_uninterrupted_weights(tmp_path, monkeypatch):
    """DINT's learned gamma was a 0-d parameter (which FSDP2 cannot shard) before it became shape (1,). A
    checkpoint from then, with its 0-d gamma and 0-d AdamW moments, still resumes, and ends where an
    uninterrupted run of today ends."""
    monkeypatch.chdir(tmp_path)
    recipe = write_recipe(tmp_path, attention="dint", max_steps=8)
    learned = ["--model.arch.gamma", "learned", "--model.optim.schedule_steps", "8"]
    main(["fit", "--config", str(recipe), *learned])
    uninterrupted = torch.load(tmp_path / "runs/run/version_0/checkpoints/last.ckpt", weights_only=True)
    main(["fit", "--config", str(recipe), *learned, "--trainer.max_steps", "4"])
    run = tmp_path / "runs/run/version_1"
    path = run / "checkpoints/last.ckpt"
    checkpoint = torch.load(path, weights_only=True)
    gammas = [key for key in checkpoint["state_dict"] if key.endswith(".gamma")]
    assert len(gammas) == 2
    for key in gammas:  # as written before the change
        checkpoint["state_dict"][key] = checkpoint["state_dict"][key].reshape(())
    scalars_made = 0
    for state in checkpoint["optimizer_states"][0]["state"].values():
        for name in ("exp_avg", "exp_avg_sq"):
            if state[name].shape == (1,):
                state[name] = state[name].reshape(())
                scalars_made += 1
    assert scalars_made == 2 * len(gammas)
    torch.save(checkpoint, path)

    main(["fit", "--config", str(run / "config.yaml"), "--trainer.max_steps", "8", "--ckpt_path", str(path)])
    resumed = torch.load(path, weights_only=True)
    assert resumed["global_step"] == 8
    for key, value in uninterrupted["state_dict"].items():
        torch.testing.assert_close(resumed["state_dict"][key], value, msg=key)
    assert all(resumed["state_dict"][key].shape == (1,) for key in gammas)

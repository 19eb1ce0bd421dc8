"""The stability study end to end: sweeps/stability.yaml at tiny size, and diverged trials recorded as such."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import yaml

from diffexp.compare import main as compare_main
from diffexp.sweep.runner import main as sweep_main
from tests.helpers import REPO, TINY_OVERRIDES, scalars, trials_by_state

STABILITY_COLUMNS = ("vitals/loss_spikes", "vitals/grad_norm_max", "vitals/context_rms", "vitals/attn_sink")


def tiny_spec(tmp_path: Path, raw: dict, **changes) -> Path:
    """`raw` at tiny size (a few steps, diagnostics every 2 of them), run under tmp_path."""
    raw = {**raw, "runs_dir": str(tmp_path / "runs"), **changes}
    raw["overrides"] = {**raw.get("overrides", {}), **TINY_OVERRIDES, "data.cache_dir": str(tmp_path / "cache"),
                        "diagnostics.every_n_steps": 2}
    path = tmp_path / f"{raw['study']}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))  # cases keep their order
    return path


@pytest.fixture
def repo_on_path(monkeypatch):
    """Trial processes import this checkout (and tests.helpers for the injected failure)."""
    monkeypatch.setenv("PYTHONPATH", str(REPO))


@pytest.mark.slow
@pytest.mark.heavy  # python -m pytest -m heavy
def test_stability_sweep_runs_and_compare_shows_the_stability_columns(tmp_path, repo_on_path, capsys):
    raw = yaml.safe_load((REPO / "sweeps/stability.yaml").read_text())
    assert raw["pruner"] == {"type": "none"} and raw["seeds"] == [0, 1]
    assert raw["grid"] == {"model.optim.lr": [2.0e-3, 4.0e-3, 6.67e-3]}
    spec = tiny_spec(tmp_path, raw, seeds=[0])  # one seed: 9 trials of 6 steps
    assert sweep_main(["--config", str(spec)]) == 0
    study = tmp_path / "runs/stability"
    records = [json.loads(p.read_text()) for p in study.glob("*/seed0/trial.json")]
    assert len(records) == 9
    for record in records:
        assert record["state"] == "complete" and record["diverged_step"] is None
        for metric in STABILITY_COLUMNS:
            assert metric in record["metrics"], metric
    logged = scalars(study / "diff-v2-lr-0.00667/seed0")
    for tag in (*STABILITY_COLUMNS, "vitals/layer_00/context_rms", "vitals/layer_00/context_rms/head_00",
                "vitals/layer_00/attn_sink"):
        assert tag in logged, tag

    capsys.readouterr()
    out = tmp_path / "cmp"
    assert compare_main([str(study), "--out", str(out), "--no-plots"]) == 0
    printed = capsys.readouterr().out
    for label in ("Loss spikes", "Max grad norm", "Context RMS", "Attn sink", "Diverged"):
        assert label in printed, label
    rows = list(csv.DictReader((out / "compare.csv").open()))
    assert [r["case"] for r in rows] == [f"{case}, lr={lr}" for case in ("Transformer", "DIFF", "DIFF V2")
                                         for lr in ("0.002", "0.004", "0.00667")]
    for row in rows:
        assert row["n_diverged"] == "0" and row["n_complete"] == "1"
        for metric in STABILITY_COLUMNS:
            assert row[f"{metric}_mean"] != "", (row["case"], metric)
    header = next(line for line in (out / "compare.md").read_text().splitlines() if line.startswith("| Model"))
    assert "| Seeds | Diverged | Tokens/s |" in header and "| Loss spikes |" in header
    assert "| Context RMS |" in header and "| Max grad norm |" in header


@pytest.mark.heavy  # a whole stability sweep (about 50 s)
def test_diverged_trials_are_recorded_not_retried_and_shown(tmp_path, repo_on_path, capsys):
    """A non-finite loss (the run stops with an error) and a loss over the divergence threshold (the run
    stops early) are both results: trial.json state "diverged" at their step, one attempt each, and compare
    counts them in Diverged and leaves them out of the loss means."""
    inject = {"class_path": "tests.helpers.InjectNonFinite",
              "init_args": {"step": 2, "quantity": "train/loss", "weights_path": str(tmp_path / "before.pt")}}
    spec = tiny_spec(tmp_path, {
        "study": "diverging", "base": str(REPO / "recipes/tiny/baseline.yaml"), "seeds": [0],
        "cases": {"stable": {}, "NaN loss": {"trainer.callbacks+": inject},
                  "over threshold": {"diagnostics.divergence_factor": 0.5}}})  # 0.5 x ln 257 < the first loss
    assert sweep_main(["--config", str(spec)]) == 0
    err = capsys.readouterr().err
    assert "diverged at step 2 (train/loss is inf); recorded as diverged, not retried" in err
    assert "2 diverged" in err
    study = tmp_path / "runs/diverging"
    nan = json.loads((study / "nan-loss/seed0/trial.json").read_text())
    assert (nan["state"], nan["diverged_step"], nan["divergence"]) == ("diverged", 2, "train/loss is inf")
    threshold = json.loads((study / "over-threshold/seed0/trial.json").read_text())
    assert (threshold["state"], threshold["diverged_step"]) == ("diverged", 0)
    assert threshold["divergence"].startswith("train/loss ") and "(0.5 x ln 257)" in threshold["divergence"]
    assert threshold["global_step"] == 1  # stopped right after the step that diverged
    assert json.loads((study / "stable/seed0/trial.json").read_text())["diverged_step"] is None
    assert scalars(study / "nan-loss/seed0")["vitals/diverged_step"] == [(2, 2.0)]
    assert scalars(study / "over-threshold/seed0")["vitals/diverged_step"][-1][1] == 0.0

    # one attempt each, finished: a second sweep run has nothing left to do
    url = f"sqlite:///{study / 'study.db'}"
    states = trials_by_state(url, "diverging")
    assert states["nan-loss/seed0"] == {"PRUNED": 1} and states["over-threshold/seed0"] == {"PRUNED": 1}
    assert states["stable/seed0"] == {"COMPLETE": 1}
    assert sweep_main(["--config", str(spec)]) == 0
    assert trials_by_state(url, "diverging") == states
    assert [p.name for p in (study / "nan-loss/seed0").glob("trial-*.log")] == ["trial-1.log"]

    capsys.readouterr()
    out = tmp_path / "cmp"
    assert compare_main([str(study), "--out", str(out), "--no-plots"]) == 0
    printed = capsys.readouterr().out
    assert "Diverged trials" in printed
    assert "NaN loss, seed 0: diverged at step 2 (train/loss is inf)" in printed
    rows = {r["case"]: r for r in csv.DictReader((out / "compare.csv").open())}
    assert [(c, rows[c]["n_diverged"], rows[c]["diverged_steps"]) for c in rows] == [
        ("stable", "0", ""), ("NaN loss", "1", "2"), ("over threshold", "1", "0")]
    assert rows["NaN loss"]["val/loss_mean"] == "" and rows["stable"]["val/loss_mean"] != ""
    # the diagnostics of a diverged run are kept: how it went unstable is what they are for
    assert rows["over threshold"]["vitals/loss_spikes_n"] == "1"
    md = (out / "compare.md").read_text()
    assert "| NaN loss |" in md and "| 0/1 (1 diverged) | 1/1 |" in md
    assert "excluded from the loss and result means" in md

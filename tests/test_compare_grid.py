"""A study of cases crossed with a grid (sweeps/softmax_constraint_lr_tiny.yaml: six designs x six learning rates):
sweep.json records one view per grid point, and compare sets each case against the reference case at the same
point, seed by seed, and tabulates the objective, the divergences and the spikes case by grid point."""

from __future__ import annotations

import csv
import io
import json
import math

import numpy as np
from rich.console import Console
from scipy.stats import t as student_t

from diffexp import compare
from diffexp.model.attention.registry import reference_variant
from diffexp.sweep.spec import parse_spec, slugify
from tests.fixtures_compare import write_trial
from tests.helpers import REPO, markdown_tables

SEEDS = [0, 1, 2]
LRS = ["0.002", "1.0"]
#: (case, lr) -> per seed: a final val/loss, or "diverged"
VALUES = {("Transformer", "0.002"): [1.85, 1.87, 1.83],
          ("Transformer", "1.0"): [2.90, "diverged", 2.95],
          ("Gated", "0.002"): [1.82, 1.85, 1.80],
          ("Gated", "1.0"): [2.40, 2.52, 2.47]}


def test_a_grid_with_two_or_more_cases_has_one_view_per_grid_point():
    spec = parse_spec({"study": "s", "base": "recipes/tiny/baseline.yaml",
                       "cases": {"Transformer": {}, "Gated": {"model.arch.attention": "gated"}},
                       "grid": {"model.optim.lr": [2.0e-3, 1.0]}, "seeds": [0]}, repo_root=REPO)
    assert spec.grid_views() == {"lr=0.002": {"Transformer": "Transformer, lr=0.002", "Gated": "Gated, lr=0.002"},
                                 "lr=1.0": {"Transformer": "Transformer, lr=1.0", "Gated": "Gated, lr=1.0"}}
    one_case = parse_spec({"study": "s", "base": "recipes/tiny/baseline.yaml", "grid": {"model.optim.lr": [1.0]},
                           "seeds": [0]}, repo_root=REPO)
    assert one_case.grid_views() is None  # nothing to set against anything at a point


def _study(root):
    study = root / "grid"
    study.mkdir(parents=True)
    names = [f"{case}, lr={lr}" for case in ("Transformer", "Gated") for lr in LRS]
    views = {f"lr={lr}": {case: f"{case}, lr={lr}" for case in ("Transformer", "Gated")} for lr in LRS}
    attention = {"Transformer": reference_variant().name, "Gated": "gated"}
    (study / "sweep.json").write_text(json.dumps({
        "study": "grid", "spec": "sweeps/grid.yaml", "seeds": SEEDS, "views": views,
        "cases": [{"name": n, "slug": slugify(n), "overrides": {"model.arch.attention": attention[n.split(",")[0]]}}
                  for n in names],
        "objective": {"metric": "val/loss", "direction": "minimize"}}))
    for (case, lr), per_seed in VALUES.items():
        name = f"{case}, lr={lr}"
        for seed, value in enumerate(per_seed):
            spikes = 2.0 if lr == "1.0" else 0.0
            if value == "diverged":
                write_trial(study, name, slugify(name), seed, {"train/loss": 9.5, "vitals/loss_spikes": 5.0},
                            state="diverged", global_step=120)
            else:
                write_trial(study, name, slugify(name), seed, {"val/loss": value, "vitals/loss_spikes": spikes})
        record_variant(study, name, attention[case])
    return study


def record_variant(study, name, variant):
    for path in (study / slugify(name)).glob("*/trial.json"):
        record = json.loads(path.read_text())
        record["overrides"]["model.arch.attention"] = variant
        path.write_text(json.dumps(record))


def test_each_case_is_set_against_the_reference_at_the_same_grid_point(tmp_path):
    study = _study(tmp_path)
    buffer = io.StringIO()
    compare.compare(study, out=tmp_path / "out", plots=False, console=Console(file=buffer, width=220,
                                                                                color_system=None))
    with open(tmp_path / "out" / "paired.csv", newline="") as f:
        paired = {(r["view"], r["case"]): r for r in csv.DictReader(f)}
    assert paired[("lr=1.0", "Gated, lr=1.0")]["paired_reference"] == "Transformer, lr=1.0"
    assert paired[("lr=0.002", "Gated, lr=0.002")]["paired_reference"] == "Transformer, lr=0.002"
    # at lr=1.0 the pairs are the seeds both finished: 0 and 2 (Transformer's seed 1 diverged)
    row = paired[("lr=1.0", "Gated, lr=1.0")]
    assert row["paired_seeds"] == "0;2"
    diffs = np.array([2.40 - 2.90, 2.47 - 2.95])
    half = student_t.ppf(0.975, 1) * diffs.std(ddof=1) / math.sqrt(2)
    assert float(row["paired_diff_mean"]) == diffs.mean()
    assert abs(float(row["paired_diff_low"]) - (diffs.mean() - half)) < 1e-9
    diffs = np.array(VALUES[("Gated", "0.002")]) - np.array(VALUES[("Transformer", "0.002")])
    assert abs(float(paired[("lr=0.002", "Gated, lr=0.002")]["paired_diff_mean"]) - diffs.mean()) < 1e-12
    # the grid tables, case by grid point, printed and in compare.md
    text = buffer.getvalue()
    assert "Paired differences vs Transformer, lr=1.0: val/loss" in text and "lr=1.0, lr=1.0" not in text
    assert "val/loss by grid point" in text and "(1/3 diverged)" in text and "Loss spikes by grid point" in text
    tables = markdown_tables((tmp_path / "out" / "compare.md").read_text())
    grid = next(t for t in tables if t[0] == ["Case", "lr=0.002", "lr=1.0"])
    assert grid[1] == ["Transformer", "1.850", "2.925 (1/3 diverged)"]
    assert grid[2] == ["Gated", "1.823", "2.463"]
    spikes = [t for t in tables if t[0] == ["Case", "lr=0.002", "lr=1.0"]][1]
    assert spikes[1] == ["Transformer", "0.000", "3.000"]  # the diverged seed's 5 spikes count: (2 + 5 + 2) / 3


def test_the_grid_plot_is_drawn_for_a_grid_study_only(tmp_path):
    study = _study(tmp_path)
    compare.compare(study, out=tmp_path / "out", console=Console(file=io.StringIO(), width=220))
    assert (tmp_path / "out" / "grid.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "out" / "paired_diffs-lr-1.0.png").is_file()
    views_gone = json.loads((study / "sweep.json").read_text())
    del views_gone["views"]
    (study / "sweep.json").write_text(json.dumps(views_gone))
    compare.compare(study, out=tmp_path / "plain", console=Console(file=io.StringIO(), width=220))
    assert not (tmp_path / "plain" / "grid.png").exists()

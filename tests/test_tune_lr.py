"""A fair lr per case from one spec (`tune_lr:`): the short runs at every lr pick each case's best, the comparison
runs each case at the spec's lr and at its best, and compare shows both views with their paired differences."""

from __future__ import annotations

import csv
import io
import json
import math
import sys

import numpy as np
import pytest
import yaml
from rich.console import Console

from diffexp import compare
from diffexp.compare.paired import BETTER, NOISE, WORSE
from diffexp.sweep import check
from diffexp.sweep import runner as sweep_runner
from diffexp.sweep.layout import SWEEP_FILE
from diffexp.sweep.runs import load_study_runs
from diffexp.sweep.spec import LR_KEY, SpecError, parse_spec
from diffexp.sweep.tune import BEST_LR, BEST_SUFFIX, SAME_LR, best_lrs, final_spec, tuning_spec
from tests.fixtures_compare import write_loss_table
from tests.helpers import REPO, TINY_OVERRIDES, markdown_tables

CASES = {"Transformer": {}, "DIFF": {"base": "recipes/tiny/diff_v1.yaml"}}
TUNE = {"values": [1.0e-3, 2.0e-3, 4.0e-3], "overrides": {"trainer.max_steps": 3}}


def spec_of(**extra):
    raw = {"study": "fair", "base": str(REPO / "recipes/tiny/baseline.yaml"), "cases": CASES, "seeds": [0, 1, 2],
           "tune_lr": TUNE, **extra}
    return parse_spec(raw, repo_root=REPO)


def test_the_tuning_stage_tries_every_case_at_every_lr_on_the_short_budget():
    tuning = tuning_spec(spec_of(overrides={"trainer.max_steps": 400}))
    assert tuning.study == "fair-lr" and tuning.seeds == [0]  # default: the spec's first seed
    assert [(label, overrides[LR_KEY]) for label, overrides in tuning.rows()] == [
        (f"{case}, lr={lr}", lr) for case in CASES for lr in TUNE["values"]]
    assert tuning.overrides == {"trainer.max_steps": 3}  # the short budget over the spec's
    assert tuning.base_of("DIFF").name == "diff_v1.yaml" and tuning.tune_lr is None


def test_each_case_gets_the_lr_whose_mean_is_best_and_a_row_at_it():
    spec = spec_of(tune_lr={**TUNE, "seeds": [0, 1]})
    tuning = tuning_spec(spec)
    loss = {("Transformer", 1e-3): [2.3, 2.5], ("Transformer", 2e-3): [2.1, 2.2], ("Transformer", 4e-3): [2.2, 2.1],
            ("DIFF", 1e-3): [2.4, 2.4], ("DIFF", 2e-3): [2.3, math.nan], ("DIFF", 4e-3): [2.0, 2.1]}
    results = {p.key: loss[(case, float(p.overrides[LR_KEY]))][p.seed]
               for p in tuning.points() for case in CASES if p.case.startswith(case + ",")}
    del results[next(p.key for p in tuning.points() if p.case == "DIFF, lr=0.001" and p.seed == 1)]  # unfinished
    best, means = best_lrs(tuning, results)
    # Transformer: 2e-3 and 4e-3 tie at 2.15, the first tried wins; DIFF: 2e-3's NaN seed is left out
    assert best == {"Transformer": 2e-3, "DIFF": 4e-3}
    assert means["DIFF"] == pytest.approx({1e-3: 2.4, 2e-3: 2.3, 4e-3: 2.05})
    final = final_spec(spec, best, means, tuning.study_dir)
    # the recipes' lr is 2e-3: the Transformer's row is its best-lr row too; DIFF gets one at 4e-3
    assert list(final.cases) == ["Transformer", "DIFF", "DIFF" + BEST_SUFFIX]
    assert final.cases["DIFF" + BEST_SUFFIX] == {LR_KEY: 4e-3}
    assert final.base_of("DIFF" + BEST_SUFFIX).name == "diff_v1.yaml"
    assert final.views == {SAME_LR: {"Transformer": "Transformer", "DIFF": "DIFF"},
                           BEST_LR: {"Transformer": "Transformer", "DIFF": "DIFF" + BEST_SUFFIX}}
    assert final.tuned["spec_lr"] == {"Transformer": 2e-3, "DIFF": 2e-3}
    assert final.fingerprint() != spec.fingerprint()


def test_a_case_with_no_finished_lr_is_named():
    tuning = tuning_spec(spec_of())
    results = {p.key: 2.0 for p in tuning.points() if p.case.startswith("Transformer")}
    with pytest.raises(SpecError, match="no learning rate of case\\(s\\) 'DIFF' finished"):
        best_lrs(tuning, results)


@pytest.mark.parametrize("change, message", [
    ({"tune_lr": {"values": [1e-3]}}, "tune_lr.values=[0.001]: expected a list of 2 or more distinct positive"),
    ({"tune_lr": {"values": [1e-3, -1e-3]}}, "expected a list of 2 or more distinct positive learning rates"),
    ({"tune_lr": {"values": [1e-3, 2e-3], "budget": 3}}, "tune_lr: unknown key(s) 'budget'"),
    ({"tune_lr": {"values": [1e-3, 2e-3], "overrides": {LR_KEY: 1e-3}}}, "'model.optim.lr' is what tune_lr.values"),
    ({"tune_lr": {"values": [1e-3, 2e-3], "seeds": [1, 1]}}, "tune_lr.seeds=[1, 1]: expected a non-empty list"),
    ({"tune_lr": [1e-3, 2e-3]}, "tune_lr=[0.001, 0.002] has the wrong type"),
    ({"grid": {"model.arch.n_layers": [1, 2]}}, "tune_lr cannot be combined with `grid` or `search`"),
])
def test_a_bad_tune_lr_block_is_refused_naming_the_key(change, message):
    with pytest.raises(SpecError) as err:
        spec_of(**change)
    assert message in str(err.value)


def _write_tuned_study(root):
    """Transformer and DIFF at the same lr (DIFF 0.05 worse on every seed, a large seed effect), and DIFF at its
    best lr (0.003 from the Transformer, within the noise of the differences)."""
    seed_effect = np.array([0.0, 0.07, -0.05])
    base = 2.0 + seed_effect
    losses = {("Transformer", "transformer"): dict(enumerate(base)),
              ("DIFF", "diff"): dict(enumerate(base + 0.05 + np.array([0.001, -0.002, 0.001]))),
              ("DIFF @ best lr", "diff-best-lr"): dict(enumerate(base + 0.003 + np.array([0.01, -0.012, 0.006])))}
    study = write_loss_table(root / "fair", losses, [0, 1, 2])
    sweep = json.loads((study / SWEEP_FILE).read_text())
    sweep["views"] = {SAME_LR: {"Transformer": "Transformer", "DIFF": "DIFF"},
                      BEST_LR: {"Transformer": "Transformer", "DIFF": "DIFF @ best lr"}}
    sweep["tuned"] = {"study_dir": "runs/fair-lr", "key": LR_KEY, "values": [1e-3, 2e-3, 4e-3], "seeds": [0],
                      "overrides": {"trainer.max_steps": 100}, "best": {"Transformer": 2e-3, "DIFF": 4e-3},
                      "means": {"Transformer": {"0.001": 2.3, "0.002": 2.1, "0.004": 2.2},
                                "DIFF": {"0.001": 2.5, "0.002": 2.2, "0.004": 2.12}},
                      "spec_lr": {"Transformer": 2e-3, "DIFF": 2e-3}}
    (study / SWEEP_FILE).write_text(json.dumps(sweep))
    return study


def test_compare_shows_the_same_lr_and_the_best_lr_views(tmp_path):
    study = _write_tuned_study(tmp_path)
    buffer = io.StringIO()
    compare.compare(study, out=tmp_path / "out", console=Console(file=buffer, width=200, color_system=None))
    printed = buffer.getvalue()
    same = printed[printed.index("Paired differences vs Transformer, same lr"):]
    best = printed[printed.index("Paired differences vs Transformer, best lr"):]
    assert WORSE in next(line for line in same.splitlines() if line.strip().startswith("DIFF "))
    assert NOISE in next(line for line in best.splitlines() if line.strip().startswith("DIFF @ best lr"))
    lr_table = printed[printed.index("Learning rate per case"):]
    lr_row = next(line for line in lr_table.splitlines() if line.startswith("│ DIFF "))
    assert [c.strip() for c in lr_row.split("│")[1:-1]] == ["DIFF", "2.5000", "2.2000", "2.1200", "0.002", "0.004"]
    md = (tmp_path / "out" / "compare.md").read_text()
    assert "## Learning rate per case" in md and "## Paired differences, best lr" in md
    assert len(markdown_tables(md)) == 4  # the comparison, the lr per case, the paired differences of each view
    assert "| Valid loss ↓ | Δ vs" not in md  # the paired columns are per view, not in the main table
    with open(tmp_path / "out" / "paired.csv", newline="") as f:
        records = {(r["view"], r["case"]): r for r in csv.DictReader(f)}
    assert records[(SAME_LR, "DIFF")]["paired_verdict"] == WORSE
    assert float(records[(SAME_LR, "DIFF")]["paired_diff_mean"]) == pytest.approx(0.05)
    assert records[(BEST_LR, "DIFF @ best lr")]["paired_verdict"] == NOISE
    assert records[(BEST_LR, "Transformer")]["paired_verdict"] == "reference"
    for view in ("same-lr", "best-lr"):
        assert (tmp_path / "out" / f"paired_diffs-{view}.png").read_bytes()[:4] == b"\x89PNG"
    # --reference names the case, whichever row it has in a view
    compare.compare(study, out=tmp_path / "ref", plots=False, reference="DIFF",
                    console=Console(file=io.StringIO(), width=200))
    with open(tmp_path / "ref" / "paired.csv", newline="") as f:
        records = {(r["view"], r["case"]): r for r in csv.DictReader(f)}
    assert records[(BEST_LR, "Transformer")]["paired_reference"] == "DIFF @ best lr"
    assert records[(SAME_LR, "Transformer")]["paired_verdict"] == BETTER


FAKE_FIT = """
import json, math, sys, pathlib
run_dir, case, seed, lr = pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
best = 4e-3 if case.startswith("DIFF") else 2e-3  # each case's loss is lowest at its own lr
loss = 2.0 + (math.log(lr / best)) ** 2 + 0.03 * seed + (0.01 if case.startswith("DIFF") else 0.0)
run_dir.mkdir(parents=True, exist_ok=True)
(run_dir / "trial.json").write_text(json.dumps({"case": case, "seed": seed, "state": "complete", "global_step": 6,
    "metrics": {"val/loss": loss}, "params": {"total": 1000, "non_embedding": 900}, "tokens_per_s": 1.0}))
"""


def test_one_spec_runs_both_stages_end_to_end_with_a_stand_in_for_fit(tmp_path, monkeypatch):
    """The orchestration (both studies, the best lr read back, sweep.json's views, compare), fit replaced by a
    script whose loss is lowest at 2e-3 for the Transformer and at 4e-3 for DIFF."""
    def command(self, trial, point, run_dir, resume):
        lr = {**self.spec.overrides, **point.overrides}.get(LR_KEY, 2e-3)
        return [sys.executable, "-c", FAKE_FIT, str(run_dir), point.case, str(point.seed), str(lr)]

    monkeypatch.setattr(sweep_runner.SweepRunner, "_command", command)
    monkeypatch.setattr(check, "refused_trials", lambda spec: check.Refused())  # the real check: the heavy test
    path = tmp_path / "fair.yaml"
    path.write_text(yaml.safe_dump({"study": "fair", "base": str(REPO / "recipes/tiny/baseline.yaml"),
                                    "runs_dir": str(tmp_path / "runs"), "cases": CASES, "seeds": [0, 1],
                                    "tune_lr": TUNE}, sort_keys=False))
    assert sweep_runner.main(["--config", str(path)]) == 0
    runs = load_study_runs(tmp_path / "runs" / "fair", curves=False)
    assert [c.name for c in runs.cases] == ["Transformer", "DIFF", "DIFF @ best lr"]
    assert runs.tuned["best"] == {"Transformer": 2e-3, "DIFF": 4e-3}
    assert (tmp_path / "runs" / "fair-lr" / "diff-lr-0.004" / "seed0" / "trial.json").is_file()
    best_row = runs.trials[("diff-best-lr", 1, 0)]
    assert best_row.metrics["val/loss"] == pytest.approx(2.0 + 0.03 + 0.01)
    compare.compare(runs.study_dir, out=tmp_path / "out", plots=False, console=Console(file=io.StringIO()))
    assert (tmp_path / "out" / "paired.csv").is_file()


@pytest.mark.heavy
def test_the_fair_lr_sweep_runs_end_to_end_at_tiny_size(tmp_path):
    """Real fits: 2 cases x 2 lrs x 1 seed on 3 steps, then each case on 4 steps at the recipes' lr and at its
    best, 2 seeds; compare reads both views."""
    overrides = {**TINY_OVERRIDES, "trainer.max_steps": 4, "trainer.val_check_interval": 2,
                 "data.cache_dir": str(tmp_path / "cache")}
    path = tmp_path / "fair.yaml"
    path.write_text(yaml.safe_dump({
        "study": "fair", "base": str(REPO / "recipes/tiny/baseline.yaml"), "runs_dir": str(tmp_path / "runs"),
        "cases": CASES, "seeds": [0, 1], "overrides": overrides,
        "tune_lr": {"values": [1e-4, 2e-3], "overrides": {"trainer.max_steps": 3, "trainer.val_check_interval": 3}}}))
    assert sweep_runner.main(["--config", str(path)]) == 0
    runs = load_study_runs(tmp_path / "runs" / "fair", curves=False)
    assert set(runs.tuned["best"]) == {"Transformer", "DIFF"}
    assert all(t.state == "complete" for t in runs.trials.values())
    buffer = io.StringIO()
    compare.compare(runs.study_dir, out=tmp_path / "out", plots=False, console=Console(file=buffer, width=200))
    assert "Paired differences vs Transformer, best lr" in buffer.getvalue()

"""`diffexp compare` gathers the harness.json of each trial into the LM-Eval table."""

from __future__ import annotations

import csv
import json
import statistics

import pytest

from diffexp import compare
from tests.fixtures_compare import write_sweep, write_trial
from tests.helpers import markdown_tables

SCORES = {  # case slug -> seed -> task -> acc
    "baseline": {0: {"arc_easy": 0.50, "piqa": 0.60}, 1: {"arc_easy": 0.54, "piqa": 0.64}},
    "diff_v1": {0: {"arc_easy": 0.56, "piqa": 0.61}, 1: {"arc_easy": 0.58}},
}


def make_harness_study(root):
    study = root / "harness-study"
    cases = [("Transformer", "baseline"), ("DIFF", "diff_v1")]
    write_sweep(study, cases, seeds=[0, 1])
    for name, slug in cases:
        for seed in (0, 1):
            trial = write_trial(study, name, slug, seed, {"val/loss": 3.0 + seed * 0.01})
            (trial / "eval").mkdir()
            tasks = {task: {"acc": acc, "acc_stderr": 0.01, "acc_norm": acc + 0.1}
                     for task, acc in SCORES[slug][seed].items()}
            (trial / "eval/harness.json").write_text(json.dumps({"tasks": tasks, "step": 400}))
    return study


def test_compare_adds_the_harness_table(tmp_path, capsys):
    study = make_harness_study(tmp_path)
    compare.compare(study, plots=False)
    markdown = (study / "compare/compare.md").read_text()
    assert markdown_tables(markdown)[1][0][0] == "Case"  # the comparison's table, then the harness's
    assert "## LM-Eval harness (acc, %, mean ± std over seeds)" in markdown
    markdown = markdown.split("## LM-Eval harness")[1]
    base_easy = [0.50, 0.54]
    row = next(line for line in markdown.splitlines() if line.startswith("| Transformer |") and "±" in line)
    mean, std = 100 * statistics.fmean(base_easy), 100 * statistics.stdev(base_easy)
    assert f"{mean:.1f} ± {std:.1f}" in row
    # the average covers the tasks every case has: DIFF has piqa from one seed only, still a value
    assert row.endswith(f"| {100 * statistics.fmean([0.52, 0.62]):.1f} |")
    diff = next(line for line in markdown.splitlines() if line.startswith("| DIFF |") and "57.0" in line)
    assert "| 61.0 |" in diff  # one seed: no spread shown
    with open(study / "compare/harness.csv") as f:
        rows = list(csv.DictReader(f))
    easy = next(r for r in rows if r["case"] == "DIFF" and r["task"] == "arc_easy")
    assert float(easy["mean"]) == pytest.approx(statistics.fmean([0.56, 0.58])) and easy["seeds"] == "2"
    assert "LM-Eval harness" in capsys.readouterr().out


def test_the_harness_metric_can_be_chosen(tmp_path):
    study = make_harness_study(tmp_path)
    compare.compare(study, plots=False, harness_metric="acc_norm")
    markdown = (study / "compare/compare.md").read_text()
    assert "## LM-Eval harness (acc_norm" in markdown and "62.0 ± 2.8" in markdown


def test_no_table_without_harness_results(tmp_path):
    study = tmp_path / "plain"
    write_sweep(study, [("Transformer", "baseline")], seeds=[0])
    write_trial(study, "Transformer", "baseline", 0, {"val/loss": 3.0})
    compare.compare(study, plots=False)
    assert "LM-Eval" not in (study / "compare/compare.md").read_text()
    assert not (study / "compare/harness.csv").exists()

"""compare reads the run directories the sweep runner writes, and shows the attention variant each case ran."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
import yaml

from diffexp import compare
from diffexp.sweep import layout, parse_spec
from diffexp.sweep.command import fit_args
from tests.fixtures_compare import write_sweep, write_trial
from tests.helpers import REPO


def _logger_dir(args: list[str]) -> Path:
    """The directory TensorBoardLogger writes a trial to, from the runner's `diffexp fit` arguments."""
    value = {k: v for k, _, v in (a[2:].partition("=") for a in args if a.startswith("--trainer.logger.init_args."))}
    prefix = "trainer.logger.init_args."
    return Path(value[prefix + "save_dir"]) / value[prefix + "name"] / value[prefix + "version"]


def test_trial_dirs_the_runner_writes_are_the_ones_compare_reads(tmp_path):
    """Regression: search draws were written as seed<k>-draw<d> but read as ^seed(\\d+)$, so compare counted
    every draw but the first as missing and listed the real ones as unexpected."""
    from diffexp.sweep.runner import SweepRunner

    spec = parse_spec({
        "study": "lr", "base": str(REPO / "recipes/tiny/diff_v1.yaml"), "runs_dir": str(tmp_path / "runs"),
        "cases": {"A": {}, "B": {"model.arch.head_norm": False}}, "seeds": [0, 3], "n_trials": 3,
        "search": {"model.optim.lr": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True}}})
    SweepRunner(spec)._write_sweep_json()  # the runner's own sweep.json (its storage: a SQLite file in runs/)
    written = []
    for point in spec.points():
        trial_dir = _logger_dir(fit_args(spec, point, point.overrides))
        assert trial_dir == layout.trial_dir(spec.study_dir, point.slug, point.seed, point.draw)
        trial_dir.mkdir(parents=True)
        (trial_dir / layout.TRIAL_FILE).write_text(json.dumps({"state": "complete", "metrics": {"val/loss": 2.0}}))
        written.append(trial_dir.name)
    assert {"seed0", "seed0-draw1", "seed0-draw2", "seed3", "seed3-draw2"} <= set(written)
    (spec.study_dir / "a" / "seed0.crashed-1700000000").mkdir()  # a crashed run moved aside is not a trial

    runs = compare.load_study_runs(spec.study_dir, curves=False)
    assert runs.draws == 3 and runs.unexpected == []
    assert all(trial.state == "complete" for trial in runs.trials.values())
    rows = compare.summarize(runs)
    assert [(r.case.name, len(r.complete), r.n_expected) for r in rows] == [("A", 6, 6), ("B", 6, 6)]
    assert layout.parse_run_name("seed0-draw2") == (0, 2) and layout.parse_run_name("seed0-draw0") is None


def _print(study: Path, tmp_path: Path, width: int = 200) -> str:
    from rich.console import Console

    buffer = io.StringIO()
    compare.compare(study, out=tmp_path / "out", plots=False, console=Console(file=buffer, width=width,
                                                                                color_system=None))
    return buffer.getvalue()


def _edit_trial(trial_dir: Path, **fields) -> None:
    path = trial_dir / layout.TRIAL_FILE
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def _csv(tmp_path: Path) -> list[dict[str, str]]:
    with open(tmp_path / "out" / "compare.csv", newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("recorded_in", ["trial.json", "config.yaml"])
def test_each_case_shows_the_attention_variant_its_runs_used(tmp_path, recorded_in):
    study = tmp_path / "toy"
    write_sweep(study, [("Toy", "toy"), ("Base", "base"), ("Later", "later")], [0])
    toy = write_trial(study, "Toy", "toy", 0, {"val/loss": 1.5})
    if recorded_in == "trial.json":
        _edit_trial(toy, overrides={"model.arch.attention": "toy_variant", "seed_everything": 0})
    else:  # a case that keeps the base recipe's attention: only the saved config names it
        _edit_trial(toy, overrides={"seed_everything": 0})
        (toy / "config.yaml").write_text(yaml.safe_dump(
            {"model": {"class_path": "diffexp.training.LitLM", "init_args": {"arch": {"attention": "toy_variant"}}}}))
    write_trial(study, "Base", "base", 0, {"val/loss": 1.6})

    printed = _print(study, tmp_path)
    header = next(line for line in printed.splitlines() if "┃ Case" in line)
    assert "Variant" in header
    toy_line = next(line for line in printed.splitlines() if line.startswith("│ Toy "))
    assert "toy_variant" in toy_line and "1.500 ± n/a" in toy_line
    assert "base" in next(line for line in printed.splitlines() if line.startswith("│ Base "))
    md = (tmp_path / "out" / "compare.md").read_text()
    assert md.splitlines()[4].endswith("| Seeds | Tokens/s | Variant |")
    assert "| Toy |" in md and md.split("| Toy |")[1].splitlines()[0].endswith("| toy_variant |")
    # a case that has not run yet shows what sweep.json plans for it
    assert [(r["case"], r["variant"]) for r in _csv(tmp_path)] == [
        ("Toy", "toy_variant"), ("Base", "base"), ("Later", "later")]


def test_no_variant_column_when_the_runs_do_not_name_one(tmp_path):
    study = tmp_path / "plain"
    write_sweep(study, [("A", "a")], [0])
    sweep = json.loads((study / layout.SWEEP_FILE).read_text())
    sweep["cases"][0]["overrides"] = {}
    (study / layout.SWEEP_FILE).write_text(json.dumps(sweep))
    _edit_trial(write_trial(study, "A", "a", 0, {"val/loss": 1.5}), overrides={"seed_everything": 0})

    assert "Variant" not in _print(study, tmp_path)
    assert "Variant" not in (tmp_path / "out" / "compare.md").read_text()
    assert _csv(tmp_path)[0]["variant"] == ""

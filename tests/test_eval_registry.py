"""An evaluation defined in this file alone reaches every part of diffexp through its registry entry.

`toy_probe` scores the mean of the model's largest next-token probability over a few fixed rows, times a
`scale` option. Nothing outside this file knows it: registered for the length of a test, it is listed by
`diffexp eval --help`, gets `--scale` and `--rows` from its dataclass (with fit's error form), runs on a
checkpoint into the run's eval/ and TensorBoard, scores during a fit as a callback, and is a sweep objective
and a compare column.
"""

from __future__ import annotations

import csv
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from diffexp.cli import main
from diffexp.evals.registry import EXTERNAL, Context, Evaluation, option, register, unregister
from diffexp.model.config import ModelConfig
from tests.helpers import save_untrained_checkpoint, write_spec

REPO = Path(__file__).resolve().parents[1]
TOY = "toy_probe"


@dataclass
class ToyOptions:
    scale: float = option(1.0, "multiplies the score")
    rows: int = option(2, "rows of fixed tokens scored", minimum=1)


@dataclass
class ToyResults:
    value: float
    name: str = TOY

    def scalars(self) -> dict[str, float]:
        return {"toy_probe/confidence": self.value}

    def summary(self) -> str:
        return f"toy confidence {self.value:.6f}"

    def save(self, directory) -> Path:
        path = Path(directory) / f"{self.name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.scalars()))
        return path


def toy_inputs(options: ToyOptions, context: Context) -> torch.Tensor:
    vocab, length = context.arch["vocab_size"], min(16, context.arch["max_seq_len"])
    return torch.arange(options.rows * length).remainder(vocab).view(options.rows, length)


def toy_score(model, tokens: torch.Tensor, options: ToyOptions, context: Context) -> ToyResults:
    with torch.no_grad():
        logits = model(tokens.to(context.device))
    return ToyResults(options.scale * logits.softmax(-1).amax(-1).mean().item())


TOY_ENTRY = Evaluation(name=TOY, summary="the toy's mean top-1 probability", paper="none (a test)",
                       options=ToyOptions, inputs=toy_inputs, score=toy_score, tags=("toy_probe/",))


@pytest.fixture
def toy():
    yield register(TOY_ENTRY)
    unregister(TOY)


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    path = tmp_path / "run" / "version_0" / "checkpoints" / "last.ckpt"
    save_untrained_checkpoint(ModelConfig(attention="baseline", vocab_size=64, d_model=32, n_layers=1, n_heads=2,
                                          max_seq_len=32), path)
    return path


def run(args, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_:
        main(["eval", *args])
    captured = capsys.readouterr()
    return exit_.value.code, captured.out + captured.err


def test_listed_with_its_options_from_the_dataclass(toy, capsys):
    code, out = run(["--help"], capsys)
    assert code == 0 and any(line.split()[:1] == [TOY] for line in out.splitlines())
    code, out = run([TOY, "--help"], capsys)
    assert code == 0 and "--scale" in out and "--rows" in out and "multiplies the score" in out


@pytest.mark.parametrize("args, message", [
    (["--rows", "0"], "--rows=0 is invalid: expected a positive integer"),
    (["--rows", "two"], "--rows='two' is invalid: expected an integer"),
    (["--scales", "2"], "--scales"),
])
def test_bad_options_are_refused_before_anything_is_written(toy, checkpoint, capsys, args, message):
    code, out = run([TOY, str(checkpoint), *args], capsys)
    assert code == 2 and message in out and "Traceback" not in out
    assert not (checkpoint.parent.parent / "eval").exists()


def test_scores_a_checkpoint_into_the_run(toy, checkpoint, capsys):
    from diffexp.sweep.events import scalar_events
    from diffexp.training.loading import load_checkpoint, load_model

    code, out = run([TOY, str(checkpoint), "--scale", "2", "--device", "cpu"], capsys)
    assert code == 0
    model = load_model(load_checkpoint(str(checkpoint))[0], str(checkpoint), "cpu")
    expected = 2 * toy_score(model, toy_inputs(ToyOptions(rows=2), Context(model.arch.__dict__, {}, 0)),
                             ToyOptions(), Context({}, {}, 0)).value
    saved = json.loads((checkpoint.parent.parent / "eval" / f"{TOY}.json").read_text())
    assert saved["toy_probe/confidence"] == pytest.approx(expected) and f"{expected:.6f}" in out
    events = scalar_events(checkpoint.parent.parent)  # the run's own TensorBoard, at the checkpoint's step
    assert [value for _, _, value in events["toy_probe/confidence"]] == pytest.approx([expected])


def test_a_fit_callback_a_sweep_objective_and_a_compare_column(toy, tmp_path, monkeypatch):
    from diffexp.compare import main as compare_main
    from diffexp.sweep.runner import main as sweep_main

    monkeypatch.chdir(tmp_path)
    # the sweep runs each trial as its own `diffexp fit` process: there the entry comes from DIFFEXP_EVALUATIONS
    monkeypatch.setenv(EXTERNAL, f"{__name__}:TOY_ENTRY")
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    callback = {"class_path": "diffexp.evals.Evaluate",
                "init_args": {"evaluation": TOY, "options": {"scale": 3.0}, "every_n_validations": 1}}
    spec = write_spec(tmp_path, "toy", grid={}, cases={"DIFF": {}}, seeds=[0],
                      objective={"metric": "toy_probe/confidence", "direction": "maximize"})
    import yaml

    raw = yaml.safe_load(spec.read_text())
    raw["overrides"]["trainer.callbacks"] = [callback]
    spec.write_text(yaml.safe_dump(raw))
    assert sweep_main(["--config", str(spec)]) == 0
    (record_path,) = (tmp_path / "runs/toy").glob("*/*/trial.json")
    record = json.loads(record_path.read_text())
    value = record["metrics"]["toy_probe/confidence"]
    assert 0 < value <= 3.0  # scale 3 times a probability
    step = record["global_step"]
    assert (record_path.parent / TOY / f"step{step:06d}" / f"{TOY}.json").is_file()
    assert compare_main([str(tmp_path / "runs/toy"), "--out", str(tmp_path / "cmp"), "--no-plots"]) == 0
    (row,) = csv.DictReader((tmp_path / "cmp/compare.csv").open())
    assert float(row["toy_probe/confidence_mean"]) == pytest.approx(value)


def test_no_other_file_names_the_toy():
    found = subprocess.run(["grep", "-rl", TOY, str(REPO / "diffexp"), str(REPO / "recipes"), str(REPO / "sweeps"),
                            str(REPO / "docs")], capture_output=True, text=True)
    assert found.stdout == ""


def test_scored_on_a_finished_trial_it_becomes_a_compare_column(toy, tmp_path, capsys):
    """`diffexp eval NAME` on a trial's checkpoint after the sweep: compare reads the trial's TensorBoard."""
    from diffexp.compare import main as compare_main
    from tests.fixtures_compare import write_sweep, write_trial

    study = tmp_path / "runs" / "study"
    write_sweep(study, [("Transformer", "baseline")], [0, 1])
    values = []
    for seed in (0, 1):
        trial = write_trial(study, "Transformer", "baseline", seed, {"val/loss": 2.0 + seed / 10})
        torch.manual_seed(seed)
        save_untrained_checkpoint(ModelConfig(attention="baseline", vocab_size=64, d_model=32, n_layers=1,
                                              n_heads=2, max_seq_len=32), trial / "checkpoints" / "last.ckpt")
        code, out = run([TOY, str(trial / "checkpoints" / "last.ckpt"), "--device", "cpu"], capsys)
        assert code == 0
        values.append(json.loads((trial / "eval" / f"{TOY}.json").read_text())["toy_probe/confidence"])
    assert compare_main([str(study), "--out", str(tmp_path / "cmp"), "--no-plots"]) == 0
    (row,) = csv.DictReader((tmp_path / "cmp/compare.csv").open())
    assert float(row["toy_probe/confidence_mean"]) == pytest.approx(sum(values) / 2)

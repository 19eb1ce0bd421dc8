"""`diffexp eval quantize`: the absmax quantizer against a hand computation, 16 bits reproducing the unquantized
loss, fewer bits changing it, LM-Eval tasks at each width, and clear refusals before the model loads."""

from __future__ import annotations

import csv
import json

import pytest
import torch
import torch.nn.functional as F

from diffexp.evals.quantize import absmax_quantize
from tests.helpers import EVAL_TEXTS, PATTERN, run_eval, save_checkpoint, small_model, write_local_task, write_texts

INF = float("inf")


def test_absmax_quantize_matches_a_hand_computation():
    z = torch.tensor([[[[1.0, -INF, -INF], [-2.0, 0.5, -INF], [0.3, 4.0, -1.1]],    # head 0: a = 4
                       [[0.2, -INF, -INF], [-0.1, 0.05, -INF], [0.0, 0.1, 0.15]]]],  # head 1: a = 0.2
                     dtype=torch.float64)
    # 3 bits: Q = 3 levels either side of 0, steps of a / 3; round half to even (-1.5 -> -2)
    step0, step1 = 4 / 3, 0.2 / 3
    want = torch.tensor([[[[1 * step0, -INF, -INF], [-2 * step0, 0.0, -INF], [0.0, 3 * step0, -1 * step0]],
                          [[3 * step1, -INF, -INF], [-2 * step1, 1 * step1, -INF], [0.0, 2 * step1, 2 * step1]]]],
                        dtype=torch.float64)
    got = absmax_quantize(z, 3)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # each batch row has its own a: scaling one row leaves the other's rounding alone
    both = absmax_quantize(torch.cat((z, z * 10)), 3)
    torch.testing.assert_close(both[0], want[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(both[1], want[0] * 10, rtol=1e-12, atol=1e-12)
    assert torch.equal(absmax_quantize(torch.zeros(1, 1, 2, 2), 4), torch.zeros(1, 1, 2, 2))


def naive_loss(module, rows) -> float:
    with torch.no_grad():
        batch = torch.tensor(rows)
        logits = module.model.eval()(batch[:, :-1])
        return float(F.cross_entropy(logits.transpose(1, 2), batch[:, 1:]))


@pytest.mark.parametrize("attention", ["baseline", "diff_v1"])
def test_sixteen_bits_reproduce_the_loss_and_fewer_change_it(tmp_path, capsys, attention):
    module = small_model(attention, max_seq_len=32)
    run = tmp_path / "run"
    checkpoint = save_checkpoint(module, run / "checkpoints" / "last.ckpt")
    code, out = run_eval(["quantize", str(checkpoint), "--text-file", *write_texts(tmp_path), "--rows", "3",
                          "--context-len", "12", "--bits", "16", "8", "3", "--device", "cpu"], capsys)
    assert code == 0, out
    scalars = json.loads((run / "eval" / "quantize.json").read_text())["scalars"]
    rows = [list(text.encode())[:13] for text in EVAL_TEXTS.values()]
    assert scalars["quantize/loss_unquantized"] == pytest.approx(naive_loss(module, rows), rel=1e-6)
    full = scalars["quantize/loss_unquantized"]
    assert scalars["quantize/loss_b16"] == pytest.approx(full, rel=1e-6)
    for bits in (16, 8, 3):  # the cost of each width, beside the loss
        assert scalars[f"quantize/loss_increase_b{bits}"] == pytest.approx(scalars[f"quantize/loss_b{bits}"] - full)
    # an untrained model's loss barely reads its attention (a trained one: test_tasks_are_scored_at_each_width)
    assert scalars["quantize/loss_b3"] != full
    with open(run / "eval" / "quantize.csv") as f:
        assert [row["bits"] for row in csv.DictReader(f)] == ["unquantized", "16", "8", "3"]


def test_tasks_are_scored_at_each_width(memorised, tmp_path, capsys):
    tasks = write_local_task(tmp_path)
    code, out = run_eval(["harness", str(memorised), "--tasks", "diffexp_toy", "--include-path", str(tasks),
                          "--device", "cpu", "--out", str(tmp_path / "plain"), "--bootstrap-iters", "0"], capsys)
    assert code == 0, out
    plain = json.loads((tmp_path / "plain" / "harness.json").read_text())["tasks"]["diffexp_toy"]["acc"]
    (tmp_path / "doc.txt").write_text(PATTERN * 2)
    code, out = run_eval(["quantize", str(memorised), "--text-file", str(tmp_path / "doc.txt"), "--rows", "1",
                          "--context-len", "16", "--bits", "16", "2", "--tasks", "diffexp_toy", "--include-path",
                          str(tasks), "--bootstrap-iters", "0", "--device", "cpu", "--out", str(tmp_path / "q")],
                         capsys)
    assert code == 0, out
    scalars = json.loads((tmp_path / "q" / "quantize.json").read_text())["scalars"]
    assert scalars["quantize/b16/diffexp_toy/acc"] == pytest.approx(plain)
    assert "quantize/b2/diffexp_toy/acc" in scalars
    # the model learned PATTERN through its attention: 2-bit logits (3 levels) cost it loss
    assert scalars["quantize/loss_b16"] == pytest.approx(scalars["quantize/loss_unquantized"], rel=1e-5)
    assert scalars["quantize/loss_b2"] > scalars["quantize/loss_unquantized"] + 0.05


@pytest.fixture(scope="module")
def baseline_checkpoint(tmp_path_factory):
    return save_checkpoint(small_model("baseline", max_seq_len=32), tmp_path_factory.mktemp("run") / "a.ckpt")


@pytest.mark.parametrize("args, message", [
    (["--bits", "1"], "--bits=1 is invalid: expected a value >= 2"),
    (["--bits", "8", "32"], "--bits=32 is invalid: expected widths from 2 to 24 bits"),
    (["--limit", "3"], "give --tasks too"),
])
def test_bad_options_are_refused_before_the_model_loads(baseline_checkpoint, tmp_path, capsys, args, message):
    checkpoint = baseline_checkpoint
    code, out = run_eval(["quantize", str(checkpoint), "--text-file", *write_texts(tmp_path), *args,
                          "--out", str(tmp_path / "never")], capsys)
    assert code == 2 and message in out, out
    assert not (tmp_path / "never").exists()


GENERATION_TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
{output_type}test_split: test
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["."]
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


@pytest.mark.parametrize("requested, refusal", [
    ("diffexp_toy_gen", "--tasks: 'diffexp_toy_gen' is a generation task (output_type: generate_until)"),
    # a task that names no output_type has LM-Eval's default, generate_until
    ("diffexp_toy_mixed", "--tasks: 'diffexp_toy_mixed' holds generation tasks (output_type: generate_until: "
                          "diffexp_toy_gen, diffexp_toy_gen_default)"),
])
def test_generation_tasks_are_refused_from_their_configs_before_any_dataset_or_the_model(
        baseline_checkpoint, tmp_path, capsys, monkeypatch, requested, refusal):
    tasks = write_local_task(tmp_path, "missing.jsonl", write_data=False)  # no data: reading any fails
    missing = tmp_path / "missing.jsonl"
    (tasks / "gen.yaml").write_text(GENERATION_TASK.format(name="diffexp_toy_gen", data=missing,
                                                           output_type="output_type: generate_until\n"))
    (tasks / "gen_default.yaml").write_text(GENERATION_TASK.format(name="diffexp_toy_gen_default", data=missing,
                                                                   output_type=""))
    (tasks / "mixed.yaml").write_text("group: diffexp_toy_mixed\ntask: [diffexp_toy, diffexp_toy_gen, "
                                      "diffexp_toy_gen_default]\n")
    loaded = []
    monkeypatch.setattr("diffexp.training.loading.load_model", lambda *args: loaded.append(args))
    code, out = run_eval(["quantize", str(baseline_checkpoint), "--text-file", *write_texts(tmp_path), "--tasks",
                          requested, "--include-path", str(tasks), "--device", "cpu", "--out", str(tmp_path / "never")],
                         capsys)
    assert code == 2 and refusal in out, out
    assert "the quantized logits do not reach; expected log-likelihood tasks (output_type: multiple_choice, " \
           "loglikelihood, loglikelihood_rolling), e.g. hellaswag" in out, out
    assert not loaded and not (tmp_path / "never").exists()
    # the log-likelihood task of the same directory passes that check, and only then is its data read
    code, out = run_eval(["quantize", str(baseline_checkpoint), "--text-file", *write_texts(tmp_path), "--tasks",
                          "diffexp_toy", "--include-path", str(tasks), "--device", "cpu"], capsys)
    assert code == 2 and "a task's dataset could not be loaded" in out, out


PYTHON_TASK = '''from lm_eval.api.task import ConfigurableTask


class GenerationTask(ConfigurableTask):
    """A Python task: only its class knows its output type."""

    def __init__(self, config=None):
        super().__init__(config={"task": "diffexp_toy_python", "dataset_path": "json",
                                 "dataset_kwargs": {"data_files": {"test": %r}}, "test_split": "test",
                                 "output_type": "generate_until", "doc_to_text": "{{question}}",
                                 "doc_to_target": "{{answer}}", "generation_kwargs": {"until": ["."]},
                                 "metric_list": [{"metric": "exact_match"}]})
'''


def test_a_python_generation_task_is_refused_once_built_before_the_model(baseline_checkpoint, tmp_path, capsys,
                                                                          monkeypatch):
    tasks = write_local_task(tmp_path)
    (tasks / "python_task.py").write_text(PYTHON_TASK % str(tmp_path / "toy.jsonl"))
    (tasks / "python.yaml").write_text("task: diffexp_toy_python\nclass: !function python_task.GenerationTask\n")
    loaded = []
    monkeypatch.setattr("diffexp.training.loading.load_model", lambda *args: loaded.append(args))
    code, out = run_eval(["quantize", str(baseline_checkpoint), "--text-file", *write_texts(tmp_path), "--tasks",
                          "diffexp_toy_python", "--include-path", str(tasks), "--device", "cpu"], capsys)
    assert code == 2 and "--tasks: 'diffexp_toy_python' is a generation task (output_type: generate_until)" in out, out
    assert not loaded


@pytest.mark.parametrize("flag, values", [("--bits", ["16", "8"]), ("--text-file", None)])
def test_a_checkpoint_after_a_list_option_is_named_with_the_orders_that_parse(baseline_checkpoint, tmp_path, capsys,
                                                                             flag, values):
    from diffexp.evals.registry import evaluation
    from diffexp.evals.run import parse

    values = values or write_texts(tmp_path)
    checkpoint = str(baseline_checkpoint)
    code, out = run_eval(["quantize", flag, *values, checkpoint], capsys)
    assert code == 2 and f"{checkpoint!r} looks like CKPT but was read as one of {flag}'s values" in out, out
    # --bits refuses the word as an integer; --text-file takes it as a file, and CKPT is missing
    assert out.startswith("error: --bits=" if flag == "--bits" else "error: CKPT is required"), out
    listed = " ".join(values)
    assert f"(diffexp eval quantize CKPT {flag} {listed})" in out and f"({flag} {listed} -- CKPT," in out, out
    # the two orders it names parse, CKPT and the list apart
    for argv in ([checkpoint, flag, *values], [flag, *values, "--", checkpoint]):
        options, shared = parse(evaluation("quantize"), argv)
        assert shared["checkpoint"] == checkpoint
        assert [str(value) for value in options[flag[2:].replace("-", "_")]] == values
    # a .ckpt that is not there yet reads the same; another bad value is only itself
    code, out = run_eval(["quantize", "--bits", "16", "8", "gone.ckpt"], capsys)
    assert code == 2 and "'gone.ckpt' looks like CKPT" in out, out
    code, out = run_eval(["quantize", "--bits", "16", "eight", checkpoint], capsys)
    assert code == 2 and "--bits='eight' is invalid: expected an integer" in out and "looks like" not in out, out

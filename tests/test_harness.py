"""`diffexp eval harness`: the LM-Eval adapter's answers against naive full forwards, and the command on a
local task (task YAML + local data file, offline) for a byte model and a BPE model."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from diffexp.cli import main
from diffexp.data.tokenizer import ByteTokenizer
from diffexp.evals.harness_lm import DiffexpHarnessLM
from diffexp.training.loading import load_checkpoint, load_model
from tests.helpers import DOCS, PATTERN, naive_logprob, write_local_task


@dataclass
class Request:  # what the adapter reads of an lm_eval Instance
    args: tuple


def adapter(path, **kwargs) -> DiffexpHarnessLM:
    from diffexp.generate.cli import resolve_tokenizer

    checkpoint, hparams = load_checkpoint(str(path))
    tokenizer = resolve_tokenizer(checkpoint, hparams, None)
    return DiffexpHarnessLM(load_model(checkpoint, str(path), "cpu"), tokenizer, progress=False, **kwargs)


@pytest.mark.parametrize("which", ["byte", "bpe"])
def test_loglikelihood_is_the_continuations_log_probability(which, memorised, bpe_checkpoint):
    lm = adapter(memorised if which == "byte" else bpe_checkpoint, batch_size=2)
    pairs = [("the cat sat on the", " mat."), ("the cat ", "sat"), ("", "the cat"), ("Once upon a", " time there")]
    results = lm.loglikelihood([Request(pair) for pair in pairs])
    encode = lm.tokenizer.encode
    for (context, continuation), (score, _) in zip(pairs, results):
        stripped = context.rstrip()  # its trailing space belongs to the continuation, as in the harness
        context, continuation = stripped, context[len(stripped):] + continuation
        context_ids = encode(context) if context else [lm.eot_token_id]
        whole = encode(context + continuation) if context else context_ids + encode(continuation)
        assert whole[: len(context_ids)] == context_ids
        assert score == pytest.approx(naive_logprob(lm.model, whole, len(context_ids)), abs=1e-4)


def test_is_greedy_says_whether_greedy_decoding_gives_the_continuation(memorised):
    lm = adapter(memorised)
    [(_, learned), (_, other)] = lm.loglikelihood([Request(("the cat sat on the", " mat.")),
                                                   Request(("the cat sat on the", " hat."))])
    assert learned is True and other is False


def test_rolling_loglikelihood_counts_every_token_once_in_windows(memorised):
    """A text longer than max_seq_len (128) in windows of 128 predicted tokens, each but the first reading
    the token before it, the last as much context as fits: the harness's disjoint rolling windows."""
    lm = adapter(memorised)
    text = PATTERN * 12  # 288 bytes
    ids = lm.tokenizer.encode(text)
    L = lm.max_length
    reference = naive_logprob(lm.model, [lm.eot_token_id] + ids[:L], 1)
    start = L
    while start < len(ids):
        end = min(start + L, len(ids))
        window = ids[end - L - 1 : end]  # L inputs and the targets they predict
        reference += naive_logprob(lm.model, window, len(window) - (end - start))
        start = end
    short = PATTERN * 2
    [long_score, short_score] = lm.loglikelihood_rolling([Request((text,)), Request((short,))])
    assert long_score == pytest.approx(reference, abs=1e-3)
    assert short_score == pytest.approx(naive_logprob(lm.model, [lm.eot_token_id] + lm.tokenizer.encode(short), 1),
                                        abs=1e-4)


def test_generate_until_stops_at_the_stop_string_and_the_token_budget(memorised):
    lm = adapter(memorised, batch_size=4)
    requests = [Request(("the cat", {"until": ["mat"], "max_gen_toks": 40})),
                Request(("the cat", {"until": ["\n"], "max_gen_toks": 5})),
                Request(("the dog", {"until": ["mat"], "max_gen_toks": 40})),  # same length: the first's batch
                Request(("the cat sat", {"until": ["."], "do_sample": False}))]
    outputs = lm.generate_until(requests)
    assert outputs[0] == " sat on the "
    assert outputs[1] == " sat "
    assert outputs[3] == " on the mat"
    # batched with another prompt or alone, the same greedy text
    assert lm.generate_until([requests[2]]) == [outputs[2]]


def expected_accuracy(lm: DiffexpHarnessLM) -> float:
    """Each document's choice by hand: the best summed log-likelihood of " <choice>" after the question."""
    correct = 0
    for doc in DOCS:
        context = lm.tokenizer.encode(doc["question"])
        scores = [naive_logprob(lm.model, lm.tokenizer.encode(doc["question"] + " " + choice), len(context))
                  for choice in doc["choices"]]
        correct += max(range(len(scores)), key=scores.__getitem__) == doc["answer"]
    return correct / len(DOCS)


@pytest.mark.parametrize("which", ["byte", "bpe", "bpe export"])
def test_harness_command_on_a_local_task(which, memorised, bpe_checkpoint, tmp_path, capsys):
    checkpoint = memorised if which == "byte" else bpe_checkpoint
    if which == "bpe export":  # `diffexp export`'s directory (weights, config, tokenizer.json) reads the same
        with pytest.raises(SystemExit):
            main(["export", str(checkpoint), str(tmp_path / "exported")])
        checkpoint = tmp_path / "exported"
    tasks = write_local_task(tmp_path)
    with pytest.raises(SystemExit) as done:
        main(["eval", "harness", str(checkpoint), "--tasks", "diffexp_toy", "--include-path", str(tasks),
              "--device", "cpu", "--out", str(tmp_path / "out"), "--bootstrap-iters", "0"])
    captured = capsys.readouterr()
    assert done.value.code == 0, captured.err[-2000:]
    results = json.loads((tmp_path / "out/harness.json").read_text())
    assert results["tasks"]["diffexp_toy"]["acc"] == pytest.approx(expected_accuracy(adapter(checkpoint)))
    assert results["n_samples"]["diffexp_toy"] == len(DOCS)
    assert "| diffexp_toy | acc |" in captured.out
    if which == "byte":  # the model learned the sentence: it gets the first three right
        assert results["tasks"]["diffexp_toy"]["acc"] >= 0.75


@pytest.mark.parametrize("args,message", [
    (["--tasks", "arc_chalenge"], "--tasks: 'arc_chalenge' is not an LM-Eval"),
    (["--tasks", "diffexp_toy", "--batch-size", "0"], "--batch-size=0 is invalid"),
    (["--tasks", "diffexp_toy", "--limit", "-1"], "--limit=-1.0 is invalid"),
    (["--tasks", "diffexp_toy", "--include-path", "/nonexistent/tasks"], "--include-path='/nonexistent/tasks'"),
])
def test_bad_input_is_one_clear_error_before_the_model_is_built(args, message, memorised, tmp_path, capsys,
                                                                 monkeypatch):
    tasks = write_local_task(tmp_path)
    built = []
    monkeypatch.setattr("diffexp.evals.common.load_model", lambda *a: built.append(a))
    with pytest.raises(SystemExit) as done:
        main(["eval", "harness", str(memorised), "--include-path", str(tasks), *args, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert done.value.code == 2 and message in err and "Traceback" not in err
    assert not built and not (tmp_path / "o").exists()


def test_a_task_whose_data_cannot_load_is_refused_before_the_model_is_built(memorised, tmp_path, capsys):
    tasks = write_local_task(tmp_path, "missing.jsonl", write_data=False)
    with pytest.raises(SystemExit) as done:
        main(["eval", "harness", str(memorised), "--tasks", "diffexp_toy", "--include-path", str(tasks),
              "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "a task's dataset could not be loaded" in err
    assert not (tmp_path / "o").exists()


def test_table2_preset_names_tasks_lm_eval_has():
    from diffexp.evals.harness import expand_tasks, task_manager

    table2 = expand_tasks(["table2"])
    assert len(table2) == 7 and set(table2) <= set(task_manager().all_tasks)
    assert expand_tasks(["boolq", "table2"]) == ["boolq", *[t for t in table2 if t != "boolq"]]


def test_byte_tokenizer_is_the_default_for_byte_models(memorised):
    assert isinstance(adapter(memorised).tokenizer, ByteTokenizer)

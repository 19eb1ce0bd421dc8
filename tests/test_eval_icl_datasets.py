"""Many-shot ICL on any tokenizer and on (text, label) datasets: prompts scored in the model's own tokens,
local jsonl/csv/parquet tables, and every bad input refused before a model is built."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from diffexp.cli import main
from diffexp.data.classification import ClassificationTask, labelled_rows
from diffexp.data.corpus import load_stdlib_corpus
from diffexp.data.icl import ICLTask
from diffexp.data.tokenizer import ByteTokenizer, HFTokenizer, train_bpe
from diffexp.evals.icl import evaluate_icl
from diffexp.evals.scoring import as_logits_fn, candidate_logprobs
from diffexp.training.loading import load_checkpoint, load_model
from tests.helpers import bpe_text_checkpoint, save_checkpoint, small_model

# three classes whose texts share a keyword; labels of different lengths and not in alphabetical order
ROWS = [{"text": f"{word} number {i}\nsecond line", "label": label}
        for label, word in (("zz", "apple"), ("y", "berry"), ("xxx", "cherry")) for i in range(6)]


def run_eval(args, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as done:
        main(["eval", *args])
    captured = capsys.readouterr()
    return done.value.code, captured.out + captured.err


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_table(path, rows):
    """rows as .jsonl or .csv (a header, then one line per row; texts with newlines quoted)."""
    if path.suffix == ".jsonl":
        return write_jsonl(path, rows)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def naive_label_logprob(model, ids: list[int], start: int) -> float:
    """log p(ids[start:] | ids[:start]) from one full forward, term by term."""
    with torch.no_grad():
        logp = as_logits_fn(model)(torch.tensor([ids[:-1]])).log_softmax(-1)[0]
    return sum(float(logp[t - 1, ids[t]]) for t in range(start, len(ids)))


# -- tokenization --------------------------------------------------------------------------------------
def test_bpe_prompts_are_scored_in_the_tokens_of_the_whole_text():
    """With a BPE, the scored ids of prompt + label are the text's own ids, and each label's summed
    log-likelihood is the naive one of that text."""
    bpe = HFTokenizer(train_bpe(load_stdlib_corpus(max_chars=50_000), 300), "test-bpe")
    model = small_model(vocab_size=bpe.vocab_size, max_seq_len=256).model.eval()
    task = ICLTask(3, seed=0, tokenizer=bpe)
    calls = []

    def recording(prompts, candidates):
        scores = candidate_logprobs(as_logits_fn(model), prompts, candidates)
        calls.append((prompts, candidates, scores))
        return scores

    results = evaluate_icl(recording, task, n_demos_list=(1, 3), orderings=("random",), n_orderings=1, n_tests=3)
    assert results.boundary_merges == [] and len(calls) == 2
    for prompts, candidates, scores in calls:
        for i, prompt in enumerate(prompts):
            text = bpe.decode(prompt)
            assert text.endswith(" label:") and text.count("\n") in (1, 3)
            for j, label in enumerate(task.labels):
                ids = bpe.encode(f"{text} {label}\n")
                assert ids == prompt + candidates[j]  # no merge across the prompt/label boundary
                assert float(scores[i, j]) == pytest.approx(naive_label_logprob(model, ids, len(prompt)), abs=1e-4)


def test_byte_scores_move_by_one_constant_per_prompt():
    """Scoring the space before a label with the label shifts every label's score by the same amount, so a byte
    model's choices are those of the earlier split (prompt ending in 'label: ', label 'owl\\n')."""
    model = small_model(max_seq_len=256).model.eval()
    task = ICLTask(4, seed=1)
    prompts = [task.prompt(task.demonstrations(4, seed=0), x) for x, _ in task.tests(4, seed=0)]
    before = candidate_logprobs(model, [task.encode(p) for p in prompts],
                                [task.encode(t) for t in task.candidate_texts()])
    now = candidate_logprobs(model, [task.scored_prompt_ids(p) for p in prompts], task.scored_candidate_ids())
    shift = now - before
    assert torch.allclose(shift, shift[:, :1].expand_as(shift), atol=1e-5) and (shift < 0).all()


# -- datasets --------------------------------------------------------------------------------------------
def test_jsonl_csv_and_parquet_rows(tmp_path):
    rows = labelled_rows(str(write_jsonl(tmp_path / "d.jsonl", ROWS + ROWS[:2])))  # duplicates kept once
    assert rows.names == ["xxx", "y", "zz"] and len(rows.texts) == 18
    assert rows.texts[0] == "apple number 0 second line" and rows.classes[0] == 2  # one line; "zz" is class 2
    with open(tmp_path / "d.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["sentence", "intent"])
        writer.writerows([[r["text"], i // 6 + 3] for i, r in enumerate(ROWS)])
    rows = labelled_rows(str(tmp_path / "d.csv"), "sentence", "intent")
    assert rows.names == ["3", "4", "5"] and rows.classes[:7] == [0] * 6 + [1]  # integer ids, no names: "3", ...
    import datasets

    features = datasets.Features({"text": datasets.Value("string"), "label": datasets.ClassLabel(names=["neg", "pos"])})
    datasets.Dataset.from_dict({"text": ["good", "bad", "fine"], "label": [1, 0, 1]}, features=features) \
        .to_parquet(str(tmp_path / "d.parquet"))
    rows = labelled_rows(str(tmp_path / "d.parquet"))
    assert rows.names == ["neg", "pos"] and rows.classes == [1, 0, 1]  # a ClassLabel's names


def test_dataset_task_holds_out_balanced_tests_and_a_scorer_that_knows_the_labels_scores_one(tmp_path):
    rows = labelled_rows(str(write_jsonl(tmp_path / "d.jsonl", ROWS)))
    task = ClassificationTask(rows, n_tests=4, seed=0)
    assert task.max_demos == 3 * (6 - 2) and [len(p) for p in task.test_pool] == [2, 2, 2]
    for demos, tests in zip(task.demo_pool, task.test_pool):
        assert not set(demos) & set(tests)
    truth = dict(zip(rows.texts, rows.classes))

    def oracle(prompts, candidates):
        scores = np.zeros((len(prompts), len(candidates)))
        for i, p in enumerate(prompts):
            scores[i, truth[task.decode(p).rsplit("input: ", 1)[1].removesuffix(" label:")]] = 1.0
        return scores

    results = evaluate_icl(oracle, task, n_demos_list=(1, 6, 12), n_orderings=2, n_tests=4)
    assert all(r["mean"] == 1.0 for r in results.to_rows()) and len(results.to_rows()) == 6
    always_first = evaluate_icl(lambda p, c: np.zeros((len(p), len(c))), task, n_demos_list=(3,), n_tests=6)
    assert all(r["mean"] == pytest.approx(1 / 3) for r in always_first.to_rows())  # 2 of 6 balanced tests


# -- the command ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def uniform_run(tmp_path_factory):
    """A byte model whose weights are all zero: every next token is uniform, so a label's score is
    -(its tokens) x ln(vocab) and the shortest label always wins."""
    module = small_model(attention="baseline", max_seq_len=512)
    with torch.no_grad():
        for p in module.parameters():
            p.zero_()
    run = tmp_path_factory.mktemp("uniform")
    save_checkpoint(module, run / "checkpoints" / "last.ckpt")
    return run


@pytest.mark.parametrize("suffix", ["jsonl", "csv"])
def test_eval_icl_on_a_dataset_file(uniform_run, tmp_path, capsys, suffix):
    data = write_table(tmp_path / f"fruit.{suffix}", ROWS)
    code, out = run_eval(["icl", str(uniform_run / "checkpoints" / "last.ckpt"), "--dataset", str(data),
                          "--n-demos", "1", "3", "--n-tests", "6", "--n-orderings", "2", "--device", "cpu"], capsys)
    assert code == 0, out
    assert "K=3 labels (xxx, y, zz)" in out
    with open(uniform_run / "eval" / "icl_fruit.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4  # n in (1, 3) x (random, alternating)
    # always "y" (the shortest label): right on the 2 of the 6 balanced tests that are y's, in every order
    assert all(float(r["mean"]) == pytest.approx(1 / 3) and float(r["std"]) == 0.0 for r in rows)
    tags = EventAccumulator(str(uniform_run)).Reload().Tags()["scalars"]
    assert "icl_fruit/random/n3" in tags and "icl_fruit_std/alternating/n1" in tags


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory):
    return bpe_text_checkpoint(tmp_path_factory.mktemp("bpe"))[0]


def test_eval_icl_on_a_bpe_model_uses_its_tokenizer(bpe_run, capsys):
    code, out = run_eval(["icl", str(bpe_run), "--n-demos", "1", "2", "--n-orderings", "2", "--n-tests", "4",
                          "--device", "cpu"], capsys)
    assert code == 0, out
    with open(bpe_run.parent.parent / "eval" / "icl.csv") as f:
        written = {(int(r["n_demos"]), r["ordering"]): float(r["mean"]) for r in csv.DictReader(f)}
    checkpoint, hparams = load_checkpoint(str(bpe_run))
    from diffexp.generate.cli import resolve_tokenizer

    tokenizer = resolve_tokenizer(checkpoint, hparams, None)
    assert not isinstance(tokenizer, ByteTokenizer)
    expected = evaluate_icl(load_model(checkpoint, str(bpe_run), "cpu"), ICLTask(4, seed=0, tokenizer=tokenizer),
                            (1, 2), n_orderings=2, n_tests=4)
    assert written == pytest.approx({key: r["mean"] for key, r in
                                     (((r["n_demos"], r["ordering"]), r) for r in expected.to_rows())})


# -- bad input ------------------------------------------------------------------------------------------
def snapshot(directory) -> set:
    return {(path, path.stat().st_size) for path in directory.rglob("*")}


@pytest.fixture
def tables(tmp_path):
    write_jsonl(tmp_path / "ok.jsonl", ROWS)
    write_jsonl(tmp_path / "one_class.jsonl", [{"text": f"t{i}", "label": "a"} for i in range(5)])
    write_jsonl(tmp_path / "no_label.jsonl", [{"text": "t", "label": None}, {"text": "u", "label": "a"}])
    (tmp_path / "notes.txt").write_text("text\n")
    return tmp_path


BAD_DATASETS = [
    (["--dataset", "{d}/missing.jsonl"], "missing.jsonl' is invalid: no such file"),
    (["--dataset", "{d}/notes.txt"], "unknown extension '.txt'"),
    (["--dataset", "{d}/ok.jsonl", "--text-column", "sentence"], "--text-column='sentence' is invalid"),
    (["--dataset", "{d}/ok.jsonl", "--label-column", "intent"], "its columns: text, label"),
    (["--dataset", "{d}/one_class.jsonl"], "has 1 class(es) ('a'); expected at least 2"),
    (["--dataset", "{d}/no_label.jsonl"], "row 0 of --dataset="),
    (["--dataset", "{d}/ok.jsonl", "--n-tests", "16"], "--n-tests=16 is invalid"),
    (["--dataset", "{d}/ok.jsonl", "--n-tests", "6", "--n-demos", "13"], "--n-demos=13 is invalid"),
    (["--dataset", "{d}/ok.jsonl", "--k-classes", "3"], "--k-classes=3 is invalid with --dataset"),
    (["--dataset", "{d}/ok.jsonl", "--split", "test"], "--split='test' is invalid: a local file"),
    (["--label-column", "intent"], "--label-column='intent' is invalid without --dataset"),
    (["--dataset", "hf:diffexp-tests/no-such-dataset"], "the Hugging Face Hub dataset could not be loaded"),
    (["--tokenizer", "{d}/missing.json"], "--tokenizer="),
]


@pytest.mark.parametrize(("flags", "named"), BAD_DATASETS)
def test_bad_dataset_input_is_refused_before_anything_is_built(uniform_run, tables, capsys, monkeypatch, flags,
                                                               named):
    import datasets
    import huggingface_hub

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # as on a machine without network
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    built = []
    monkeypatch.setattr("diffexp.training.loading.load_model", lambda *a: built.append(a))
    before = snapshot(uniform_run)
    code, out = run_eval(["icl", str(uniform_run / "checkpoints" / "last.ckpt"), "--device", "cpu",
                          *[f.format(d=tables) for f in flags]], capsys)
    assert code == 2 and "Traceback" not in out and named in out, out
    assert built == [] and snapshot(uniform_run) == before


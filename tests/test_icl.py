"""Many-shot in-context classification: the task, constrained choice, orderings, results, training data."""

from __future__ import annotations

import csv
from collections import Counter

import lightning as L
import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.tensorboard import SummaryWriter

from diffexp.data.icl import ICLDataModule, ICLTask
from diffexp.evals import Evaluate
from diffexp.evals.icl import (
    evaluate_icl,
    order_demonstrations,
)
from diffexp.evals.scoring import best_candidates as choose_labels
from diffexp.model import Decoder
from diffexp.model.config import ModelConfig
from diffexp.training import DiffexpLM
from tests.oracles import oracle_scorer, predict_labels


def tiny_decoder(max_seq_len: int = 256) -> Decoder:
    torch.manual_seed(0)
    return Decoder(ModelConfig(vocab_size=257, d_model=32, n_layers=1, n_heads=2, max_seq_len=max_seq_len))


def parse_demos(text: str) -> list[tuple[str, str]]:
    """(input, label) of every complete demonstration line of a prompt (the query line is dropped)."""
    lines = text.split("\n")[:-1]
    return [tuple(line[len("input: "):].split(" label: ")) for line in lines]


def test_task_rule_pools_and_demonstrations():
    task = ICLTask(4, seed=5)
    assert len(set(task.labels)) == 4 and all(len(task.encode(y)) == 3 for y in task.labels)
    assert len({w for g in task.groups for w in g}) == 4 * task.group_size
    for c in range(4):
        demo_sets = {frozenset(x.split()) for x in task.demo_pool[c]}
        test_sets = {frozenset(x.split()) for x in task.test_pool[c]}
        assert not demo_sets & test_sets  # held-out test inputs
        assert all(task.label_of(x) == c for x in task.demo_pool[c] + task.test_pool[c])
    demos = task.demonstrations(10, seed=1)
    assert sorted(Counter(c for _, c in demos).values()) == [2, 2, 3, 3]  # class-balanced
    assert set(task.demonstrations(4, seed=1)) <= set(demos) <= set(task.demonstrations(16, seed=1))  # nested
    tests = task.tests(12, seed=1)
    assert Counter(c for _, c in tests) == {0: 3, 1: 3, 2: 3, 3: 3}
    assert all(x in task.test_pool[c] for x, c in tests)
    prompt = task.prompt(demos[:2], tests[0][0])
    assert prompt.startswith("input: ") and prompt.endswith(" label: ")
    assert prompt.count("\n") == 2 and f"label: {task.labels[demos[0][1]]}\n" in prompt
    assert ICLTask(4, seed=5).groups == task.groups and ICLTask(4, seed=6).groups != task.groups
    # fixed label names (the first K of the pool), assigned at random; or names drawn per task
    assert all(set(ICLTask(4, seed=s).labels) == set(task.labels) for s in range(5))
    assert len({ICLTask(4, seed=s).labels[0] for s in range(8)}) > 1
    assert len({frozenset(ICLTask(4, seed=s, random_label_names=True).labels) for s in range(5)}) > 1
    with pytest.raises(ValueError, match="k_classes=1"):
        ICLTask(1)
    with pytest.raises(ValueError, match="n_demos_list contains 1000"):
        evaluate_icl(oracle_scorer(task), task, n_demos_list=(1000,))


def test_constrained_choice_returns_only_labels():
    task = ICLTask(3, seed=0)
    scores = np.random.default_rng(0).normal(size=(50, 3))
    assert set(choose_labels(scores)) <= {0, 1, 2}
    assert choose_labels([[0.0, 2.0, 1.0], [-1.0, -3.0, -2.0]]) == [1, 0]
    demos = task.demonstrations(6, seed=0)
    prompts = [task.prompt(demos, x) for x, _ in task.tests(6, seed=0)]
    predicted = predict_labels(tiny_decoder(), task, prompts)
    assert len(predicted) == 6 and set(predicted) <= set(task.labels)
    assert predict_labels(oracle_scorer(task), task, prompts) == [task.labels[c] for _, c in task.tests(6, seed=0)]


def test_oracle_scores_one():
    task = ICLTask(4, seed=1)
    results = evaluate_icl(oracle_scorer(task), task, n_demos_list=(1, 4, 16), n_orderings=2, n_tests=20)
    rows = results.to_rows()
    assert len(rows) == 6 and all(r["mean"] == 1.0 and r["min"] == 1.0 and r["std"] == 0.0 for r in rows)
    assert results.skipped == []  # a bare scorer has no context limit


def test_random_decoder_near_chance_and_too_long_n_skipped():
    task = ICLTask(4, seed=2)
    model = tiny_decoder(max_seq_len=128)
    model.train()
    results = evaluate_icl(model, task, n_demos_list=(1, 2, 16, 64), n_orderings=2, n_tests=12)
    assert model.training  # mode restored
    assert [s["n_demos"] for s in results.skipped] == [16, 64]
    assert all(s["tokens_needed"] > 128 and s["max_seq_len"] == 128 for s in results.skipped)
    assert "skipped" in results.summary()
    rows = results.to_rows()
    assert {r["n_demos"] for r in rows} == {1, 2} and {r["ordering"] for r in rows} == {"random", "alternating"}
    mean = float(np.mean([r["mean"] for r in rows]))
    assert abs(mean - 0.25) < 0.25  # chance 1/K, loose: 12 tests


def test_alternating_and_grouped_orders():
    task = ICLTask(4, seed=3)
    rng = np.random.default_rng(0)
    demos = task.demonstrations(12, seed=0)
    alternating = [c for _, c in order_demonstrations(demos, "alternating", rng)]
    assert len(set(alternating[:4])) == 4 and all(alternating[i] == alternating[i + 4] for i in range(8))
    uneven = [c for _, c in order_demonstrations(task.demonstrations(10, seed=0), "alternating", rng)]
    assert len(set(uneven[:4])) == 4 and uneven[4:8] == uneven[:4] and all(a != b for a, b in zip(uneven, uneven[1:]))
    grouped = [c for _, c in order_demonstrations(demos, "grouped", rng)]
    assert sum(a != b for a, b in zip(grouped, grouped[1:])) == 3  # one block per class
    for ordering in ("random", "alternating", "grouped"):
        assert Counter(order_demonstrations(demos, ordering, rng)) == Counter(demos)
    with pytest.raises(ValueError, match="ordering='sorted'"):
        order_demonstrations(demos, "sorted", rng)


def test_same_demonstrations_across_orderings():
    task = ICLTask(4, seed=4)
    oracle = oracle_scorer(task)
    calls = []

    def recording(prompts, candidates):
        calls.append(parse_demos(task.decode(prompts[0])))
        assert all(parse_demos(task.decode(p)) == calls[-1] for p in prompts)  # one context per call
        return oracle(prompts, candidates)

    n_list, orderings, n_orderings = (4, 8), ("random", "alternating"), 3
    evaluate_icl(recording, task, n_demos_list=n_list, orderings=orderings, n_orderings=n_orderings, n_tests=8)
    assert len(calls) == len(n_list) * len(orderings) * n_orderings
    keys = [(n, o) for n in n_list for o in orderings for _ in range(n_orderings)]
    for n in n_list:
        contexts = [c for c, (m, _) in zip(calls, keys) if m == n]
        assert all(len(c) == n and Counter(c) == Counter(contexts[0]) for c in contexts)  # same multiset
        assert len({tuple(c) for c in contexts}) > 1  # but really reordered
    label_class = {y: i for i, y in enumerate(task.labels)}
    for context, (_, ordering) in zip(calls, keys):
        if ordering == "alternating":
            classes = [label_class[y] for _, y in context]
            assert all(a != b for a, b in zip(classes, classes[1:]))
            assert len(set(classes[:4])) == 4


def test_results_rows_csv_png_and_tensorboard(tmp_path):
    task = ICLTask(3, seed=0)
    results = evaluate_icl(oracle_scorer(task), task, n_demos_list=(1, 3, 9), n_orderings=2, n_tests=6,
                           orderings=("random", "alternating", "grouped"))
    results.skipped.append({"n_demos": 81, "tokens_needed": 2000, "max_seq_len": 1024})
    rows = results.to_rows()
    assert len(rows) == 9
    assert set(rows[0]) >= {"n_demos", "ordering", "mean", "std", "min", "max"}
    paths = results.save(tmp_path / "icl")
    with open(paths["csv"]) as f:
        read = list(csv.DictReader(f))
    assert len(read) == 9 and read[0]["n_demos"] == "1" and float(read[0]["mean"]) == 1.0
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and paths["png"].stat().st_size > 10_000
    assert "81  skipped" in paths["txt"].read_text()
    scalars = results.scalars()
    assert scalars["icl/random/n3"] == 1.0 and scalars["icl_std/grouped/n9"] == 0.0
    assert "icl_range/alternating/n1" in scalars
    writer = SummaryWriter(str(tmp_path / "tb"))
    results.log_to_tensorboard(writer, step=7)
    writer.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert "icl/alternating/n9" in events.Tags()["scalars"]
    assert [e.step for e in events.Scalars("icl/alternating/n9")] == [7]


def test_icl_datamodule_masks_labels_and_trains(tmp_path):
    dm = ICLDataModule(k_classes=3, seq_len=96, batch_size=4, train_size=8, val_size=4)
    assert dm.vocab_size == 257
    batch = next(iter(dm.train_dataloader()))
    assert batch["tokens"].shape == (4, 97) and batch["loss_mask"].shape == (4, 96)
    for tokens, mask in zip(batch["tokens"], batch["loss_mask"]):
        targets = tokens[1:]
        # every masked run of targets is a label followed by a newline (the last one may be cut off)
        runs, current = [], []
        for t, m in zip(targets.tolist(), mask.tolist()):
            if m:
                current.append(t)
            elif current:
                runs.append(current)
                current = []
        text = [bytes(r).decode() for r in runs]
        assert len(text) >= 3 and all(len(r) == 4 and r.endswith("\n") for r in text)
        assert len({r for r in text}) <= 3  # K labels per task
        unmasked = bytes(t for t, m in zip(targets.tolist(), mask.tolist()) if not m).decode()
        assert "input: " in unmasked and "label: " in unmasked
    with pytest.raises(ValueError, match="seq_len=0"):
        ICLDataModule(seq_len=0)

    model = DiffexpLM(arch=ModelConfig(d_model=32, n_layers=1, n_heads=2, max_seq_len=128), vocab_size=dm.vocab_size)
    callback = Evaluate("icl", {"k_classes": 3, "seed": 11, "n_demos": [1, 2, 64], "n_orderings": 1, "n_tests": 3},
                        every_n_validations=None, at_fit_end=True)
    trainer = L.Trainer(max_steps=2, limit_val_batches=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
                        default_root_dir=tmp_path, num_sanity_val_steps=0)
    trainer.fit(model, datamodule=dm)
    assert callback.last is not None and [s["n_demos"] for s in callback.last.skipped] == [64]
    assert {r["n_demos"] for r in callback.last.to_rows()} == {1, 2}


def test_batched_scores_match_one_sequence_at_a_time():
    """Padding and batching do not change a candidate's summed log-likelihood."""
    from diffexp.evals.scoring import candidate_logprobs as score_candidates

    task = ICLTask(3, seed=9)
    model = tiny_decoder().eval()
    prompts = [task.encode(task.prompt(task.demonstrations(n, seed=0), "x")) for n in (0, 1, 3)]
    candidates = [task.encode(t) for t in task.candidate_texts()] + [task.encode("ab\n")]
    batched = score_candidates(model, prompts, candidates, batch_size=5)
    with torch.no_grad():
        for i, p in enumerate(prompts):
            for j, c in enumerate(candidates):
                ids = torch.tensor([p + c])
                logp = model(ids[:, :-1]).log_softmax(-1)[0]
                expected = sum(float(logp[len(p) - 1 + k, c[k]]) for k in range(len(c)))
                assert float(batched[i, j]) == pytest.approx(expected, abs=1e-4)

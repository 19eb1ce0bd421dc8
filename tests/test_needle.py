"""Multi-needle data (placement, leaks, held-out split, loss mask, data module) and the retrieval evaluation."""

from __future__ import annotations

import csv
import random
import re

import pytest
import torch

from diffexp.data.needle import MAX_SNAP, NeedleDataModule, is_held_out, make_sample, min_context_len
from diffexp.evals.needle import (
    eval_samples,
    evaluate_needles,
    greedy_answers,
    score_samples,
)
from diffexp.model import Decoder
from diffexp.model.config import ModelConfig
from tests.oracles import NeedleOracle

DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def _text(tokens, start=0, end=None) -> str:
    return bytes(t for t in tokens.tolist()[start:end] if t < 256).decode("latin-1")


def _samples(n=4, r=2, haystack="synthetic", split="val", count=6, context_len=448, depth=None):
    return [make_sample(random.Random(f"t{haystack}{split}{depth}{i}"), context_len, n, r, depth, haystack, split)
            for i in range(count)]


@pytest.mark.parametrize("haystack", ["synthetic", "corpus"])
@pytest.mark.parametrize("depth", DEPTHS)
def test_answer_needle_sits_at_the_asked_depth(haystack, depth):
    for n, r in ((3, 1), (4, 2)):
        for s in _samples(n, r, haystack, count=3, depth=depth):
            H = s.haystack_len
            block_start = min(start for start, _ in s.answer_needle_spans)
            block_len = sum(end - start + 1 for start, end in s.answer_needle_spans)  # + separator
            needle_len = max(end - start + 1 for start, end in s.answer_needle_spans)
            # exact rule: the answer block starts at depth * (H - block) of the haystack region, +- the snap
            assert abs(block_start - 1 - round(depth * (H - block_len))) <= MAX_SNAP
            # and the answer needle's relative position is within about one needle length of the depth
            for start, _ in s.answer_needle_spans:
                assert abs((start - 1) / H - depth) <= (r * needle_len + MAX_SNAP) / H
            assert s.depth == depth


@pytest.mark.parametrize("haystack", ["synthetic", "corpus"])
@pytest.mark.parametrize("split", ["train", "val"])
def test_every_city_once_and_no_number_leaks(haystack, split):
    for s in _samples(4, 2, haystack, split, count=8):
        tokens = s.tokens
        assert len(tokens) == 449 and tokens[0] == 256
        haystack_text = _text(tokens, 1, s.query_start)
        query_text = _text(tokens, s.query_start)
        whole = _text(tokens)
        assert len(s.needle_spans) == 4 and len(s.answers) == 2
        assert sorted(s.candidates) == sorted(s.needle_numbers) and set(s.answers) <= set(s.candidates)
        for (start, end), city, number in zip(s.needle_spans, s.needle_cities, s.needle_numbers):
            assert _text(tokens, start, end) == f"the magic number of {city} is {number}."
            assert haystack_text.count(city) == 1  # the city appears once in the context
            assert haystack_text.count(number) == 1  # the number only in its own needle
            assert whole.count(number) == 1 + (number in s.answers)  # + its answer after the question
        assert haystack_text.count("magic number") == 4
        for (start, end), city in zip(s.query_spans, s.cities):
            question = _text(tokens, start, end)
            assert question == f"what is the magic number of {city}? "
            assert not re.search(r"\d", question)
        # nothing but the answers carries digits in the query region
        assert re.sub(r"\? \d+\.", "", query_text).count("magic") == 2
        assert not re.search(r"\d", re.sub(r"\? \d+\.", "", query_text))
        for (start, end), answer in zip(s.answer_spans, s.answers):
            assert _text(tokens, start, end) == answer
        assert [s.needle_cities[s.needle_numbers.index(a)] for a in s.answers] == s.cities
        # spans do not overlap
        spans = sorted(s.needle_spans)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def test_held_out_cities_and_numbers_never_in_training():
    train = _samples(6, 2, "synthetic", "train", count=60, context_len=512)
    val = _samples(6, 2, "synthetic", "val", count=30, context_len=512)
    train_cities = {c for s in train for c in s.needle_cities}
    train_numbers = {n for s in train for n in s.needle_numbers}
    val_cities = {c for s in val for c in s.needle_cities}
    val_numbers = {n for s in val for n in s.needle_numbers}
    assert not any(is_held_out(x) for x in train_cities | train_numbers)
    assert all(is_held_out(x) for x in val_cities | val_numbers)
    assert not train_cities & val_cities and not train_numbers & val_numbers
    train_text = "".join(_text(s.tokens) for s in train)
    assert not any(c in train_text for c in val_cities)
    assert not any(re.search(rf"(?<!\d){n}(?!\d)", train_text) for n in val_numbers)


def test_loss_mask_selects_exactly_the_answer_digits():
    for s in _samples(4, 2, "synthetic", count=4) + _samples(1, 1, "corpus", count=2, context_len=256):
        mask = s.loss_mask()
        assert mask.shape == (s.context_len,)
        targets = s.tokens[1:]
        selected = (mask.nonzero().flatten() + 1).tolist()
        assert selected == sorted(p for positions in s.answer_target_positions for p in positions)
        answers = _text(targets[mask.bool()])
        assert answers == "".join(a + "." for a in s.answers)
        assert int(mask.sum()) == sum(len(a) + 1 for a in s.answers)
        for positions, query_row in zip(s.answer_target_positions, s.query_positions):
            assert _text(s.tokens, query_row, query_row + 1) == " " and query_row == positions[0] - 1


def test_make_sample_is_pure_and_validates():
    a = make_sample(random.Random(7), 256, 2, 2, 0.5, "synthetic", "val")
    b = make_sample(random.Random(7), 256, 2, 2, 0.5, "synthetic", "val")
    assert torch.equal(a.tokens, b.tokens) and a.answer_spans == b.answer_spans
    with pytest.raises(ValueError, match="n_queries=3"):
        make_sample(random.Random(0), 512, 2, 3, 0.5, "synthetic", "val")
    with pytest.raises(ValueError, match="depth=1.5"):
        make_sample(random.Random(0), 512, 2, 1, 1.5, "synthetic", "val")
    with pytest.raises(ValueError, match="context_len=100"):
        make_sample(random.Random(0), 100, 2, 1, 0.5, "synthetic", "val")


def test_data_module_batches_shapes_and_determinism():
    kwargs = dict(context_len=256, n_needles=2, n_queries=1, haystack="synthetic", batch_size=4, train_size=16,
                  val_size=8)
    dm = NeedleDataModule(seed=3, **kwargs)
    dm.setup("fit")
    assert dm.vocab_size == 257
    batch = next(iter(dm.train_dataloader()))
    assert batch["tokens"].shape == (4, 257) and batch["tokens"].dtype == torch.long
    assert batch["loss_mask"].shape == (4, 256)
    assert (batch["loss_mask"].sum(1) >= 5).all()
    again = next(iter(NeedleDataModule(seed=3, **kwargs).train_dataloader()))
    assert torch.equal(batch["tokens"], again["tokens"])
    other = next(iter(NeedleDataModule(seed=4, **kwargs).train_dataloader()))
    assert not torch.equal(batch["tokens"], other["tokens"])
    val = list(dm.val_dataloader())
    assert sum(b["tokens"].shape[0] for b in val) == 8
    # the metadata generator matches the batches, and validation is held out
    samples = list(dm.samples("val"))
    assert torch.equal(torch.stack([s.tokens for s in samples[:4]]), val[0]["tokens"])
    assert all(is_held_out(c) for s in samples for c in s.needle_cities)
    mixed = NeedleDataModule(context_len=256, nr_mix=[[1, 1], [2, 2]], haystack="synthetic", batch_size=2,
                             train_size=8, val_size=8)
    assert {len(s.needle_spans) for s in mixed.samples("train")} == {1, 2}


@pytest.mark.parametrize("kwargs, message", [
    (dict(context_len=64), "data.context_len=64"),
    (dict(n_needles=2, n_queries=3), "n_queries=3"),
    (dict(depth=1.5), "data.depth=1.5"),
    (dict(haystack="web"), "data.haystack='web'"),
    (dict(batch_size=0), "data.batch_size=0"),
    (dict(val_size=-1), "data.val_size=-1"),
    (dict(loss_on="digits"), "data.loss_on='digits'"),
])
def test_data_module_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        NeedleDataModule(**kwargs)


def test_loss_on_all_trains_on_every_token_but_validates_on_the_answers():
    kwargs = dict(context_len=256, haystack="synthetic", batch_size=2, train_size=4, val_size=4)
    answers, every = NeedleDataModule(**kwargs), NeedleDataModule(**kwargs, loss_on="all")
    train = every.dataset("train")[0]
    assert torch.equal(train["tokens"], answers.dataset("train")[0]["tokens"])  # same sequences
    assert train["loss_mask"].sum() == 256
    assert torch.equal(every.dataset("val")[1]["loss_mask"], answers.dataset("val")[1]["loss_mask"])
    assert 0 < answers.dataset("val")[1]["loss_mask"].sum() < 20


def test_min_context_len_is_enough_for_extreme_depths():
    for n, r in ((1, 1), (2, 2), (6, 2)):
        for depth in (0.0, 1.0):
            make_sample(random.Random(1), min_context_len(n, r), n, r, depth, "synthetic", "val")


# ----------------------------------------------------------------------------- evaluation


def _tiny_decoder(seed=0):
    torch.manual_seed(seed)
    return Decoder(ModelConfig(attention="baseline", vocab_size=257, d_model=32, n_layers=1, n_heads=2,
                               max_seq_len=512))


def test_oracle_scores_one_with_both_methods(tmp_path):
    results = evaluate_needles(NeedleOracle(), [256, 288], depths=(0.0, 0.5, 1.0), nr=((1, 1), (2, 2)), samples=4,
                               haystack="synthetic", progress=False)
    assert len(results.rows) == 2 * 3 * 2 * 2
    assert all(row["accuracy"] == 1.0 for row in results.rows)
    assert results.mean_by_nr() == {(m, n, r): 1.0 for m in ("greedy", "rank") for n, r in ((1, 1), (2, 2))}
    # CSV (long format) and one PNG heatmap per (method, N, R)
    path = results.to_csv(tmp_path / "needles.csv")
    rows = list(csv.DictReader(path.open()))
    assert len(rows) == 24 and {r["method"] for r in rows} == {"greedy", "rank"}
    assert float(rows[0]["accuracy"]) == 1.0
    pngs = results.heatmaps(tmp_path / "heat" / "needle")
    assert len(pngs) == 4 and all(p.stat().st_size > 1000 for p in pngs)
    assert pngs[0].read_bytes()[:4] == b"\x89PNG"
    assert "| greedy | 1.00 | 1.00 |" in results.table()


def test_random_model_scores_chance_when_ranking_and_zero_greedy():
    model = _tiny_decoder()
    results = evaluate_needles(model, [256], depths=(0.0, 1.0), nr=((2, 1), (3, 1)), samples=8,
                               haystack="synthetic", batch_size=32, progress=False)
    means = results.mean_by_nr()
    assert means[("greedy", 2, 1)] == 0.0 and means[("greedy", 3, 1)] == 0.0
    assert abs(means[("rank", 2, 1)] - 1 / 2) <= 0.3
    assert abs(means[("rank", 3, 1)] - 1 / 3) <= 0.3
    assert all(rec["rank_choice"] in ("", None) or rec["rank_choice"].isdigit() for rec in results.records)


def test_batched_scoring_matches_one_row_at_a_time():
    model = _tiny_decoder(1).eval()
    samples = eval_samples(256, 0.5, 2, 2, 2, "synthetic", seed=5)  # 4 prompts of different lengths
    one = score_samples(model, samples, batch_size=1)
    many = score_samples(model, samples, batch_size=8)
    assert len({p for s in samples for p in s.query_positions}) == 4  # the padding is exercised
    assert [r["rank_choice"] for r in one] == [r["rank_choice"] for r in many]
    assert [r["greedy_output"] for r in one] == [r["greedy_output"] for r in many]
    # greedy decoding stops at "." and returns the digits before it
    prompt = list(b"what is the magic number of X? ")
    assert greedy_answers(lambda idx: _copy_logits(idx, b"42."), [prompt], [3]) == ["42"]
    assert greedy_answers(lambda idx: _copy_logits(idx, b"4242"), [prompt], [3]) == ["424<no stop>"]


def _copy_logits(idx, answer: bytes):
    """Logits that emit `answer` after a prompt of 31 tokens."""
    logits = torch.zeros(*idx.shape, 257)
    for j, ch in enumerate(answer):
        if 30 + j < idx.shape[1]:
            logits[:, 30 + j, ch] = 10.0
    return logits


def test_log_to_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    results = evaluate_needles(NeedleOracle(), [256], depths=(0.0, 1.0), nr=((1, 1),), samples=2,
                               haystack="synthetic", progress=False)
    writer = SummaryWriter(str(tmp_path))
    results.log_to_tensorboard(writer, step=7)
    writer.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"needle/greedy/N1R1", "needle/rank/N1R1"}
    assert events.Scalars("needle/rank/N1R1")[0].value == 1.0 and events.Scalars("needle/rank/N1R1")[0].step == 7
    assert "needle_heatmap/rank/N1R1" in events.Tags()["images"]


def test_callback_logs_during_fit_and_the_command_line_evaluates_a_checkpoint(tmp_path, capsys):
    import lightning as L
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from diffexp.evals import Evaluate
    from diffexp.evals.cli import main as eval_main
    from diffexp.training.module import DiffexpLM

    dm = NeedleDataModule(context_len=256, n_needles=2, n_queries=2, haystack="synthetic", batch_size=2,
                          train_size=8, val_size=2)
    model = DiffexpLM(ModelConfig(attention="baseline", d_model=32, n_layers=1, n_heads=2, max_seq_len=256),
                      vocab_size=dm.vocab_size)
    callback = Evaluate("needle", {"context_lens": [256], "depths": [0.5], "nr": ["1,1", "2,2"], "samples": 2,
                                   "haystack": "synthetic", "methods": ["rank", "greedy"]})
    logger = TensorBoardLogger(str(tmp_path), name="run", default_hp_metric=False)
    trainer = L.Trainer(max_steps=2, val_check_interval=2, limit_val_batches=1, num_sanity_val_steps=0,
                        logger=logger, callbacks=[callback], enable_checkpointing=False, enable_progress_bar=False,
                        log_every_n_steps=1,
                        enable_model_summary=False)
    trainer.fit(model, dm)
    run_dir = tmp_path / "run" / "version_0"
    assert (run_dir / "needles" / "step000002" / "needles.csv").is_file()
    events = EventAccumulator(str(run_dir))
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert {"needle/greedy/N2R2", "needle/rank/N1R1", "attention/answer", "attention/noise",
            "attention/negative_fraction"} <= scalars
    ckpt = tmp_path / "model.ckpt"
    trainer.save_checkpoint(ckpt)
    assert eval_main(["needle", str(ckpt), "--context-lens", "256", "--depths", "0", "1", "--nr", "2,1",
                      "--samples", "2", "--haystack", "synthetic", "--device", "cpu",
                      "--out", str(tmp_path / "eval")]) == 0
    out = capsys.readouterr().out
    assert "| rank |" in out and "| baseline | 0% answer" in out
    assert (tmp_path / "eval" / "needles.csv").is_file() and (tmp_path / "eval" / "attention.md").is_file()
    assert len(list((tmp_path / "eval").glob("needles_*.png"))) == 2


def test_eval_cli_writes_into_the_run(tmp_path, capsys):
    import lightning as L
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from diffexp.cli import main as diffexp_main
    from diffexp.training import DiffexpLM

    cfg = ModelConfig(attention="baseline", vocab_size=257, d_model=32, n_layers=1, n_heads=2, max_seq_len=512)
    module = DiffexpLM(cfg)
    run_dir = tmp_path / "runs" / "x" / "version_0"
    trainer = L.Trainer(max_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.strategy.connect(module)
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    trainer.save_checkpoint(ckpt)
    with pytest.raises(SystemExit) as exit_:
        diffexp_main(["eval", "needle", str(ckpt), "--context-lens", "256", "--depths", "0.5", "--nr", "2,1",
                      "--samples", "2", "--haystack", "synthetic", "--device", "cpu"])
    assert exit_.value.code == 0
    assert (run_dir / "eval" / "needles.md").is_file() and (run_dir / "eval" / "attention.md").is_file()
    tags = EventAccumulator(str(run_dir)).Reload().Tags()
    assert "needle/rank/N2R1" in tags["scalars"] and tags["images"]
    with pytest.raises(SystemExit) as exit_:
        diffexp_main(["eval", "nonsense", str(ckpt)])
    assert exit_.value.code == 2 and "nonsense" in capsys.readouterr().err

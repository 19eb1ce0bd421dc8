"""The needle evaluation on a model trained with a BPE: samples rendered as text and tokenized with the model's
tokenizer, answers located in token space, and `diffexp eval needle` end to end on a BPE checkpoint."""

from __future__ import annotations

import csv
import random

import pytest
import torch

from diffexp.cli import main
from diffexp.data.needle import (
    FILLER_SENTENCES,
    NEEDLE_TEMPLATE,
    QUESTION_TEMPLATE,
    make_sample,
    random_city,
    random_number,
)
from diffexp.data.tokenizer import HFTokenizer, train_bpe
from diffexp.evals.needle import evaluate_needles
from tests.helpers import save_checkpoint, small_model
from tests.oracles import NeedleOracle


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory):
    """(checkpoint of a tiny model after one step on text with a 512-token BPE, that BPE)."""
    from diffexp.data import TextDataModule

    root = tmp_path_factory.mktemp("bpe")
    datamodule = TextDataModule(tokenizer="bpe", bpe_vocab_size=512, seq_len=32, cache_dir=str(root / "cache"))
    model = small_model(vocab_size=datamodule.tokenizer.vocab_size, max_seq_len=128)
    checkpoint = save_checkpoint(model, root / "run" / "checkpoints" / "last.ckpt", datamodule)
    return checkpoint, datamodule.tokenizer


@pytest.fixture(scope="module")
def needle_bpe():
    """A BPE trained on needle text: it merges the space before a number into the number's first token."""
    rng = random.Random(0)
    lines = list(FILLER_SENTENCES) * 50
    for _ in range(2000):
        city, number = random_city(rng, "train"), random_number(rng, "train")
        question = QUESTION_TEMPLATE.format(city=city)
        lines.append(NEEDLE_TEMPLATE.format(city=city, number=number) + "\n" + question + number + ".")
    return HFTokenizer(train_bpe(lines, 400), "needle-test-bpe")


@pytest.mark.parametrize("haystack", ["synthetic", "corpus"])
@pytest.mark.parametrize("trained_on", ["text", "needles"])
def test_bpe_samples_count_tokens_and_their_spans_decode_to_the_answers(bpe_run, needle_bpe, haystack, trained_on):
    bpe = bpe_run[1] if trained_on == "text" else needle_bpe
    for i, (n, r, depth) in enumerate([(1, 1, 0.0), (2, 2, 0.5), (3, 1, 1.0), (2, 1, None)]):
        s = make_sample(random.Random(i), 256, n, r, depth, haystack, "val", tokenizer=bpe)
        tokens = s.tokens.tolist()

        def text(span, tokens=tokens):
            return bpe.decode(tokens[span[0] : span[1]])

        assert len(tokens) == 257 and tokens[0] == bpe.eos_id
        assert len(bpe.decode(tokens)) > len(tokens)  # the context counts BPE tokens, not characters
        assert set(s.answer_prefixes) <= {"", " "}
        if trained_on == "needles":  # it merged " 4": the answer's first token holds the space, the prompt ends at "?"
            assert set(s.answer_prefixes) == {" "}
        for positions, answer, prefix, query_row in zip(s.answer_target_positions, s.answers, s.answer_prefixes,
                                                        s.query_positions):
            assert positions == list(range(positions[0], positions[-1] + 1)) and query_row == positions[0] - 1
            assert text((positions[0], positions[-1] + 1)) == prefix + answer + "." and not prefix.strip()
        for span, answer in zip(s.answer_spans, s.answers):
            assert text(span).strip() == answer
        for span, city in zip(s.query_spans, s.cities):
            assert text(span).strip() == QUESTION_TEMPLATE.format(city=city).strip()
        for span, city, number in zip(s.needle_spans, s.needle_cities, s.needle_numbers):
            assert text(span).strip() == NEEDLE_TEMPLATE.format(city=city, number=number)
        haystack_text = text((1, s.query_start))
        assert haystack_text.count("magic number") == n
        assert all(haystack_text.count(number) == 1 for number in s.needle_numbers)
        assert sorted(s.answer_needle_spans) == sorted(span for span in s.needle_spans
                                                       if text(span).split()[4] in s.cities)


def test_the_oracle_scores_one_through_a_bpe(needle_bpe):
    """Prompts, the stop at ".", the answer comparison and the candidates' tokens all line up in token space."""
    bpe = needle_bpe
    results = evaluate_needles(NeedleOracle(bpe), [256], depths=(0.0, 1.0), nr=((1, 1), (2, 2)), samples=2,
                               haystack="synthetic", progress=False, tokenizer=bpe)
    assert [row["accuracy"] for row in results.rows] == [1.0] * 8
    assert all(rec["greedy_output"] == rec["answer"] for rec in results.records)
    # and a model that is not the oracle is scored on the same footing: chance-level, not an error
    torch.manual_seed(0)
    guess = evaluate_needles(lambda idx: torch.randn(*idx.shape, bpe.vocab_size), [256], depths=(0.5,),
                             nr=((2, 1),), samples=2, haystack="synthetic", progress=False, tokenizer=bpe)
    assert not any(rec["greedy_correct"] for rec in guess.records)


def test_eval_needle_on_a_bpe_checkpoint(bpe_run, capsys, tmp_path):
    checkpoint, bpe = bpe_run
    args = ["eval", "needle", str(checkpoint), "--context-lens", "128", "--depths", "0", "1", "--nr", "1,1",
            "--samples", "2", "--haystack", "synthetic", "--device", "cpu"]
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 0
    assert "| rank |" in capsys.readouterr().out
    eval_dir = checkpoint.parent.parent / "eval"
    rows = list(csv.DictReader((eval_dir / "needles.csv").open()))
    assert {(row["method"], row["context_len"], row["asked"]) for row in rows} == {
        ("greedy", "128", "2"), ("rank", "128", "2")}
    assert all(0.0 <= float(row["accuracy"]) <= 1.0 for row in rows)
    assert "0% answer" in (eval_dir / "attention.md").read_text()
    # saved without its tokenizer, the checkpoint asks for one before building anything
    bare = save_checkpoint(small_model(vocab_size=bpe.vocab_size, max_seq_len=128), tmp_path / "bare.ckpt")
    with pytest.raises(SystemExit) as exit_:
        main(["eval", "needle", str(bare), "--context-lens", "128", "--nr", "1,1", "--device", "cpu"])
    assert exit_.value.code == 2 and "--tokenizer" in capsys.readouterr().err
    assert not (tmp_path / "bare-eval").exists()


def test_the_data_module_writes_needles_in_a_tokenizer_json(needle_bpe, tmp_path):
    from diffexp.data.needle import NeedleDataModule
    from diffexp.errors import UserError

    path = tmp_path / "tokenizer.json"
    needle_bpe.tokenizer.save(str(path))
    dm = NeedleDataModule(context_len=256, n_needles=2, n_queries=2, haystack="synthetic", batch_size=2,
                          train_size=2, val_size=2, tokenizer=str(path))
    assert (dm.vocab_size, dm.eos_id) == (needle_bpe.vocab_size, needle_bpe.eos_id)
    row, sample = dm.dataset("val")[1], list(dm.samples("val"))[1]
    assert row["tokens"].shape == (257,) and torch.equal(row["tokens"], sample.tokens)
    targets = row["tokens"][1:][row["loss_mask"].bool()].tolist()
    assert needle_bpe.decode(targets) == "".join(f" {answer}." for answer in sample.answers)
    with pytest.raises(UserError, match="data.tokenizer='/nonexistent/tokenizer.json'"):
        NeedleDataModule(tokenizer="/nonexistent/tokenizer.json")

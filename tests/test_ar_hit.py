"""AR-Hit mask on hand-built sequences, the frequency threshold, and the split logged in validation."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from diffexp import ModelConfig
from diffexp.errors import UserError
from diffexp.training.loss_slices import DEFAULT_TOP_PERCENT, ar_hit_mask, counted_rows, frequent_bigrams
from diffexp.training.module import ARHitConfig, DiffexpLM


def test_ar_hit_mask_by_hand():
    #            x0 x1 x2 x3 x4 x5 x6 x7
    row = [5, 6, 7, 5, 6, 7, 5, 5]
    # targets x1..x7 with bigrams (5,6) (6,7) (7,5) (5,6)* (6,7)* (7,5)* (5,5)
    expected = [False, False, False, True, True, True, False]
    mask = ar_hit_mask(torch.tensor([row]), vocab_size=10)
    assert mask.tolist() == [expected]


def test_first_occurrence_is_never_a_hit_and_rows_are_independent():
    rows = torch.tensor([[1, 1, 1, 1], [2, 3, 2, 3]])
    # row 0: (1,1) (1,1)* (1,1)*; row 1: (2,3) (3,2) (2,3)*
    assert ar_hit_mask(rows, vocab_size=4).tolist() == [[False, True, True], [False, False, True]]


def test_same_token_after_different_context_is_not_a_hit():
    rows = torch.tensor([[1, 9, 2, 9, 1, 9]])
    # (1,9) (9,2) (2,9) (9,1) (1,9)*
    assert ar_hit_mask(rows, vocab_size=10).tolist() == [[False, False, False, False, True]]


def test_frequent_bigrams_are_left_out_of_hits():
    train = np.array([[5, 6, 5, 6, 5, 6], [5, 6, 1, 2, 3, 4]])  # (5,6) x4 in training, others rare
    frequent = frequent_bigrams(train, vocab_size=10, min_count=3)
    assert frequent.tolist() == [5 * 10 + 6]
    rows = torch.tensor([[5, 6, 5, 6, 1, 2, 1, 2]])
    plain = ar_hit_mask(rows, vocab_size=10)
    filtered = ar_hit_mask(rows, vocab_size=10, frequent=frequent)
    # (5,6) (6,5) (5,6)* (6,1) (1,2) (2,1) (1,2)*
    assert plain.tolist() == [[False, False, True, False, False, False, True]]
    assert filtered.tolist() == [[False, False, False, False, False, False, True]]
    top = frequent_bigrams(train, vocab_size=10, top_percent=20)
    assert top.tolist() == [56]


def naive_frequent(train: np.ndarray, vocab: int, top_percent: float) -> set[int]:
    """The top top_percent % of the distinct training bigrams by count, ties with the last kept included."""
    counts = Counter(int(a) * vocab + int(b) for row in train for a, b in zip(row[:-1], row[1:]))
    ranked = sorted(counts.values(), reverse=True)
    last = ranked[max(1, round(len(ranked) * top_percent / 100)) - 1]
    return {bigram for bigram, count in counts.items() if count >= last}


def naive_hits(row: list[int], frequent: set[int], vocab: int) -> list[bool]:
    seen, hits = set(), []
    for prev, token in zip(row[:-1], row[1:]):
        bigram = prev * vocab + token
        hits.append(bigram in seen and bigram not in frequent)
        seen.add(bigram)  # after scoring: a first occurrence is never a hit
    return hits


def zipf_rows(rng, rows: int, length: int, vocab: int) -> np.ndarray:
    weights = 1.0 / np.arange(1, vocab + 1)
    return rng.choice(vocab, size=(rows, length), p=weights / weights.sum())


def test_default_threshold_is_the_top_percent_of_training_bigrams():
    """The default leaves the top 1 % of the distinct training bigrams out of the hits; exclude_frequent
    false keeps today's reading (every repeated bigram is a hit)."""
    assert ARHitConfig().exclude_frequent and ARHitConfig().threshold() == {"top_percent": DEFAULT_TOP_PERCENT}
    assert DEFAULT_TOP_PERCENT == 1.0
    assert ARHitConfig(exclude_frequent=False).threshold() is None
    assert ARHitConfig(min_count=4).threshold() == {"min_count": 4}
    rng = np.random.default_rng(0)
    vocab = 40
    train, val = zipf_rows(rng, 50, 33, vocab), zipf_rows(rng, 6, 33, vocab)
    expected = naive_frequent(train, vocab, DEFAULT_TOP_PERCENT)
    frequent = frequent_bigrams(train, vocab, **ARHitConfig().threshold())
    assert set(frequent.tolist()) == expected and 1 <= len(expected) < 40
    mask = ar_hit_mask(torch.from_numpy(val), vocab, frequent)
    assert mask.tolist() == [naive_hits(row.tolist(), expected, vocab) for row in val]
    plain = ar_hit_mask(torch.from_numpy(val), vocab)
    assert plain.tolist() == [naive_hits(row.tolist(), set(), vocab) for row in val]
    assert plain.sum() > mask.sum()  # frequent repeats were hits before


def test_large_splits_are_counted_on_evenly_spaced_rows():
    rows = np.arange(100 * 9).reshape(100, 9) % 7
    assert counted_rows(rows, max_tokens=10**6).shape == (100, 9)
    sample = counted_rows(rows, max_tokens=5 * 9)
    np.testing.assert_array_equal(sample, rows[[0, 25, 50, 74, 99]])  # linspace(0, 99, 5), rounded
    # min_count is a count in the whole split: a sample's counts are scaled by rows / sampled rows
    train = np.tile(np.array([[1, 2, 1, 2, 3, 4]]), (10, 1))  # (1,2) x2 per row, 20 in the split
    assert frequent_bigrams(train, 10, min_count=20, max_tokens=12).tolist() == [12]
    assert frequent_bigrams(train, 10, min_count=21, max_tokens=12).tolist() == []


def test_validation_split_uses_the_default_threshold():
    """DiffexpLM counts the training split's bigrams once and splits the validation losses with them."""
    rng = np.random.default_rng(1)
    vocab = 40
    train, val = zipf_rows(rng, 40, 17, vocab), torch.from_numpy(zipf_rows(rng, 4, 17, vocab))
    losses = torch.rand(4, 16, dtype=torch.float64)
    sums = {}
    for name, config in (("default", ARHitConfig()), ("every", ARHitConfig(exclude_frequent=False))):
        lm = DiffexpLM(arch=ModelConfig(vocab_size=vocab, d_model=16, n_layers=1, n_heads=2), ar_hit=config)
        lm._trainer = SimpleNamespace(datamodule=SimpleNamespace(train_rows=train))
        lm._accumulate_ar_hit(val, losses)
        sums[name] = lm._split_sums.clone()
    frequent = naive_frequent(train, vocab, DEFAULT_TOP_PERCENT)
    for name, excluded in (("default", frequent), ("every", set())):
        hits = torch.tensor([naive_hits(row.tolist(), excluded, vocab) for row in val])
        expected = [losses[hits].sum(), hits.sum(), losses[~hits].sum(), (~hits).sum()]
        torch.testing.assert_close(sums[name], torch.stack(expected).double())
    assert sums["default"][1] < sums["every"][1]


def test_exclusion_without_training_rows_is_a_clear_error():
    lm = DiffexpLM(arch=ModelConfig(vocab_size=40, d_model=16, n_layers=1, n_heads=2))
    lm._trainer = SimpleNamespace(datamodule=None)
    with pytest.raises(UserError, match="model.ar_hit.exclude_frequent false"):
        lm._accumulate_ar_hit(torch.zeros(1, 5, dtype=torch.long), torch.zeros(1, 4))


def test_threshold_without_exclusion_is_refused():
    with pytest.raises(UserError, match="model.ar_hit.exclude_frequent=False and model.ar_hit.min_count=3"):
        ARHitConfig(exclude_frequent=False, min_count=3)

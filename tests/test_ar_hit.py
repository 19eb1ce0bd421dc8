"""AR-Hit mask on hand-built sequences, the frequency threshold, and the split logged in validation."""

from __future__ import annotations

import numpy as np
import torch

from diffexp.training.loss_slices import ar_hit_mask, frequent_bigrams


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
    assert frequent[5 * 10 + 6] and not frequent[1 * 10 + 2]
    rows = torch.tensor([[5, 6, 5, 6, 1, 2, 1, 2]])
    plain = ar_hit_mask(rows, vocab_size=10)
    filtered = ar_hit_mask(rows, vocab_size=10, frequent=frequent)
    # (5,6) (6,5) (5,6)* (6,1) (1,2) (2,1) (1,2)*
    assert plain.tolist() == [[False, False, True, False, False, False, True]]
    assert filtered.tolist() == [[False, False, False, False, False, False, True]]
    top = frequent_bigrams(train, vocab_size=10, top_percent=20)
    assert top[5 * 10 + 6] and int(top.sum()) == 1

"""Attention to answer vs noise and the fraction of negative entries, on hand-built maps with known answers."""

from __future__ import annotations

import pytest
import torch

from diffexp.evals.attention import (
    attention_allocation,
    attention_by_depth,
    attention_table,
    negative_fraction,
    negative_fraction_by_layer,
)
from diffexp.evals.needle import eval_samples
from diffexp.model import Decoder
from diffexp.model.config import ModelConfig

T = 6


def _map(rows: dict[tuple[int, int], list[float]], heads: int = 2, batch: int = 1) -> torch.Tensor:
    """(batch, heads, T, T) zeros with the given (head, row) rows filled in (batch 0)."""
    m = torch.zeros(batch, heads, T, T)
    for (h, q), values in rows.items():
        m[0, h, q] = torch.tensor(values)
    return m


def test_shares_on_a_positive_map_averaged_over_heads():
    m = _map({(0, 5): [0.1, 0.2, 0.3, 0.1, 0.1, 0.2], (1, 5): [0.0, 0.0, 1.0, 0.0, 0.0, 0.0]})
    alloc = attention_allocation([m], [[5]], [[(1, 3)]], query_starts=[4])
    # head 0: answer 0.2+0.3 = 0.5, query (4, 5) 0.3, noise (0, 3) 0.2; head 1: answer 1
    assert alloc.answer.tolist() == pytest.approx([0.75])
    assert alloc.query.tolist() == pytest.approx([0.15])
    assert alloc.noise.tolist() == pytest.approx([0.10])
    assert alloc.distractor is None
    assert alloc.overall() == pytest.approx({"answer": 0.75, "noise": 0.10, "query": 0.15})


def test_negative_entries_are_normalised_by_the_absolute_row_sum():
    # rows summing to 1 - lambda with a negative entry: |row| sums to 1.5
    row = [0.5, -0.25, 0.5, 0.25, 0.0, 0.0]
    m = _map({(0, 5): row, (1, 5): row})
    alloc = attention_allocation([m], [5], [(2, 3)])  # no query_start: the query is the row itself
    assert alloc.answer.item() == pytest.approx(0.5 / 1.5)
    assert alloc.noise.item() == pytest.approx((0.5 + 0.25 + 0.25) / 1.5)
    assert alloc.query.item() == pytest.approx(0.0)
    assert 0.0 <= alloc.answer.item() <= 1.0 and 0.0 <= alloc.noise.item() <= 1.0


def test_entries_after_the_query_row_and_distractor_needles():
    # entries to the right of q (non-causal) are ignored; positions 0..3 are the causal part of row 3
    m = _map({(0, 3): [0.2, 0.4, 0.2, 0.2, 0.7, 0.7]}, heads=1)
    alloc = attention_allocation([m], [[3]], [[(1, 2)]], needle_spans=[[(1, 2), (2, 3)]])
    assert alloc.answer.item() == pytest.approx(0.4)
    assert alloc.query.item() == pytest.approx(0.2)  # the row's own position 3
    assert alloc.noise.item() == pytest.approx(0.4)  # positions 0 and 2
    assert alloc.distractor.item() == pytest.approx(0.2)  # position 2: the other needle, part of the noise


def test_per_layer_values_several_rows_and_samples():
    layer0 = torch.zeros(2, 1, T, T)
    layer0[0, 0, 4] = torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0, 0.0])  # sample 0, row 4: all on the answer (1, 2)
    layer0[0, 0, 5] = torch.tensor([0.5, 0.0, 0.0, 0.0, 0.0, 0.5])  # sample 0, row 5: answer (3, 4) gets 0
    layer0[1, 0, 5] = torch.tensor([0.0, 0.0, 0.0, 0.5, 0.5, 0.0])  # sample 1, row 5: answer (3, 5) gets 1
    layer1 = torch.zeros(2, 1, T, T)
    layer1[:, 0, :, 0] = 1.0  # every row on the first token: all noise
    alloc = attention_allocation([layer0, layer1], [[4, 5], [5]], [[(1, 2), (3, 4)], [(3, 5)]])
    # layer 0: rows (1 + 0 + 1) / 3 answer; noise only in sample 0 row 5: 0.5 -> 0.5 / 3
    assert alloc.answer.tolist() == pytest.approx([2 / 3, 0.0])
    assert alloc.noise.tolist() == pytest.approx([0.5 / 3, 1.0])
    assert alloc.query.tolist() == pytest.approx([0.5 / 3, 0.0])
    assert alloc.overall()["answer"] == pytest.approx(1 / 3)
    assert [r["layer"] for r in alloc.per_layer()] == [0, 1]


def test_negative_fraction_counts_causal_entries_only():
    m = torch.zeros(1, 2, 3, 3)
    m[0, 0] = torch.tensor([[1.0, 0.0, 0.0], [-0.1, 1.1, 0.0], [0.3, -0.2, 0.9]])
    m[0, 0, 0, 2] = -5.0  # above the diagonal: not counted
    m[0, 1] = torch.tensor([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    # 6 causal entries per head, 2 heads: 2 negatives out of 12
    assert negative_fraction(m) == pytest.approx(2 / 12)
    other = -torch.ones(1, 2, 3, 3)  # all 12 causal entries negative
    assert negative_fraction_by_layer([m, other]) == pytest.approx([2 / 12, 1.0])
    assert negative_fraction([m, other]) == pytest.approx(14 / 24)


@pytest.mark.parametrize("attention", ["baseline", "dint"])
def test_attention_by_depth_on_a_model(attention):
    torch.manual_seed(0)
    model = Decoder(ModelConfig(attention=attention, vocab_size=257, d_model=32, n_layers=2, n_heads=2,
                                max_seq_len=256))
    by_depth = {d: eval_samples(256, d, 2, 2, 2, "synthetic") for d in (0.0, 1.0)}
    rows = attention_by_depth(model, by_depth, batch_size=2)
    assert [(r["depth"], r["layer"]) for r in rows] == [(0.0, 0), (0.0, 1), (0.0, "all"), (1.0, 0), (1.0, 1),
                                                        (1.0, "all")]
    for r in rows:
        assert 0 <= r["answer"] <= 1 and 0 <= r["noise"] <= 1 and 0 <= r["distractor"] <= r["noise"] + 1e-6
        assert r["answer"] + r["noise"] + r["query"] == pytest.approx(1.0, abs=1e-5)
    table = attention_table(rows, attention)
    assert table.splitlines()[0].startswith(f"| {attention} | 0% answer")
    assert len(table.splitlines()) == 2 + 3
    _, maps = model(by_depth[0.0][0].tokens[None, :-1], need_weights=True)
    if attention == "baseline":
        assert negative_fraction(maps) == 0.0

"""AR-Hit / Others split of the validation loss (Table 6 of the Shared DIFF and DINT papers, after zoology).

A target x_i is an AR-Hit when its bigram (x_{i-1}, x_i) already occurred earlier in the same sequence (a
bigram's first occurrence never is) and is not frequent in the training split; every other target is Others.
Frequent: the top DEFAULT_TOP_PERCENT % of the distinct training bigrams by count, or a count threshold, counted
over at most MAX_COUNTED_TOKENS tokens of evenly spaced rows (seconds, no vocab^2 table, at any corpus size).
"""

from __future__ import annotations

import numpy as np
import torch

#: the default threshold: the most frequent 1 % of the distinct training bigrams are not AR-Hits
DEFAULT_TOP_PERCENT = 1.0
#: training tokens counted at most (2^25, about 33.5M: a sample of evenly spaced rows beyond that)
MAX_COUNTED_TOKENS = 2**25


def ar_hit_mask(tokens: torch.Tensor, vocab_size: int, frequent: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T + 1) token rows -> (B, T) bool mask over the targets tokens[:, 1:] that are AR-Hits.

    frequent: sorted bigram ids (first * vocab_size + second) that are never hits, from frequent_bigrams;
    None: every repeated bigram is a hit.
    """
    bigrams = tokens[:, :-1].long() * vocab_size + tokens[:, 1:].long()
    # a bigram is a hit at every occurrence after its first: sort stably, mark repeats, scatter back
    ordered, order = torch.sort(bigrams, dim=1, stable=True)
    repeat = torch.zeros_like(ordered, dtype=torch.bool)
    repeat[:, 1:] = ordered[:, 1:] == ordered[:, :-1]
    hits = torch.zeros_like(repeat).scatter(1, order, repeat)
    if frequent is not None:
        hits &= ~torch.isin(bigrams, frequent.to(bigrams.device))
    return hits


def counted_rows(train_rows: np.ndarray, max_tokens: int = MAX_COUNTED_TOKENS) -> np.ndarray:
    """The training rows whose bigrams are counted: all of them, or evenly spaced ones up to max_tokens."""
    n, length = train_rows.shape
    if n * length <= max_tokens:
        return np.asarray(train_rows)
    keep = max(1, max_tokens // length)
    return np.asarray(train_rows[np.unique(np.linspace(0, n - 1, keep).round().astype(np.int64))])


def frequent_bigrams(train_rows: np.ndarray, vocab_size: int, min_count: int | None = None,
                     top_percent: float | None = None, max_tokens: int = MAX_COUNTED_TOKENS) -> torch.Tensor:
    """Sorted int64 ids (first * vocab_size + second) of the bigrams frequent in the training rows.

    min_count: a bigram seen at least this often in the training split is frequent (counts from a sample
        are scaled up to the whole split).
    top_percent: the most frequent top_percent % of the distinct bigrams seen in training are frequent
        (ties with the last one kept are kept too).
    """
    if (min_count is None) == (top_percent is None):
        raise ValueError("give exactly one of min_count and top_percent")
    rows = counted_rows(train_rows, max_tokens).astype(np.int64)
    ids, counts = np.unique((rows[:, :-1] * vocab_size + rows[:, 1:]).ravel(), return_counts=True)
    if min_count is not None:
        scale = train_rows.shape[0] / max(len(rows), 1)  # sampled rows -> the whole split
        frequent = counts * scale >= min_count
    else:
        if not 0 < top_percent < 100:
            raise ValueError(f"top_percent={top_percent!r}: expected a number in (0, 100)")
        keep = max(1, round(len(counts) * top_percent / 100))
        threshold = np.sort(counts)[::-1][keep - 1] if len(counts) else 1
        frequent = counts >= threshold
    return torch.from_numpy(ids[frequent])  # np.unique returns them sorted

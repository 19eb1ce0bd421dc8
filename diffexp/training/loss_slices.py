"""AR-Hit / Others split of the validation loss (Table 6 of the Shared DIFF and DINT papers; zoology).

A target x_i is an AR-Hit when the bigram (x_{i-1}, x_i) already occurred earlier in the same
sequence: some j < i with x_{j-1} = x_{i-1} and x_j = x_i (the set of seen bigrams is updated only
after scoring i, so a bigram's first occurrence is never a hit). Bigrams that are frequent in the
training data can be left out of the hits (zoology's refinement); they then count as Others.
"""

from __future__ import annotations

import numpy as np
import torch


def ar_hit_mask(tokens: torch.Tensor, vocab_size: int, frequent: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T + 1) token rows -> (B, T) bool mask over the targets tokens[:, 1:] that are AR-Hits."""
    bigrams = tokens[:, :-1].long() * vocab_size + tokens[:, 1:].long()
    # a bigram is a hit at every occurrence after its first: sort stably, mark repeats, scatter back
    ordered, order = torch.sort(bigrams, dim=1, stable=True)
    repeat = torch.zeros_like(ordered, dtype=torch.bool)
    repeat[:, 1:] = ordered[:, 1:] == ordered[:, :-1]
    hits = torch.zeros_like(repeat).scatter(1, order, repeat)
    if frequent is not None:
        hits &= ~frequent.to(bigrams.device)[bigrams]
    return hits


def frequent_bigrams(train_rows: np.ndarray, vocab_size: int, min_count: int | None = None,
                     top_percent: float | None = None) -> torch.Tensor:
    """Bool table over bigram ids (vocab_size ** 2) of the bigrams frequent in the training rows.

    min_count: a bigram seen at least this often in training is frequent.
    top_percent: the most frequent top_percent % of the distinct bigrams seen in training are frequent.
    """
    if (min_count is None) == (top_percent is None):
        raise ValueError("give exactly one of min_count and top_percent")
    rows = np.asarray(train_rows, dtype=np.int64)
    ids = (rows[:, :-1] * vocab_size + rows[:, 1:]).ravel()
    counts = np.bincount(ids, minlength=vocab_size * vocab_size)
    if min_count is not None:
        threshold = min_count
    else:
        if not 0 < top_percent < 100:
            raise ValueError(f"top_percent={top_percent!r}: expected a number in (0, 100)")
        seen = np.sort(counts[counts > 0])[::-1]
        keep = max(1, round(len(seen) * top_percent / 100))  # ties with the last kept count are kept too
        threshold = seen[keep - 1]
    return torch.from_numpy(counts >= threshold)

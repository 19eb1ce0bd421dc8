"""One decoding step of the two-map head, at the cost its math needs: both maps' scores against the cached
keys, and V read once, through the combined map (A1 - lambda A2 [+ gamma A3]) of the step's row. DINT's A3 row
comes from the column sums of A1's earlier rows, kept in the cache: O(context) state per head.
"""

from __future__ import annotations

import torch


def two_map_step(q1, q2, k1, k2, v, lam, key_mask=None, integral=None, col_sums=None, positions=None):
    """q1, q2: (B, h, 1, d); k1, k2: (B, h_kv, S, d); v: (B, h_kv, S, dv); lam: a number, a 0-d tensor or
    (B, h, 1, 1); key_mask: (B, 1, 1, S), True where a row may read a key, or None (all). With an `Integral`:
    col_sums (B, h, >= S), A1's column sums of the earlier rows, updated in place, and positions (B,), each row's
    position. Returns (B, h, 1, dv)."""
    b, h, _, d = q1.shape
    h_kv, keys = k1.shape[1], k1.shape[-2]
    group = h // h_kv

    def probabilities(q, k):  # (B, h_kv, rows, S): query head p reads kv head p // group
        scores = (q.reshape(b, h_kv, -1, d) * d ** -0.5) @ k.transpose(-1, -2)
        if key_mask is not None:
            scores = scores.masked_fill(~key_mask, float("-inf"))
        return scores.softmax(dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))

    if k1 is k2:  # DIFF V2's pairs: both maps' queries in one product with the shared K
        both = probabilities(torch.stack((q1.reshape(b, h_kv, group, d), q2.reshape(b, h_kv, group, d)), 2), k1)
        a1, a2 = both.unflatten(2, (2, group)).unbind(2)
    else:
        a1, a2 = probabilities(q1, k1), probabilities(q2, k2)
    combined = a1 - _per_head(lam, b, h_kv, group) * a2
    if integral is not None:
        sums = col_sums[..., :keys].view(b, h_kv, group, keys)
        sums += a1  # this row joins A1's column sums
        mean_row = sums / (positions + 1).to(a1.dtype).view(-1, 1, 1, 1)  # G[n] = (1/n) sum_{m<=n} A1[m]
        if integral.kind == "mean":
            a3 = mean_row
        else:
            a3 = mean_row if key_mask is None else mean_row.masked_fill(~key_mask, float("-inf"))
            a3 = a3.softmax(dim=-1)
        combined = combined + integral.gamma.to(a1.dtype) * a3
    out = combined.to(v.dtype) @ v
    return out.view(b, h, 1, v.shape[-1])


def _per_head(lam, b: int, h_kv: int, group: int):
    """lambda broadcast over (B, h_kv, group, S)."""
    if torch.is_tensor(lam) and lam.dim() > 0:
        return lam.reshape(b, h_kv, group, 1)
    return lam


def single_map_step(q, k, v, key_mask=None):
    """softmax(q k^T / sqrt(d)) V for one query per head: q (B, Hq, 1, d), k (B, Hk, S, d), v (B, Hk, S, dv). The
    query heads of a GQA group share one product with their K and one with their V: each is read once."""
    b, hq, _, d = q.shape
    h_kv = k.shape[1]
    scores = (q.reshape(b, h_kv, hq // h_kv, d) * d ** -0.5) @ k.transpose(-1, -2)
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask, float("-inf"))
    weights = scores.softmax(dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
    return (weights.to(v.dtype) @ v).view(b, hq, 1, v.shape[-1])

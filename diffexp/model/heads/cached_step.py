"""One decoding step of the two-map head, at the cost its math needs: both maps' scores against the cached
keys, and V read once, through the combined map (A1 - lambda A2 [+ gamma A3]) of the step's row. DINT's A3 row
comes from the column sums of A1's earlier rows, kept in the cache: O(context) state per head.

The query rows of a GQA group share one product with their K and one with their V (plain matmuls; torch.compile
fuses the rest of the step around them).
"""

from __future__ import annotations

import torch


def key_mask(lengths: torch.Tensor | None, keys: int) -> torch.Tensor | None:
    """(B, 1, 1, keys): True where row b may read key j (j < lengths[b]); None when it may read every key."""
    if lengths is None:
        return None
    return (torch.arange(keys, device=lengths.device) < lengths[:, None]).view(-1, 1, 1, keys)


def probabilities(q: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) over each row's visible keys. q: (B, h_kv, rows, d), the rows of a GQA group;
    k: (B, h_kv, S, d). Returns (B, h_kv, rows, S), in fp32 at least."""
    scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-1, -2)
    mask = key_mask(lengths, k.shape[-2])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))


def weighted_values(weights: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """weights @ v: (B, h_kv, rows, S) @ (B, h_kv, S, dv); weights past each row's visible keys are 0."""
    return weights.to(v.dtype) @ v


def two_map_step(q1, q2, k1, k2, v, lam, lengths=None, integral=None, col_sums=None, positions=None):
    """q1, q2: (B, h, 1, d); k1, k2: (B, h_kv, S, d); v: (B, h_kv, S, dv); lam: a number, a 0-d tensor or
    (B, h, 1, 1); lengths: (B,), the keys row b may read (the first lengths[b]), or None (all). With an `Integral`:
    col_sums (B, h, >= S), A1's column sums of the earlier rows, updated in place, and positions (B,), each row's
    position. Returns (B, h, 1, dv)."""
    b, h, _, d = q1.shape
    h_kv, keys = k1.shape[1], k1.shape[-2]
    group = h // h_kv

    q1, q2 = q1.reshape(b, h_kv, group, d), q2.reshape(b, h_kv, group, d)
    if k1 is k2:  # both maps' queries in one product with the shared K
        a1, a2 = probabilities(torch.cat((q1, q2), 2), k1, lengths).chunk(2, dim=2)
    else:
        a1, a2 = probabilities(q1, k1, lengths), probabilities(q2, k2, lengths)
    combined = a1 - _per_head(lam, b, h_kv, group) * a2
    if integral is not None:
        sums = col_sums[..., :keys].view(b, h_kv, group, keys)
        sums += a1  # this row joins A1's column sums
        mean_row = sums / (positions + 1).to(a1.dtype).view(-1, 1, 1, 1)  # G[n] = (1/n) sum_{m<=n} A1[m]
        if integral.kind == "mean":
            a3 = mean_row
        else:
            mask = key_mask(lengths, keys)
            a3 = (mean_row if mask is None else mean_row.masked_fill(~mask, float("-inf"))).softmax(dim=-1)
        combined = combined + integral.gamma.to(a1.dtype) * a3
    return weighted_values(combined, v, lengths).view(b, h, 1, v.shape[-1])


def _per_head(lam, b: int, h_kv: int, group: int):
    """lambda broadcast over (B, h_kv, group, S)."""
    if torch.is_tensor(lam) and lam.dim() > 0:
        return lam.reshape(b, h_kv, group, 1)
    return lam


def single_map_step(q, k, v, lengths=None):
    """softmax(q k^T / sqrt(d)) V for one query per head: q (B, Hq, 1, d), k (B, Hk, S, d), v (B, Hk, S, dv). The
    query heads of a GQA group share one pass over their K and one over their V."""
    b, hq, _, d = q.shape
    h_kv = k.shape[1]
    q = q.reshape(b, h_kv, hq // h_kv, d)
    return weighted_values(probabilities(q, k, lengths), v, lengths).view(b, hq, 1, v.shape[-1])

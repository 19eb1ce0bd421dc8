"""The plain two-map head, one attention call per map: the eager maps, SDPA over whole sequences, and a chunk
of tokens after a cache. DINT's integral is added from A1's full map (eager), from A1 V (mean), from the streaming
pass fused with map 1 (softmax), or, decoding, from the column sums of A1's earlier rows kept in the cache.
"""

from __future__ import annotations

import torch

from diffexp.model.heads.dint_integral import fused_first_map_integral, integral_rows
from diffexp.model.heads.single_map import attend, expand_kv


def row_positions(t: int, like: torch.Tensor, start: int = 0) -> torch.Tensor:
    """n = 1, 2, ... for rows start .. start + t - 1, shaped to divide (..., t, cols)."""
    return torch.arange(start + 1, start + t + 1, device=like.device, dtype=like.dtype).unsqueeze(-1)


def integral_map(a1: torch.Tensor, integral: str) -> torch.Tensor:
    """A3 from the full map A1 (B, h, T, T): the causal softmax of the cumulative row mean G, or G itself."""
    t = a1.shape[-1]
    g = a1.cumsum(dim=-2) / row_positions(t, a1)
    if integral == "mean":
        return g
    future = torch.ones(t, t, dtype=torch.bool, device=g.device).triu(1)
    return g.masked_fill(future, float("-inf")).softmax(dim=-1)


def per_map_head(q1, q2, k1, k2, v, lam, integral, cache, eager: bool):
    """(A1 - lambda A2 [+ gamma A3]) V and, when eager, the effective map; arguments as `two_map_head`."""
    h = q1.shape[1]
    call = dict(backend="eager" if eager else "sdpa", need_weights=eager)
    fuse_integral = integral is not None and integral.kind == "softmax" and not eager and cache is None
    if fuse_integral:  # (A1 + gamma A3) V in one streaming pass
        out1, weights1 = fused_first_map_integral(q1, expand_kv(k1, h), expand_kv(v, h), integral.gamma,
                                                  integral.block_size), None
    else:
        out1, weights1 = attend(q1, k1, v, **call)
    out2, weights2 = attend(q2, k2, v, **call)
    out = out1 - _as(lam, out1.dtype) * out2
    effective = weights1 - _as(lam, torch.promote_types(weights1.dtype, torch.float32)) * weights2 \
        if weights1 is not None else None
    if integral is None or fuse_integral:
        return out, effective
    if cache is not None:  # the new rows from the column sums of A1's earlier rows: O(T) state per head
        sums = cache.sums("col_sums", q1)
        keys, first = k1.shape[-2], k1.shape[-2] - q1.shape[-2]
        integral_out, sums[..., :keys] = integral_rows(
            q1, expand_kv(k1, h), expand_kv(v, h), integral.block_size, sums[..., :first] if first else None,
            integral.kind)
        integral_out = integral_out.to(v.dtype)
    elif weights1 is not None:
        a3 = integral_map(weights1, integral.kind)
        integral_out = a3.to(v.dtype) @ expand_kv(v, h)
        effective = effective + integral.gamma * a3
    else:  # the mean integral: G V = cumsum(A1 V) / n exactly
        integral_out = out1.cumsum(dim=-2) / row_positions(out1.shape[-2], out1)
    return out + integral.gamma.to(out.dtype) * integral_out, effective


def _as(lam, dtype: torch.dtype):
    """lambda (a number, a 0-d tensor or one per token) in the dtype it multiplies."""
    return lam.to(dtype) if torch.is_tensor(lam) else lam

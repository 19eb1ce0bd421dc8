"""DINT (Cang et al. 2025): differential attention plus an integral term; rows sum to 1.

    G[n, :] = (1/n) sum_{m<=n} A1[m, :]          cumulative mean of A1's rows (n is 1-based)
    A3      = softmax over j <= n of G[n, j]     (integral="softmax", the paper)
            = G                                  (integral="mean")
    Final   = A1 - lambda A2 + lambda A3         (gamma = lambda, so every row sums to 1)
    head    = GroupNorm(Final V)                 no (1 - lambda_init) factor

The fast path never builds a T x T map for the whole sequence: "mean" is cumsum(A1 V) / n, and
"softmax" streams over query blocks with running column sums of A1 (G lies in [0, 1], so exp(G)
needs no max subtraction).
"""

from __future__ import annotations

import math

import torch

from diffexp.model.attention.base import expand_kv
from diffexp.model.attention.differential import TwoMapDifferentialAttention


def row_positions(t: int, like: torch.Tensor, start: int = 0) -> torch.Tensor:
    """n = 1, 2, ... for rows start .. start + t - 1, shaped to divide (..., t, cols)."""
    return torch.arange(start + 1, start + t + 1, device=like.device, dtype=like.dtype).unsqueeze(-1)


def integral_map(weights1: torch.Tensor, integral: str) -> torch.Tensor:
    """A3 from the full map A1 (B, h, T, T), the naive way."""
    t = weights1.shape[-1]
    g = weights1.cumsum(dim=-2) / row_positions(t, weights1)
    if integral == "mean":
        return g
    future = torch.ones(t, t, dtype=torch.bool, device=g.device).triu(1)
    return g.masked_fill(future, float("-inf")).softmax(dim=-1)


def integral_softmax_streaming(q1: torch.Tensor, k1: torch.Tensor, v: torch.Tensor,
                               block_size: int = 128) -> torch.Tensor:
    """A3 V for integral="softmax", one query block at a time, carrying A1's column sums."""
    b, h, t, d = q1.shape
    k1, v = expand_kv(k1, h), expand_kv(v, h)
    scale = 1.0 / math.sqrt(d)
    dtype = torch.promote_types(q1.dtype, torch.float32)
    col_sums = q1.new_zeros(b, h, t, dtype=dtype)  # sum of A1 rows above the block
    outputs = []
    for start in range(0, t, block_size):
        end = min(start + block_size, t)
        rows = torch.arange(start, end, device=q1.device).unsqueeze(-1)
        future = torch.arange(end, device=q1.device) > rows  # (blk, end)
        logits = (q1[:, :, start:end].to(dtype) @ k1[:, :, :end].to(dtype).transpose(-1, -2)) * scale
        a1 = logits.masked_fill(future, float("-inf")).softmax(dim=-1)
        g = (col_sums[:, :, :end].unsqueeze(-2) + a1.cumsum(dim=-2)) / row_positions(end - start, a1, start)
        numer = torch.exp(g).masked_fill(future, 0.0)
        a3 = numer / numer.sum(dim=-1, keepdim=True)
        outputs.append(a3.to(v.dtype) @ v[:, :, :end])
        col_sums = torch.cat([col_sums[:, :, :end] + a1.sum(dim=-2), col_sums[:, :, end:]], dim=-1)
    return torch.cat(outputs, dim=-2)


class DintAttention(TwoMapDifferentialAttention):
    scale_by_lambda_init = False
    #: query rows per step of the streaming integral; memory is O(block_size * T) per head
    integral_block_size = 128

    def add_terms(self, out, effective, lam, q1, k1, v, out1, weights1):
        if weights1 is not None:  # eager: the naive map
            a3 = integral_map(weights1, self.cfg.integral)
            integral_out = a3.to(v.dtype) @ expand_kv(v, a3.shape[1])
            effective = effective + lam * a3
        elif self.cfg.integral == "mean":  # G V = cumsum(A1 V) / n exactly
            n = row_positions(out1.shape[-2], out1)
            integral_out = out1.cumsum(dim=-2) / n
        else:
            integral_out = integral_softmax_streaming(q1, k1, v, self.integral_block_size)
        return out + lam.to(out.dtype) * integral_out, effective

    def extra_repr(self) -> str:
        return super().extra_repr() + f", integral={self.cfg.integral}"

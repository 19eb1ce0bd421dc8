"""Shared DIFF (Cang et al., ICML 2025), equations (3)-(4).

    W_Q1 = W_Q + A_q1 B_q1^T,   W_Q2 = W_Q + A_q2 B_q2^T   (same for K)
    A: d_model x r,  B: d x r, one pair per head and map.

Computed as X W_Q once plus (X A) B^T, never forming d_model x d matrices. The rest (lambda,
GroupNorm, (1 - lambda_init), 2d-wide V) is DIFF V1's.

base_sharing="maps": each head has its own W_Q, shared by its two maps (default).
base_sharing="heads": one W_Q for all heads and both maps (the paper's section 2.4 wording).
B starts at N(0, lowrank_init_std^2), not zero: with B = 0 both maps would start identical and
A1 - lambda A2 would be (1 - lambda) A1.
"""

from __future__ import annotations

import torch
from torch import nn

from diffexp.model.attention.differential import TwoMapDifferentialAttention


class LowRankSharedProjection(nn.Module):
    """Two maps of `n_heads` heads: shared base X W plus per-map, per-head low-rank updates (X A) B^T."""

    def __init__(self, d_model: int, n_heads: int, head_dim: int, rank: int, share_across_heads: bool,
                 up_init_std: float) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.rank = n_heads, head_dim, rank
        self.base = nn.Linear(d_model, (1 if share_across_heads else n_heads) * head_dim, bias=False)
        self.down = nn.Linear(d_model, 2 * n_heads * rank, bias=False)  # A for (map, head)
        self.up = nn.Parameter(torch.empty(2, n_heads, rank, head_dim).normal_(0, up_init_std))  # B^T

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        shared = self.base(x).view(b, t, 1, -1, self.head_dim)  # broadcasts over maps (and heads)
        low = self.down(x).view(b, t, 2, self.n_heads, self.rank)
        update = torch.einsum("btmhr,mhrd->btmhd", low, self.up.to(low.dtype))
        both = shared + update  # (B, T, map, head, d)
        return both[:, :, 0].transpose(1, 2), both[:, :, 1].transpose(1, 2)


class SharedDiffAttention(TwoMapDifferentialAttention):
    def build_qk_projections(self) -> None:
        cfg = self.cfg
        across_heads = cfg.base_sharing == "heads"
        self.q_proj = LowRankSharedProjection(self.d_model, self.n_heads, self.head_dim, cfg.rank,
                                              across_heads, cfg.lowrank_init_std)
        self.k_proj = LowRankSharedProjection(self.d_model, self.n_kv_heads, self.head_dim, cfg.rank,
                                              across_heads, cfg.lowrank_init_std)

    def project_qk(self, x: torch.Tensor):
        q1, q2 = self.q_proj(x)
        k1, k2 = self.k_proj(x)
        return q1, q2, k1, k2

    def extra_repr(self) -> str:
        return super().extra_repr() + f", rank={self.cfg.rank}, base_sharing={self.cfg.base_sharing}"

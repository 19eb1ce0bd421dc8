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

from diffexp.errors import invalid
from diffexp.model.attention.differential import (
    TWO_MAP_CASES,
    TWO_MAP_FIELDS,
    TwoMapDifferentialAttention,
    check_two_map,
    naive_two_map,
    two_map_flops,
)
from diffexp.model.attention.registry import Variant, register


def check(cfg) -> None:
    check_two_map(cfg)
    if cfg.rank <= 0:
        raise invalid("model.arch.rank", cfg.rank, "expected a positive integer")
    if cfg.base_sharing not in ("maps", "heads"):
        raise invalid("model.arch.base_sharing", cfg.base_sharing, "expected 'maps' or 'heads'")
    if not cfg.lowrank_init_std >= 0:
        raise invalid("model.arch.lowrank_init_std", cfg.lowrank_init_std, "expected a standard deviation >= 0")


def attention_flops(cfg, keys: float) -> float:
    """DIFF V1's maps plus the low-rank up-projections (X A) B^T, which are not nn.Linear layers."""
    up_weights = 2 * (cfg.n_heads + cfg.kv_heads) * cfg.rank * cfg.resolved_head_dim  # 2 maps, Q and K
    return two_map_flops(cfg, keys) + 2 * up_weights


def naive_projection(proj, x: torch.Tensor, n_heads: int, cfg):
    """W_{map, head} = W_base(head) + A_{map, head} B_{map, head}^T, formed as full matrices."""
    r, d = cfg.rank, cfg.resolved_head_dim
    maps = []
    for map_idx in range(2):
        per_head = []
        for i in range(n_heads):
            base_rows = slice(0, d) if cfg.base_sharing == "heads" else slice(i * d, (i + 1) * d)
            w_base = proj.base.weight[base_rows].T  # (d_model, d)
            a = proj.down.weight[(map_idx * n_heads + i) * r:(map_idx * n_heads + i + 1) * r].T
            per_head.append(x @ (w_base + a @ proj.up[map_idx, i]))
        maps.append(torch.stack(per_head, dim=1))  # (B, heads, T, d)
    return maps


def reference(m, x: torch.Tensor):
    q1, q2 = naive_projection(m.q_proj, x, m.cfg.n_heads, m.cfg)
    k1, k2 = naive_projection(m.k_proj, x, m.cfg.kv_heads, m.cfg)
    return naive_two_map(m, x, (q1, q2, k1, k2))


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


@register
class SharedDiffAttention(TwoMapDifferentialAttention):
    variant = Variant(
        name="shared_diff",
        summary="DIFF V1 whose two maps share a base projection plus low-rank updates per map",
        paper="Cang et al., ICML 2025, Shared DIFF Transformer",
        maps_per_head=2,
        fields=(*TWO_MAP_FIELDS, "rank", "base_sharing", "lowrank_init_std"),
        check=check,
        attention_flops=attention_flops,
        reference=reference,
        cases={**TWO_MAP_CASES, "heads": {"base_sharing": "heads"}, "rank4": {"rank": 4},
               "heads-rank2-lam0.5": {"base_sharing": "heads", "rank": 2, "lambda_init": 0.5}},
        bench_arch={"rank": 8},
    )

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

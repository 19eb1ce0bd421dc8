"""Shared DIFF (Cang et al., ICML 2025), equations (3)-(4).

    W_Q1 = W_Q + A_q1 B_q1^T,   W_Q2 = W_Q + A_q2 B_q2^T   (same for K, with h_kv heads)

lowrank_scope="layer": one update per map for the whole projection, A: d_model x r, B: (h*d) x r,
    added to the full-width base (the reading in which Shared DIFF has fewer Q/K parameters than DIFF).
lowrank_scope="head": one update per head and per map, A: d_model x r, B: d x r.
base_sharing="maps": each head has its own d-wide W_Q, shared by its two maps; side by side one
    full-width W_Q, as in DIFF.
base_sharing="heads": one d-wide W_Q for all heads and both maps (section 2.4); under "layer" the
    full-width base is that W_Q repeated for every head, plus the full-width update.

Computed as X W_Q once plus (X A) B^T, never forming d_model x (h d) matrices. The rest (lambda,
GroupNorm, (1 - lambda_init), 2d-wide V) is DIFF V1's. B starts at N(0, lowrank_init_std^2), not
zero: with B = 0 both maps would start identical and A1 - lambda A2 would be (1 - lambda) A1.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from diffexp.model.attention.differential import (
    TWO_MAP_FLAGS,
    TwoMapDifferentialAttention,
    two_map_flops,
)
from diffexp.model.attention.registry import Variant, register
from diffexp.model.flags import Flag

FLAGS = (
    Flag("rank", int, 16, "Shared DIFF: rank r of the per-map low-rank updates", "a positive integer",
         lambda value: value > 0),
    Flag("base_sharing", Literal["maps", "heads"], "maps",
         "Shared DIFF: 'maps' (a base per head, shared by its two maps) or 'heads' (one base for all heads and maps)"),
    Flag("lowrank_scope", Literal["layer", "head"], "layer",
         "Shared DIFF: 'layer' (one update per map for the whole projection, the default of every comparison) or "
         "'head' (an update per head and map; how a checkpoint saved without the flag is read)",
         "'layer' (one update per map for the whole projection) or 'head' (one per head)"),
    Flag("lowrank_init_std", float, 0.02, "Shared DIFF: std of the low-rank factors; non-zero so the maps start apart",
         "a standard deviation >= 0", lambda value: value >= 0),
)


def up_widths(cfg, n_heads: int) -> tuple[int, int]:
    """(updates per map, width of each update's B) for a projection of n_heads heads of dim d."""
    d = cfg.resolved_head_dim
    return (1, n_heads * d) if cfg.lowrank_scope == "layer" else (n_heads, d)


def attention_flops(cfg, keys: float) -> float:
    """DIFF V1's maps plus the up-projections (X A) B^T, which are not nn.Linear layers (X A is one):
    2 maps x r x (h d + h_kv d) multiply-adds per token under either scope ("layer": one B of h d
    columns per map; "head": h of d columns)."""
    up_weights = 0
    for heads in (cfg.n_heads, cfg.kv_heads):
        groups, width = up_widths(cfg, heads)
        up_weights += 2 * groups * cfg.rank * width
    return two_map_flops(cfg, keys) + 2 * up_weights


class LowRankSharedProjection(nn.Module):
    """Two maps of `n_heads` heads: the base X W (broadcast over maps, and over heads when shared) plus one
    low-rank update (X A) B^T per map and per group: `groups` = n_heads (scope "head") or 1 (scope "layer",
    B spanning all n_heads * head_dim columns)."""

    def __init__(self, d_model: int, n_heads: int, head_dim: int, rank: int, share_across_heads: bool,
                 up_init_std: float, per_head: bool = True) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.rank = n_heads, head_dim, rank
        self.groups = n_heads if per_head else 1
        width = head_dim if per_head else n_heads * head_dim
        self.base = nn.Linear(d_model, (1 if share_across_heads else n_heads) * head_dim, bias=False)
        self.down = nn.Linear(d_model, 2 * self.groups * rank, bias=False)  # A for (map, group)
        self.up = nn.Parameter(torch.empty(2, self.groups, rank, width))  # B^T
        self.up_init_std = up_init_std
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """B (the factors that are not an nn.Linear) from N(0, lowrank_init_std^2)."""
        nn.init.normal_(self.up, 0.0, self.up_init_std)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.maps(self.base(x), self.down(x))

    def maps(self, base_out: torch.Tensor, down_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Both maps' (B, n_heads, T, d) from X W (B, T, width) and X A (B, T, 2 groups r)."""
        b, t, _ = base_out.shape
        shared = base_out.reshape(b, t, 1, -1, self.head_dim)  # broadcasts over maps (and heads)
        low = down_out.reshape(b, t, 2, self.groups, self.rank)
        update = torch.einsum("btmgr,mgrw->btmgw", low, self.up.to(low.dtype))
        both = shared + update.reshape(b, t, 2, self.n_heads, self.head_dim)  # (B, T, map, head, d)
        return both[:, :, 0].transpose(1, 2), both[:, :, 1].transpose(1, 2)


@register
class SharedDiffAttention(TwoMapDifferentialAttention):
    variant = Variant(
        name="shared_diff",
        summary="DIFF V1 whose two maps share a base projection plus low-rank updates per map",
        paper="Cang et al., ICML 2025, Shared DIFF Transformer",
        maps_per_head=2,
        flags=(*TWO_MAP_FLAGS, *FLAGS),
        attention_flops=attention_flops,
        bench_arch={"rank": 8},
    )

    def build_qk_projections(self) -> None:
        cfg = self.cfg
        across_heads, per_head = cfg.base_sharing == "heads", cfg.lowrank_scope == "head"
        self.q_proj = LowRankSharedProjection(self.d_model, self.n_heads, self.head_dim, cfg.rank,
                                              across_heads, cfg.lowrank_init_std, per_head)
        self.k_proj = LowRankSharedProjection(self.d_model, self.n_kv_heads, self.head_dim, cfg.rank,
                                              across_heads, cfg.lowrank_init_std, per_head)

    def project_qk(self, x: torch.Tensor):
        q1, q2 = self.q_proj(x)
        k1, k2 = self.k_proj(x)
        return q1, q2, k1, k2

    def extra_repr(self) -> str:
        cfg = self.cfg
        return (super().extra_repr() + f", rank={cfg.rank}, base_sharing={cfg.base_sharing}, "
                f"lowrank_scope={cfg.lowrank_scope}")

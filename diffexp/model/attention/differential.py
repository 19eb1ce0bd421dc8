"""DIFF V1's differential head, which Shared DIFF and DINT build on, and the family's shared pieces.

head_p = (1 - lambda_init) Norm((A1 - lambda A2) V_g), with
lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init   (one lambda per layer, fp32).
"""

from __future__ import annotations

import math
from typing import Literal, Union

import torch
from torch import nn

from diffexp.model.attention.base import AttentionBase, merge_heads, split_heads
from diffexp.model.blocks import RMSNorm
from diffexp.model.flags import Flag

#: the flags every two-map variant reads
TWO_MAP_FLAGS = (
    Flag("lambda_init", Union[Literal["depth"], float], "depth",
         "two-map variants: 'depth' (0.8 - 0.6 exp(-0.3 l)) or a constant in (0, 1)", "'depth' or a number in (0, 1)",
         lambda value: value == "depth" or 0.0 < value < 1.0),
    Flag("head_norm", bool, True, "two-map variants: per-head RMSNorm after the differential map (\"GroupNorm\")"),
)


def depth_lambda_init(layer_idx: int) -> float:
    """DIFF V1's schedule 0.8 - 0.6 exp(-0.3 l), with l counted from 0."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer_idx)


def lambda_init_for(cfg, layer_idx: int) -> float:
    return depth_lambda_init(layer_idx) if cfg.lambda_init == "depth" else float(cfg.lambda_init)


def two_map_flops(cfg, keys: float) -> float:
    """2h maps of dim d, each reading a 2d-wide V: 2 d per key for Q K^T, 2 (2d) per key for A V."""
    d = cfg.resolved_head_dim
    return 2 * cfg.n_heads * 2 * keys * (d + 2 * d)


class ReparamLambda(nn.Module):
    """lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init; vectors init N(0, 0.1^2), kept in fp32."""

    def __init__(self, head_dim: int, lambda_init: float) -> None:
        super().__init__()
        self.lambda_init = lambda_init
        self.lambda_q1 = nn.Parameter(torch.zeros(head_dim, dtype=torch.float32))
        self.lambda_k1 = nn.Parameter(torch.zeros(head_dim, dtype=torch.float32))
        self.lambda_q2 = nn.Parameter(torch.zeros(head_dim, dtype=torch.float32))
        self.lambda_k2 = nn.Parameter(torch.zeros(head_dim, dtype=torch.float32))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for vector in (self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2):
            nn.init.normal_(vector, 0.0, 0.1)

    def forward(self) -> torch.Tensor:
        dtype = torch.promote_types(self.lambda_q1.dtype, torch.float32)  # fp32 even under bf16 training
        lam1 = torch.exp((self.lambda_q1.to(dtype) * self.lambda_k1.to(dtype)).sum())
        lam2 = torch.exp((self.lambda_q2.to(dtype) * self.lambda_k2.to(dtype)).sum())
        return lam1 - lam2 + self.lambda_init


class TwoMapDifferentialAttention(AttentionBase):
    """DIFF V1's head: Q: 2h*d, K: 2h_kv*d (maps interleaved), V: h_kv*2d, O: h*2d -> d_model.

        [Q1; Q2] = X W_Q,  [K1; K2] = X W_K,  V = X W_V
        head = (1 - lambda_init) GroupNorm((A1 - lambda A2) V)

    Shared DIFF changes how Q1, Q2, K1, K2 are made (`project_qk`); DINT adds its integral in its own forward.
    """

    def __init__(self, cfg, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        h, h_kv, d = self.n_heads, self.n_kv_heads, self.head_dim
        self.lambda_init = lambda_init_for(cfg, layer_idx)
        self.build_qk_projections()
        self.v_proj = self.linear(self.d_model, h_kv * 2 * d)
        self.o_proj = self.linear(h * 2 * d, self.d_model)
        self.lambda_ = ReparamLambda(d, self.lambda_init)
        # one weight shared by all heads, as in the authors' code ("GroupNorm" in the papers)
        self.head_norm = RMSNorm(2 * d, eps=1e-5) if cfg.head_norm else nn.Identity()

    def build_qk_projections(self) -> None:
        self.q_proj = self.linear(self.d_model, 2 * self.n_heads * self.head_dim)
        self.k_proj = self.linear(self.d_model, 2 * self.n_kv_heads * self.head_dim)

    def project_qk(self, x: torch.Tensor):
        """Returns q1, q2: (B, h, T, d) and k1, k2: (B, h_kv, T, d); heads 2p / 2p+1 are maps 1 / 2."""
        q = split_heads(self.q_proj(x), 2 * self.n_heads)
        k = split_heads(self.k_proj(x), 2 * self.n_kv_heads)
        return q[:, 0::2], q[:, 1::2], k[:, 0::2], k[:, 1::2]

    def project(self, x: torch.Tensor, cache=None):
        """Q1, Q2, K1, K2 rotated at their positions, and V: (B, h_kv, T, 2d), one V for both maps; K and V
        hold the cached positions too."""
        start = self.start_of(cache)
        q1, q2, k1, k2 = (self.rope.rotate(t, start) for t in self.project_qk(x))
        k1, k2, v = self.cached(cache, k1=k1, k2=k2, v=split_heads(self.v_proj(x), self.n_kv_heads))
        return q1, q2, k1, k2, v

    def forward(self, x: torch.Tensor, need_weights: bool = False, cache=None):
        q1, q2, k1, k2, v = self.project(x, cache)
        lam = self.lambda_()  # exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init
        out, effective = self.two_map_head(q1, q2, k1, k2, v, lam, need_weights, cache)  # (A1 - lambda A2) V
        out = self.head_norm(out) * (1.0 - self.lambda_init)
        return self.o_proj(merge_heads(out)), effective

    def extra_repr(self) -> str:
        return super().extra_repr() + f", lambda_init={self.lambda_init:.3f}"

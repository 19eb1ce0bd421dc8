"""Standard causal multi-head attention with GQA: the reference every variant is compared with."""

from __future__ import annotations

import torch

from diffexp.model.attention.base import AttentionBase, merge_heads, split_heads


class BaselineAttention(AttentionBase):
    """Q: d_model -> h*d, K, V: d_model -> h_kv*d, O: h*d -> d_model; scale 1/sqrt(d)."""

    def __init__(self, cfg, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        h, h_kv, d = self.n_heads, self.n_kv_heads, self.head_dim
        self.q_proj = self.linear(self.d_model, h * d)
        self.k_proj = self.linear(self.d_model, h_kv * d)
        self.v_proj = self.linear(self.d_model, h_kv * d)
        self.o_proj = self.linear(h * d, self.d_model)

    def forward(self, x: torch.Tensor, need_weights: bool = False):
        q = split_heads(self.q_proj(x), self.n_heads)
        k = split_heads(self.k_proj(x), self.n_kv_heads)
        v = split_heads(self.v_proj(x), self.n_kv_heads)
        q, k = self.rope.rotate(q), self.rope.rotate(k)
        out, weights = self.attend(q, k, v, need_weights)
        return self.o_proj(merge_heads(out)), weights

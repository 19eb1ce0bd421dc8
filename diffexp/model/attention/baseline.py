"""Standard causal multi-head attention with GQA: the reference every variant is compared with.

    head_i = softmax(Q_i K_g^T / sqrt(d)) V_g,   g = i // (h / h_kv)
"""

from __future__ import annotations

import torch

from diffexp.model.attention.base import AttentionBase, merge_heads, split_heads
from diffexp.model.attention.registry import Variant, register


def attention_flops(cfg, keys: float) -> float:
    """h maps, each 2 d per key for Q K^T and 2 d per key for A V."""
    d = cfg.resolved_head_dim
    return cfg.n_heads * 2 * keys * (d + d)


@register
class BaselineAttention(AttentionBase):
    """Q: d_model -> h*d, K, V: d_model -> h_kv*d, O: h*d -> d_model; scale 1/sqrt(d)."""

    variant = Variant(
        name="baseline",
        summary="LLaMA-style softmax attention with GQA (the reference of every ratio)",
        paper="Touvron et al. 2023 (LLaMA); Ainslie et al. 2023 (GQA)",
        differential=False,
        reference_variant=True,
        attention_flops=attention_flops,
        hf_architecture="LlamaForCausalLM",
    )

    def __init__(self, cfg, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        h, h_kv, d = self.n_heads, self.n_kv_heads, self.head_dim
        self.q_proj = self.linear(self.d_model, h * d)
        self.k_proj = self.linear(self.d_model, h_kv * d)
        self.v_proj = self.linear(self.d_model, h_kv * d)
        self.o_proj = self.linear(h * d, self.d_model)

    def qkv(self, x: torch.Tensor, cache=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q (B, h, T, d) and K, V (B, h_kv, T_k, d): RoPE applied, the cached positions in front of K and V."""
        start = self.start_of(cache)
        q = self.rope.rotate(split_heads(self.q_proj(x), self.n_heads), start)
        k = self.rope.rotate(split_heads(self.k_proj(x), self.n_kv_heads), start)
        k, v = self.cached(cache, k=k, v=split_heads(self.v_proj(x), self.n_kv_heads))
        return q, k, v

    def forward(self, x: torch.Tensor, need_weights: bool = False, cache=None):
        q, k, v = self.qkv(x, cache)
        out, weights = self.attend(q, k, v, need_weights, cache)
        return self.o_proj(merge_heads(out)), weights

"""Standard causal multi-head attention with GQA: the reference every variant is compared with.

    head_i = softmax(Q_i K_g^T / sqrt(d)) V_g,   g = i // (h / h_kv)
"""

from __future__ import annotations

import torch

from diffexp.model.attention import naive
from diffexp.model.attention.base import AttentionBase, merge_heads, split_heads
from diffexp.model.attention.registry import Variant, register


def attention_flops(cfg, keys: float) -> float:
    """h maps, each 2 d per key for Q K^T and 2 d per key for A V."""
    d = cfg.resolved_head_dim
    return cfg.n_heads * 2 * keys * (d + d)


def reference(m, x: torch.Tensor):
    cfg = m.cfg
    h, h_kv = cfg.n_heads, cfg.kv_heads
    q = m.rope.rotate(naive.project(x, m.q_proj, h))
    k = m.rope.rotate(naive.project(x, m.k_proj, h_kv))
    v = naive.project(x, m.v_proj, h_kv).double()
    b, t = x.shape[:2]
    maps = torch.zeros(b, h, t, t, dtype=torch.float64)
    out = torch.zeros(b, h, t, v.shape[-1], dtype=torch.float64)
    for bi in range(b):
        for i in range(h):
            g = i // (h // h_kv)
            maps[bi, i] = naive.causal_softmax_rows(q[bi, i], k[bi, g])
            out[bi, i] = maps[bi, i] @ v[bi, g]
    return naive.output(out, m.o_proj), maps


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
        reference=reference,
        cases={"": {}, "mha": {"n_kv_heads": None}, "tied": {"tie_embeddings": True}},
    )

    def __init__(self, cfg, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        h, h_kv, d = self.n_heads, self.n_kv_heads, self.head_dim
        self.q_proj = self.linear(self.d_model, h * d)
        self.k_proj = self.linear(self.d_model, h_kv * d)
        self.v_proj = self.linear(self.d_model, h_kv * d)
        self.o_proj = self.linear(h * d, self.d_model)

    def forward(self, x: torch.Tensor, need_weights: bool = False, cache=None):
        start = self.start_of(cache)
        q = self.rope.rotate(split_heads(self.q_proj(x), self.n_heads), start)
        k = self.rope.rotate(split_heads(self.k_proj(x), self.n_kv_heads), start)
        k, v = self.cached(cache, k=k, v=split_heads(self.v_proj(x), self.n_kv_heads))
        out, weights = self.attend(q, k, v, need_weights)
        return self.o_proj(merge_heads(out)), weights

"""Gated attention (Qiu et al. 2025, "Gated Attention for Large Language Models", arXiv 2505.06708): a sigmoid gate
projected from the layer's input multiplies each head's SDPA output (position G1, head-specific, multiplicative):

    head_i = sigmoid(x W_g)_i * softmax(Q_i K_g^T / sqrt(d)) V_g          g = i // (h / h_kv)

gate "elementwise" (the paper's best): W_g: d_model -> h*d, one gate per channel of each head. gate "headwise":
W_g: d_model -> h, one scalar gate per head. W_g has no bias and the decoder's N(0, init_std^2) init, as the
paper's code (its gate is extra output columns of q_proj), so the gate starts near sigmoid(0) = 1/2. The rest is
the baseline. The effective map is the softmax map scaled per row by the head's gate (the mean of its d gates
for "elementwise").
"""

from __future__ import annotations

from typing import Literal

import torch

from diffexp.model.attention.base import merge_heads, split_heads
from diffexp.model.attention.baseline import BaselineAttention, attention_flops
from diffexp.model.attention.registry import Variant, register
from diffexp.model.flags import Flag

FLAGS = (
    Flag("gate", Literal["elementwise", "headwise"], "elementwise", "gated: a sigmoid gate after SDPA per channel "
         "of each head ('elementwise', the paper's best) or one per head ('headwise')"),
)


@register
class GatedAttention(BaselineAttention):
    variant = Variant(
        name="gated",
        summary="softmax attention times a sigmoid gate from the input, per channel or per head (G1)",
        paper="Qiu et al. 2025 (Gated Attention for LLMs, arXiv 2505.06708)",
        differential=False,
        flags=FLAGS,
        attention_flops=attention_flops,  # the baseline's maps; W_g is an nn.Linear, the product is elementwise
    )

    def __init__(self, cfg, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)  # the baseline's Q, K, V and O
        width = self.n_heads * (self.head_dim if cfg.gate == "elementwise" else 1)
        self.gate_proj = self.linear(self.d_model, width)

    def forward(self, x: torch.Tensor, need_weights: bool = False, cache=None):
        q, k, v = self.qkv(x, cache)
        gate = torch.sigmoid(split_heads(self.gate_proj(x), self.n_heads))  # (B, h, T, d or 1), new tokens only
        self.record_gate(gate)
        out, weights = self.attend(q, k, v, need_weights, cache)
        if weights is not None:
            weights = weights * gate.mean(-1, keepdim=True).to(weights.dtype)
        return self.o_proj(merge_heads(gate * out)), weights

    def record_gate(self, gate: torch.Tensor) -> None:
        """On a diagnostics forward, the gate's mean (the paper reads its sparsity from it)."""
        if self.record_stats:
            self.stats["gate_mean"] = gate[: self.stats_rows].detach().float().mean().item()

    def extra_repr(self) -> str:
        return super().extra_repr() + f", gate={self.cfg.gate}"

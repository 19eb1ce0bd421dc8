"""Softmax with a sink: attention that may attend to nothing.

    a_ij = exp(z_ij) / (exp(s_h) + sum_k exp(z_ik)),     head_i = sum_j a_ij v_j
         = sigmoid(LSE_i - s_h) * softmax(z_i) V          (the context RMS can go to 0)

sink "zero": s_h = 0 in every head (Miller 2023, "Attention Is Off By One": softmax_1, one added to the
denominator). sink "learned": s_h a learnable logit per query head (OpenAI 2025, gpt-oss), starting at 0, so a run
starts exactly where "zero" starts. Everything else is the baseline: Q: d_model -> h*d, K, V: d_model -> h_kv*d
(GQA), O: h*d -> d_model. The effective map is a without the sink's column: its rows sum to less than 1, and the
sink's mass is attention to no token (not to token 0).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from diffexp.model.attention.base import merge_heads
from diffexp.model.attention.baseline import BaselineAttention, attention_flops
from diffexp.model.attention.registry import Variant, register
from diffexp.model.flags import Flag

FLAGS = (
    Flag("sink", Literal["zero", "learned"], "zero", "softmax_sink: 'zero' (off by one: exp(0) added to each "
         "softmax denominator) or 'learned' (gpt-oss: a learnable sink logit per head, starting at 0)"),
)


@register
class SoftmaxSinkAttention(BaselineAttention):
    variant = Variant(
        name="softmax_sink",
        summary="softmax with a sink logit per head: 'zero' (off by one) or 'learned' (gpt-oss)",
        paper="Miller 2023 (Attention Is Off By One); OpenAI 2025 (gpt-oss attention sinks)",
        differential=False,
        flags=FLAGS,
        attention_flops=attention_flops,  # the baseline's maps; the sink's column is one more key
    )

    def __init__(self, cfg, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)  # the baseline's Q, K, V and O
        # "learned": fp32 and 1-d, so no weight decay; "zero" holds no tensor (an exported model's loader leaves
        # buffers outside the weights file uninitialised)
        self.sinks = nn.Parameter(torch.zeros(self.n_heads)) if cfg.sink == "learned" else None

    def forward(self, x: torch.Tensor, need_weights: bool = False, cache=None):
        q, k, v = self.qkv(x, cache)
        self.record_sinks()
        sinks = self.sinks if self.sinks is not None else q.new_zeros(self.n_heads, dtype=torch.float32)
        out, weights = self.attend_with_sink(q, k, v, sinks, need_weights, cache)
        return self.o_proj(merge_heads(out)), weights

    def record_sinks(self) -> None:
        """On a diagnostics forward, the learned sink logits' mean."""
        if self.record_stats and self.sinks is not None:
            self.stats["sink_logit_mean"] = self.sinks.detach().float().mean().item()

    def extra_repr(self) -> str:
        return super().extra_repr() + f", sink={self.cfg.sink}"

"""Scalable-Softmax (Nakanishi 2025, "Scalable-Softmax Is Superior for Attention", arXiv 2501.19399): the logits of
the query at position n (1-based: the number of keys its causal row sees) are multiplied by s_h log n,

    head_i = softmax((s_i log n) Q_i K_g^T / sqrt(d)) V_g          g = i // (h / h_kv)

so a row's largest weight stops fading as the row grows. s is a learnable scalar per query head (fp32, 1-d: no
weight decay). The factor scales each query row before the attention call, which is then the baseline's own (SDPA
over whole sequences, the fused decoding step). Position 1 has log 1 = 0: its one logit is 0 and its weight 1, as
any softmax over one key. Decoding reads each row's position from the cache before the new tokens join it.
ssmax_init: each s starts at 1 / log(max_seq_len) ('length': then s log n = 1, softmax's own logits, at the last
position the model is built for, and the factor is below 1 before it), or at the number given.
"""

from __future__ import annotations

import math
from typing import Literal, Union

import torch
from torch import nn

from diffexp.errors import invalid
from diffexp.model.attention.base import merge_heads
from diffexp.model.attention.baseline import BaselineAttention, attention_flops
from diffexp.model.attention.registry import Variant, register
from diffexp.model.flags import Flag

FLAGS = (
    Flag("ssmax_init", Union[Literal["length"], float], "length",
         "ssmax: the start of each head's s, 'length' (1 / log(max_seq_len): s log n = 1 at the last position) or a "
         "positive number", "'length' (1 / log(max_seq_len)) or a positive number",
         lambda value: value == "length" or (math.isfinite(value) and value > 0)),
)


def check(cfg) -> None:
    if cfg.ssmax_init == "length" and cfg.max_seq_len < 2:
        raise invalid("model.arch.ssmax_init", cfg.ssmax_init,
                      f"expected a positive number when model.arch.max_seq_len={cfg.max_seq_len} (log 1 = 0)")


def length_factor(start, t: int, s: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """s_h log n for the t queries from position `start` on (0-based; a tensor (B,) in a decoding step, each row
    its own): (1, h, t, 1) or (B, h, 1, 1), in `like`'s dtype and fp32 at least, so log n rounds no further."""
    dtype = torch.promote_types(torch.promote_types(like.dtype, s.dtype), torch.float32)
    if torch.is_tensor(start):
        n = (start.to(dtype) + 1).view(-1, 1, 1, 1)
    else:
        n = torch.arange(start + 1, start + t + 1, dtype=dtype, device=like.device).view(1, 1, t, 1)
    return s.to(dtype).view(1, -1, 1, 1) * torch.log(n)


@register
class SsmaxAttention(BaselineAttention):
    variant = Variant(
        name="ssmax",
        summary="softmax with the logits of position n times s log n, s learned per head (against fading long rows)",
        paper="Nakanishi 2025 (Scalable-Softmax Is Superior for Attention, arXiv 2501.19399)",
        differential=False,
        flags=FLAGS,
        check=check,
        attention_flops=attention_flops,  # the baseline's maps; the factor is elementwise on Q
    )

    def __init__(self, cfg, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)  # the baseline's Q, K, V and O
        init = 1.0 / math.log(cfg.max_seq_len) if cfg.ssmax_init == "length" else float(cfg.ssmax_init)
        self.s = nn.Parameter(torch.full((self.n_heads,), init, dtype=torch.float32))

    def forward(self, x: torch.Tensor, need_weights: bool = False, cache=None):
        start = self.start_of(cache)  # before qkv: it appends the new tokens to the cache
        q, k, v = self.qkv(x, cache)
        factor = length_factor(start, q.shape[-2], self.s, q)
        q = (q.to(factor.dtype) * factor).to(q.dtype)
        self.record_scale()
        out, weights = self.attend(q, k, v, need_weights, cache)
        return self.o_proj(merge_heads(out)), weights

    def record_scale(self) -> None:
        """On a diagnostics forward, the mean of the heads' s."""
        if self.record_stats:
            self.stats["ssmax_s_mean"] = self.s.detach().float().mean().item()

    def extra_repr(self) -> str:
        return super().extra_repr() + f", ssmax_init={self.cfg.ssmax_init}"

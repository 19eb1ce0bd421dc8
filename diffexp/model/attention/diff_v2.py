"""DIFF V2 (DIFF Transformer V2 blog, 2026).

One attention call over 2h query heads with GQA (query head i reads kv head i // (2h / h_kv)),
then pairs of heads are subtracted with a token-wise, head-wise lambda:

    out_p = attn[2p] - sigmoid(x W_lam)_p * attn[2p + 1]        pairing="same" (pairs share K/V)
    out_p = attn[p]  - sigmoid(x W_lam)_p * attn[p + h]         pairing="cross" (blog's ablation)

No per-head norm, no lambda_init. lambda_mode "none" drops W_lam
(attn1 - attn2); "raw" drops the sigmoid. pair_norm puts DIFF V1's per-head RMSNorm back on out_p (the blog
removed it as destabilising). W_lam keeps PyTorch's nn.Linear init (lambda_proj_init "default", the spec) or
takes the decoder's N(0, init_std^2) ("normal").
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from diffexp.errors import invalid
from diffexp.model.attention.base import AttentionBase, merge_heads, split_heads
from diffexp.model.attention.registry import Variant, register
from diffexp.model.blocks import RMSNorm
from diffexp.model.flags import Flag

FLAGS = (
    Flag("pairing", Literal["same", "cross"], "same", "DIFF V2: 'same' pairs query heads that share K/V, 'cross' "
         "heads of different GQA groups (the blog's unstable ablation)"),
    Flag("lambda_mode", Literal["sigmoid", "none", "raw"], "sigmoid",
         "DIFF V2: 'sigmoid' (the blog), 'none' (attn1 - attn2) or 'raw' (no sigmoid)"),
    Flag("pair_norm", bool, False, "DIFF V2: DIFF V1's per-head RMSNorm after the subtraction (the blog removed it)"),
    Flag("lambda_proj_init", Literal["default", "normal"], "default", "DIFF V2: init of W_lam, 'default' (PyTorch's "
         "nn.Linear init, the spec) or 'normal' (N(0, init_std^2) like the other linears)"),
)


def check(cfg) -> None:
    if cfg.pairing == "cross" and cfg.kv_heads < 2:  # heads p and p + h must sit in different kv groups
        raise invalid("model.arch.pairing", cfg.pairing,
                      f"with n_heads={cfg.n_heads}, n_kv_heads={cfg.kv_heads} heads p and p+h share one K/V "
                      "group, so no cross-group pair exists; use n_kv_heads >= 2")


def attention_flops(cfg, keys: float) -> float:
    """2h query maps of dim d over d-wide V; the pairing subtraction is negligible."""
    d = cfg.resolved_head_dim
    return 2 * cfg.n_heads * 2 * keys * (d + d)


@register
class DiffV2Attention(AttentionBase):
    variant = Variant(
        name="diff_v2",
        summary="2h query heads paired inside a GQA group, token-wise sigmoid lambda, no norm",
        paper="DIFF Transformer V2 (blog, 2026)",
        flags=FLAGS,
        check=check,
        attention_flops=attention_flops,
        bench_arch={"n_kv_heads": 2},  # GQA groups, where the blog's pairing applies
    )

    def __init__(self, cfg, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        h, h_kv, d = self.n_heads, self.n_kv_heads, self.head_dim
        self.q_proj = self.linear(self.d_model, 2 * h * d)
        self.k_proj = self.linear(self.d_model, h_kv * d)
        self.v_proj = self.linear(self.d_model, h_kv * d)
        self.o_proj = self.linear(h * d, self.d_model)
        self.lambda_mode = cfg.lambda_mode
        self.lambda_proj = (self.linear(self.d_model, h, default_init=cfg.lambda_proj_init == "default")
                            if cfg.lambda_mode != "none" else None)
        # DIFF V1's per-head norm, one weight shared by all heads; off by default, as in the blog
        self.pair_norm = RMSNorm(d, eps=1e-5) if cfg.pair_norm else nn.Identity()
        # the query heads of each pair: 2p and 2p + 1 ("same"), or p and p + h ("cross")
        if cfg.pairing == "same":
            self.first, self.second = slice(0, 2 * h, 2), slice(1, 2 * h, 2)
        else:
            self.first, self.second = slice(0, h), slice(h, 2 * h)

    def token_lambda(self, x: torch.Tensor) -> torch.Tensor | float:
        """(B, h, T, 1) lambda per token and head, or 1.0 for lambda_mode="none"."""
        if self.lambda_proj is None:
            return 1.0
        lam = self.lambda_proj(x).transpose(1, 2).unsqueeze(-1)
        return torch.sigmoid(lam) if self.lambda_mode == "sigmoid" else lam

    def forward(self, x: torch.Tensor, need_weights: bool = False, cache=None):
        start = self.start_of(cache)
        q = self.rope.rotate(split_heads(self.q_proj(x), 2 * self.n_heads), start)
        k = self.rope.rotate(split_heads(self.k_proj(x), self.n_kv_heads), start)
        k, v = self.cached(cache, k=k, v=split_heads(self.v_proj(x), self.n_kv_heads))  # h_kv heads, as GQA
        lam = self.token_lambda(x)  # from the new tokens only: lambda is token-wise
        self.record_lambda(lam)
        # attn[first] - lambda attn[second], attn from one attention call over the 2h query heads
        out, effective = self.paired_heads(q, k, v, lam, self.first, self.second, self.cfg.pairing == "same",
                                           need_weights, cache)
        return self.o_proj(merge_heads(self.pair_norm(out))), effective

    def record_lambda(self, lam) -> None:
        """On a diagnostics forward, the token-wise lambda's mean and spread."""
        if self.record_stats and torch.is_tensor(lam):
            observed = lam[: self.stats_rows].detach().float()
            self.stats.update(lambda_mean=observed.mean().item(), lambda_std=observed.std().item())

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", pairing={self.cfg.pairing}, lambda_mode={self.lambda_mode}, "
                f"pair_norm={self.cfg.pair_norm}, lambda_proj_init={self.cfg.lambda_proj_init}")


"""DIFF V2 (DIFF Transformer V2 blog, 2026).

One attention call over 2h query heads with GQA (query head i reads kv head i // (2h / h_kv)),
then pairs of heads are subtracted with a token-wise, head-wise lambda:

    out_p = attn[2p] - sigmoid(x W_lam)_p * attn[2p + 1]        pairing="same" (pairs share K/V)
    out_p = attn[p]  - sigmoid(x W_lam)_p * attn[p + h]         pairing="cross" (blog's ablation)

No per-head norm, no lambda_init. lambda_mode "none" drops W_lam (attn1 - attn2); "raw" drops the
sigmoid.
"""

from __future__ import annotations

import torch

from diffexp.model.attention.base import AttentionBase, merge_heads, split_heads


class DiffV2Attention(AttentionBase):
    def __init__(self, cfg, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        h, h_kv, d = self.n_heads, self.n_kv_heads, self.head_dim
        self.q_proj = self.linear(self.d_model, 2 * h * d)
        self.k_proj = self.linear(self.d_model, h_kv * d)
        self.v_proj = self.linear(self.d_model, h_kv * d)
        self.o_proj = self.linear(h * d, self.d_model)
        self.lambda_mode = cfg.lambda_mode
        self.lambda_proj = self.linear(self.d_model, h) if cfg.lambda_mode != "none" else None
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

    def forward(self, x: torch.Tensor, need_weights: bool = False):
        q = self.rope.rotate(split_heads(self.q_proj(x), 2 * self.n_heads))
        k = self.rope.rotate(split_heads(self.k_proj(x), self.n_kv_heads))
        v = split_heads(self.v_proj(x), self.n_kv_heads)
        out, weights = self.attend(q, k, v, need_weights)
        lam = self.token_lambda(x)
        if self.record_stats and torch.is_tensor(lam):  # the token-wise lambda's mean and spread
            observed = lam[: self.stats_rows].detach().float()
            self.stats.update(lambda_mean=observed.mean().item(), lambda_std=observed.std().item())
        out = out[:, self.first] - lam * out[:, self.second]
        effective = None
        if weights is not None:
            lam_f = lam.float() if torch.is_tensor(lam) else lam
            effective = weights[:, self.first] - lam_f * weights[:, self.second]
        return self.o_proj(merge_heads(out)), effective

    def extra_repr(self) -> str:
        return super().extra_repr() + f", pairing={self.cfg.pairing}, lambda_mode={self.lambda_mode}"

"""LLaMA-style decoder: pre-RMSNorm blocks, SwiGLU, RoPE, no biases; attention is any variant.

    Y  = X + Attn(RMSNorm(X))
    X' = Y + SwiGLU(RMSNorm(Y)),   SwiGLU(X) = (silu(X W_G) * X W_1) W_2
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from diffexp.config import ModelConfig
from diffexp.model.attention import build_attention
from diffexp.model.attention.base import RMSNorm


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d_model, hidden, bias=False)
        self.up_proj = nn.Linear(d_model, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = build_attention(cfg, layer_idx)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn = SwiGLU(cfg.d_model, cfg.resolved_ffn_hidden)

    def forward(self, x: torch.Tensor, need_weights: bool = False):
        attn_out, weights = self.attn(self.attn_norm(x), need_weights)
        x = x + attn_out
        x = x + self.ffn(self.ffn_norm(x))
        return x, weights


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(DecoderBlock(cfg, i) for i in range(cfg.n_layers))
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """N(0, init_std) for embeddings and linears; residual outputs scaled by 1/sqrt(2 n_layers)."""
        std = self.cfg.init_std
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, 0.0, std)
        for block in self.blocks:
            for residual_out in (block.attn.o_proj, block.ffn.down_proj):
                nn.init.normal_(residual_out.weight, 0.0, std / math.sqrt(2 * self.cfg.n_layers))

    def forward(self, idx: torch.Tensor, need_weights: bool = False):
        """Logits (B, T, vocab); with need_weights also each layer's effective map (B, h, T, T)."""
        x = self.embed(idx)
        maps = []
        for block in self.blocks:
            x, weights = block(x, need_weights)
            maps.append(weights)
        logits = self.lm_head(self.final_norm(x))
        return (logits, maps) if need_weights else logits

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        params = {id(p): p for p in self.parameters()}
        if exclude_embeddings:
            params.pop(id(self.embed.weight), None)
            params.pop(id(self.lm_head.weight), None)
        return sum(p.numel() for p in params.values())

    def flops_per_token(self, seq_len: int, training: bool = True) -> float:
        """Model FLOPs per token (2 per multiply-add) at sequence length seq_len, for throughput and MFU.

        Matmuls with weights: 2 x (linear parameters). Attention, causal (on average T/2 keys per query):
        each map costs 2 d per key for Q K^T plus 2 dv per key for A V. Per layer:
        baseline h maps (dv = d); diff_v1 / shared_diff 2h maps with dv = 2d; dint those plus the
        integral's A3 V (h x 2 x 2d); diff_v2 2h maps (dv = d). The logical count: FlashAttention's
        recomputation and V splitting are not counted. Training = forward + backward = 3 x forward.
        """
        linear = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        if self.cfg.attention == "shared_diff":  # its low-rank updates are matmuls too
            linear += sum(p.numel() for n, p in self.named_parameters() if n.endswith(".up"))
        cfg, d, h = self.cfg, self.cfg.resolved_head_dim, self.cfg.n_heads
        keys = seq_len / 2
        per_map = {"baseline": (h, d), "diff_v2": (2 * h, d)}.get(cfg.attention, (2 * h, 2 * d))
        maps, dv = per_map
        attention = maps * 2 * keys * (d + dv)
        if cfg.attention == "dint":
            attention += h * 2 * keys * 2 * d
        forward = 2 * linear + cfg.n_layers * attention
        return forward * (3 if training else 1)

    def parameter_report(self) -> dict[str, int]:
        """Parameter counts per kind of module, for the logs and Shared DIFF's claims."""
        attn = sum(p.numel() for b in self.blocks for p in b.attn.parameters())
        ffn = sum(p.numel() for b in self.blocks for p in b.ffn.parameters())
        return {"total": self.num_parameters(), "non_embedding": self.num_parameters(True),
                "attention": attn, "ffn": ffn}

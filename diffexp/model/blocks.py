"""The decoder's building blocks: RMSNorm, SwiGLU and the pre-norm residual block.

    Y  = X + Attn(RMSNorm(X))
    X' = Y + SwiGLU(RMSNorm(Y)),   SwiGLU(X) = (silu(X W_G) * X W_1) W_2
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(x.dtype, torch.float32)  # normalise in fp32 under bf16
        x_wide = x.to(dtype)
        normed = x_wide * torch.rsqrt(x_wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.to(dtype)).to(x.dtype)


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d_model, hidden, bias=False)
        self.up_proj = nn.Linear(d_model, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderBlock(nn.Module):
    """Pre-norm attention and SwiGLU, each with a residual; `attn` is any variant's module."""

    def __init__(self, d_model: int, ffn_hidden: int, norm_eps: float, attn: nn.Module) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(d_model, norm_eps)
        self.attn = attn
        self.ffn_norm = RMSNorm(d_model, norm_eps)
        self.ffn = SwiGLU(d_model, ffn_hidden)

    def forward(self, x: torch.Tensor, need_weights: bool = False, cache=None):
        normed = self.attn_norm(x)  # a variant without decoding support takes no cache argument
        attn_out, weights = self.attn(normed, need_weights) if cache is None else self.attn(normed, need_weights, cache)
        x = x + attn_out
        x = x + self.ffn(self.ffn_norm(x))
        return x, weights

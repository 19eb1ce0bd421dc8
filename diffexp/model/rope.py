"""Rotary position embedding (RoPE), LLaMA's rotate-half convention."""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables; `rotate` rotates a (B, heads, T, d) tensor by position."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)  # (T, d)
        # not persistent: derived from config, so checkpoints stay small and dtype-stable
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def rotate(self, x: torch.Tensor, start: int | torch.Tensor = 0) -> torch.Tensor:
        """Rotate positions start .. start + T - 1 (start > 0: new tokens after a cache of `start`); a tensor
        start (B,) gives each row of a one-token step its own position."""
        if torch.is_tensor(start):
            shape = (-1, *[1] * (x.dim() - 2), x.shape[-1])
            cos, sin = self.cos[start].view(shape).to(x.dtype), self.sin[start].view(shape).to(x.dtype)
        else:
            end = start + x.shape[-2]
            if end > self.cos.shape[0]:
                raise ValueError(f"sequence length {end} exceeds model.max_seq_len={self.cos.shape[0]}")
            cos = self.cos[start:end].to(x.dtype)
            sin = self.sin[start:end].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat([-x2, x1], dim=-1)
        return x * cos + rotated * sin

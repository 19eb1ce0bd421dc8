"""Rotary position embedding (RoPE), LLaMA's rotate-half convention."""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables; `rotate` rotates a (B, heads, T, d) tensor by position.

    rotate_half(x) sin = [-x2, x1] sin = [x2, x1] signed_sin with signed_sin = [-sin, sin] (the two halves of sin
    are equal), and [x2, x1] is x with its halves flipped: an index map that torch.compile fuses into the
    product, where the concatenation of [-x2, x1] is a buffer of its own in every step. The same numbers either
    way: negating is exact.
    """

    def __init__(self, head_dim: int, max_seq_len: int, theta: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
        sin = angles.sin()
        # not persistent: derived from config, so checkpoints stay small and dtype-stable
        self.register_buffer("cos", torch.cat([angles.cos(), angles.cos()], dim=-1), persistent=False)  # (T, d)
        self.register_buffer("signed_sin", torch.cat([-sin, sin], dim=-1), persistent=False)

    def rotate(self, x: torch.Tensor, start: int | torch.Tensor = 0) -> torch.Tensor:
        """Rotate positions start .. start + T - 1 (start > 0: new tokens after a cache of `start`); a tensor
        start (B,) gives each row of a one-token step its own position."""
        if torch.is_tensor(start):
            shape = (-1, *[1] * (x.dim() - 2), x.shape[-1])
            cos, signed_sin = (table[start].view(shape).to(x.dtype) for table in (self.cos, self.signed_sin))
        else:
            end = start + x.shape[-2]
            if end > self.cos.shape[0]:
                raise ValueError(f"sequence length {end} exceeds model.max_seq_len={self.cos.shape[0]}")
            cos, signed_sin = (table[start:end].to(x.dtype) for table in (self.cos, self.signed_sin))
        halves_flipped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)  # [x2, x1]
        return x * cos + halves_flipped * signed_sin

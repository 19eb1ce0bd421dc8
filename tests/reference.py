"""The naive reference of any registered variant: its registry entry's `reference`, in float64.

Each variant writes its reference beside its module (diffexp/model/attention/<variant>.py) from the
equations, with explicit loops; it reads the module's weights but none of its code paths.
"""

from __future__ import annotations

import torch

from diffexp.model.attention import variant


def reference_attention(m, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Output (B, T, d_model) and effective maps (B, h, T, T) of attention module m on input x."""
    return variant(m.cfg.attention).reference(m, x)

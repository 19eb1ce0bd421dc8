"""Host-side helpers shared by the Triton kernels: tile sizes, dot precision, strides."""

from __future__ import annotations

import torch
import triton


def width_block(width: int) -> int:
    """A power-of-two tile width >= width; at least 16, the smallest tl.dot operand on GPUs."""
    return max(16, triton.next_power_of_2(width))


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs stay exact ("ieee"), as PyTorch's own fp32 attention is; TF32 would cost ~1e-3."""
    return "ieee" if dtype in (torch.float32, torch.float64) else "tf32"


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 accumulators, as flash attention keeps; fp64 inputs keep fp64 (exactness tests)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def head_strides(x: torch.Tensor) -> tuple[int, int, int]:
    """(batch, head, position) strides of a (B, H, T, width) tensor whose last dim is contiguous."""
    assert x.stride(-1) == 1, "the last dim must be contiguous"
    return x.stride(0), x.stride(1), x.stride(2)


def last_dim_contiguous(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in tensors)


def same_strides(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels take one stride set per pair (q1/q2, k1/k2): copy both when they differ."""
    if a.stride() == b.stride():
        return a, b
    return a.contiguous(), b.contiguous()


def check_blocks(*blocks: int) -> None:
    for block in blocks:
        if block < 16 or block & (block - 1):
            raise ValueError(f"Triton tile sizes are powers of two >= 16, got {block}")

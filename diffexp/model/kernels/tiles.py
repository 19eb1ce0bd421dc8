"""What the Triton kernels share: tile sizes, dot precision, strides, and the tile loads and stores."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


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


def check_device(x: torch.Tensor) -> None:
    from diffexp.model.kernels.triton_support import unavailable_reason

    reason = unavailable_reason(x.device)
    if reason is not None:
        raise RuntimeError(reason)


def check_blocks(*blocks: int) -> None:
    for block in blocks:
        if block < 16 or block & (block - 1):
            raise ValueError(f"Triton tile sizes are powers of two >= 16, got {block}")


def default_blocks(d: int, dv: int) -> tuple[int, int]:
    """(query block, key block): untuned guesses sized so two fp32 accumulators of width dv fit."""
    return (64 if width_block(dv) <= 128 else 32), (64 if width_block(d) <= 64 else 32)


class Launch:
    """Sizes and strides of one call, shared by its forward and backward kernels."""

    def __init__(self, q1, k1, v, block_m, block_n):
        self.b, self.h, self.t, self.d = q1.shape
        self.hk, self.dv = k1.shape[1], v.shape[-1]
        self.group = self.h // self.hk
        self.block_m, self.block_n = block_m, block_n
        self.acc = accumulator_dtype(q1.dtype)
        self.sizes = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=width_block(self.d),
                          BLOCK_DV=width_block(self.dv), PREC=dot_precision(q1.dtype),
                          ACC=tl.float64 if self.acc == torch.float64 else tl.float32)
        self.strides = (*head_strides(q1), *head_strides(k1), *head_strides(v))
        # a tensor, not a float: compiled Triton passes a Python float as fp32, which would round fp64 runs
        self.scale = torch.full((1,), 1.0 / math.sqrt(self.d), dtype=self.acc, device=q1.device)

    def rows_grid(self, block: int):
        return triton.cdiv(self.t, block), self.b * self.h


@triton.jit
def load_rows(base, rows, cols, stride_t, n_rows, width):
    """The (rows, cols) tile of one head, zero outside the sequence and the width."""
    mask = (rows[:, None] < n_rows) & (cols[None, :] < width)
    return tl.load(base + rows[:, None] * stride_t + cols[None, :], mask=mask, other=0.0)


@triton.jit
def store_rows(base, rows, cols, stride_t, n_rows, width, value):
    mask = (rows[:, None] < n_rows) & (cols[None, :] < width)
    tl.store(base + rows[:, None] * stride_t + cols[None, :], value.to(base.dtype.element_ty), mask=mask)


@triton.jit
def probabilities(q, k, lse, rows, keys, n_rows, scale, PREC: tl.constexpr):
    """Causal softmax tile recomputed from the rows' log-sum-exp; zero above the diagonal and past the end."""
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
    valid = (keys[None, :] <= rows[:, None]) & (rows[:, None] < n_rows)
    return tl.where(valid, tl.exp(s - lse[:, None]), 0.0)

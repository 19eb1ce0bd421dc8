"""DINT's head on the GPU: map 1 and its row log-sum-exp from one flex_attention call, map 2 from SDPA, and the
softmax integral A3 V from the Triton kernel without atomics (triton_dint.py).

    out = A1 V - lambda A2 V + gamma A3 V

Triton is imported on the first call, not at registration.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from diffexp.kernels.registry import Kernel, register
from diffexp.kernels.triton_support import unavailable_reason


def attend(q, k, v) -> torch.Tensor:
    """Causal SDPA over a V wider than Q (d-wide slices of V, each the same softmax), K and V repeated for GQA."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    d = q.shape[-1]
    return torch.cat([F.scaled_dot_product_attention(q, k, part, is_causal=True) for part in v.split(d, dim=-1)], -1)


def head(q1, q2, k1, k2, v, lam, integral) -> torch.Tensor:
    from diffexp.kernels.triton_dint import dint_integral, map1_attention, map1_lse

    if q1.is_cuda:
        out1, lse1 = map1_attention(q1, k1, v)
    else:  # Triton's interpreter (tests): eager flex_attention has no CPU backward
        out1, lse1 = attend(q1, k1, v), map1_lse(q1, k1)
    out = out1 - lam.to(out1.dtype) * attend(q2, k2, v)
    return out + integral.gamma.to(out.dtype) * dint_integral(q1, k1, v, lse1)


def tile_width(n: int) -> int:
    """A power-of-two tile width >= n; at least 16, the smallest tl.dot operand on GPUs."""
    return max(16, 1 << (n - 1).bit_length())


def tiles(d: int, dv: int) -> tuple[int, int]:
    """The query and key tile sizes the Triton integral takes unless given, for head widths d (q1, k1) and dv (v).
    Untuned: 64 x 64, the query tile halved past dv 128 (two fp32 accumulators of width dv fit), the key tile past
    d 64. tests/test_triton_aot.py compiles every kernel at these tiles for an H100."""
    return (64 if tile_width(dv) <= 128 else 32), (64 if tile_width(d) <= 64 else 32)


def scratch_bytes(batch: int, heads: int, seq_len: int, d: int, dv: int) -> tuple[int, int]:
    """(kept, backward) bytes of the Triton integral's fp32 buffers in one layer, at its default tiles: PREFIX
    (B, h, T / query tile, T), kept from the forward for the backward; CARRY (the same) and ROWPART
    (B, h, T / key tile, T), made in the backward. T^2 / 64 floats a head each: the memory estimate adds them."""
    block_m, block_n = tiles(d, dv)
    row = 4 * batch * heads * seq_len
    prefix = row * -(-seq_len // block_m)
    return prefix, prefix + row * -(-seq_len // block_n)


def refuses(q1: torch.Tensor, k1: torch.Tensor, v: torch.Tensor, integral: str | None) -> str | None:
    if integral != "softmax":
        return "DINT's softmax integral only"
    if q1.is_cuda and q1.dtype not in (torch.float16, torch.bfloat16):  # fp32 tiles: no tensor cores, large tiles
        return "half precision only on CUDA (the plain path's streaming integral runs fp32)"
    return unavailable_reason(q1.device)


register(Kernel("gpu_dint", head, ("cuda",), refuses, "DINT: map 1 and its log-sum-exp from flex_attention, map 2 "
                "from SDPA, the integral from a Triton kernel without atomics"))

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


def refuses(q1: torch.Tensor, k1: torch.Tensor, v: torch.Tensor, integral: str | None) -> str | None:
    if integral != "softmax":
        return "DINT's softmax integral only"
    if q1.is_cuda and q1.dtype not in (torch.float16, torch.bfloat16):  # fp32 tiles: no tensor cores, large tiles
        return "half precision only on CUDA (the plain path's streaming integral runs fp32)"
    return unavailable_reason(q1.device)


register(Kernel("gpu_dint", head, ("cuda",), refuses, "DINT: map 1 and its log-sum-exp from flex_attention, map 2 "
                "from SDPA, the integral from a Triton kernel without atomics"))

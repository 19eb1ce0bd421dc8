"""Both maps of DIFF V1 and Shared DIFF in one SDPA call over 2h query heads, with V at its full 2d width.

    [O1; O2] = SDPA([Q1; Q2], [K1; K2], [V; V])      out = O1 - lambda O2

Heads are map-major: query head i < h is map 1's head i, query head h + p map 2's head p, which GQA's
i // (h / h_kv) sends to kv head h_kv + p // (h / h_kv): map 2's K, and V again. The scores cost 2h d and the
products with V 2h 2d per query-key pair, the 6d the math needs, where one d-wide call per map and V slice costs
8d. It needs an SDPA backend that takes a V wider than Q and K without the math fallback (cuDNN or
memory-efficient attention, checked with gradients, and the only backends the call may take there): it is picked on
CUDA in half precision, elsewhere only when asked for (tests).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from diffexp.kernels.registry import Kernel, constant_result, register

#: the SDPA backends the joined call may take on CUDA: those `fused_backend_takes` checks, never the math
#: fallback, which would hold the T x T map
FUSED = (SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)


def head(q1, q2, k1, k2, v, lam, integral=None) -> torch.Tensor:
    h = q1.shape[1]
    q, k, vv = torch.cat((q1, q2), 1), torch.cat((k1, k2), 1), torch.cat((v, v), 1)
    with sdpa_kernel(list(FUSED)) if q.is_cuda else contextlib.nullcontext():
        out = F.scaled_dot_product_attention(q, k, vv, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
    return out[:, :h] - lam.to(out.dtype) * out[:, h:]


@constant_result  # torch.compile reads it once while tracing
def fused_backend_takes(device: str, dtype: torch.dtype, heads: int, kv_heads: int, d: int, dv: int) -> bool:
    """Whether SDPA's cuDNN or memory-efficient backend runs the joined call's shapes (checked on small tensors:
    the rules read head counts, widths, dtype and the device, not the length)."""
    return _fused_backend_takes(device, dtype, heads, kv_heads, d, dv)


@functools.cache
def _fused_backend_takes(device, dtype, heads, kv_heads, d, dv) -> bool:
    # requiring grad: the backends' rules for the backward (cuDNN's head widths) are checked too
    q = torch.zeros(1, 2 * heads, 16, d, device=device, dtype=dtype, requires_grad=True)
    k = torch.zeros(1, 2 * kv_heads, 16, d, device=device, dtype=dtype, requires_grad=True)
    v = torch.zeros(1, 2 * kv_heads, 16, dv, device=device, dtype=dtype, requires_grad=True)
    params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, True, heads != kv_heads)
    return torch.backends.cuda.can_use_cudnn_attention(params) or torch.backends.cuda.can_use_efficient_attention(
        params)


def refuses(q1: torch.Tensor, k1: torch.Tensor, v: torch.Tensor, integral: str | None) -> str | None:
    if integral is not None:
        return "two maps only (DINT's integral needs map 1's rows)"
    if v.shape[-1] == q1.shape[-1]:
        return "V as wide as Q: one plain SDPA call over the heads already computes both maps at that cost"
    if not q1.is_cuda:  # picked for CUDA only: SDPA's fused CPU kernel wants V as wide as Q and K
        return None
    if q1.dtype not in (torch.float16, torch.bfloat16):
        return "half precision only on CUDA (the fused SDPA backends)"
    if not fused_backend_takes(str(q1.device), q1.dtype, q1.shape[1], k1.shape[1], q1.shape[-1], v.shape[-1]):
        return "no fused SDPA backend takes these shapes here (cuDNN or memory-efficient, V wider than Q)"
    return None


register(Kernel("sdpa_joined", head, ("cuda",), refuses, "both maps in one SDPA call over 2h query heads, V at "
                "full width (cuDNN or memory-efficient attention)"))

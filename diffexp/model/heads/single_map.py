"""One causal softmax attention per query head (GQA-capable): SDPA or the eager map.

Query head i reads kv head i // (Hq / Hk). With fewer queries than keys (decoding with a cache) the queries
are the last positions: query i sees keys 0 .. T_k - T_q + i. The scale is 1/sqrt(d), also when V is wider.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def expand_kv(kv: torch.Tensor, n_query_heads: int) -> torch.Tensor:
    """Repeat each kv head for the consecutive query heads of its GQA group."""
    return kv.repeat_interleave(n_query_heads // kv.shape[1], dim=1)


def future_mask(t_q: int, t_k: int, device) -> torch.Tensor:
    """True where key j lies after query i, the queries being the last t_q of t_k positions: (t_q, t_k)."""
    return torch.ones(t_q, t_k, dtype=torch.bool, device=device).triu(t_k - t_q + 1)


def causal_logits(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q k^T / sqrt(d) per query head, in fp32 at least, future entries -inf: (B, Hq, T_q, T_k)."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    k = expand_kv(k, q.shape[1])
    logits = (q.to(dtype) @ k.to(dtype).transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return logits.masked_fill(future_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))


def causal_softmax(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + causal mask) per query head, in fp32 at least: (B, Hq, T, T)."""
    return causal_logits(q, k).softmax(dim=-1)


#: how SDPA runs over a V wider than Q and K: "pad" Q and K to V's width, or "split" V into d-wide slices
WIDE_V_MODES = ("pad", "split")


def wide_v_mode(q: torch.Tensor) -> str:
    """The faster of the two where measured (bench/README.md): one padded call on CPU, d-wide slices on GPU."""
    return "pad" if q.device.type == "cpu" else "split"


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str = "sdpa", need_weights: bool = False,
    wide_v: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal attention. q: (B, Hq, T_q, d); k: (B, Hk, T_k, d); v: (B, Hk, T_k, dv), dv a multiple of d.

    Returns the output (B, Hq, T_q, dv) and, when need_weights (always on the eager backend), the map.
    wide_v: one of WIDE_V_MODES, or None for `wide_v_mode`'s choice.
    """
    if need_weights or backend == "eager":
        weights = causal_softmax(q, k)
        out = weights.to(v.dtype) @ expand_kv(v, q.shape[1])
        return out, weights
    gqa = q.shape[1] != k.shape[1]
    t_q, t_k = q.shape[-2], k.shape[-2]
    # SDPA's is_causal aligns the mask top-left; decoding (fewer queries than keys) needs it bottom-right
    mask = {"is_causal": True} if t_q == t_k else {} if t_q == 1 else {"attn_mask": ~future_mask(t_q, t_k, q.device)}
    if gqa and t_q > 1 and not sdpa_fuses_gqa(q, "attn_mask" in mask):
        k, v, gqa = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1]), False
    d, dv = q.shape[-1], v.shape[-1]
    if dv == d:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa, **mask), None
    # SDPA's fused kernels want equal q/v head dims (a wider V falls back to the math kernel): either zero-pad
    # Q and K to V's width (the padding adds nothing to Q K^T) or attend to d-wide slices of V; both exact
    if (wide_v or wide_v_mode(q)) == "pad":
        q, k = (F.pad(t, (0, dv - d)) for t in (q, k))
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa, scale=d ** -0.5, **mask), None
    parts = [F.scaled_dot_product_attention(q, k, v_part, enable_gqa=gqa, **mask) for v_part in v.split(d, dim=-1)]
    return torch.cat(parts, dim=-1), None


def sdpa_fuses_gqa(q: torch.Tensor, masked: bool) -> bool:
    """Whether SDPA runs GQA (fewer K/V heads) in a fused kernel. On CUDA only its flash kernel does (half
    precision, no mask): otherwise SDPA falls back to its math kernel, which holds every (T_q, T_k) map (128 GiB
    for a 16K fp32 prompt), so the K/V heads are repeated instead. On CPU its flash kernel takes GQA in any dtype."""
    return not q.is_cuda or (q.dtype in (torch.float16, torch.bfloat16) and not masked)


"""Causal softmax attention with a sink per query head: a_ij = exp(z_ij) / (exp(s) + sum_k exp(z_ik)).

The sink is one more key that every query sees, with logit s and a zero value; its column is dropped from the map,
whose rows then sum to 1 - exp(s) / (exp(s) + sum_k exp(z_ik)). Over whole sequences SDPA computes it without a
T x T tensor: the sink is a key slot in front of the tokens, reached through an extra channel of Q and K (the
query's holds s sqrt(d), the sink's key 1, the tokens' keys 0), and one zero query row in front keeps SDPA's own
causal mask (row r sees slots 0..r: the sink and tokens 0..r-1); that row's output is dropped. A chunk after a cache
gives the slots its (T_q, T_k + 1) mask, as `attend` does; the eager map and a decoding step write the sink's column
out. s: (Hq,), a number per query head (0 is "off by one").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from diffexp.model.heads.cached_step import key_mask
from diffexp.model.heads.single_map import causal_logits, expand_kv, future_mask, sdpa_fuses_gqa


def sink_attention(q, k, v, sink: torch.Tensor, backend: str = "sdpa", need_weights: bool = False, cache=None):
    """q: (B, Hq, T_q, d); k, v: (B, Hk, T_k, d); sink: (Hq,). Returns the output (B, Hq, T_q, d) and, when
    need_weights (always on the eager backend), the map without the sink's column; else None."""
    if cache is not None and cache.stepping:
        return sink_step(q, k, v, sink, cache.key_lengths()), None
    if need_weights or backend == "eager":
        return eager_sink(q, k, v, sink)
    return sdpa_sink(q, k, v, sink), None


def eager_sink(q, k, v, sink):
    """The map written out: softmax over [s, z_i0, ..., z_in] per row, the sink's column dropped."""
    logits = causal_logits(q, k)
    column = sink.to(logits.dtype).view(1, -1, 1, 1).expand(*logits.shape[:-1], 1)
    weights = torch.cat((column, logits), dim=-1).softmax(dim=-1)[..., 1:]
    return weights.to(v.dtype) @ expand_kv(v, q.shape[1]), weights


#: SDPA's fused CUDA kernels want the head dimension a multiple of 8
CUDA_ALIGN = 8


def sdpa_sink(q, k, v, sink, align: int | None = None):
    """The sink as a key slot in front of the keys, in one SDPA call (no (T_q, T_k) tensor when T_q == T_k). align:
    the multiple the channels are padded to (default: CUDA_ALIGN on CUDA, else 1)."""
    b, hq, t_q, d = q.shape
    hk, t_k, dv = k.shape[1], k.shape[-2], v.shape[-1]
    align = align or (CUDA_ALIGN if q.is_cuda else 1)
    width = -(-(max(d, dv) + 1) // align) * align  # one more channel, the last, carries the sink's logit
    sink_q = (sink * d ** 0.5).to(q.dtype).view(1, hq, 1, 1).expand(b, hq, t_q, 1)
    q = torch.cat((F.pad(q, (0, width - 1 - d)), sink_q), dim=-1)
    sink_k = torch.zeros(width, dtype=k.dtype, device=k.device)
    sink_k[-1] = 1
    k = torch.cat((sink_k.expand(b, hk, 1, width), F.pad(k, (0, width - d))), dim=-2)
    v = F.pad(v, (0, width - dv, 1, 0))  # the sink's value is 0
    square = t_q == t_k
    if square:  # a zero query row in front: then slot j is visible to row r exactly when j <= r
        q = F.pad(q, (0, 0, 1, 0))
    mask = {"is_causal": True} if square else {"attn_mask": ~future_mask(t_q, t_k + 1, q.device)}
    gqa = hq != hk
    if gqa and not sdpa_fuses_gqa(q, not square):
        k, v, gqa = expand_kv(k, hq), expand_kv(v, hq), False
    out = F.scaled_dot_product_attention(q, k, v, scale=d ** -0.5, enable_gqa=gqa, **mask)
    return out[:, :, int(square):, :dv]


def sink_step(q, k, v, sink, lengths):
    """One decoding step: q (B, Hq, 1, d) against the cache's k, v (B, Hk, S, d), row b reading its first
    lengths[b] keys (all when None). The query heads of a GQA group share one product with K and one with V."""
    b, hq, _, d = q.shape
    hk, keys = k.shape[1], k.shape[-2]
    q = q.reshape(b, hk, hq // hk, d)
    scores = (q * d ** -0.5) @ k.transpose(-1, -2)
    mask = key_mask(lengths, keys)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    column = sink.to(scores.dtype).view(1, hk, hq // hk, 1).expand(b, -1, -1, 1)
    dtype = torch.promote_types(scores.dtype, torch.float32)
    weights = torch.cat((column, scores), dim=-1).softmax(dim=-1, dtype=dtype)[..., 1:]
    return (weights.to(v.dtype) @ v).view(b, hq, 1, v.shape[-1])

"""The attention calls every variant makes, on the plain PyTorch path or a registered fast kernel.

`attention(q, k, v, ...)`: causal softmax attention per query head (SDPA, or the eager map).
`paired_heads(q, k, v, lam, first, second, ...)`: DIFF V2's attn[first] - lambda attn[second], attn one attention call
over all query heads; where a pair shares K and V, a kernel may compute each pair as a two-map head.
`two_map_head(q1, q2, k1, k2, v, lam, ...)`: (A1 - lambda A2 [+ gamma A3]) V, the head of DIFF V1, Shared DIFF
and DINT. Over whole sequences it runs the kernel diffexp.kernels resolves, if any computes the call; otherwise,
and for maps requested, eager attention and decoding, the plain path:

    per_map.py       one SDPA call per map; DINT's integral from A1 V (mean) or streamed with map 1 (softmax)
    single_map.py    one causal attention per query head (SDPA or the eager map), GQA
    cached_step.py   one decoding step: both maps against the cache, V read once
    dint_integral.py DINT's softmax integral without a T x T tensor, and decoding's rows from column sums
    sink.py          softmax with a sink logit per head (off by one, gpt-oss): the sink as one more key slot
    taps.py          the door of evaluations: every call above, eager, with each map's logits and terms seen
"""

from __future__ import annotations

import torch

from diffexp.kernels.registry import Integral, resolve
from diffexp.model.heads import taps
from diffexp.model.heads.cached_step import key_mask, single_map_step, two_map_step
from diffexp.model.heads.per_map import per_map_head
from diffexp.model.heads.single_map import attend, causal_logits, expand_kv
from diffexp.model.heads.sink import sink_attention


def attention(q, k, v, backend: str = "sdpa", need_weights: bool = False, cache=None):
    """Causal softmax attention per query head: (out, the map when need_weights or eager, else None). cache: the
    layer's LayerCache when decoding; a one-token step reads K and V once per GQA group (cached_step.py)."""
    if cache is not None and cache.stepping:
        return single_map_step(q, k, v, cache.key_lengths()), None
    return attend(q, k, v, backend, need_weights)


def normalised_attention(q, k, v, normalise, cache=None):
    """Causal attention whose rows are `normalise(logits)` (logits (..., T_k), masked keys -inf), a row rule other
    than softmax. q: (B, Hq, T_q, d); k, v: (B, Hk, T_k, d), the queries the last T_q positions, or in a decoding
    step one query per row against the cache, row b reading its first key_lengths[b] keys. Returns the output and
    the map (B, Hq, T_q, T_k), in fp32 at least."""
    logits = causal_logits(q, k)
    if cache is not None and cache.stepping:
        mask = key_mask(cache.key_lengths(), k.shape[-2])
        if mask is not None:
            logits = logits.masked_fill(~mask, float("-inf"))
    weights = normalise(logits)
    return weights.to(v.dtype) @ expand_kv(v, q.shape[1]), weights


def two_map_head(q1, q2, k1, k2, v, lam, *, backend: str = "sdpa", integral: Integral | None = None,
                 cache=None, need_weights: bool = False):
    """(A1 - lambda A2 [+ gamma A3]) V with A_m = causal softmax(Q_m K_m^T / sqrt(d)).

    q1, q2: (B, h, T_q, d); k1, k2: (B, h_kv, T_k, d); v: (B, h_kv, T_k, dv); head p reads kv head p // (h / h_kv).
    lam: a 0-d tensor (the fast kernels' contract), or a number or one per token (B, h, T_q, 1) on the plain path.
    cache: the layer's LayerCache when decoding (the keys hold the cached positions; in a chunk
    the queries are the last T_q of T_k). Returns (B, h, T_q, dv) and the effective map (B, h, T_q, T_k) when
    eager, else None.
    """
    if cache is not None and cache.stepping:
        col_sums = None if integral is None else cache.sums("col_sums", q1)
        return two_map_step(q1, q2, k1, k2, v, lam, cache.key_lengths(), integral, col_sums, cache.positions), None
    eager = need_weights or backend == "eager"
    layer_lambda = torch.is_tensor(lam) and lam.dim() == 0  # the door's contract; a new variant may pass others
    kernel = None if eager or cache is not None or not layer_lambda else resolve(q1, k1, v, integral)
    if kernel is not None:
        return kernel.head(q1, q2, k1, k2, v, lam, integral), None
    return per_map_head(q1, q2, k1, k2, v, lam, integral, cache, eager)


def paired_heads(q, k, v, lam, first: slice, second: slice, *, shared_kv: bool, backend: str = "sdpa", cache=None,
                 need_weights: bool = False):
    """attn[:, first] - lam * attn[:, second] with attn = causal attention over every query head of q (one call),
    and the effective map when computed. lam: a number or (B, h, T_q, 1). shared_kv: each pair's two query heads
    read one K/V head, so over whole sequences a kernel that takes a lambda per token (diffexp.kernels) may compute
    the pair as a two-map head, both maps with one product with V."""
    if shared_kv and not (need_weights or backend == "eager" or cache is not None):
        q1, q2 = q[:, first], q[:, second]
        lam_k = lam if torch.is_tensor(lam) else q.new_tensor(lam, dtype=torch.float32)  # a 0-d lambda
        kernel = resolve(q1, k, v, None, token_lambda=lam_k.dim() > 0)
        if kernel is not None:
            return kernel.head(q1, q2, k, k, v, lam_k), None
    attn, weights = attention(q, k, v, backend, need_weights, cache)
    out = attn[:, first] - lam * attn[:, second]
    if weights is None:
        return out, None
    lam_maps = lam.to(torch.promote_types(lam.dtype, torch.float32)) if torch.is_tensor(lam) else lam
    return out, weights[:, first] - lam_maps * weights[:, second]


__all__ = ["Integral", "attention", "normalised_attention", "paired_heads", "sink_attention", "taps", "two_map_head"]

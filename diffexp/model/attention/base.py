"""What every attention variant shares: sizes, projections' init, RoPE, the cache, and the attention calls.

The calls themselves live in diffexp.model.heads: `attend` here is one softmax attention per query head,
`two_map_head` the differential head of the two-map variants (on a registered fast kernel where one applies).
Inside `diffexp.model.heads.taps.tapping(tap)` each call runs through the tap instead (an evaluation's view of
every map's logits, probabilities and V); outside it a call costs one check more.
"""

from __future__ import annotations

import torch
from torch import nn

from diffexp.model.heads import (
    Integral,
    attention,
    normalised_attention,
    paired_heads,
    sink_attention,
    taps,
    two_map_head,
)
from diffexp.model.heads.single_map import causal_logits
from diffexp.model.rope import RotaryEmbedding


def split_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(B, T, n_heads * d) -> (B, n_heads, T, d)."""
    b, t, _ = x.shape
    return x.view(b, t, n_heads, -1).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(B, n_heads, T, d) -> (B, T, n_heads * d)."""
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, h * d)


class AttentionBase(nn.Module):
    """Holds sizes, RoPE and the attention call; subclasses define projections and how maps combine.

    `forward(x, need_weights=False, cache=None)` returns (output, effective_map or None); the effective map
    is (B, n_heads, T, T), the per-head matrix that multiplies V (see variants.md). With a LayerCache
    (diffexp.model.cache) x holds the tokens after the cached ones: rotate them at `start_of(cache)` and pass
    what later tokens need through `cached(cache, ...)`. Name the modules that
    make queries and keys `q_proj` and `k_proj`, and the output projection `o_proj`: the parameter report
    counts the first two as `qk_projections`, and the decoder scales the init of the last.
    """

    def __init__(self, cfg, layer_idx: int) -> None:  # cfg: a validated diffexp.model.config.ModelConfig
        super().__init__()
        self.cfg = cfg
        self.layer_idx = layer_idx
        self.d_model = cfg.d_model
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.kv_heads
        self.head_dim = cfg.resolved_head_dim
        self.backend = cfg.backend
        self.rope = RotaryEmbedding(self.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.stats: dict[str, float] = {}

    def linear(self, in_features: int, out_features: int, default_init: bool = False) -> nn.Linear:
        """A bias-free projection. The decoder re-initialises it from N(0, init_std^2), unless
        `default_init`: then it keeps PyTorch's own nn.Linear init (kaiming-uniform, bound 1/sqrt(fan_in))."""
        layer = nn.Linear(in_features, out_features, bias=False)
        layer.keep_default_init = default_init
        return layer

    #: set by the diagnostics: record the largest attention logit (over the first `stats_rows` rows of the
    #: batch) and variant statistics on the next forward
    record_stats = False
    stats_rows: int | None = None

    @staticmethod
    def start_of(cache) -> int | torch.Tensor:
        """The position of x's first token: 0, the number of cached positions, or in a decoding step each row's
        own position (B,)."""
        if cache is None:
            return 0
        return cache.positions if cache.stepping else cache.length

    @staticmethod
    def cached(cache, **new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The new tensors as they are (no cache), or appended to the cache's and returned in full."""
        return tuple(new.values()) if cache is None else cache.append(**new)

    def record_logit_max(self, q, k) -> None:
        """On a diagnostics forward, keep the largest pre-softmax logit (every attention call goes through here)."""
        if self.record_stats:
            with torch.no_grad():
                logit_max = causal_logits(q[: self.stats_rows], k[: self.stats_rows]).max().item()
            self.stats["attn_logit_max"] = max(self.stats.get("attn_logit_max", float("-inf")), logit_max)

    def attend(self, q, k, v, need_weights: bool = False, cache=None):
        """Causal softmax attention per query head on this layer's backend (RoPE already applied)."""
        self.record_logit_max(q, k)
        if taps.ACTIVE is not None:
            return taps.attend(self.layer_idx, q, k, v, need_weights, cache)
        return attention(q, k, v, self.backend, need_weights, cache)

    def attend_with_sink(self, q, k, v, sink: torch.Tensor, need_weights: bool = False, cache=None):
        """Causal softmax attention per query head with a sink logit per query head, sink: (h,) (heads/sink.py);
        the map returned leaves the sink's mass out."""
        self.record_logit_max(q, k)
        if taps.ACTIVE is not None:
            return taps.attend_with_sink(self.layer_idx, q, k, v, sink, need_weights, cache)
        return sink_attention(q, k, v, sink, self.backend, need_weights, cache)

    def attend_normalised(self, q, k, v, normalise, name: str, cache=None):
        """Causal attention whose rows are `normalise(logits)` (a rectified softmax, say), always written out:
        (output, the map in fp32 at least). `name` names the map for the taps."""
        self.record_logit_max(q, k)
        if taps.ACTIVE is not None:
            return taps.attend_normalised(self.layer_idx, q, k, v, normalise, name, cache)
        return normalised_attention(q, k, v, normalise, cache)

    def paired_heads(self, q, k, v, lam, first: slice, second: slice, shared_kv: bool, need_weights: bool = False,
                     cache=None):
        """attn[first] - lambda attn[second], attn one causal attention call over every query head of q."""
        self.record_logit_max(q, k)
        if taps.ACTIVE is not None:
            return taps.paired_heads(self.layer_idx, q, k, v, lam, first, second, need_weights, cache)
        return paired_heads(q, k, v, lam, first, second, shared_kv=shared_kv, backend=self.backend, cache=cache,
                            need_weights=need_weights)

    def two_map_head(self, q1, q2, k1, k2, v, lam, need_weights: bool = False, cache=None,
                     integral: Integral | None = None):
        """(A1 - lambda A2 [+ gamma A3]) V and the effective map (when computed), on this layer's backend."""
        self.record_logit_max(q1, k1)
        self.record_logit_max(q2, k2)
        if taps.ACTIVE is not None:
            return taps.two_map_head(self.layer_idx, q1, q2, k1, k2, v, lam, need_weights, cache, integral)
        return two_map_head(q1, q2, k1, k2, v, lam, backend=self.backend, integral=integral, cache=cache,
                            need_weights=need_weights)

    def extra_repr(self) -> str:
        return (f"layer={self.layer_idx}, heads={self.n_heads}, kv_heads={self.n_kv_heads}, "
                f"head_dim={self.head_dim}, backend={self.backend}")

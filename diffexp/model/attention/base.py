"""What every attention variant shares: head reshaping, RoPE, and the causal attention call.

`attend` runs one causal (GQA-capable) attention: query head i reads kv head i // (Hq / Hk).
The fast path is PyTorch SDPA, or FlashAttention-2 when installed and the tensors are on CUDA;
the eager path materialises the softmax map so variants can return their effective attention.
Backend triton: the two-map variants call their fused kernels themselves (differential.py); the
calls that reach `attend` (other variants, decoding with a cache, maps requested) run SDPA.
With fewer queries than keys (decoding with a cache) the queries are the last positions: query i
sees keys 0 .. T_k - T_q + i.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from diffexp.errors import invalid
from diffexp.model.rope import RotaryEmbedding

try:  # optional GPU extra
    from flash_attn import flash_attn_func
except ImportError:  # pragma: no cover - depends on the environment
    flash_attn_func = None


def split_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(B, T, n_heads * d) -> (B, n_heads, T, d)."""
    b, t, _ = x.shape
    return x.view(b, t, n_heads, -1).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(B, n_heads, T, d) -> (B, T, n_heads * d)."""
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, h * d)


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


def flash_available(*tensors: torch.Tensor) -> bool:
    return flash_attn_func is not None and all(t.is_cuda for t in tensors)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str = "sdpa", need_weights: bool = False,
    backend_fallback: bool = True, wide_v: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal attention. q: (B, Hq, T_q, d); k: (B, Hk, T_k, d); v: (B, Hk, T_k, dv) with dv a multiple of d,
    T_q <= T_k (the queries are the last T_q positions).

    Returns the output (B, Hq, T_q, dv) and, when need_weights (always on the eager backend), the map.
    The scale is 1/sqrt(d), the query/key dim, also when V is wider. wide_v: one of WIDE_V_MODES, or None
    for `wide_v_mode`'s choice.
    """
    if need_weights or backend == "eager":
        weights = causal_softmax(q, k)
        out = weights.to(v.dtype) @ expand_kv(v, q.shape[1])
        return out, weights
    if backend == "flash_attn":
        if flash_available(q, k, v):
            return _flash(q, k, v), None
        if backend_fallback:
            warnings.warn("model.arch.backend='flash_attn' needs CUDA tensors; using sdpa for these", stacklevel=2)
        else:
            raise RuntimeError("model.arch.backend='flash_attn' needs the flash-attn package and CUDA tensors; "
                               "use backend 'sdpa' or set model.arch.backend_fallback=true")
    gqa = q.shape[1] != k.shape[1]
    t_q, t_k = q.shape[-2], k.shape[-2]
    # SDPA's is_causal aligns the mask top-left; decoding (fewer queries than keys) needs it bottom-right
    mask = {"is_causal": True} if t_q == t_k else {} if t_q == 1 else {"attn_mask": ~future_mask(t_q, t_k, q.device)}
    d, dv = q.shape[-1], v.shape[-1]
    if dv == d:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa, **mask), None
    # SDPA's fused kernels want equal q/v head dims; a 2d-wide V would fall back to the math kernel
    # (T x T maps kept for backward). Either zero-pad Q and K to V's width (one call; the padding adds
    # nothing to Q K^T, and the scale stays 1/sqrt(d)) or attend to d-wide slices of V: both exact.
    if (wide_v or wide_v_mode(q)) == "pad":
        q, k = (F.pad(t, (0, dv - d)) for t in (q, k))
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa, scale=d ** -0.5, **mask), None
    parts = [F.scaled_dot_product_attention(q, k, v_part, enable_gqa=gqa, **mask) for v_part in v.split(d, dim=-1)]
    return torch.cat(parts, dim=-1), None


#: how `attend` runs SDPA over a V wider than Q and K: "pad" Q and K to V's width, or "split" V into d-wide slices
WIDE_V_MODES = ("pad", "split")


def wide_v_mode(q: torch.Tensor) -> str:
    """The faster of the two where measured: "pad" on CPU (one fused call instead of two); see bench/README.md."""
    return "pad" if q.device.type == "cpu" else "split"


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # FlashAttention-2 wants (B, T, H, d) and equal q/v head dims: split a wider V into d-wide
    # slices; each call recomputes the same softmax, so the concatenation is exact. Its causal mask
    # is aligned bottom-right (flash-attn >= 2.1), as decoding with a cache needs.
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    d = q.shape[-1]
    parts = [flash_attn_func(q, k, v_part, causal=True) for v_part in v.split(d, dim=-1)]
    return torch.cat(parts, dim=-1).transpose(1, 2)


def resolve_backend(backend: str, fallback: bool = True) -> str:
    """Decided once at build time: flash_attn without the package falls back to sdpa, or fails; triton
    needs CUDA (or Triton's interpreter, for tests)."""
    if backend == "triton":
        from diffexp.model.kernels import unavailable_reason

        reason = unavailable_reason("cuda" if torch.cuda.is_available() else "cpu")
        if reason is not None:
            raise invalid("model.arch.backend", backend, f"cannot run here: {reason}; use sdpa")
    if backend == "flash_attn" and flash_attn_func is None:
        message = "flash-attn is not installed (pip install 'diffexp[flash]' on a CUDA machine)"
        if not fallback:
            raise invalid("model.arch.backend", backend, f"{message}; use sdpa, or set "
                          "model.arch.backend_fallback=true to fall back to sdpa")
        warnings.warn(f"{message}; model.arch.backend='flash_attn' falls back to 'sdpa'", stacklevel=2)
        return "sdpa"
    return backend


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
        self.backend = resolve_backend(cfg.backend, cfg.backend_fallback)
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
    def start_of(cache) -> int:
        """The position of x's first token: 0, or the number of cached positions."""
        return 0 if cache is None else cache.length

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

    def attend(self, q, k, v, need_weights: bool = False):
        """The causal attention call on this layer's backend (RoPE already applied)."""
        self.record_logit_max(q, k)
        return attend(q, k, v, self.backend, need_weights, self.cfg.backend_fallback)

    def extra_repr(self) -> str:
        return (f"layer={self.layer_idx}, heads={self.n_heads}, kv_heads={self.n_kv_heads}, "
                f"head_dim={self.head_dim}, backend={self.backend}")

"""Every implementation of attention, behind two calls and one resolver.

`attention(q, k, v, ...)`: causal softmax attention per query head (SDPA, flash-attn or the eager map).
`two_map_head(q1, q2, k1, k2, v, lam, ...)`: the differential head (A1 - lambda A2 [+ gamma A3]) V of every
two-map variant, run by the kernel `resolve_kernel` picks from `model.arch.backend` and the call:

    eager       the maps themselves (backend eager, or maps requested)
    per_map     one attention call per map (GPU sdpa and flash_attn; a chunk after a cache)
    cached_step one decoding step: both maps against the cache, V read once (cached_step.py)
    cpu_native  the compiled CPU kernel: both maps, lambda and DINT's integral in one pass (cpu_native.py)
    blocked     the same pass in PyTorch ops, where the CPU kernel cannot be built or for fp64
    triton      the fused Triton kernels (backend triton, CUDA; and DINT's softmax integral on any GPU backend)

A kernel that cannot compute a head (DIFF V2's lambda per token, DINT's mean integral) hands it to per_map.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import torch

from diffexp.errors import invalid
from diffexp.model.kernels import blocked_two_map, cpu_native
from diffexp.model.kernels.cached_step import single_map_step, two_map_step
from diffexp.model.kernels.dint_integral import fused_dint_head
from diffexp.model.kernels.per_map import per_map_head, row_positions
from diffexp.model.kernels.single_map import attend, expand_kv, flash_attn_func
from diffexp.model.kernels.triton_support import unavailable_reason

KERNELS = ("eager", "per_map", "cached_step", "cpu_native", "blocked", "triton")


@dataclass(frozen=True)
class Integral:
    """DINT's third map, + gamma A3: kind "softmax" (the paper) or "mean"; gamma a 0-d tensor."""

    kind: str
    gamma: torch.Tensor
    block_size: int = 32  # query rows per step of the streaming passes


def check_backend(backend: str, fallback: bool = True) -> str:
    """The backend a model builds with: flash_attn without its package falls back to sdpa (or fails); triton
    needs CUDA, or Triton's interpreter for tests."""
    if backend == "triton":
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


_FORCED: list[str] = []


@contextlib.contextmanager
def forced_kernel(kernel: str):
    """Within the block, sdpa and flash_attn heads run on `kernel` where it can compute them (benchmarks)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel {kernel!r}: expected one of {KERNELS}")
    if kernel == "cpu_native" and cpu_native.unavailable_reason() is not None:
        raise RuntimeError(f"the CPU attention kernel is unavailable: {cpu_native.unavailable_reason()}")
    _FORCED.append(kernel)
    try:
        yield
    finally:
        _FORCED.pop()


def resolve_kernel(backend: str, q: torch.Tensor, need_weights: bool = False, decoding: str | None = None,
                   layer_lambda: bool = True, integral: str | None = None) -> str:
    """The kernel of one two-map head call: the backend's fastest one that computes this head.
    decoding: None (no cache), "chunk" (positions after a cache) or "step" (one token per row)."""
    if decoding == "step":
        return "cached_step"
    if need_weights or backend == "eager":
        return "eager"
    if decoding:
        return "per_map"
    if backend == "triton":
        preferred = "triton"
    elif _FORCED:
        preferred = _FORCED[-1]
    elif q.device.type != "cpu":  # CUDA's SDPA and flash kernels; DINT's integral has none, Triton's beats a loop
        triton_runs = q.device.type == "cuda" and unavailable_reason(q.device) is None
        preferred = "triton" if integral == "softmax" and triton_runs else "per_map"
    else:  # both beat one SDPA call per map on CPU (bench/README.md); the compiled kernel computes in fp32
        preferred = "cpu_native" if q.dtype != torch.float64 and cpu_native.available() else "blocked"
    # layer_lambda: lambda is one 0-d tensor (not a number, not one per token)
    computes = {"triton": layer_lambda, "cpu_native": integral != "mean",
                "blocked": layer_lambda and integral != "mean"}
    return preferred if computes.get(preferred, True) else "per_map"


def attention(q, k, v, backend: str = "sdpa", need_weights: bool = False, backend_fallback: bool = True, cache=None):
    """Causal softmax attention per query head: (out, the map when need_weights or eager, else None). cache: the
    layer's LayerCache when decoding; a one-token step reads K and V once per GQA group (cached_step.py)."""
    if cache is not None and cache.stepping:
        return single_map_step(q, k, v, cache.key_lengths()), None
    return attend(q, k, v, backend, need_weights, backend_fallback)


def two_map_head(q1, q2, k1, k2, v, lam, *, backend: str = "sdpa", integral: Integral | None = None,
                 cache=None, need_weights: bool = False, backend_fallback: bool = True):
    """(A1 - lambda A2 [+ gamma A3]) V with A_m = causal softmax(Q_m K_m^T / sqrt(d)).

    q1, q2: (B, h, T_q, d); k1, k2: (B, h_kv, T_k, d); v: (B, h_kv, T_k, dv); head p reads kv head p // (h / h_kv).
    lam: a number, a 0-d tensor, or (B, h, T_q, 1), one per token and head. cache: the layer's LayerCache when
    decoding (the keys hold the cached positions; in a chunk the queries are the last T_q of T_k). Returns
    (B, h, T_q, dv) and the effective map (B, h, T_q, T_k) when the kernel is eager, else None.
    """
    layer_lambda = torch.is_tensor(lam) and lam.dim() == 0
    decoding = None if cache is None else "step" if cache.stepping else "chunk"
    kernel = resolve_kernel(backend, q1, need_weights, decoding, layer_lambda, integral.kind if integral else None)
    if kernel == "cached_step":
        col_sums = None if integral is None else cache.sums("col_sums", q1)
        return two_map_step(q1, q2, k1, k2, v, lam, cache.key_lengths(), integral, col_sums, cache.positions), None
    if kernel in ("eager", "per_map"):
        return per_map_head(q1, q2, k1, k2, v, lam, integral, cache, kernel == "eager", backend,
                            backend_fallback)
    if kernel == "triton":
        return _triton_head(q1, q2, k1, k2, v, lam, integral), None
    if kernel == "cpu_native":
        lam_rows = lam.squeeze(-1) if torch.is_tensor(lam) and lam.dim() > 0 else lam
        if integral is None:
            return cpu_native.two_map(q1, q2, k1, k2, v, lam_rows), None
        return cpu_native.dint_head(q1, q2, k1, k2, v, lam, integral.gamma, integral.block_size), None
    if integral is None:
        return blocked_two_map.blocked_two_map(q1, q2, k1, k2, v, lam), None
    h = q1.shape[1]
    k1, k2, v = (expand_kv(t, h) for t in (k1, k2, v))
    return fused_dint_head(q1, q2, k1, k2, v, lam, integral.gamma, integral.block_size), None


def _triton_head(q1, q2, k1, k2, v, lam, integral):
    from diffexp.model.kernels.triton_diff_attention import differential_attention

    if integral is None:
        return differential_attention(q1, q2, k1, k2, v, lam)[0]
    from diffexp.kernels.triton_dint import dint_integral

    mean = integral.kind == "mean"
    out, out1, lse1 = differential_attention(q1, q2, k1, k2, v, lam, want_out1=mean)
    integral_out = out1.cumsum(dim=-2) / row_positions(out1.shape[-2], out1) if mean else dint_integral(
        q1, k1, v, lse1)
    return out + integral.gamma.to(out.dtype) * integral_out


__all__ = ["KERNELS", "Integral", "attention", "check_backend", "forced_kernel", "resolve_kernel", "two_map_head",
           "unavailable_reason"]

"""DINT (Cang et al. 2025): differential attention plus an integral term; rows sum to 1.

    G[n, :] = (1/n) sum_{m<=n} A1[m, :]          cumulative mean of A1's rows (n is 1-based)
    A3      = softmax over j <= n of G[n, j]     (integral="softmax", the paper)
            = G                                  (integral="mean")
    Final   = A1 - lambda A2 + gamma A3          gamma="lambda" (the paper): gamma = lambda, every row sums
                                                 to 1; gamma="learned": a scalar per layer of its own, rows
                                                 sum to 1 - lambda + gamma
    head    = GroupNorm(Final V)                 no (1 - lambda_init) factor

The fast path never builds a T x T map: "mean" is cumsum(A1 V) / n, and "softmax" streams over
query blocks with running column sums of A1, forward and backward (dint_integral.py). Decoding with a
cache keeps those column sums (one number per head and position) and extends them row by row.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from diffexp.errors import invalid
from diffexp.model.attention.base import expand_kv
from diffexp.model.attention.differential import (
    TWO_MAP_CASES,
    TWO_MAP_FIELDS,
    TwoMapDifferentialAttention,
    check_two_map,
    naive_plain_qk,
    naive_two_map,
    two_map_flops,
)
from diffexp.model.attention.dint_integral import fused_dint_head, fused_first_map_integral, integral_rows
from diffexp.model.attention.registry import Variant, register
from diffexp.model.kernels import cpu_native


def check(cfg) -> None:
    check_two_map(cfg)
    if cfg.integral not in ("softmax", "mean"):
        raise invalid("model.arch.integral", cfg.integral, "expected 'softmax' or 'mean'")
    if cfg.gamma not in ("lambda", "learned"):
        raise invalid("model.arch.gamma", cfg.gamma, "expected 'lambda' (gamma = lambda, the paper) or 'learned' "
                      "(a scalar per layer of its own)")
    init = cfg.gamma_init
    if init != "lambda_init" and (isinstance(init, bool) or not isinstance(init, (int, float))
                                  or not math.isfinite(init)):
        raise invalid("model.arch.gamma_init", init, "expected 'lambda_init' (the layer's lambda_init) or a number")
    if cfg.gamma == "lambda" and init != "lambda_init":
        raise invalid("model.arch.gamma_init", init, "expected 'lambda_init' unless model.arch.gamma is 'learned' "
                      "(with gamma = lambda there is no gamma of its own to initialise)")


def attention_flops(cfg, keys: float) -> float:
    """DIFF V1's maps plus the integral's A3 V: h maps over the 2d-wide V."""
    return two_map_flops(cfg, keys) + cfg.n_heads * 2 * keys * 2 * cfg.resolved_head_dim


def naive_integral(a1: torch.Tensor, integral: str) -> torch.Tensor:
    """A3 of one head, row by row: the (soft-maxed) mean of A1's rows 0..n over columns 0..n."""
    t = a1.shape[0]
    a3 = torch.zeros_like(a1)
    for n in range(t):
        g = a1[: n + 1, : n + 1].sum(dim=0) / (n + 1)
        a3[n, : n + 1] = g if integral == "mean" else torch.softmax(g, dim=0)
    return a3


def reference(m, x: torch.Tensor):
    gamma = m.gamma.double() if m.cfg.gamma == "learned" else None  # None: the integral weighs lambda
    return naive_two_map(m, x, naive_plain_qk(m, x), extra_map=lambda a1: naive_integral(a1, m.cfg.integral),
                         scale_by_lambda_init=False, extra_weight=gamma)


def row_positions(t: int, like: torch.Tensor, start: int = 0) -> torch.Tensor:
    """n = 1, 2, ... for rows start .. start + t - 1, shaped to divide (..., t, cols)."""
    return torch.arange(start + 1, start + t + 1, device=like.device, dtype=like.dtype).unsqueeze(-1)


def integral_map(weights1: torch.Tensor, integral: str) -> torch.Tensor:
    """A3 from the full map A1 (B, h, T, T), the eager way."""
    t = weights1.shape[-1]
    g = weights1.cumsum(dim=-2) / row_positions(t, weights1)
    if integral == "mean":
        return g
    future = torch.ones(t, t, dtype=torch.bool, device=g.device).triu(1)
    return g.masked_fill(future, float("-inf")).softmax(dim=-1)


@register
class DintAttention(TwoMapDifferentialAttention):
    variant = Variant(
        name="dint",
        summary="DIFF V1 plus an integral term from cumulative attention; rows sum to 1",
        paper="Cang et al. 2025, DINT Transformer",
        maps_per_head=2,
        fields=(*TWO_MAP_FIELDS, "integral", "gamma", "gamma_init"),
        check=check,
        attention_flops=attention_flops,
        reference=reference,
        cases={**TWO_MAP_CASES, "mean": {"integral": "mean"},
               "mean-nonorm-lam0.5": {"integral": "mean", "head_norm": False, "lambda_init": 0.5},
               "learned": {"gamma": "learned"},
               "learned-init0.9": {"gamma": "learned", "gamma_init": 0.9},
               "learned-mean-init0.9": {"gamma": "learned", "gamma_init": 0.9, "integral": "mean"}},
    )
    scale_by_lambda_init = False
    #: query rows per step of the streaming integral; memory is O(block_size * T) per head. 32 beat 128 on
    #: CPU (bench/README.md): smaller blocks keep the elementwise passes in cache
    integral_block_size = 32

    def __init__(self, cfg, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        if cfg.gamma == "learned":  # one scalar per layer, fp32 like lambda; 0-d, so no weight decay
            init = self.lambda_init if cfg.gamma_init == "lambda_init" else float(cfg.gamma_init)
            self.gamma = nn.Parameter(torch.tensor(init, dtype=torch.float32))

    def integral_weight(self, lam: torch.Tensor) -> torch.Tensor:
        """gamma: lambda itself, or the layer's own learned scalar."""
        if self.cfg.gamma == "learned":
            return self.gamma.to(torch.promote_types(self.gamma.dtype, torch.float32))
        return lam

    def first_map(self, q1, k1, v, lam, need_weights: bool, cache=None):
        """Map 1 and the softmax integral in one blocked pass (full forwards without the eager maps); the
        mean integral, decoding and the eager maps take map 1 from `attend` and the integral in `add_terms`."""
        if self.cfg.integral != "softmax" or need_weights or cache is not None or self.backend == "eager":
            return super().first_map(q1, k1, v, lam, need_weights, cache)
        self.record_logit_max(q1, k1)
        h = q1.shape[1]
        out = fused_first_map_integral(q1, expand_kv(k1, h), expand_kv(v, h), self.integral_weight(lam),
                                       self.integral_block_size)
        return out, None, True  # (A1 + gamma A3) V: the integral is in already

    def add_terms(self, out, effective, lam, q1, k1, v, out1, weights1, cache=None, fused=None):
        gamma = self.integral_weight(lam)
        if fused:  # first_map's pass added gamma A3 V
            return out, effective
        if cache is not None:  # the new rows from the column sums of A1's earlier rows, O(T) state per head
            h = q1.shape[1]
            integral_out, cache.state["col_sums"] = integral_rows(
                q1, expand_kv(k1, h), expand_kv(v, h), self.integral_block_size, cache.state.get("col_sums"),
                self.cfg.integral)
            integral_out = integral_out.to(v.dtype)
        elif weights1 is not None:  # eager: the full map
            a3 = integral_map(weights1, self.cfg.integral)
            integral_out = a3.to(v.dtype) @ expand_kv(v, a3.shape[1])
            effective = effective + gamma * a3
        else:  # the mean integral: G V = cumsum(A1 V) / n exactly
            n = row_positions(out1.shape[-2], out1)
            integral_out = out1.cumsum(dim=-2) / n
        return out + gamma.to(out.dtype) * integral_out, effective

    def single_pass(self, q1, need_weights: bool, cache) -> str | None:
        """The Triton kernels, or on CPU the softmax integral's blocked pass with both maps in it; the mean integral
        takes A1 V from its own SDPA call (cumsum(A1 V) / n)."""
        path = super().single_pass(q1, need_weights, cache)
        return path if path == "triton" or self.cfg.integral == "softmax" else None

    def cpu_head(self, q1, q2, k1, k2, v, lam, path: str):
        """(A1 - lambda A2 + gamma A3) V: the compiled kernel ("native"), or the streaming integral's pass in PyTorch
        ops with map 2 added ("blocked"); one product with V either way."""
        if path == "native":
            return cpu_native.dint_head(q1, q2, k1, k2, v, lam, self.integral_weight(lam), self.integral_block_size)
        h = q1.shape[1]
        k1, k2, v = (expand_kv(t, h) for t in (k1, k2, v))
        return fused_dint_head(q1, q2, k1, k2, v, lam, self.integral_weight(lam), self.integral_block_size)

    def kernel_head(self, q1, q2, k1, k2, v, lam):
        from diffexp.model.kernels.triton_diff_attention import differential_attention
        from diffexp.model.kernels.triton_dint_integral import dint_integral

        mean = self.cfg.integral == "mean"
        out, out1, lse1 = differential_attention(q1, q2, k1, k2, v, lam, want_out1=mean)
        integral_out = out1.cumsum(dim=-2) / row_positions(out1.shape[-2], out1) if mean else dint_integral(
            q1, k1, v, lse1)
        return out + self.integral_weight(lam).to(out.dtype) * integral_out

    def extra_repr(self) -> str:
        return super().extra_repr() + f", integral={self.cfg.integral}, gamma={self.cfg.gamma}"

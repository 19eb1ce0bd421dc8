"""DINT (Cang et al. 2025): differential attention plus an integral term; rows sum to 1.

    G[n, :] = (1/n) sum_{m<=n} A1[m, :]          cumulative mean of A1's rows (n is 1-based)
    A3      = softmax over j <= n of G[n, j]     (integral="softmax", the paper)
            = G                                  (integral="mean")
    Final   = A1 - lambda A2 + gamma A3          gamma="lambda" (the paper): gamma = lambda, every row sums
                                                 to 1; gamma="learned": a scalar per layer of its own, rows
                                                 sum to 1 - lambda + gamma
    head    = GroupNorm(Final V)                 no (1 - lambda_init) factor

The kernels never build a T x T map (diffexp.model.kernels): "mean" is cumsum(A1 V) / n, "softmax" streams
over query blocks with running column sums of A1, which decoding keeps in the cache.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from diffexp.errors import invalid
from diffexp.model.attention.base import merge_heads
from diffexp.model.attention.differential import (
    TWO_MAP_CASES,
    TWO_MAP_FIELDS,
    TwoMapDifferentialAttention,
    check_two_map,
    naive_plain_qk,
    naive_two_map,
    two_map_flops,
)
from diffexp.model.attention.registry import Variant, register
from diffexp.model.kernels import Integral


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
    #: query rows per step of the streaming integral; memory is O(block_size * T) per head
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

    def forward(self, x: torch.Tensor, need_weights: bool = False, cache=None):
        q1, q2, k1, k2, v = self.project(x, cache)
        lam = self.lambda_()  # exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init
        integral = Integral(self.cfg.integral, self.integral_weight(lam), self.integral_block_size)
        # (A1 - lambda A2 + gamma A3) V
        out, effective = self.two_map_head(q1, q2, k1, k2, v, lam, need_weights, cache, integral)
        return self.o_proj(merge_heads(self.head_norm(out))), effective  # no (1 - lambda_init)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", integral={self.cfg.integral}, gamma={self.cfg.gamma}"

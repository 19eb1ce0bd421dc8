"""DINT (Cang et al. 2025): differential attention plus an integral term; rows sum to 1.

    G[n, :] = (1/n) sum_{m<=n} A1[m, :]          cumulative mean of A1's rows (n is 1-based)
    A3      = softmax over j <= n of G[n, j]     (integral="softmax", the paper)
            = G                                  (integral="mean")
    Final   = A1 - lambda A2 + gamma A3          gamma="lambda" (the paper): gamma = lambda, every row sums
                                                 to 1; gamma="learned": a scalar per layer of its own, rows
                                                 sum to 1 - lambda + gamma
    head    = GroupNorm(Final V)                 no (1 - lambda_init) factor

The heads never build a T x T map (diffexp.model.heads): "mean" is cumsum(A1 V) / n, "softmax" streams
over query blocks with running column sums of A1, which decoding keeps in the cache.
"""

from __future__ import annotations

import math
from typing import Literal, Union

import torch
from torch import nn

from diffexp.errors import invalid
from diffexp.model.attention.base import merge_heads
from diffexp.model.attention.differential import (
    TWO_MAP_FLAGS,
    TwoMapDifferentialAttention,
    two_map_flops,
)
from diffexp.model.attention.registry import Variant, register
from diffexp.model.flags import Flag
from diffexp.model.heads import Integral

FLAGS = (
    Flag("integral", Literal["softmax", "mean"], "softmax",
         "DINT: A3 is the causal softmax of the cumulative row mean G (the paper) or G itself ('mean')"),
    Flag("gamma", Literal["lambda", "learned"], "lambda", "DINT: the integral's weight, 'lambda' (the paper: rows "
         "sum to 1) or 'learned' (a scalar per layer: rows sum to 1 - lambda + gamma)",
         "'lambda' (gamma = lambda, the paper) or 'learned' (a scalar per layer of its own)"),
    Flag("gamma_init", Union[Literal["lambda_init"], float], "lambda_init", "DINT with gamma 'learned': its start, "
         "'lambda_init' (the layer's lambda_init) or a number", "'lambda_init' (the layer's lambda_init) or a number",
         lambda value: value == "lambda_init" or math.isfinite(value)),
)


def check(cfg) -> None:
    init = cfg.gamma_init
    if cfg.gamma == "lambda" and init != "lambda_init":
        raise invalid("model.arch.gamma_init", init, "expected 'lambda_init' unless model.arch.gamma is 'learned' "
                      "(with gamma = lambda there is no gamma of its own to initialise)")


def attention_flops(cfg, keys: float) -> float:
    """DIFF V1's maps plus the integral's A3 V: h maps over the 2d-wide V."""
    return two_map_flops(cfg, keys) + cfg.n_heads * 2 * keys * 2 * cfg.resolved_head_dim


@register
class DintAttention(TwoMapDifferentialAttention):
    variant = Variant(
        name="dint",
        summary="DIFF V1 plus an integral term from cumulative attention; rows sum to 1",
        paper="Cang et al. 2025, DINT Transformer",
        maps_per_head=2,
        flags=(*TWO_MAP_FLAGS, *FLAGS),
        check=check,
        attention_flops=attention_flops,
    )
    #: query rows per step of the streaming integral; memory is O(block_size * T) per head
    integral_block_size = 32

    def __init__(self, cfg, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        if cfg.gamma == "learned":  # one scalar per layer, fp32 like lambda; 1-d, so no weight decay
            init = self.lambda_init if cfg.gamma_init == "lambda_init" else float(cfg.gamma_init)
            # shape (1,), not 0-d: FSDP2's fully_shard refuses scalar parameters
            self.gamma = nn.Parameter(torch.tensor([init], dtype=torch.float32))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """A checkpoint from before gamma had shape (1,) holds it 0-d: read it as (1,)."""
        key = prefix + "gamma"
        if self.cfg.gamma == "learned" and key in state_dict and state_dict[key].dim() == 0:
            state_dict[key] = state_dict[key].reshape(1)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def integral_weight(self, lam: torch.Tensor) -> torch.Tensor:
        """gamma: lambda itself, or the layer's own learned scalar (0-d, as the heads take it)."""
        if self.cfg.gamma == "learned":
            return self.gamma.to(torch.promote_types(self.gamma.dtype, torch.float32)).reshape(())
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

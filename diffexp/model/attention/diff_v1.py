"""DIFF V1 (Ye et al. 2024, arXiv 2410.05258), section 2.1.

    [Q1; Q2] = X W_Q,  [K1; K2] = X W_K,  V = X W_V            (W_V is 2d wide per kv group)
    A_i = softmax(Q_i K_i^T / sqrt(d))
    lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init
    head = (1 - lambda_init) * GroupNorm((A1 - lambda A2) V)

Everything lives in the shared two-map base; DIFF V1 is that base with plain projections.
"""

from diffexp.model.attention.differential import (
    TWO_MAP_FLAGS,
    TwoMapDifferentialAttention,
    two_map_flops,
)
from diffexp.model.attention.registry import Variant, register


@register
class DiffV1Attention(TwoMapDifferentialAttention):
    """Parameter-matched to a baseline with 2h heads of dim d (plus 4d lambda and 2d norm weights)."""

    variant = Variant(
        name="diff_v1",
        summary="two softmax maps subtracted with a learnable lambda, per-head norm",
        paper="Ye et al. 2024, Differential Transformer, arXiv 2410.05258",
        maps_per_head=2,
        flags=TWO_MAP_FLAGS,
        attention_flops=two_map_flops,
        hf_architecture="DiffLlamaForCausalLM",
    )

"""DIFF V1 (Ye et al. 2024, arXiv 2410.05258), section 2.1.

    [Q1; Q2] = X W_Q,  [K1; K2] = X W_K,  V = X W_V            (W_V is 2d wide per kv group)
    A_i = softmax(Q_i K_i^T / sqrt(d))
    lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init
    head = (1 - lambda_init) * GroupNorm((A1 - lambda A2) V)

Everything lives in the shared two-map base; DIFF V1 is that base with plain projections.
"""

from diffexp.model.attention.differential import TwoMapDifferentialAttention


class DiffV1Attention(TwoMapDifferentialAttention):
    """Parameter-matched to a baseline with 2h heads of dim d (plus 4d lambda and 2d norm weights)."""

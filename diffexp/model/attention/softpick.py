"""Softpick (Zuhri et al. 2025, "Softpick: No Attention Sink, No Massive Activations with Rectified Softmax",
arXiv 2504.20966): the softmax of each causal row replaced by a rectified one,

    a_ij = relu(exp(z_ij) - 1) / sum_k |exp(z_ik) - 1|          k over the row's visible keys 0..i

computed in the authors' numerically stable form, m the row's largest logit:

    a_ij = relu(exp(z_ij - m) - exp(-m)) / (sum_k |exp(z_ik - m) - exp(-m)| + EPS)

A key with z <= 0 gets exactly 0, so a head can attend to nothing (a row of non-positive logits is all zeros) and
needs no sink token; rows sum to at most 1. Masked positions count in neither sum. Everything else is the baseline:
Q: d_model -> h*d, K, V: d_model -> h_kv*d (GQA), O: h*d -> d_model. The map is not a softmax, so no fused softmax
kernel (SDPA) computes it: every path here writes the (T_q, T_k) map out in fp32 at least.
"""

from __future__ import annotations

import torch

from diffexp.model.attention.base import merge_heads
from diffexp.model.attention.baseline import BaselineAttention, attention_flops
from diffexp.model.attention.registry import Variant, register
from diffexp.model.heads import normalised_attention

#: added to the stable form's denominator, where it stands for EPS exp(m) in the unshifted one. It only matters for
#: a row whose logits are all exactly 0 (then both sums are 0 and the row's weights are 0, not 0/0). 1e-6 is the
#: value of the authors' FlashAttention kernel, the one their models were trained with (their naive code uses 1e-8).
EPS = 1e-6


def softpick(logits: torch.Tensor) -> torch.Tensor:
    """The rows of `logits` (..., T_k), masked keys -inf, in the stable form; every row must see a key. Its backward
    recomputes the rows from the saved logits: one (T_q, T_k) tensor kept for it, where autograd through the
    elementwise steps keeps about four and a half."""
    return _Softpick.apply(logits)


class _Softpick(torch.autograd.Function):
    """r = exp(z - m) - exp(-m), D = sum |r| + EPS over the visible keys, a = relu(r) / D. With delta = sum_j g_j a_j:

        dL/dz_k = exp(z_k - m) / D * (1[r_k > 0] g_k - sign(r_k) delta)      (z's own path)
        dL/dm   = -delta EPS / D                                              (m's, shared by the row's maxima)

    m's path is what EPS makes of the shift (exactly 0 without EPS); it goes to the row's largest logits as amax's
    gradient does (split evenly between ties). A masked key has exp(z - m) = 0 and gets 0."""

    @staticmethod
    def forward(ctx, logits):
        m = logits.amax(dim=-1, keepdim=True)
        shifted = torch.exp(logits - m) - torch.exp(-m)
        visible = torch.isfinite(logits)
        total = torch.where(visible, shifted.abs(), torch.zeros_like(shifted)).sum(dim=-1, keepdim=True) + EPS
        ctx.save_for_backward(logits, m, total)
        return torch.relu(shifted) / total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        logits, m, total = ctx.saved_tensors
        e = torch.exp(logits - m)
        shifted = e - torch.exp(-m)
        positive = shifted > 0
        delta = (grad * torch.relu(shifted)).sum(dim=-1, keepdim=True) / total
        own = torch.where(positive, grad, torch.zeros_like(grad)) - torch.sign(shifted) * delta
        grad_logits = e / total * own
        top = logits == m
        return grad_logits + top * (-delta * EPS / total / top.sum(dim=-1, keepdim=True))


def softpick_attention(q, k, v, cache=None) -> tuple[torch.Tensor, torch.Tensor]:
    """q: (B, Hq, T_q, d); k, v: (B, Hk, T_k, d), the queries the last T_q positions (a chunk after a cache), or
    in a decoding step one query per row against the cache, row b reading its first key_lengths[b] keys. Returns
    the output (B, Hq, T_q, d) and the map (B, Hq, T_q, T_k), in fp32 at least."""
    return normalised_attention(q, k, v, softpick, cache)


@register
class SoftpickAttention(BaselineAttention):
    variant = Variant(
        name="softpick",
        summary="softmax replaced by relu(exp(z) - 1) / sum |exp(z) - 1|: a head can attend to nothing, no sink",
        paper="Zuhri et al. 2025 (Softpick: No Attention Sink, No Massive Activations with Rectified Softmax, "
              "arXiv 2504.20966)",
        differential=False,
        attention_flops=attention_flops,  # the baseline's maps; the rectified rows are elementwise work
    )

    def forward(self, x: torch.Tensor, need_weights: bool = False, cache=None):
        q, k, v = self.qkv(x, cache)
        out, weights = self.attend_normalised(q, k, v, softpick, "softpick", cache)
        keep = need_weights or self.backend == "eager"  # as `attend`: the eager backend returns its map
        return self.o_proj(merge_heads(out)), weights if keep else None

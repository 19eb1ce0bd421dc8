"""The DIFF V2 blog's stability quantities, measured generically (no attention variant is named here).

Context RMS: per head, the RMS of the attention output before W_O (the `o_proj` input); the blog bounds it in
[1/sqrt(n), 1) for softmax attention and in (0, sqrt(2)) for DIFF V2. Attention sink: the mass on token 0 of the
effective map, over query rows i >= 1. Loss spikes: a train loss above `factor` x the median of the previous
`window` ones. Divergence: a non-finite loss or gradient norm, or a loss above `factor` x ln(vocab_size).
"""

from __future__ import annotations

import math
import statistics
from collections import deque

import torch
from torch import nn

from diffexp.model.attention.base import AttentionBase


def context_rms(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(..., n_heads * d_head) attention outputs before W_O -> (n_heads,): per head, the mean over tokens
    of RMS(c_i) = sqrt(mean_k c_ik^2)."""
    heads = x.detach().float().unflatten(-1, (n_heads, -1))  # (..., n_heads, d_head)
    return heads.pow(2).mean(-1).sqrt().reshape(-1, n_heads).mean(0)


def sink_score(weights: torch.Tensor) -> float:
    """The mean attention mass on token 0 of a (B, h, T, T) map, over batch, heads and query rows 1..T-1."""
    if weights.shape[-2] < 2:
        return float("nan")
    return float(weights[..., 1:, 0].double().mean())


class ContextRMS:
    """Forward pre-hooks on the `o_proj` of every attention layer: context RMS of the next forward, per
    layer and head, on its first `rows` rows. A layer run twice (activation checkpointing) counts once."""

    def __init__(self, model: nn.Module, rows: int) -> None:
        self.layers = [m for m in model.modules() if isinstance(m, AttentionBase)
                       and isinstance(getattr(m, "o_proj", None), nn.Module)]
        self.rows = rows
        self.per_head: dict[int, torch.Tensor] = {}
        self.hooks: list = []

    def start(self) -> ContextRMS:
        for i, attn in enumerate(self.layers):
            self.hooks.append(attn.o_proj.register_forward_pre_hook(self._keep(i, attn.n_heads)))
        return self

    def _keep(self, i: int, n_heads: int):
        def hook(module, inputs) -> None:
            if i not in self.per_head:
                with torch.no_grad():
                    self.per_head[i] = context_rms(inputs[0][: self.rows], n_heads)
        return hook

    def stop(self) -> dict[str, float]:
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        out: dict[str, float] = {}
        for i, heads in sorted(self.per_head.items()):
            out[f"vitals/layer_{i:02d}/context_rms"] = float(heads.mean())
            for h, value in enumerate(heads.tolist()):
                out[f"vitals/layer_{i:02d}/context_rms/head_{h:02d}"] = value
        layer_means = [v for k, v in out.items() if k.endswith("/context_rms")]
        if layer_means:
            out["vitals/context_rms"] = sum(layer_means) / len(layer_means)
        return out


@torch.no_grad()
def attention_sinks(model: nn.Module, idx: torch.Tensor) -> dict[str, float]:
    """One eval-mode forward of `model(idx, need_weights=True)`: the sink score per layer and its mean.

    Each layer's map is reduced in a forward hook and dropped there (the hook returns no map), so only
    one layer's maps are held at a time.
    """
    layers = [m for m in model.modules() if isinstance(m, AttentionBase)]
    scores: dict[int, float] = {}

    def reduce(i: int):
        def hook(module, inputs, output):
            out, weights = output
            if weights is not None:
                scores[i] = sink_score(weights)
            return out, None
        return hook

    handles = [m.register_forward_hook(reduce(i)) for i, m in enumerate(layers)]
    was_training = model.training
    try:
        model.eval()
        model(idx, need_weights=True)
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()
    out = {f"vitals/layer_{i:02d}/attn_sink": v for i, v in sorted(scores.items())}
    if scores:
        out["vitals/attn_sink"] = sum(scores.values()) / len(scores)
    return out


class LossSpikes:
    """Counts train losses above `factor` x the running median of the previous `window` finite losses."""

    def __init__(self, factor: float, window: int, warmup: int) -> None:
        self.factor, self.warmup = factor, warmup
        self.recent: deque[float] = deque(maxlen=window)
        self.count = 0
        self.seen = 0

    def update(self, loss: float) -> bool:
        """Add one step's loss; True when it is a spike. Non-finite losses are skipped (divergence)."""
        if not math.isfinite(loss):
            return False
        spike = self.seen >= max(self.warmup, 1) and loss > self.factor * statistics.median(self.recent)
        self.count += spike
        self.recent.append(loss)
        self.seen += 1
        return spike

    def state_dict(self) -> dict:
        return {"count": self.count, "seen": self.seen, "recent": list(self.recent)}

    def load_state_dict(self, state: dict) -> None:
        self.count, self.seen = state["count"], state["seen"]
        self.recent.clear()
        self.recent.extend(state["recent"])


def divergence_threshold(factor: float, vocab_size: int | None) -> float | None:
    """factor x ln(vocab_size): the train loss above which a run counts as diverged (None: no threshold)."""
    if not factor or not vocab_size or vocab_size < 2:
        return None
    return factor * math.log(vocab_size)

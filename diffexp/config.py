"""Typed model configuration: every architectural flag of the spec, validated before any work starts."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Union

from diffexp.errors import UserError, invalid

ATTENTION_VARIANTS = ("baseline", "diff_v1", "diff_v2", "shared_diff", "dint")
BACKENDS = ("sdpa", "flash_attn", "eager")

LambdaInit = Union[Literal["depth"], float]


def depth_lambda_init(layer_idx: int) -> float:
    """DIFF V1's schedule 0.8 - 0.6 exp(-0.3 l), with l counted from 0."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer_idx)


@dataclass
class ModelConfig:
    """A LLaMA-style decoder whose attention is one of the differential variants.

    Args:
        attention: one of baseline, diff_v1, diff_v2, shared_diff, dint.
        vocab_size: set from the data module when trained through the CLI.
        d_model: residual width.
        n_layers: decoder blocks.
        n_heads: attention heads of the variant (for diff_v1/shared_diff/dint: differential heads,
            each made of two maps; for diff_v2: output heads, the query has 2 * n_heads heads).
        n_kv_heads: key/value heads (GQA); None means n_heads (plain multi-head attention).
        head_dim: d, the per-map head dimension; None means d_model // n_heads for the baseline and
            d_model // (2 * n_heads) for the differential variants (the papers' parameter matching).
        ffn_hidden: SwiGLU hidden width; None means 8/3 d_model rounded up to a multiple of 64.
        max_seq_len: longest sequence RoPE is precomputed for.
        rope_theta: RoPE base.
        tie_embeddings: share the input embedding and the LM head.
        norm_eps: epsilon of every RMSNorm.
        lambda_init: "depth" (0.8 - 0.6 exp(-0.3 l)) or a constant in (0, 1); diff_v1, shared_diff, dint.
        head_norm: per-head RMSNorm after the differential map ("GroupNorm"); diff_v1, shared_diff, dint.
        rank: low-rank size of shared_diff's per-map updates.
        base_sharing: shared_diff: "maps" (a base per head, shared by its two maps) or "heads" (one base
            for all heads and maps).
        lowrank_init_std: std of shared_diff's low-rank factors; non-zero so the two maps start apart.
        pairing: diff_v2: "same" pairs query heads that share K/V, "cross" pairs heads from different
            GQA groups (the blog's unstable ablation).
        lambda_mode: diff_v2: "sigmoid" (default), "none" (attn1 - attn2) or "raw" (no sigmoid).
        integral: dint: "softmax" (the paper) or "mean" (use the cumulative mean G itself).
        backend: attention call for the fast path: sdpa, flash_attn (CUDA + flash-attn) or eager.
        backend_fallback: when flash_attn cannot run (package missing, CPU tensors), fall back to sdpa with
            a logged warning (true) or stop with an error (false).
        init_std: std of the normal init of linear and embedding weights.
    """

    attention: str = "baseline"
    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None
    head_dim: int | None = None
    ffn_hidden: int | None = None
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    norm_eps: float = 1e-5
    lambda_init: LambdaInit = "depth"
    head_norm: bool = True
    rank: int = 16
    base_sharing: Literal["maps", "heads"] = "maps"
    lowrank_init_std: float = 0.02
    pairing: Literal["same", "cross"] = "same"
    lambda_mode: Literal["sigmoid", "none", "raw"] = "sigmoid"
    integral: Literal["softmax", "mean"] = "softmax"
    backend: Literal["sdpa", "flash_attn", "eager"] = "sdpa"
    backend_fallback: bool = True
    init_std: float = 0.02

    def __post_init__(self) -> None:
        self.validate()

    @property
    def is_differential_pair(self) -> bool:
        """Variants whose differential head has two d-wide maps over a 2d-wide V."""
        return self.attention in ("diff_v1", "shared_diff", "dint")

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def resolved_head_dim(self) -> int:
        if self.head_dim is not None:
            return self.head_dim
        return self.d_model // (2 * self.n_heads if self.is_differential_pair else self.n_heads)

    @property
    def resolved_ffn_hidden(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        return 64 * math.ceil(8 * self.d_model / 3 / 64)

    def lambda_init_for(self, layer_idx: int) -> float:
        if self.lambda_init == "depth":
            return depth_lambda_init(layer_idx)
        return float(self.lambda_init)

    def validate(self) -> None:
        def bad(field: str, value: object, allowed: str) -> UserError:
            return invalid(f"model.arch.{field}", value, allowed)

        if self.attention not in ATTENTION_VARIANTS:
            raise bad("attention", self.attention, f"expected one of {', '.join(ATTENTION_VARIANTS)}")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len"):
            if int(getattr(self, name)) <= 0:
                raise bad(name, getattr(self, name), "expected a positive integer")
        if self.n_kv_heads is not None and self.n_kv_heads <= 0:
            raise bad("n_kv_heads", self.n_kv_heads, "expected a positive integer or null")
        if self.n_heads % self.kv_heads != 0:
            raise bad("n_kv_heads", self.n_kv_heads,
                      f"n_heads={self.n_heads} must be a multiple of n_kv_heads (GQA groups)")
        maps_per_head = 2 if self.is_differential_pair else 1
        if self.head_dim is None and self.d_model % (maps_per_head * self.n_heads) != 0:
            raise bad("n_heads", self.n_heads,
                      f"{maps_per_head} * n_heads must divide d_model={self.d_model} when head_dim is null")
        if self.head_dim is not None and self.head_dim <= 0:
            raise bad("head_dim", self.head_dim, "expected a positive integer or null")
        if self.resolved_head_dim % 2 != 0:
            raise bad("head_dim", self.resolved_head_dim, "RoPE needs an even head dimension")
        if self.lambda_init != "depth":
            if isinstance(self.lambda_init, bool) or not isinstance(self.lambda_init, (int, float)):
                raise bad("lambda_init", self.lambda_init, "expected 'depth' or a number in (0, 1)")
            if not 0.0 < float(self.lambda_init) < 1.0:
                raise bad("lambda_init", self.lambda_init, "expected 'depth' or a number in (0, 1)")
        if self.rank <= 0:
            raise bad("rank", self.rank, "expected a positive integer")
        if self.base_sharing not in ("maps", "heads"):
            raise bad("base_sharing", self.base_sharing, "expected 'maps' or 'heads'")
        if self.pairing not in ("same", "cross"):
            raise bad("pairing", self.pairing, "expected 'same' or 'cross'")
        if self.attention == "diff_v2" and self.pairing == "cross":
            # cross pairs query head p with head p + h; those must sit in different kv groups
            if self.kv_heads < 2:
                raise bad("pairing", self.pairing,
                          f"with n_heads={self.n_heads}, n_kv_heads={self.kv_heads} heads p and p+h share "
                          "one K/V group, so no cross-group pair exists; use n_kv_heads >= 2")
        if self.lambda_mode not in ("sigmoid", "none", "raw"):
            raise bad("lambda_mode", self.lambda_mode, "expected 'sigmoid', 'none' or 'raw'")
        if self.integral not in ("softmax", "mean"):
            raise bad("integral", self.integral, "expected 'softmax' or 'mean'")
        if self.backend not in BACKENDS:
            raise bad("backend", self.backend, f"expected one of {', '.join(BACKENDS)}")
        if not self.init_std > 0:
            raise bad("init_std", self.init_std, "expected a positive standard deviation")
        if not self.lowrank_init_std >= 0:
            raise bad("lowrank_init_std", self.lowrank_init_std, "expected a standard deviation >= 0")
        if not self.norm_eps > 0:
            raise bad("norm_eps", self.norm_eps, "expected a positive number")
        if not self.rope_theta > 0:
            raise bad("rope_theta", self.rope_theta, "expected a positive number")
        if self.ffn_hidden is not None and self.ffn_hidden <= 0:
            raise bad("ffn_hidden", self.ffn_hidden, "expected a positive integer or null")

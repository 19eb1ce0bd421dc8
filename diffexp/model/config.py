"""Typed model configuration: every architectural flag of the spec, validated before any work starts."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Union

from diffexp.errors import UserError, invalid
from diffexp.model.attention.registry import reference_variant, variant, variant_names, variants

BACKENDS = ("sdpa", "flash_attn", "eager", "triton")
#: fields every variant reads; the others belong to the variants that list them in their registry entry
SHARED_FIELDS = ("attention", "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                 "ffn_hidden", "max_seq_len", "rope_theta", "tie_embeddings", "norm_eps", "backend",
                 "backend_fallback", "init_std")

LambdaInit = Union[Literal["depth"], float]
GammaInit = Union[Literal["lambda_init"], float]


@dataclass
class ModelConfig:
    """A LLaMA-style decoder whose attention is one of the differential variants.

    Args:
        attention: the attention variant, a name from the registry (`diffexp variants` lists them).
        vocab_size: set from the data module when trained through the CLI.
        d_model: residual width.
        n_layers: decoder blocks.
        n_heads: attention heads of the variant (for the two-map variants: differential heads, each made
            of two maps; for DIFF V2: output heads, the query has 2 * n_heads heads).
        n_kv_heads: key/value heads (GQA); None means n_heads (plain multi-head attention).
        head_dim: d, the per-map head dimension; None means d_model // (maps_per_head * n_heads) with the
            variant's maps_per_head (1, or 2 for the two-map variants): the papers' parameter matching.
        ffn_hidden: SwiGLU hidden width; None means 8/3 d_model rounded up to a multiple of 64.
        max_seq_len: longest sequence RoPE is precomputed for.
        rope_theta: RoPE base.
        tie_embeddings: share the input embedding and the LM head.
        norm_eps: epsilon of every RMSNorm.
        lambda_init: "depth" (0.8 - 0.6 exp(-0.3 l)) or a constant in (0, 1); the two-map variants
            (DIFF V1, Shared DIFF, DINT).
        head_norm: per-head RMSNorm after the differential map ("GroupNorm"); the two-map variants.
        rank: Shared DIFF: low-rank size of the per-map updates.
        base_sharing: Shared DIFF: "maps" (a base per head, shared by its two maps) or "heads" (one base
            for all heads and maps).
        lowrank_scope: Shared DIFF: "layer" (one low-rank update per map for the whole projection, A:
            d_model x r, B: (h d) x r; the default of every comparison with DIFF) or "head" (an update per
            head and per map, B: d x r; the only reading before this flag existed, and what a checkpoint
            saved without the flag is read as).
        lowrank_init_std: Shared DIFF: std of the low-rank factors; non-zero so the two maps start apart.
        pairing: DIFF V2: "same" pairs query heads that share K/V, "cross" pairs heads from different
            GQA groups (the blog's unstable ablation).
        lambda_mode: DIFF V2: "sigmoid" (default), "none" (attn1 - attn2) or "raw" (no sigmoid).
        pair_norm: DIFF V2: put DIFF V1's per-head RMSNorm back after the subtraction (the blog removed it
            as destabilising; default false).
        lambda_proj_init: DIFF V2: init of the lambda projection W_lam: "default" (PyTorch's nn.Linear
            init, kaiming-uniform U(-1/sqrt(d_model), 1/sqrt(d_model)), the spec) or "normal"
            (N(0, init_std^2) like the other linears).
        integral: DINT: "softmax" (the paper) or "mean" (use the cumulative mean G itself).
        gamma: DINT: the weight of the integral term, "lambda" (gamma = lambda, the paper: every row of the
            map sums to 1) or "learned" (a learnable scalar per layer: rows sum to 1 - lambda + gamma).
        gamma_init: DINT with gamma "learned": its initial value, "lambda_init" (the layer's lambda_init, so
            the layer starts as with gamma = lambda) or a number.
        backend: attention call for the fast path: sdpa, flash_attn (CUDA + flash-attn), eager, or triton (the
            fused Triton kernels of the two-map variants, on CUDA; the other variants use sdpa).
        backend_fallback: when flash_attn cannot run (package missing, CPU tensors), fall back to sdpa with
            a logged warning (true) or stop with an error (false).
        init_std: std of the normal init of linear and embedding weights.
    """

    attention: str = reference_variant().name  # the plain softmax baseline
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
    lowrank_scope: Literal["layer", "head"] = "layer"
    lowrank_init_std: float = 0.02
    pairing: Literal["same", "cross"] = "same"
    lambda_mode: Literal["sigmoid", "none", "raw"] = "sigmoid"
    pair_norm: bool = False
    lambda_proj_init: Literal["default", "normal"] = "default"
    integral: Literal["softmax", "mean"] = "softmax"
    gamma: Literal["lambda", "learned"] = "lambda"
    gamma_init: GammaInit = "lambda_init"
    backend: Literal["sdpa", "flash_attn", "eager", "triton"] = "sdpa"
    backend_fallback: bool = True
    init_std: float = 0.02

    def __post_init__(self) -> None:
        self.validate()

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def resolved_head_dim(self) -> int:
        if self.head_dim is not None:
            return self.head_dim
        return self.d_model // (variant(self.attention).maps_per_head * self.n_heads)

    @property
    def resolved_ffn_hidden(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        return 64 * math.ceil(8 * self.d_model / 3 / 64)

    def validate(self) -> None:
        def bad(field: str, value: object, allowed: str) -> UserError:
            return invalid(f"model.arch.{field}", value, allowed)

        if self.attention not in variant_names():
            raise bad("attention", self.attention, f"expected one of {', '.join(variant_names())}")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len"):
            if int(getattr(self, name)) <= 0:
                raise bad(name, getattr(self, name), "expected a positive integer")
        if self.n_kv_heads is not None and self.n_kv_heads <= 0:
            raise bad("n_kv_heads", self.n_kv_heads, "expected a positive integer or null")
        if self.n_heads % self.kv_heads != 0:
            raise bad("n_kv_heads", self.n_kv_heads,
                      f"n_heads={self.n_heads} must be a multiple of n_kv_heads (GQA groups)")
        maps_per_head = variant(self.attention).maps_per_head
        if self.head_dim is None and self.d_model % (maps_per_head * self.n_heads) != 0:
            raise bad("n_heads", self.n_heads,
                      f"{maps_per_head} * n_heads must divide d_model={self.d_model} when head_dim is null")
        if self.head_dim is not None and self.head_dim <= 0:
            raise bad("head_dim", self.head_dim, "expected a positive integer or null")
        if self.resolved_head_dim % 2 != 0:
            raise bad("head_dim", self.resolved_head_dim, "RoPE needs an even head dimension")
        if self.backend not in BACKENDS:
            raise bad("backend", self.backend, f"expected one of {', '.join(BACKENDS)}")
        if not self.init_std > 0:
            raise bad("init_std", self.init_std, "expected a positive standard deviation")
        if not self.norm_eps > 0:
            raise bad("norm_eps", self.norm_eps, "expected a positive number")
        if not self.rope_theta > 0:
            raise bad("rope_theta", self.rope_theta, "expected a positive number")
        if self.ffn_hidden is not None and self.ffn_hidden <= 0:
            raise bad("ffn_hidden", self.ffn_hidden, "expected a positive integer or null")
        chosen = variant(self.attention)
        chosen.check(self)
        # a value given for another variant's flag is checked too: a bad value fails now, not in a later run
        changed = set(self.changed_settings())
        for other in variants():
            if other is not chosen and changed & set(other.fields):
                other.check(self)

    def changed_settings(self) -> dict[str, object]:
        """Fields set away from their defaults."""
        return {name: getattr(self, name) for name, f in ModelConfig.__dataclass_fields__.items()
                if getattr(self, name) != f.default}

    def unused_settings(self) -> dict[str, object]:
        """Fields set away from their default that the chosen variant does not read (they change nothing)."""
        used = set(SHARED_FIELDS) | set(variant(self.attention).fields)
        return {name: value for name, value in self.changed_settings().items() if name not in used}

"""Typed model configuration: every `model.arch` flag, declared once and validated before any work starts.

The shared flags are declared here; each variant declares its own in its registry entry. ModelConfig is the
dataclass of all of them (LightningCLI reads its fields and help from it), rebuilt when a variant registers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Literal

from diffexp.errors import invalid
from diffexp.model.attention import registry
from diffexp.model.attention.registry import reference_variant, variant, variant_names, variants
from diffexp.model.flags import Flag


def _positive(value) -> bool:
    return value > 0


def _positive_or_null(value) -> bool:
    return value is None or value > 0


SHARED_FLAGS = (
    Flag("attention", str, reference_variant().name,
         "the attention variant, a name from the registry (`diffexp variants` lists them)"),
    Flag("vocab_size", int, 256, "set from the data module when trained through the CLI", "a positive integer",
         _positive),
    Flag("d_model", int, 128, "residual width", "a positive integer", _positive),
    Flag("n_layers", int, 4, "decoder blocks", "a positive integer", _positive),
    Flag("n_heads", int, 4, "attention heads of the variant (two-map variants: differential heads of two maps each; "
         "DIFF V2: output heads, its query has 2 * n_heads heads)", "a positive integer", _positive),
    Flag("n_kv_heads", int | None, None, "key/value heads (GQA); null means n_heads",
         "a positive integer or null", _positive_or_null),
    Flag("head_dim", int | None, None, "d, the per-map head dimension; null means d_model // (maps_per_head * "
         "n_heads), the papers' parameter matching", "a positive integer or null", _positive_or_null),
    Flag("ffn_hidden", int | None, None, "SwiGLU hidden width; null means 8/3 d_model rounded up to a multiple "
         "of 64", "a positive integer or null", _positive_or_null),
    Flag("max_seq_len", int, 2048, "longest sequence RoPE is precomputed for", "a positive integer", _positive),
    Flag("rope_theta", float, 10000.0, "RoPE base", "a positive number", _positive),
    Flag("tie_embeddings", bool, False, "share the input embedding and the LM head"),
    Flag("norm_eps", float, 1e-5, "epsilon of every RMSNorm", "a positive number", _positive),
    Flag("backend", Literal["sdpa", "eager"], "sdpa",
         "attention backend: sdpa (PyTorch's fused attention, or a registered fast kernel where one computes the "
         "head: diffexp.kernels) or eager (the maps themselves, for inspection)", "one of sdpa, eager"),
    Flag("init_std", float, 0.02, "std of the normal init of linear and embedding weights",
         "a positive standard deviation", _positive),
)
SHARED_FIELDS = tuple(f.name for f in SHARED_FLAGS)


class ModelConfig:
    """A LLaMA-style decoder whose attention is one of the differential variants."""

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
        if self.attention not in variant_names():
            raise invalid("model.arch.attention", self.attention, f"expected one of {', '.join(variant_names())}")
        for field in dataclasses.fields(self):
            problem = field.metadata["flag"].problem(getattr(self, field.name))
            if problem is not None:
                raise invalid(f"model.arch.{field.name}", getattr(self, field.name), problem)
        if self.n_heads % self.kv_heads != 0:
            raise invalid("model.arch.n_kv_heads", self.n_kv_heads,
                          f"n_heads={self.n_heads} must be a multiple of n_kv_heads (GQA groups)")
        maps_per_head = variant(self.attention).maps_per_head
        if self.head_dim is None and self.d_model % (maps_per_head * self.n_heads) != 0:
            raise invalid("model.arch.n_heads", self.n_heads,
                          f"{maps_per_head} * n_heads must divide d_model={self.d_model} when head_dim is null")
        if self.resolved_head_dim % 2 != 0:
            raise invalid("model.arch.head_dim", self.resolved_head_dim, "RoPE needs an even head dimension")
        chosen = variant(self.attention)
        chosen.check(self)
        # another variant's flag given a value is checked too: a bad value fails now, not in a later run
        changed = set(self.changed_settings())
        for other in variants():
            if other is not chosen and changed & set(other.fields):
                other.check(self)

    def changed_settings(self) -> dict[str, object]:
        """Fields set away from their defaults."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) != f.default}

    def read_fields(self) -> tuple[str, ...]:
        """The fields the chosen variant reads: the shared ones and its own."""
        return (*SHARED_FIELDS, *variant(self.attention).fields)

    def unused_settings(self, named: Iterable[str] = ()) -> dict[str, object]:
        """Fields the chosen variant does not read (they would change nothing) that are set away from their default,
        or are in `named` (the fields a command line names, whatever their value)."""
        read, given = set(self.read_fields()), set(named) | set(self.changed_settings())
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name in given - read}


def all_flags() -> tuple[Flag, ...]:
    """The shared flags, then each registered variant's, each once; two declarations of one name must agree."""
    declared = {f.name: f for f in SHARED_FLAGS}
    for entry in variants():
        for flag in entry.flags:
            if declared.setdefault(flag.name, flag) != flag:
                raise ValueError(f"variant {entry.name!r} declares flag {flag.name!r} unlike its earlier "
                                 "declaration; declare it once and share the Flag")
    return tuple(declared.values())


def _declare_fields(cls: type) -> None:
    """(Re)make `cls` the dataclass of `all_flags()`, in place: a variant registered later adds its flags."""
    flags = all_flags()
    for name in getattr(cls, "__dataclass_fields__", {}):
        if hasattr(cls, name) and not isinstance(getattr(cls, name), property):
            delattr(cls, name)
    for generated in ("__init__", "__repr__", "__eq__", "__match_args__", "__dataclass_fields__"):
        if generated in cls.__dict__:
            delattr(cls, generated)
    cls.__annotations__ = {flag.name: flag.type for flag in flags}
    for flag in flags:
        setattr(cls, flag.name, dataclasses.field(default=flag.default, metadata={"flag": flag}))
    dataclasses.dataclass(cls)
    summary = cls.__doc__.split("\n\n")[0]
    cls.__doc__ = summary + "\n\nArgs:\n" + "".join(f"    {flag.name}: {flag.doc}\n" for flag in flags)


_declare_fields(ModelConfig)
registry.on_change(lambda: _declare_fields(ModelConfig))

"""The variant registry: each attention variant declares its identity once, on its own class.

A variant is one module in `diffexp/model/attention/` whose class carries a `Variant` entry and is
decorated with `@register`. Config validation, FLOP counting, parameter matching, the tests' reference
and cases, and the benchmark all read the entry; nothing else names a variant.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from diffexp.model.flags import Flag


def _no_check(cfg: Any) -> None:
    return None


@dataclass(frozen=True)
class Variant:
    """Everything the rest of diffexp knows about one attention variant.

    Args:
        name: the value of `model.arch.attention`.
        summary: one line for help texts and tables.
        paper: where its equations come from.
        differential: subtracts attention maps (False only for the plain softmax reference).
        maps_per_head: d-wide maps that one head of the variant spends its budget on; the default
            head_dim is d_model // (maps_per_head * n_heads), which matches the baseline's parameters.
        flags: the `model.arch` flags it reads beyond the shared ones (sizes, RoPE, backend, init), each
            declared once (diffexp.model.flags.Flag); ModelConfig gains them when the variant registers.
        check: checks across flags that their single declarations cannot (a value checks its own type
            and range); raises `diffexp.errors.UserError` via `invalid(...)`.
        attention_flops: forward FLOPs per token of one layer that are not nn.Linear matmuls (scores,
            attention-times-V, low-rank updates), given the config and the mean number of keys per query.
        bench_arch: arch overrides of the matched benchmark (e.g. GQA groups the variant needs).
        reference_variant: the baseline that speed and quality ratios are taken against (exactly one).
        hf_architecture: the transformers class that computes it (as config.json's `architectures` names it,
            one of `diffexp.hf.classes.CLASSES`), which `export --format hf` writes and `model.init_from`
            reads back; None when only `--remote-code` exports it.
    """

    name: str
    summary: str
    paper: str
    attention_flops: Callable[[Any, float], float]
    differential: bool = True
    maps_per_head: int = 1
    flags: tuple[Flag, ...] = ()
    check: Callable[[Any], None] = _no_check
    bench_arch: Mapping[str, Any] = field(default_factory=dict)
    reference_variant: bool = False
    hf_architecture: str | None = None

    @property
    def fields(self) -> tuple[str, ...]:
        """The names of its flags."""
        return tuple(flag.name for flag in self.flags)


_CLASSES: dict[str, type] = {}
_LISTENERS: list[Callable[[], None]] = []


def on_change(listener: Callable[[], None]) -> None:
    """Call `listener` after each register and unregister (ModelConfig adds and drops the variants' flags)."""
    _LISTENERS.append(listener)


def _notify() -> None:
    for listener in _LISTENERS:
        listener()


def register(cls: type) -> type:
    """Class decorator: adds a class with a `variant: Variant` attribute to the registry."""
    entry = getattr(cls, "variant", None)
    if not isinstance(entry, Variant):
        raise TypeError(f"{cls.__name__} needs a `variant = Variant(...)` class attribute to be registered")
    known = _CLASSES.get(entry.name)
    if known is not None and known is not cls:
        raise ValueError(f"attention variant {entry.name!r} is already registered by {known.__qualname__}")
    if entry.reference_variant and any(c.variant.reference_variant for n, c in _CLASSES.items() if n != entry.name):
        raise ValueError(f"{entry.name!r}: only one variant can be the reference")
    _CLASSES[entry.name] = cls
    try:
        _notify()
    except Exception:
        del _CLASSES[entry.name]
        _notify()
        raise
    return cls


def unregister(name: str) -> None:
    """Removes a variant (for tests that register a temporary one)."""
    if _CLASSES.pop(name, None) is not None:
        _notify()


def variant_names() -> tuple[str, ...]:
    """Registered names, the reference variant first."""
    return tuple(sorted(_CLASSES, key=lambda name: not _CLASSES[name].variant.reference_variant))


def variant_class(name: str) -> type:
    """The module class of a registered variant; KeyError for an unknown name (configs check first)."""
    return _CLASSES[name]


def variant(name: str) -> Variant:
    return _CLASSES[name].variant


def variants() -> tuple[Variant, ...]:
    return tuple(variant(name) for name in variant_names())


def reference_variant() -> Variant:
    """The plain-attention variant that every ratio is taken against."""
    return next(v for v in variants() if v.reference_variant)

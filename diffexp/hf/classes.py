"""The transformers classes a variant's weights can be written as, by the name its registry entry gives.

A variant names its class once, on its `Variant` entry (`hf_architecture`); this table says how each class's
config.json and weights are written and read back. A class's `unrepresentable` lists the settings it cannot
compute (key, value, why), so an export refuses them before anything is written.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from diffexp.hf import diff_llama, llama


def _none(cfg) -> list[tuple[str, object, str]]:
    return []


@dataclass(frozen=True)
class HfClass:
    name: str  #: the transformers class, as config.json's `architectures` names it
    model_type: str  #: config.json's `model_type`
    config: Callable  #: (ModelConfig, eos_id) -> config.json fields
    to_hf: Callable  #: (Decoder state dict, ModelConfig) -> the class's weights
    from_hf: Callable  #: the class's weights, ModelConfig -> Decoder state dict
    unrepresentable: Callable = _none


CLASSES = {c.name: c for c in (
    HfClass("LlamaForCausalLM", "llama", llama.llama_config, llama.to_llama, llama.from_llama),
    HfClass("DiffLlamaForCausalLM", "diffllama", diff_llama.diff_llama_config, diff_llama.to_diff_llama,
            diff_llama.from_diff_llama, diff_llama.unrepresentable),
)}


def written_as() -> dict[str, HfClass]:
    """Each registered variant that names a transformers class, and that class."""
    from diffexp.model.attention import variants

    named = {v.name: v.hf_architecture for v in variants() if v.hf_architecture is not None}
    unknown = {name: cls for name, cls in named.items() if cls not in CLASSES}
    if unknown:
        raise ValueError(f"hf_architecture of {unknown}: diffexp.hf.classes writes only {', '.join(CLASSES)}")
    return {name: CLASSES[cls] for name, cls in named.items()}


def hf_class(attention: str) -> HfClass | None:
    """The class a variant's weights are written as, or None when it has none (remote code only)."""
    return written_as().get(attention)


def read_as(model_type: str) -> tuple[str, HfClass] | None:
    """(variant, class) of a config.json's model_type, or None when no registered variant is written as it."""
    return next(((name, c) for name, c in written_as().items() if c.model_type == model_type), None)

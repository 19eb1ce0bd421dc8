"""One module per attention variant. Each registers itself (see registry.py); this package imports
every module in its folder, so a new variant is one new file here and nothing else.
"""

import importlib
import pkgutil

from diffexp.model.attention.base import AttentionBase
from diffexp.model.attention.registry import Variant, variant, variant_class, variant_names, variants


def _import_variant_modules() -> None:
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")


_import_variant_modules()


def build_attention(cfg, layer_idx: int) -> AttentionBase:
    return variant_class(cfg.attention)(cfg, layer_idx)


__all__ = ["AttentionBase", "Variant", "build_attention", "variant", "variant_class", "variant_names", "variants"]

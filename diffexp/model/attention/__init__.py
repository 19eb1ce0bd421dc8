"""One module per attention variant; `build_attention` picks one by name."""

from diffexp.model.attention.base import AttentionBase
from diffexp.model.attention.baseline import BaselineAttention
from diffexp.model.attention.diff_v1 import DiffV1Attention
from diffexp.model.attention.diff_v2 import DiffV2Attention
from diffexp.model.attention.dint import DintAttention
from diffexp.model.attention.shared_diff import SharedDiffAttention

ATTENTION_CLASSES: dict[str, type[AttentionBase]] = {
    "baseline": BaselineAttention,
    "diff_v1": DiffV1Attention,
    "diff_v2": DiffV2Attention,
    "shared_diff": SharedDiffAttention,
    "dint": DintAttention,
}


def build_attention(cfg, layer_idx: int) -> AttentionBase:
    return ATTENTION_CLASSES[cfg.attention](cfg, layer_idx)


__all__ = ["ATTENTION_CLASSES", "AttentionBase", "build_attention"]

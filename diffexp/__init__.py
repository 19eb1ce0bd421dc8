"""diffexp: train, ablate and compare differential-attention transformers."""

__version__ = "0.1.0"
__all__ = ["Decoder", "ModelConfig", "__version__"]


def __getattr__(name: str):
    # lazy: `diffexp data prepare` workers import diffexp's data code without torch
    if name == "Decoder":
        from diffexp.model import Decoder

        return Decoder
    if name == "ModelConfig":
        from diffexp.model.config import ModelConfig

        return ModelConfig
    raise AttributeError(f"module 'diffexp' has no attribute {name!r}")

"""diffexp: train, ablate and compare differential-attention transformers."""

from diffexp.model import Decoder
from diffexp.model.config import ModelConfig

__version__ = "0.1.0"
__all__ = ["Decoder", "ModelConfig", "__version__"]

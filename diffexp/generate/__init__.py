"""Text from a trained model: sampling rules (sampling.py), decoding with the KV cache (decode.py) and the
`diffexp generate` command (cli.py)."""

from diffexp.generate.decode import generate
from diffexp.generate.sampling import Sampling

__all__ = ["Sampling", "generate"]

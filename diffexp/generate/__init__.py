"""Text from a trained model: sampling rules (sampling.py), decoding with the KV cache (decode.py) and the
`diffexp generate` command (cli.py).

`generate` and `Sampling` load on first use: `diffexp generate --help` and the readers of cli.py's tokenizer
helpers (export, eval) start without the model's modules."""

__all__ = ["Sampling", "generate"]


def __getattr__(name: str):
    if name == "generate":
        from diffexp.generate.decode import generate

        return generate
    if name == "Sampling":
        from diffexp.generate.sampling import Sampling

        return Sampling
    raise AttributeError(f"module 'diffexp.generate' has no attribute {name!r}")

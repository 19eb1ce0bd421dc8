"""Data layer: corpora, offline tokenizers, token shards (``diffexp data prepare``) and the resumable
``TextDataModule``."""

__all__ = ["TextDataModule"]


def __getattr__(name: str):
    # lazy: the preparation's worker processes import this package without Lightning and torch
    if name == "TextDataModule":
        from diffexp.data.datamodule import TextDataModule

        return TextDataModule
    raise AttributeError(f"module 'diffexp.data' has no attribute {name!r}")

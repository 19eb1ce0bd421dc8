"""Data layer: corpora, offline tokenizers, packing/caching and the resumable ``TextDataModule``."""

from diffexp.data.datamodule import TextDataModule

__all__ = ["TextDataModule"]

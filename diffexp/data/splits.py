"""Which split a document goes to: a hash of its text keyed by the seed, the same on every machine and layout.

``split_of`` gives a document's split from its score alone, so copies of a text always land in the same split.
A small corpus may have no score below a fraction; ``held_out_overrides`` then moves the lowest-scoring training
text of the corpus's first documents, read across its units whatever its file layout (one document per file, many
per file, JSON lines shards), into each empty held-out split (every copy of it).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from itertools import islice

from diffexp.data import sources
from diffexp.data.units import Unit, unit_documents
from diffexp.errors import UserError


def split_score(text: str, seed: int) -> float:
    """A document's place in [0, 1): a hash of its text keyed by ``seed``."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8, key=str(seed).encode()).digest()
    return int.from_bytes(digest, "little") / 2**64


def split_of(text: str, seed: int, val_fraction: float, test_fraction: float,
             overrides: dict[float, str] | None = None) -> str:
    """"val", "test" or "train" for a document by its score alone, so documents with the same text always land
    in the same split (``overrides``: the scores ``held_out_overrides`` moves out of training)."""
    u = split_score(text, seed)
    if overrides and u in overrides:
        return overrides[u]
    return "val" if u < val_fraction else "test" if u < val_fraction + test_fraction else "train"


GUARANTEED_WITHIN = 10_000


def held_out_overrides(units: Sequence[Unit], source: sources.Source, text_field: str, hf_cache_dir: str,
                       seed: int, val_fraction: float, test_fraction: float) -> dict[float, str]:
    """A small corpus may have no score below a fraction: if none of the corpus's first ``GUARANTEED_WITHIN``
    documents (in corpus order, over as many units as hold them) is held out for validation (or test), the training
    text with the lowest score is, one each (every copy of it). Large corpora are never affected."""
    first = islice(_documents(units, source, text_field, hf_cache_dir), GUARANTEED_WITHIN)
    scores = {split_score(text, seed) for text in first}
    held_out = val_fraction + test_fraction
    wanted = [split for split, low, high in (("val", 0.0, val_fraction), ("test", val_fraction, held_out))
              if high > low and not any(low <= score < high for score in scores)]
    training = sorted(score for score in scores if score >= held_out)
    if len(training) <= len(wanted):
        splits = "train/val/test" if test_fraction > 0 else "train/val"
        needed = 3 if test_fraction > 0 else 2
        hint = "raise data.max_chars" if units[-1].max_chars else "add text; .txt files split at blank lines"
        raise UserError(f"data.source={source.spec!r}: need at least {needed} documents to split into {splits}, got "
                        f"{len(scores)} different ones ({hint})")
    return dict(zip(training, wanted))


def _documents(units: Sequence[Unit], source: sources.Source, text_field: str, hf_cache_dir: str) -> Iterator[str]:
    for unit in units:
        yield from unit_documents(unit, source, text_field, hf_cache_dir)


def unit_splits(unit: Unit, source: sources.Source, text_field: str, hf_cache_dir: str, seed: int,
                val_fraction: float, test_fraction: float, overrides: dict[float, str]) -> Iterator[tuple[str, str]]:
    """(split, document) for each document of a unit."""
    for text in unit_documents(unit, source, text_field, hf_cache_dir):
        yield split_of(text, seed, val_fraction, test_fraction, overrides), text

"""The text of the needle task and its tokens under any tokenizer: the templates, the cities and numbers with
their held-out split, the haystacks, and the tokenization of pieces and haystacks with token offsets.

The samples themselves (placement, depth, leak checks) are ``diffexp.data.needle_samples``; they are built
from the pieces tokenized here, so every count there (context length, depth, spans) is in model tokens.

Token offsets: ``encode`` gives each token's ``[start, end)`` offsets into its text (bytes for the byte
tokenizer, characters for a ``tokenizers`` one; the pieces are ASCII, where the two agree). Spans of text
(the answer digits, a question) become token spans through the tokens that overlap them.

Separators: the byte tokenizer puts a needle's separator after it (``sentence + "\\n"``) and inserts it
right after a separator of the haystack (a line start, a sentence start), as diffexp always did. Any other
tokenizer gets it before (``"\\n" + sentence``), inserted right before a separator of the haystack: a BPE
attaches whitespace to what follows (`` the``, ``"\\n   "``), so that is where its token boundaries are and
where a separately tokenized needle joins the haystack as the whole text would have been tokenized.
"""

from __future__ import annotations

import random
import re
import zlib
from dataclasses import dataclass
from functools import cache

import numpy as np

from diffexp.data.tokenizer import ByteTokenizer, TextTokenizer
from diffexp.errors import UserError

NEEDLE_TEMPLATE = "the magic number of {city} is {number}."
QUESTION_TEMPLATE = "what is the magic number of {city}? "
SPLITS = ("train", "val", "test")
HAYSTACKS = ("corpus", "synthetic")
HELD_OUT_MODULUS = 5  # held out: crc32(text) % 5 == 0, i.e. about 20 % of cities and numbers
MAX_SNAP = 16  # tokens a needle may move to start at a line / sentence boundary
WINDOW_SEARCH = 200  # tokens after a random start searched for a line / sentence start
CORPUS_CHARS = 2_000_000  # corpus characters used for haystacks (the first files of the stdlib corpus)
CORPUS_TRAIN_FRACTION = 0.9
#: per haystack: what ends a unit of the haystack text (a line, a sentence) and what separates needles
BOUNDARY_MARKERS = {"corpus": "\n", "synthetic": ". "}
SEPARATORS = {"corpus": "\n", "synthetic": " "}

# Pronounceable synthetic city names: 2-3 syllables of onset + vowel + optional coda, capitalised.
ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z",
          "br", "dr", "gr", "kr", "tr", "st", "sh", "th")
VOWELS = ("a", "e", "i", "o", "u")
CODAS = ("", "", "n", "r", "l", "s")
MAX_CITY_LEN = 3 * (2 + 1 + 1)
MIN_DIGITS, MAX_DIGITS = 4, 6
MAX_NEEDLE_PIECE = len(NEEDLE_TEMPLATE.format(city="", number="")) + MAX_CITY_LEN + MAX_DIGITS + 1  # + separator
MAX_QUERY_PIECE = 1 + len(QUESTION_TEMPLATE.format(city="")) + MAX_CITY_LEN + MAX_DIGITS + 1  # "\n" ... "."

# Filler of the synthetic haystack (the passkey-retrieval sentences of Mohtashami & Jaggi, LWM).
FILLER_SENTENCES = (
    "The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.",
    "The river flows to the sea.", "Birds sing in the morning.", "The road goes ever on.",
)


def is_held_out(text: str) -> bool:
    """Whether a city name or a number (as a decimal string) belongs to the held-out split."""
    return zlib.crc32(text.encode()) % HELD_OUT_MODULUS == 0


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is invalid: expected one of {', '.join(SPLITS)}")


def random_city(rng: random.Random, split: str) -> str:
    """A synthetic city name of the split (held out for "val" and "test", never held out for "train")."""
    check_split(split)
    while True:
        syllables = rng.choice((2, 2, 3))
        name = "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) for _ in range(syllables))
        name = name.capitalize()
        if is_held_out(name) == (split != "train"):
            return name


def random_number(rng: random.Random, split: str) -> str:
    """A 4-6 digit number (no leading zero) of the split, as a string."""
    check_split(split)
    while True:
        digits = rng.randint(MIN_DIGITS, MAX_DIGITS)
        number = str(rng.randrange(10 ** (digits - 1), 10**digits))
        if is_held_out(number) == (split != "train"):
            return number


def min_context_len(n_needles: int, n_queries: int) -> int:
    """Smallest context_len that fits N needles and R queries (at their longest) with room to place them.

    Counted in bytes: an upper bound for any tokenizer whose tokens hold at least one character each."""
    distractor_room = MAX_NEEDLE_PIECE if n_needles > n_queries else 0
    return 1 + n_queries * MAX_QUERY_PIECE + n_needles * MAX_NEEDLE_PIECE + distractor_room + 16


# ----------------------------------------------------------------------------- haystack text


@cache
def haystack_bytes(haystack: str, split: str) -> bytes:
    """The text haystack windows are cut from (cached per process)."""
    check_split(split)
    if haystack == "synthetic":
        rng = random.Random("needle-filler")  # same filler for both splits: it holds no needle
        return " ".join(rng.choice(FILLER_SENTENCES) for _ in range(20_000)).encode() + b" "
    if haystack != "corpus":
        raise UserError(f"haystack={haystack!r} is invalid: expected one of {', '.join(HAYSTACKS)}")
    from diffexp.data.corpus import load_stdlib_corpus

    text = "\n".join(load_stdlib_corpus(CORPUS_CHARS)).encode("utf-8")
    cut = text.index(b"\n", int(len(text) * CORPUS_TRAIN_FRACTION)) + 1
    return text[:cut] if split == "train" else text[cut:]


# ----------------------------------------------------------------------------- tokens with offsets


@dataclass
class Encoded:
    """Token ids of a text and each token's ``[start, end)`` offsets into it."""

    ids: list[int]
    starts: list[int]
    ends: list[int]

    def overlapping(self, start: int, end: int) -> tuple[int, int]:
        """The token span ``[first, last + 1)`` of the tokens that overlap the text ``[start, end)``."""
        inside = [i for i, (s, e) in enumerate(zip(self.starts, self.ends)) if s < end and e > start]
        if not inside:
            raise ValueError(f"no token overlaps the text [{start}, {end})")
        return inside[0], inside[-1] + 1


def encode(tokenizer: TextTokenizer, text: str) -> Encoded:
    """``text`` as tokens with offsets (no special tokens added)."""
    if isinstance(tokenizer, ByteTokenizer):
        ids = list(text.encode("utf-8"))
        return Encoded(ids, list(range(len(ids))), list(range(1, len(ids) + 1)))
    inner = getattr(tokenizer, "tokenizer", None)
    if inner is None or not hasattr(inner, "encode"):
        raise TypeError(f"{type(tokenizer).__name__} gives no token offsets: expected a ByteTokenizer or an "
                        "HFTokenizer")
    encoding = inner.encode(text, add_special_tokens=False)
    return Encoded(list(encoding.ids), [s for s, _ in encoding.offsets], [e for _, e in encoding.offsets])


def separator_first(tokenizer: TextTokenizer) -> bool:
    """Whether needles carry their separator in front (any tokenizer but bytes; see the module docstring)."""
    return not isinstance(tokenizer, ByteTokenizer)


@dataclass
class TokenHaystack:
    """A haystack's text as tokens, with the token indices a needle may be inserted before.

    ``boundaries`` (sorted) are those indices; ``markers`` the offset where the marker that makes each one a
    boundary (the line's "\\n", the sentence's ". ") starts; ``cut_offsets[i]`` the text offset between
    tokens i - 1 and i."""

    ids: np.ndarray
    boundaries: np.ndarray
    markers: np.ndarray
    cut_offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.ids)

    def boundaries_within(self, start: int, length: int) -> set[int]:
        """Boundaries of the window ``ids[start : start + length]``, relative to it, whose marker lies inside it."""
        lo, hi = np.searchsorted(self.boundaries, [start + 1, start + length])
        first = self.cut_offsets[start]
        return {int(b) - start for b, m in zip(self.boundaries[lo:hi], self.markers[lo:hi]) if m >= first}


_token_haystacks: dict[tuple[str, str, str], TokenHaystack] = {}


def token_haystack(haystack: str, split: str, tokenizer: TextTokenizer) -> TokenHaystack:
    """The haystack of a split tokenized by ``tokenizer`` (cached per process and tokenizer identity)."""
    key = (haystack, split, tokenizer.identity)
    if key not in _token_haystacks:
        data = haystack_bytes(haystack, split)
        marker = BOUNDARY_MARKERS[haystack]
        # a boundary is where a needle goes in: right after the marker, or right before its separator
        shift = len(SEPARATORS[haystack]) if separator_first(tokenizer) else 0
        if isinstance(tokenizer, ByteTokenizer):
            text: bytes | str = data
            ids = np.frombuffer(data, dtype=np.uint8).astype(np.int64)
            cut_offsets = np.arange(len(ids) + 1)
            pattern = re.escape(marker.encode())
        else:
            text = data.decode("utf-8")
            encoded = encode(tokenizer, text)
            ids = np.asarray(encoded.ids, dtype=np.int64)
            # offsets of tokens that split a character may step back: keep the cut points sorted
            cut_offsets = np.maximum.accumulate(np.asarray([0] + encoded.ends, dtype=np.int64))
            pattern = re.escape(marker)
        marker_starts = np.asarray([m.start() for m in re.finditer(pattern, text)], dtype=np.int64)
        cuts = marker_starts + len(marker) - shift
        index = np.searchsorted(cut_offsets, cuts).clip(max=len(cut_offsets) - 1)
        at_token = (cut_offsets[index] == cuts) & (index > 0) & (index < len(ids))
        _token_haystacks[key] = TokenHaystack(ids, index[at_token], marker_starts[at_token], cut_offsets)
    return _token_haystacks[key]

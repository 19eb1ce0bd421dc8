"""Multi-needle retrieval (Needle-in-a-Haystack, after LWM / Gemini 1.5) as data: the text of the task, its
tokens under any tokenizer, the generation of one sample, and the Lightning data module that trains on it.

A needle gives a city a unique number (``the magic number of Valdoren is 48213.``); N needles are hidden in a
haystack and R of the cities are asked for at the end (``what is the magic number of Valdoren? 48213.``).
"""

from __future__ import annotations

import itertools
import random
import re
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Literal

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from diffexp.data.loader import resumable_train_loader, training_order_seed
from diffexp.data.tokenizer import ByteTokenizer, TextTokenizer, load_tokenizer_file
from diffexp.errors import UserError

# ----------------------------------------------------------------------------- the text: templates, cities, numbers
# A city or number is held out when crc32(text) % HELD_OUT_MODULUS == 0: training samples use only the others,
# validation and test samples only held-out ones, so evaluation asks about pairs never seen in training.

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
    """The text haystack windows are cut from (cached per process); the corpus's first CORPUS_TRAIN_FRACTION
    is the training split's, the rest validation's and test's. Its callers have checked both arguments."""
    if haystack == "synthetic":
        rng = random.Random("needle-filler")  # same filler for both splits: it holds no needle
        return " ".join(rng.choice(FILLER_SENTENCES) for _ in range(20_000)).encode() + b" "
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
        inside = [index for index, (token_start, token_end) in enumerate(zip(self.starts, self.ends))
                  if token_start < end and token_end > start]
        if not inside:
            raise ValueError(f"no token overlaps the text [{start}, {end})")
        return inside[0], inside[-1] + 1


def encode(tokenizer: TextTokenizer, text: str) -> Encoded:
    """``text`` as tokens with offsets (no special tokens added): bytes for the byte tokenizer, characters for
    a ``tokenizers`` one (the task's pieces are ASCII, where the two agree)."""
    if isinstance(tokenizer, ByteTokenizer):
        ids = list(text.encode("utf-8"))
        return Encoded(ids, list(range(len(ids))), list(range(1, len(ids) + 1)))
    inner = getattr(tokenizer, "tokenizer", None)
    if inner is None or not hasattr(inner, "encode"):
        raise TypeError(f"{type(tokenizer).__name__} gives no token offsets: expected a ByteTokenizer or an "
                        "HFTokenizer")
    encoding = inner.encode(text, add_special_tokens=False)
    return Encoded(list(encoding.ids), [start for start, _ in encoding.offsets], [end for _, end in encoding.offsets])


def separator_first(tokenizer: TextTokenizer) -> bool:
    """Whether needles carry their separator in front ("\\n" + sentence, inserted right before a separator of the
    haystack): a BPE attaches whitespace to what follows, so its token boundaries lie there. Bytes put it after."""
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
        first, stop = np.searchsorted(self.boundaries, [start + 1, start + length])
        window_offset = self.cut_offsets[start]
        return {int(boundary) - start for boundary, marker in zip(self.boundaries[first:stop], self.markers[first:stop])
                if marker >= window_offset}


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
        marker_starts = np.asarray([match.start() for match in re.finditer(pattern, text)], dtype=np.int64)
        cuts = marker_starts + len(marker) - shift
        index = np.searchsorted(cut_offsets, cuts).clip(max=len(cut_offsets) - 1)
        at_token = (cut_offsets[index] == cuts) & (index > 0) & (index < len(ids))
        _token_haystacks[key] = TokenHaystack(ids, index[at_token], marker_starts[at_token], cut_offsets)
    return _token_haystacks[key]


# ----------------------------------------------------------------------------- one sample

Span = tuple[int, int]


@dataclass
class NeedleSample:
    """One generated sequence and where everything is (the layout: ``_try_sample``). Spans are ``[start, end)``
    indices into ``tokens``; lists in "query order" follow the questions, those in "order of position" the
    needles in the haystack."""

    tokens: torch.Tensor  # (context_len + 1,) long token ids; the model reads tokens[:-1]
    answer_spans: list[Span]  # the number inside each answer needle (the tokens overlapping it), query order
    answer_needle_spans: list[Span]  # the whole sentence of each answer needle, query order
    needle_spans: list[Span]  # every needle sentence, order of position
    query_start: int  # first index of the query region (its leading "\n")
    query_spans: list[Span]  # each "what is the magic number of <city>? " (up to the answer's tokens)
    answers: list[str]  # the answer number of each query
    cities: list[str]  # the queried cities
    needle_cities: list[str]  # every needle's city, order of position
    needle_numbers: list[str]  # every needle's number, order of position
    candidates: list[str]  # the numbers present in the context (= needle_numbers): the ranking's choices
    # per query, the indices of the answer's tokens (its digits and the "."); [k][0] - 1 is the prompt's last row
    answer_target_positions: list[list[int]]
    # per query, the text the answer's tokens hold before the digits: "" for bytes, " " for a BPE that merges
    # the space after "?" into the number
    answer_prefixes: list[str]
    depth: float  # the answer depth used (drawn uniformly when None was asked)
    haystack_len: int  # H: the haystack region is tokens[1 : 1 + H]

    @property
    def context_len(self) -> int:
        return len(self.tokens) - 1

    @property
    def query_positions(self) -> list[int]:
        """Per query, the position whose next-token prediction is the answer's first token."""
        return [positions[0] - 1 for positions in self.answer_target_positions]

    def loss_mask(self) -> torch.Tensor:
        """(context_len,) float mask over the targets ``tokens[1:]``: 1 on the answers' tokens."""
        mask = torch.zeros(self.context_len, dtype=torch.float32)
        for positions in self.answer_target_positions:
            mask[torch.tensor(positions) - 1] = 1.0
        return mask


def make_sample(
    rng: random.Random,
    context_len: int,
    n_needles: int,
    n_queries: int,
    depth: float | None,
    haystack: Literal["corpus", "synthetic"],
    split: Literal["train", "val", "test"],
    max_tries: int = 200,
    tokenizer: TextTokenizer | None = None,
) -> NeedleSample:
    """Generate one multi-needle sequence from ``rng`` (pure: same rng state, same sample).

    Args:
        rng: the random source (``random.Random``).
        context_len: tokens the model reads; the sample has ``context_len + 1`` tokens.
        n_needles: N, needles in the haystack.
        n_queries: R <= N, cities asked for at the end; their needles sit at ``depth``.
        depth: 0..1, where in the haystack region the answer needles start; None draws it uniformly.
        haystack: "corpus" (windows of the stdlib text) or "synthetic" (repeated filler sentences).
        split: "train" (cities/numbers not held out), or "val" / "test" (held-out cities/numbers only).
        max_tries: rejection-sampling attempts before giving up (a leak check failed every time).
        tokenizer: the model's tokenizer (a ByteTokenizer or an HFTokenizer); default bytes.
    """
    check_split(split)
    if haystack not in HAYSTACKS:
        raise ValueError(f"haystack={haystack!r} is invalid: expected one of {', '.join(HAYSTACKS)}")
    if not 1 <= n_queries <= n_needles:
        raise ValueError(f"n_queries={n_queries} is invalid: expected 1 <= n_queries <= n_needles={n_needles}")
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth={depth!r} is invalid: expected a fraction in [0, 1] or None")
    if context_len < min_context_len(n_needles, n_queries):
        raise ValueError(f"context_len={context_len} is too short for {n_needles} needles and {n_queries} "
                         f"queries: expected >= {min_context_len(n_needles, n_queries)}")
    tokenizer = tokenizer or ByteTokenizer()
    source = token_haystack(haystack, split, tokenizer)
    for _ in range(max_tries):
        sample = _try_sample(rng, source, tokenizer, context_len, n_needles, n_queries, depth, haystack, split)
        if sample is not None:
            return sample
    raise RuntimeError(f"could not generate a leak-free needle sample in {max_tries} tries")


def _try_sample(rng: random.Random, source: TokenHaystack, tokenizer: TextTokenizer, context_len: int,
                n_needles: int, n_queries: int, depth: float | None, haystack: str,
                split: str) -> NeedleSample | None:
    """One attempt at a sample: None when the needles do not fit or a leak check fails (make_sample retries).

    The layout, ``context_len + 1`` tokens::

        tokens[0]   tokens[1 : 1 + H]                  tokens[1 + H :], from query_start = 1 + H
        <eos>       the haystack region: filler and    R x "\\nwhat is the magic number of <city>? <number>."
                    the N needles, H tokens

    In the haystack region the R answer needles form one block that starts at ``round(depth * (H - block
    length))``; the N - R distractor needles go to random places before and after it; every insertion point
    then snaps to a line (corpus) or sentence (synthetic) start if one is within MAX_SNAP tokens. The questions
    ask for the answer needles in a shuffled order; the model reads ``tokens[:-1]`` and the loss mask selects
    each answer's tokens (its digits and the "."). Every needle and question is tokenized on its own, so lengths
    and spans are exact in tokens and a needle is the same tokens at any depth.
    """
    cities = _distinct(lambda: random_city(rng, split), n_needles)
    numbers = _distinct(lambda: random_number(rng, split), n_needles)
    # needles 0..R-1 are the answers (in block order); the questions ask for them in a shuffled order
    separator = SEPARATORS[haystack]
    needles = [_tokenized_needle(tokenizer, city, number, separator) for city, number in zip(cities, numbers)]
    query_order = list(range(n_queries))
    rng.shuffle(query_order)
    queries = [_tokenized_query(tokenizer, cities[k], numbers[k]) for k in query_order]
    haystack_len = context_len - sum(len(query.ids) for query in queries)

    placement = _place_needles(rng, needles, n_queries, haystack_len, depth)
    if placement is None:
        return None
    filler, boundaries = _filler_window(rng, source, placement.filler_len, haystack)
    cuts = _snap_to_boundaries(placement.cuts, boundaries, placement.filler_len)
    tokens, needle_spans, number_spans = _fill_haystack(tokenizer.eos_id, filler, placement.groups, cuts, needles)
    assert len(tokens) == 1 + haystack_len, (len(tokens), haystack_len)
    if _leaks(tokenizer.decode(tokens[1:]), cities, numbers, queries):
        return None

    query_start = len(tokens)
    query_ids, question_spans, target_positions = _query_region(queries, query_start)
    tokens += query_ids
    assert len(tokens) == context_len + 1
    by_position = sorted(range(n_needles), key=lambda i: needle_spans[i][0])
    return NeedleSample(
        tokens=torch.tensor(tokens, dtype=torch.long),
        answer_spans=[number_spans[k] for k in query_order],
        answer_needle_spans=[needle_spans[k] for k in query_order],
        needle_spans=[needle_spans[i] for i in by_position],
        query_start=query_start,
        query_spans=question_spans,
        answers=[numbers[k] for k in query_order],
        cities=[cities[k] for k in query_order],
        needle_cities=[cities[i] for i in by_position],
        needle_numbers=[numbers[i] for i in by_position],
        candidates=[numbers[i] for i in by_position],
        answer_target_positions=target_positions,
        answer_prefixes=[query.prefix for query in queries],
        depth=placement.depth,
        haystack_len=haystack_len,
    )


def _distinct(draw: Callable[[], str], count: int) -> list[str]:
    """``count`` results of ``draw()``, none inside another (so each is found exactly once in a text)."""
    chosen: list[str] = []
    while len(chosen) < count:
        candidate = draw()
        if all(candidate not in other and other not in candidate for other in chosen):
            chosen.append(candidate)
    return chosen


@dataclass
class _Needle:
    """A needle sentence with its separator, tokenized; spans relative to its first token."""

    ids: list[int]
    sentence: Span
    number: Span


def _tokenized_needle(tokenizer: TextTokenizer, city: str, number: str, separator: str) -> _Needle:
    sentence = NEEDLE_TEMPLATE.format(city=city, number=number)
    if separator_first(tokenizer):
        sentence_at, text = len(separator), separator + sentence
    else:
        sentence_at, text = 0, sentence + separator
    encoded = encode(tokenizer, text)
    number_at = sentence_at + len(sentence) - len(number) - 1  # the sentence ends with "<number>."
    return _Needle(encoded.ids, encoded.overlapping(sentence_at, sentence_at + len(sentence)),
                   encoded.overlapping(number_at, number_at + len(number)))


@dataclass
class _Query:
    """A question with its answer, tokenized as one piece; spans relative to its first token."""

    ids: list[int]
    question: Span  # "what is the magic number of <city>? " (after the leading "\n")
    answer: Span  # the answer's tokens: its digits and the "."
    prefix: str  # what the answer's tokens hold before the digits ("" or " ")
    question_text: str  # "\nwhat is the magic number of <city>? "


def _tokenized_query(tokenizer: TextTokenizer, city: str, number: str) -> _Query:
    question = "\n" + QUESTION_TEMPLATE.format(city=city)
    text = question + number + "."
    encoded = encode(tokenizer, text)  # one piece: "? 48213" tokenized as in running text
    answer_first, answer_end = encoded.overlapping(len(question), len(text))
    if answer_first == 0 or answer_end != len(encoded.ids):
        raise ValueError(f"the tokenizer merges the question {question!r} into its answer {number!r}.")
    prefix = text[encoded.ends[answer_first - 1] : len(question)]  # what the answer's tokens add before the digits
    question_span = (encoded.overlapping(1, len(question))[0], answer_first)
    return _Query(encoded.ids, question_span, (answer_first, answer_end), prefix, question)


@dataclass
class _Placement:
    """Where the needles go into ``filler_len`` filler tokens: the needles ``groups[i]`` (the answer block, or one
    distractor) right before filler token ``cuts[i]``."""

    depth: float
    groups: list[list[int]]
    cuts: list[int]
    filler_len: int


def _place_needles(rng: random.Random, needles: list[_Needle], n_queries: int, haystack_len: int,
                   depth: float | None) -> _Placement | None:
    """The answer block (needles 0..R-1) at ``depth`` of the haystack region, the other needles (the
    distractors, shuffled) at random before and after it; None when they do not fit."""
    distractors = list(range(n_queries, len(needles)))
    rng.shuffle(distractors)
    block_len = sum(len(needle.ids) for needle in needles[:n_queries])
    distractor_lens = [len(needles[i].ids) for i in distractors]
    filler_len = haystack_len - block_len - sum(distractor_lens)
    if filler_len < 0 or (distractors and filler_len < MAX_NEEDLE_PIECE):
        return None
    used_depth = rng.random() if depth is None else float(depth)
    block_start = round(used_depth * (haystack_len - block_len))  # in the haystack region
    # the distractors before the block: the first k of the shuffled list, where they fit before block_start and
    # the rest fit after the block (some k does, since filler_len >= the longest needle)
    room_after = haystack_len - block_len - block_start
    len_before = list(itertools.accumulate(distractor_lens, initial=0))  # len_before[k]: of the first k
    fitting = [k for k, length in enumerate(len_before)
               if length <= block_start and sum(distractor_lens) - length <= room_after]
    if not fitting:
        return None
    n_before = rng.choice(fitting)
    before, after = distractors[:n_before], distractors[n_before:]
    block_cut = block_start - len_before[n_before]  # filler tokens before the block
    cuts_before = sorted(rng.randint(0, block_cut) for _ in before)
    cuts_after = sorted(rng.randint(block_cut, filler_len) for _ in after)
    groups = [[i] for i in before] + [list(range(n_queries))] + [[i] for i in after]
    return _Placement(used_depth, groups, cuts_before + [block_cut] + cuts_after, filler_len)


def _filler_window(rng: random.Random, source: TokenHaystack, length: int, haystack: str) -> tuple[list[int], set]:
    """``length`` haystack tokens and the boundaries inside them (relative indices)."""
    if length == 0:
        return [], set()
    if len(source) < length + 1:
        raise ValueError(f"the {haystack} haystack has {len(source)} tokens, fewer than the {length} needed")
    start = rng.randrange(0, len(source) - length)
    # start at a line (corpus) or sentence (synthetic) boundary when one is close
    next_marker = int(np.searchsorted(source.markers, source.cut_offsets[start]))
    if next_marker < len(source.boundaries):
        boundary = int(source.boundaries[next_marker])
        if boundary <= start + WINDOW_SEARCH and boundary + length <= len(source):
            start = boundary
    return source.ids[start : start + length].tolist(), source.boundaries_within(start, length)


def _snap_to_boundaries(cuts: list[int], boundaries: set, length: int) -> list[int]:
    """Move each cut point to the nearest boundary within MAX_SNAP tokens, keeping them non-decreasing."""
    snapped: list[int] = []
    for cut in cuts:
        lowest = snapped[-1] if snapped else 0
        best = None
        for delta in range(MAX_SNAP + 1):
            for candidate in (cut - delta, cut + delta):
                if lowest <= candidate <= length and (candidate <= 0 or candidate >= length or candidate in boundaries):
                    best = candidate
                    break
            if best is not None:
                break
        snapped.append(best if best is not None else max(cut, lowest))
    return snapped


def _fill_haystack(eos_id: int, filler: list[int], groups: list[list[int]], cuts: list[int],
                   needles: list[_Needle]) -> tuple[list[int], dict[int, Span], dict[int, Span]]:
    """``[eos_id]`` + the filler with each group of needles inserted at its cut, and each needle's sentence and
    number spans in it."""
    tokens = [eos_id]
    needle_spans: dict[int, Span] = {}
    number_spans: dict[int, Span] = {}
    filler_at = 0
    for group, cut in zip(groups, cuts):
        tokens.extend(filler[filler_at:cut])
        filler_at = cut
        for i in group:
            start = len(tokens)
            tokens.extend(needles[i].ids)
            needle_spans[i] = (start + needles[i].sentence[0], start + needles[i].sentence[1])
            number_spans[i] = (start + needles[i].number[0], start + needles[i].number[1])
    tokens.extend(filler[filler_at:])
    return tokens, needle_spans, number_spans


def _leaks(haystack_text: str, cities: list[str], numbers: list[str], queries: list[_Query]) -> bool:
    """Whether the haystack holds a stray "magic number", a city or number anywhere but once (in its needle), or
    a question holds a digit."""
    if haystack_text.count("magic number") != len(cities):
        return True
    if any(haystack_text.count(city) != 1 or haystack_text.count(number) != 1
           for city, number in zip(cities, numbers)):
        return True
    return any(char.isdigit() for query in queries for char in query.question_text)


def _query_region(queries: list[_Query], start: int) -> tuple[list[int], list[Span], list[list[int]]]:
    """The questions and answers' tokens from index ``start`` on, each question's span, each answer's indices."""
    ids: list[int] = []
    question_spans, target_positions = [], []
    for query in queries:
        at = start + len(ids)
        question_spans.append((at + query.question[0], at + query.question[1]))
        target_positions.append(list(range(at + query.answer[0], at + query.answer[1])))
        ids.extend(query.ids)
    return ids, question_spans, target_positions


# ----------------------------------------------------------------------------- the data module


class NeedleDataset(Dataset):
    """``size`` needle samples of one split, each generated on demand from (seed, split, index).

    With several (N, R) pairs, each index draws its pair uniformly (deterministically).
    """

    def __init__(self, size: int, split: str, seed: int, context_len: int, nr: list[tuple[int, int]],
                 depth: float | None, haystack: str, loss_on: str = "answers",
                 tokenizer: TextTokenizer | None = None) -> None:
        self.size, self.split, self.seed = size, split, seed
        self.context_len, self.nr, self.depth, self.haystack = context_len, nr, depth, haystack
        self.loss_on, self.tokenizer = loss_on, tokenizer

    def __len__(self) -> int:
        return self.size

    def sample(self, index: int) -> NeedleSample:
        if not 0 <= index < self.size:
            raise IndexError(f"index {index} out of range for {self.size} {self.split} samples")
        rng = random.Random(f"needle:{self.seed}:{self.split}:{index}")
        n, r = self.nr[0] if len(self.nr) == 1 else rng.choice(self.nr)
        return make_sample(rng, self.context_len, n, r, self.depth, self.haystack, self.split,
                           tokenizer=self.tokenizer)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        sample = self.sample(index)
        mask = sample.loss_mask() if self.loss_on == "answers" else torch.ones(sample.context_len)
        return {"tokens": sample.tokens, "loss_mask": mask}


class NeedleDataModule(L.LightningDataModule):
    """Synthetic multi-needle retrieval batches generated on the fly (byte tokens, or a tokenizer.json's): dicts
    ``{"tokens": (B, context_len + 1) long, "loss_mask": (B, context_len) float}``, the mask 1 on the answers'
    tokens; validation uses held-out cities and numbers only. ``samples(split)`` gives each sample's spans.

    Args:
        context_len: Tokens the model reads per sample (rows hold context_len + 1 tokens).
        n_needles: N, needles per sample.
        n_queries: R <= N, cities asked for at the end of each sample.
        nr_mix: Optional list of (N, R) pairs; each sample draws one uniformly (overrides n_needles and
            n_queries), e.g. [[1, 1], [2, 2], [4, 2], [6, 2]] to train for the whole evaluation grid.
        depth: Fraction 0..1 of the haystack where the answer needles start; None draws it per sample.
        haystack: "corpus" (windows of the embedded stdlib text) or "synthetic" (repeated filler sentences).
        batch_size: Samples per batch.
        train_size: Training samples per epoch (generated from seed and index; nothing is stored).
        val_size: Validation samples (held-out cities and numbers), and as many test samples (other draws).
        num_workers: DataLoader worker processes (0 generates in the main process).
        seed: Seeds the samples.
        order_seed: Seeds the training order; None: the run's seed (seed_everything), else ``seed``.
        loss_on: the training targets: "answers" (the answer digits and their ".", retrieval only) or
            "all" (next-token loss on every token, as a language model sees the sequence: the repeated
            haystack teaches copying early, which the retrieval then builds on). Validation always scores
            the answers, so val/loss means the same either way.
        tokenizer: "byte" (vocab 257), or a tokenizer.json whose tokens the samples are written in (context
            lengths then count its tokens).
    """

    def __init__(
        self,
        context_len: int = 512,
        n_needles: int = 2,
        n_queries: int = 1,
        nr_mix: list[tuple[int, int]] | None = None,
        depth: float | None = None,
        haystack: Literal["corpus", "synthetic"] = "corpus",
        batch_size: int = 16,
        train_size: int = 100_000,
        val_size: int = 256,
        num_workers: int = 0,
        seed: int = 1234,
        order_seed: int | None = None,
        loss_on: Literal["answers", "all"] = "answers",
        tokenizer: str = "byte",
    ) -> None:
        super().__init__()
        nr_mix = [list(p) for p in nr_mix] if nr_mix else nr_mix  # saved as lists: hparams.yaml is plain YAML
        self.save_hyperparameters()  # reads the arguments' current values, nr_mix included
        if loss_on not in ("answers", "all"):
            raise UserError(f"data.loss_on={loss_on!r} is invalid: expected 'answers' or 'all'")
        pairs = [tuple(p) for p in nr_mix] if nr_mix else [(n_needles, n_queries)]
        for n, r in pairs:
            name = "data.nr_mix" if nr_mix else "data.n_needles"
            if not isinstance(n, int) or n < 1:
                raise UserError(f"{name}: n_needles={n!r} is invalid: expected a positive integer")
            if not isinstance(r, int) or not 1 <= r <= n:
                raise UserError(f"{'data.nr_mix' if nr_mix else 'data.n_queries'}: n_queries={r!r} is invalid: "
                                 f"expected 1 <= n_queries <= n_needles={n}")
            if context_len < min_context_len(n, r):
                raise UserError(f"data.context_len={context_len} is too short for N={n} needles and R={r} "
                                 f"queries: expected >= {min_context_len(n, r)}")
        if depth is not None and not 0.0 <= depth <= 1.0:
            raise UserError(f"data.depth={depth!r} is invalid: expected a fraction in [0, 1] or null (random)")
        if haystack not in HAYSTACKS:
            raise UserError(f"data.haystack={haystack!r} is invalid: expected one of {', '.join(HAYSTACKS)}")
        for name, value in (("batch_size", batch_size), ("train_size", train_size), ("val_size", val_size)):
            if value <= 0:
                raise UserError(f"data.{name}={value!r} is invalid: expected a positive integer")
        if train_size < batch_size:
            raise UserError(f"data.train_size={train_size} is invalid: expected >= data.batch_size={batch_size}")
        if num_workers < 0:
            raise UserError(f"data.num_workers={num_workers!r} is invalid: expected >= 0")
        self.context_len, self.nr, self.depth, self.haystack = context_len, pairs, depth, haystack
        self.batch_size, self.train_size, self.val_size = batch_size, train_size, val_size
        self.num_workers, self.seed, self.loss_on = num_workers, seed, loss_on
        self.order_seed = training_order_seed(order_seed, seed)
        if tokenizer == "byte":
            self.tokenizer: TextTokenizer = ByteTokenizer()
        elif Path(tokenizer).is_file():
            self.tokenizer = load_tokenizer_file(tokenizer, tokenizer)
        else:
            raise UserError(f"data.tokenizer={tokenizer!r} is invalid: no such file; expected 'byte' or a "
                            "tokenizer.json")

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def seq_len(self) -> int:
        return self.context_len

    def dataset(self, split: str) -> NeedleDataset:
        check_split(split)
        size = self.train_size if split == "train" else self.val_size
        loss_on = self.loss_on if split == "train" else "answers"
        return NeedleDataset(size, split, self.seed, self.context_len, self.nr, self.depth, self.haystack, loss_on,
                             self.tokenizer)

    def samples(self, split: str = "val", start: int = 0, count: int | None = None) -> Iterator[NeedleSample]:
        """The samples of a split with their metadata, in index order (the same as the batches)."""
        dataset = self.dataset(split)
        stop = len(dataset) if count is None else min(len(dataset), start + count)
        for index in range(start, stop):
            yield dataset.sample(index)

    def describe(self) -> str:
        pairs = ", ".join(f"N={n} R={r}" for n, r in self.nr)
        depth = "random" if self.depth is None else f"{self.depth:g}"
        tokens = f"{self.tokenizer.identity} tokens"
        return (f"needles ({pairs}) in a {self.haystack} haystack | context {self.context_len} {tokens} | "
                f"answer depth {depth} | train {self.train_size}, val {self.val_size} samples (held-out cities "
                f"and numbers) | training loss on {self.loss_on}")

    def setup(self, stage: str | None = None) -> None:
        token_haystack(self.haystack, "train", self.tokenizer)  # load the corpus once, before workers fork

    def train_dataloader(self) -> DataLoader:
        trainer = self.trainer
        dataset = self.dataset("train")
        if trainer is not None and trainer.overfit_batches > 0:
            return self._ordered_loader(dataset, drop_last=True)
        return resumable_train_loader(dataset, trainer, self.batch_size, self.order_seed, self.num_workers,
                                      collate_fn=default_collate)

    def val_dataloader(self) -> DataLoader:
        return self._ordered_loader(self.dataset("val"), drop_last=False)

    def test_dataloader(self) -> DataLoader:
        return self._ordered_loader(self.dataset("test"), drop_last=False)

    def _ordered_loader(self, dataset: NeedleDataset, drop_last: bool) -> DataLoader:
        return DataLoader(dataset, batch_size=self.batch_size, shuffle=False, drop_last=drop_last,
                          num_workers=self.num_workers, persistent_workers=self.num_workers > 0,
                          pin_memory=torch.cuda.is_available())

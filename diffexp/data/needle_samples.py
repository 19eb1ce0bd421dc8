"""Multi-needle retrieval sequences (Needle-in-a-Haystack, after LWM / Gemini 1.5): the haystacks and the
generation of one sample. Batches of them for training are ``diffexp.data.needle.NeedleDataModule``.

A *needle* gives a city a unique number::

    the magic number of Valdoren is 48213.

``N`` needles are hidden in a haystack (windows of the embedded stdlib corpus, or repeated filler
sentences); ``R`` of the cities are asked for at the end, each question followed by its answer::

    <eos>...haystack...the magic number of Valdoren is 48213.\\n...haystack...
    what is the magic number of Valdoren? 48213.

Layout of one sample (byte tokens, vocab 257, id 256 = end of document), ``context_len + 1`` tokens:
``tokens[0]`` is the end-of-document id (a document boundary), ``tokens[1 : 1 + H]`` is the haystack
region holding every needle, and ``tokens[1 + H :]`` is the query region (``"\\nwhat is the magic
number of <city>? <number>."`` per query). The model reads ``tokens[:-1]`` (``context_len`` tokens)
and predicts ``tokens[1:]``; the loss mask selects the answer digits and the ``.`` after them.

Depth: the answer needles (the queried ones, kept together as one block in random order) start at
``round(depth * (H - L))`` of the haystack region, ``L`` being the block's length, so depth 0 puts
them first and depth 1 last; needle cut points are then snapped (by at most 16 bytes) to a line start
(corpus) or a sentence start (synthetic). The other needles go to random places before or after.

Held-out split: a city or number is *held out* when ``crc32(str) % 5 == 0``. Training samples use only
the other cities and numbers; validation/evaluation and test samples only held-out ones, so evaluation
asks about (city, number) pairs never seen in training. The corpus haystack is split too: training
windows come from the first 90 % of the corpus text, validation and test windows from the last 10 %.
Validation and test samples are different draws (their own random streams), not the same rows.

Every sample is generated on the fly from ``random.Random(f"...{seed}:{split}:{index}")``: deterministic,
with nothing stored. Rejection sampling guarantees that every needle city and number occurs exactly
once in the haystack region (not in the haystack text, not inside another needle) and that the
question text holds no number.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, field
from functools import cache
from typing import Literal

import torch

from diffexp.data.tokenizer import ByteTokenizer
from diffexp.errors import UserError

EOS_ID = ByteTokenizer.eos_id
VOCAB_SIZE = ByteTokenizer.vocab_size
NEEDLE_TEMPLATE = "the magic number of {city} is {number}."
QUESTION_TEMPLATE = "what is the magic number of {city}? "
SPLITS = ("train", "val", "test")
HAYSTACKS = ("corpus", "synthetic")
HELD_OUT_MODULUS = 5  # held out: crc32(text) % 5 == 0, i.e. about 20 % of cities and numbers
MAX_SNAP = 16  # bytes a needle may move to start at a line / sentence boundary
CORPUS_CHARS = 2_000_000  # corpus characters used for haystacks (the first files of the stdlib corpus)
CORPUS_TRAIN_FRACTION = 0.9

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
    """Smallest context_len that fits N needles and R queries (at their longest) with room to place them."""
    distractor_room = MAX_NEEDLE_PIECE if n_needles > n_queries else 0
    return 1 + n_queries * MAX_QUERY_PIECE + n_needles * MAX_NEEDLE_PIECE + distractor_room + 16


# ----------------------------------------------------------------------------- haystacks


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


def _is_boundary(filler: bytes, i: int, haystack: str) -> bool:
    if i <= 0 or i >= len(filler):
        return True
    if haystack == "corpus":
        return filler[i - 1] == 0x0A  # after "\n"
    return filler[i - 1] == 0x20 and i >= 2 and filler[i - 2] == 0x2E  # after ". "


def _snap(cuts: list[int], filler: bytes, haystack: str) -> list[int]:
    """Move each cut point to the nearest boundary within MAX_SNAP bytes, keeping them non-decreasing."""
    out: list[int] = []
    for c in cuts:
        lo = out[-1] if out else 0
        best = None
        for delta in range(MAX_SNAP + 1):
            for cand in (c - delta, c + delta):
                if lo <= cand <= len(filler) and _is_boundary(filler, cand, haystack):
                    best = cand
                    break
            if best is not None:
                break
        out.append(best if best is not None else max(c, lo))
    return out


def _filler_window(rng: random.Random, source: bytes, length: int, haystack: str) -> bytes:
    if length == 0:
        return b""
    if len(source) < length + 1:
        raise ValueError(f"the {haystack} haystack has {len(source)} bytes, fewer than the {length} needed")
    start = rng.randrange(0, len(source) - length)
    # start at a line (corpus) or sentence (synthetic) boundary when one is close
    sep = b"\n" if haystack == "corpus" else b". "
    nxt = source.find(sep, start, start + 200)
    if nxt != -1 and nxt + len(sep) + length <= len(source):
        start = nxt + len(sep)
    return source[start : start + length]


# ----------------------------------------------------------------------------- samples


Span = tuple[int, int]


@dataclass
class NeedleSample:
    """One generated sequence and where everything is. Spans are ``[start, end)`` indices into ``tokens``.

    Attributes:
        tokens: (context_len + 1,) long token ids; the model reads ``tokens[:-1]``.
        answer_spans: the number inside each answer needle, in query order.
        answer_needle_spans: the whole sentence of each answer needle, in query order.
        needle_spans: every needle sentence, in order of position.
        query_start: first index of the query region (its leading "\\n").
        query_spans: each question, "what is the magic number of <city>? " (ends with the space).
        answers: the answer number of each query, in query order.
        cities: the queried cities, in query order.
        needle_cities / needle_numbers: every needle's city and number, in order of position.
        candidates: the numbers present in the context (= needle_numbers), the choices of the ranking.
        answer_target_positions: per query, the indices of the answer digits and the "." after them;
            ``answer_target_positions[k][0] - 1`` is the prompt's last position (the query row).
        depth: the answer depth used (drawn uniformly when None was asked).
        haystack_len: H, the haystack region is ``tokens[1 : 1 + H]``.
    """

    tokens: torch.Tensor
    answer_spans: list[Span]
    answer_needle_spans: list[Span]
    needle_spans: list[Span]
    query_start: int
    query_spans: list[Span]
    answers: list[str]
    cities: list[str]
    needle_cities: list[str]
    needle_numbers: list[str]
    candidates: list[str]
    answer_target_positions: list[list[int]]
    depth: float
    haystack_len: int
    split: str = "train"
    meta: dict = field(default_factory=dict)

    @property
    def context_len(self) -> int:
        return len(self.tokens) - 1

    @property
    def query_positions(self) -> list[int]:
        """Per query, the position whose next-token prediction is the answer's first digit."""
        return [positions[0] - 1 for positions in self.answer_target_positions]

    def loss_mask(self) -> torch.Tensor:
        """(context_len,) float mask over the targets ``tokens[1:]``: 1 on answer digits and their "."."""
        mask = torch.zeros(self.context_len, dtype=torch.float32)
        for positions in self.answer_target_positions:
            mask[torch.tensor(positions) - 1] = 1.0
        return mask

    def text(self) -> str:
        """The sequence as text (the end-of-document id shown as ``<eos>``)."""
        return "".join("<eos>" if t == EOS_ID else chr(t) for t in self.tokens.tolist())


def make_sample(
    rng: random.Random,
    context_len: int,
    n_needles: int,
    n_queries: int,
    depth: float | None,
    haystack: Literal["corpus", "synthetic"],
    split: Literal["train", "val", "test"],
    max_tries: int = 200,
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
    source = haystack_bytes(haystack, split)
    sep = b"\n" if haystack == "corpus" else b" "
    for _ in range(max_tries):
        sample = _try_sample(rng, source, context_len, n_needles, n_queries, depth, haystack, split, sep)
        if sample is not None:
            return sample
    raise RuntimeError(f"could not generate a leak-free needle sample in {max_tries} tries")


def _try_sample(rng, source, context_len, n_needles, n_queries, depth, haystack, split, sep) -> NeedleSample | None:
    cities: list[str] = []
    while len(cities) < n_needles:
        city = random_city(rng, split)
        if all(city not in c and c not in city for c in cities):
            cities.append(city)
    numbers: list[str] = []
    while len(numbers) < n_needles:
        number = random_number(rng, split)
        if all(number not in n and n not in number for n in numbers):
            numbers.append(number)
    # needles 0..R-1 are the answers (in block order); query order is a separate shuffle
    sentences = [NEEDLE_TEMPLATE.format(city=c, number=n).encode() for c, n in zip(cities, numbers)]
    pieces = [s + sep for s in sentences]
    query_order = list(range(n_queries))
    rng.shuffle(query_order)

    query_parts = [(b"\n" + QUESTION_TEMPLATE.format(city=cities[k]).encode(), (numbers[k] + ".").encode())
                   for k in query_order]
    query_len = sum(len(q) + len(a) for q, a in query_parts)
    H = context_len - query_len  # haystack region: tokens[1 : 1 + H]
    answer_len = sum(len(p) for p in pieces[:n_queries])
    distractors = list(range(n_queries, n_needles))
    rng.shuffle(distractors)
    distractor_len = sum(len(pieces[i]) for i in distractors)
    F = H - answer_len - distractor_len  # filler bytes
    if F < 0 or (distractors and F < MAX_NEEDLE_PIECE):
        return None
    used_depth = rng.random() if depth is None else float(depth)
    P = round(used_depth * (H - answer_len))  # target start of the answer block in the haystack region
    # distractors before the block: a prefix of the shuffled list whose length fits in P and leaves
    # the rest fitting after the block (one exists because F >= the longest piece)
    after_room = H - answer_len - P
    prefix = [0]
    for i in distractors:
        prefix.append(prefix[-1] + len(pieces[i]))
    feasible = [k for k, s in enumerate(prefix) if s <= P and distractor_len - s <= after_room]
    if not feasible:
        return None
    k_before = rng.choice(feasible)
    before, after = distractors[:k_before], distractors[k_before:]
    filler_before = P - prefix[k_before]  # filler bytes before the block
    # random filler cut points for the distractors on each side
    cuts_before = sorted(rng.randint(0, filler_before) for _ in before)
    cuts_after = sorted(rng.randint(filler_before, F) for _ in after)
    order = before + ["block"] + after
    cuts = cuts_before + [filler_before] + cuts_after
    filler = _filler_window(rng, source, F, haystack)
    cuts = _snap(cuts, filler, haystack)

    # assemble
    tokens: list[int] = [EOS_ID]
    needle_spans: dict[int, Span] = {}
    prev = 0
    for item, cut in zip(order, cuts):
        tokens.extend(filler[prev:cut])
        prev = cut
        for i in (range(n_queries) if item == "block" else [item]):
            start = len(tokens)
            tokens.extend(sentences[i])
            needle_spans[i] = (start, len(tokens))
            tokens.extend(sep)
    tokens.extend(filler[prev:])
    assert len(tokens) == 1 + H, (len(tokens), H)
    haystack_region = bytes(tokens[1:])
    query_start = len(tokens)
    query_spans, target_positions = [], []
    for question, answer in query_parts:
        query_spans.append((len(tokens) + 1, len(tokens) + len(question)))
        tokens.extend(question)
        target_positions.append(list(range(len(tokens), len(tokens) + len(answer))))
        tokens.extend(answer)
    assert len(tokens) == context_len + 1

    # leak checks: each city / number once in the haystack region, no stray "magic number"
    if haystack_region.count(b"magic number") != n_needles:
        return None
    for c, n in zip(cities, numbers):
        if haystack_region.count(c.encode()) != 1 or haystack_region.count(n.encode()) != 1:
            return None
    questions = b"".join(q for q, _ in query_parts)
    if any(ch in b"0123456789" for ch in questions):
        return None

    number_offset = len(NEEDLE_TEMPLATE.split("{number}")[0].format(city=""))
    answer_spans, answer_needle_spans = [], []
    for k in query_order:
        start, end = needle_spans[k]
        num_start = start + number_offset + len(cities[k])
        answer_spans.append((num_start, num_start + len(numbers[k])))
        answer_needle_spans.append((start, end))
    by_position = sorted(range(n_needles), key=lambda i: needle_spans[i][0])
    return NeedleSample(
        tokens=torch.tensor(tokens, dtype=torch.long),
        answer_spans=answer_spans,
        answer_needle_spans=answer_needle_spans,
        needle_spans=[needle_spans[i] for i in by_position],
        query_start=query_start,
        query_spans=query_spans,
        answers=[numbers[k] for k in query_order],
        cities=[cities[k] for k in query_order],
        needle_cities=[cities[i] for i in by_position],
        needle_numbers=[numbers[i] for i in by_position],
        candidates=[numbers[i] for i in by_position],
        answer_target_positions=target_positions,
        depth=used_depth,
        haystack_len=H,
        split=split,
    )

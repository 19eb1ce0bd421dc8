"""Multi-needle retrieval sequences (Needle-in-a-Haystack, after LWM / Gemini 1.5): the generation of one
sample. Its text and tokens (templates, cities, haystacks, tokenizers) are ``diffexp.data.needle_text``;
batches of samples for training are ``diffexp.data.needle.NeedleDataModule`` (byte tokens).

A *needle* gives a city a unique number::

    the magic number of Valdoren is 48213.

``N`` needles are hidden in a haystack (windows of the embedded stdlib corpus, or repeated filler
sentences); ``R`` of the cities are asked for at the end, each question followed by its answer::

    <eos>...haystack...the magic number of Valdoren is 48213.\\n...haystack...
    what is the magic number of Valdoren? 48213.

Layout of one sample, ``context_len + 1`` tokens of the chosen tokenizer (default: bytes, vocab 257, id
256 = end of document): ``tokens[0]`` is the tokenizer's end-of-document id (a document boundary),
``tokens[1 : 1 + H]`` is the haystack region holding every needle, and ``tokens[1 + H :]`` is the query
region (``"\\nwhat is the magic number of <city>? <number>."`` per query). The model reads ``tokens[:-1]``
(``context_len`` tokens) and predicts ``tokens[1:]``; the loss mask selects the answer's tokens: the
digits and the ``.`` after them (with a BPE, the token holding the digits may also hold the space before
them, and the prompt then ends at ``?``).

Every piece (a haystack window, a needle with its separator, a question with its answer) is tokenized on
its own and the pieces' tokens are concatenated: lengths and spans are exact in tokens, and a needle is
the same tokens at every depth. With a BPE the seams may differ from a tokenization of the whole text
(``diffexp.data.needle_text`` chooses them where its pre-tokenizer would split anyway).

Depth: the answer needles (the queried ones, kept together as one block in random order) start at
``round(depth * (H - L))`` of the haystack region, ``L`` being the block's length, so depth 0 puts
them first and depth 1 last; needle cut points are then snapped (by at most 16 tokens) to a line start
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
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from diffexp.data.needle_text import (
    HAYSTACKS,
    MAX_NEEDLE_PIECE,
    MAX_SNAP,
    NEEDLE_TEMPLATE,
    QUESTION_TEMPLATE,
    SEPARATORS,
    SPLITS,
    WINDOW_SEARCH,
    TokenHaystack,
    check_split,
    encode,
    haystack_bytes,
    is_held_out,
    min_context_len,
    random_city,
    random_number,
    separator_first,
    token_haystack,
)
from diffexp.data.tokenizer import ByteTokenizer, TextTokenizer

# the names the data module, the evaluation and the tests use, from where they always came
__all__ = ["EOS_ID", "VOCAB_SIZE", "HAYSTACKS", "MAX_SNAP", "SPLITS", "NeedleSample", "check_split", "haystack_bytes",
           "is_held_out", "make_sample", "min_context_len"]

EOS_ID = ByteTokenizer.eos_id
VOCAB_SIZE = ByteTokenizer.vocab_size
Span = tuple[int, int]


@dataclass
class NeedleSample:
    """One generated sequence and where everything is. Spans are ``[start, end)`` indices into ``tokens``.

    Attributes:
        tokens: (context_len + 1,) long token ids; the model reads ``tokens[:-1]``.
        answer_spans: the number inside each answer needle, in query order (the tokens overlapping it).
        answer_needle_spans: the whole sentence of each answer needle, in query order.
        needle_spans: every needle sentence, in order of position.
        query_start: first index of the query region (its leading "\\n").
        query_spans: each question, "what is the magic number of <city>? " (up to the answer's tokens).
        answers: the answer number of each query, in query order.
        cities: the queried cities, in query order.
        needle_cities / needle_numbers: every needle's city and number, in order of position.
        candidates: the numbers present in the context (= needle_numbers), the choices of the ranking.
        answer_target_positions: per query, the indices of the answer's tokens (the digits and the "."
            after them); ``answer_target_positions[k][0] - 1`` is the prompt's last position (the query row).
        answer_prefixes: per query, the text the answer's tokens hold before the digits: "" for bytes,
            " " for a BPE that merges the space after "?" into the number.
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
    answer_prefixes: list[str]
    depth: float
    haystack_len: int
    split: str = "train"
    meta: dict = field(default_factory=dict)

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

    def text(self, tokenizer: TextTokenizer | None = None) -> str:
        """The sequence as text (the end-of-document id shown as ``<eos>``); bytes unless told otherwise."""
        return "<eos>" + (tokenizer or ByteTokenizer()).decode(self.tokens[1:].tolist())


@dataclass
class _Needle:
    """A needle with its separator, tokenized; spans relative to its first token."""

    ids: list[int]
    sentence: Span
    number: Span


@dataclass
class _Query:
    """A question with its answer, tokenized; spans relative to its first token."""

    ids: list[int]
    question: Span
    answer: Span
    prefix: str
    text: str


def _needle(tokenizer: TextTokenizer, city: str, number: str, sep: str) -> _Needle:
    sentence = NEEDLE_TEMPLATE.format(city=city, number=number)
    first = separator_first(tokenizer)
    at = len(sep) if first else 0
    encoded = encode(tokenizer, sep + sentence if first else sentence + sep)
    number_at = at + len(sentence) - len(number) - 1  # the sentence ends with "<number>."
    return _Needle(encoded.ids, encoded.overlapping(at, at + len(sentence)),
                   encoded.overlapping(number_at, number_at + len(number)))


def _query(tokenizer: TextTokenizer, city: str, number: str) -> _Query:
    question = "\n" + QUESTION_TEMPLATE.format(city=city)
    text = question + number + "."
    encoded = encode(tokenizer, text)  # one piece: "? 48213" tokenized as in running text
    first, end = encoded.overlapping(len(question), len(text))
    if first == 0 or end != len(encoded.ids):
        raise ValueError(f"the tokenizer merges the question {question!r} into its answer {number!r}.")
    prefix = text[encoded.ends[first - 1] : len(question)]  # what the answer's tokens add before the digits
    return _Query(encoded.ids, (encoded.overlapping(1, len(question))[0], first), (first, end), prefix, question)


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


def _filler_window(rng: random.Random, source: TokenHaystack, length: int, haystack: str) -> tuple[list[int], set]:
    """``length`` haystack tokens and the boundaries inside them (relative indices)."""
    if length == 0:
        return [], set()
    if len(source) < length + 1:
        raise ValueError(f"the {haystack} haystack has {len(source)} tokens, fewer than the {length} needed")
    start = rng.randrange(0, len(source) - length)
    # start at a line (corpus) or sentence (synthetic) boundary when one is close
    k = int(np.searchsorted(source.markers, source.cut_offsets[start]))
    if k < len(source.boundaries):
        boundary = int(source.boundaries[k])
        if boundary <= start + WINDOW_SEARCH and boundary + length <= len(source):
            start = boundary
    return source.ids[start : start + length].tolist(), source.boundaries_within(start, length)


def _snap(cuts: list[int], boundaries: set, length: int) -> list[int]:
    """Move each cut point to the nearest boundary within MAX_SNAP tokens, keeping them non-decreasing."""
    out: list[int] = []
    for c in cuts:
        lo = out[-1] if out else 0
        best = None
        for delta in range(MAX_SNAP + 1):
            for cand in (c - delta, c + delta):
                if lo <= cand <= length and (cand <= 0 or cand >= length or cand in boundaries):
                    best = cand
                    break
            if best is not None:
                break
        out.append(best if best is not None else max(c, lo))
    return out


def _try_sample(rng, source, tokenizer, context_len, n_needles, n_queries, depth, haystack,
                split) -> NeedleSample | None:
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
    pieces = [_needle(tokenizer, c, n, SEPARATORS[haystack]) for c, n in zip(cities, numbers)]
    query_order = list(range(n_queries))
    rng.shuffle(query_order)

    queries = [_query(tokenizer, cities[k], numbers[k]) for k in query_order]
    H = context_len - sum(len(q.ids) for q in queries)  # haystack region: tokens[1 : 1 + H]
    answer_len = sum(len(p.ids) for p in pieces[:n_queries])
    distractors = list(range(n_queries, n_needles))
    rng.shuffle(distractors)
    distractor_len = sum(len(pieces[i].ids) for i in distractors)
    F = H - answer_len - distractor_len  # filler tokens
    if F < 0 or (distractors and F < MAX_NEEDLE_PIECE):
        return None
    used_depth = rng.random() if depth is None else float(depth)
    P = round(used_depth * (H - answer_len))  # target start of the answer block in the haystack region
    # distractors before the block: a prefix of the shuffled list whose length fits in P and leaves
    # the rest fitting after the block (one exists because F >= the longest piece)
    after_room = H - answer_len - P
    prefix = [0]
    for i in distractors:
        prefix.append(prefix[-1] + len(pieces[i].ids))
    feasible = [k for k, s in enumerate(prefix) if s <= P and distractor_len - s <= after_room]
    if not feasible:
        return None
    k_before = rng.choice(feasible)
    before, after = distractors[:k_before], distractors[k_before:]
    filler_before = P - prefix[k_before]  # filler tokens before the block
    # random filler cut points for the distractors on each side
    cuts_before = sorted(rng.randint(0, filler_before) for _ in before)
    cuts_after = sorted(rng.randint(filler_before, F) for _ in after)
    order = before + ["block"] + after
    cuts = cuts_before + [filler_before] + cuts_after
    filler, boundaries = _filler_window(rng, source, F, haystack)
    cuts = _snap(cuts, boundaries, F)

    # assemble
    tokens: list[int] = [tokenizer.eos_id]
    needle_spans: dict[int, Span] = {}
    number_spans: dict[int, Span] = {}
    prev = 0
    for item, cut in zip(order, cuts):
        tokens.extend(filler[prev:cut])
        prev = cut
        for i in (range(n_queries) if item == "block" else [item]):
            start = len(tokens)
            tokens.extend(pieces[i].ids)
            needle_spans[i] = (start + pieces[i].sentence[0], start + pieces[i].sentence[1])
            number_spans[i] = (start + pieces[i].number[0], start + pieces[i].number[1])
    tokens.extend(filler[prev:])
    assert len(tokens) == 1 + H, (len(tokens), H)
    haystack_text = tokenizer.decode(tokens[1:])
    query_start = len(tokens)
    query_spans, target_positions = [], []
    for query in queries:
        start = len(tokens)
        query_spans.append((start + query.question[0], start + query.question[1]))
        target_positions.append(list(range(start + query.answer[0], start + query.answer[1])))
        tokens.extend(query.ids)
    assert len(tokens) == context_len + 1

    # leak checks: each city / number once in the haystack region, no stray "magic number"
    if haystack_text.count("magic number") != n_needles:
        return None
    for c, n in zip(cities, numbers):
        if haystack_text.count(c) != 1 or haystack_text.count(n) != 1:
            return None
    if any(ch.isdigit() for query in queries for ch in query.text):
        return None

    by_position = sorted(range(n_needles), key=lambda i: needle_spans[i][0])
    return NeedleSample(
        tokens=torch.tensor(tokens, dtype=torch.long),
        answer_spans=[number_spans[k] for k in query_order],
        answer_needle_spans=[needle_spans[k] for k in query_order],
        needle_spans=[needle_spans[i] for i in by_position],
        query_start=query_start,
        query_spans=query_spans,
        answers=[numbers[k] for k in query_order],
        cities=[cities[k] for k in query_order],
        needle_cities=[cities[i] for i in by_position],
        needle_numbers=[numbers[i] for i in by_position],
        candidates=[numbers[i] for i in by_position],
        answer_target_positions=target_positions,
        answer_prefixes=[query.prefix for query in queries],
        depth=used_depth,
        haystack_len=H,
        split=split,
    )

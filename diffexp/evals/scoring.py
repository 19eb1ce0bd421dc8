"""Scoring shared by the evaluations: what a causal language model says about given token spans, and where
its attention goes.

Everything works on tensors, token-id lists and a logits function ``idx (B, T) -> logits (B, T, V)``, causal (so
rows of different lengths can share a right-padded batch); a span ``(start, end)`` is positions start .. end - 1.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from diffexp.generate.decode import static_capacity

LogitsFn = Callable[[torch.Tensor], torch.Tensor]
Span = tuple[int, int]


# ----------------------------------------------------------------------------- models


def as_logits_fn(model: Any) -> LogitsFn:
    """The logits function of a ``Decoder``, a ``DiffexpLM`` (its inner ``Decoder``) or any causal callable.

    A module whose forward returns ``(logits, maps)`` gives its logits."""
    inner = getattr(model, "model", model)  # DiffexpLM -> Decoder: no Lightning hooks around the forward
    if not isinstance(inner, nn.Module):
        return inner

    def logits_fn(idx: torch.Tensor) -> torch.Tensor:
        out = inner(idx)
        return out[0] if isinstance(out, tuple) else out

    return logits_fn


def model_max_seq_len(model: Any) -> int | None:
    """max_seq_len of a Decoder, a DiffexpLM or anything holding one; None if unknown."""
    for path in ("cfg", "arch", "model.cfg", "model.arch"):
        obj = model
        for attr in path.split("."):
            obj = getattr(obj, attr, None)
        if obj is not None and getattr(obj, "max_seq_len", None) is not None:
            return int(obj.max_seq_len)
    return None


@contextlib.contextmanager
def evaluating(model: Any, device: str | torch.device | None = None) -> Iterator[None]:
    """Run an ``nn.Module`` in eval mode (on ``device`` if given); its training mode and device are restored
    afterwards, also on error. Anything else (a plain callable) is left alone."""
    if not isinstance(model, nn.Module):
        yield
        return
    first = next(model.parameters(), None)
    was_training, original_device = model.training, first.device if first is not None else None
    model.eval()
    if device is not None and original_device is not None and original_device != torch.device(device):
        model.to(device)
    try:
        yield
    finally:
        if device is not None and original_device is not None:
            model.to(original_device)
        model.train(was_training)


# ----------------------------------------------------------------------------- likelihood


def pad_rows(rows: Sequence[Sequence[int]], pad_id: int = 0) -> torch.Tensor:
    """Token-id rows of any lengths as one right-padded (B, longest) long tensor."""
    batch = torch.full((len(rows), max(len(r) for r in rows)), pad_id, dtype=torch.long)
    for i, row in enumerate(rows):
        batch[i, : len(row)] = torch.as_tensor(list(row), dtype=torch.long)
    return batch


def span_logprobs(logits: torch.Tensor, tokens: torch.Tensor, spans: Sequence[Span]) -> torch.Tensor:
    """(B,) float64: per row b, log p(tokens[b, start:end] | tokens[b, :start]) for its span ``(start, end)``,
    ``1 <= start <= end <= T + 1`` (empty: 0), where ``logits`` (B, T, V) is the model's output on ``tokens[:, :T]``."""
    if len(spans) != logits.shape[0]:
        raise ValueError(f"spans: expected one span per row ({logits.shape[0]}), got {len(spans)}")
    logp = logits.float().log_softmax(dim=-1)
    tokens = tokens.to(logp.device)
    scores = torch.empty(len(spans), dtype=torch.float64)
    for b, (start, end) in enumerate(spans):
        if not 1 <= start <= end <= min(logits.shape[1] + 1, tokens.shape[1]):
            raise ValueError(f"span ({start}, {end}) of row {b} is invalid for {logits.shape[1]} logits and "
                             f"{tokens.shape[1]} tokens: expected 1 <= start <= end <= {logits.shape[1] + 1}")
        positions = torch.arange(start - 1, end - 1, device=logp.device)
        # summed in float64: candidates' scores are compared, rounding should not break near-ties
        scores[b] = logp[b, positions, tokens[b, start:end]].cpu().double().sum()
    return scores


@torch.no_grad()
def continuation_logprobs(logits_fn: LogitsFn, prompts: Sequence[Sequence[int]],
                          continuations: Sequence[Sequence[int]], device: str | torch.device = "cpu",
                          batch_size: int = 16, max_len: int | None = None, pad_id: int = 0) -> torch.Tensor:
    """(N,) float64: summed log-likelihood of ``continuations[i]`` after ``prompts[i]``.

    Rows are batched by length (less padding). A row longer than ``max_len`` model inputs (the model's
    context limit) drops its first tokens; without ``max_len`` every row must fit the model.
    """
    return continuation_scores(logits_fn, prompts, continuations, device, batch_size, max_len, pad_id)[0]


@torch.no_grad()
def continuation_scores(logits_fn: LogitsFn, prompts: Sequence[Sequence[int]],
                        continuations: Sequence[Sequence[int]], device: str | torch.device = "cpu",
                        batch_size: int = 16, max_len: int | None = None, pad_id: int = 0,
                        progress: str | None = None) -> tuple[torch.Tensor, list[bool]]:
    """``continuation_logprobs`` and, per row, whether greedy decoding would produce the continuation (every
    continuation token is its position's argmax): what LM-Eval's ``loglikelihood`` returns.
    ``progress``: a progress-bar description (None: no bar)."""
    if len(prompts) != len(continuations):
        raise ValueError(f"{len(prompts)} prompts but {len(continuations)} continuations: expected pairs")
    rows, starts = [], []
    for prompt, continuation in zip(prompts, continuations):
        row = list(prompt) + list(continuation)
        cut = max(0, len(row) - 1 - max_len) if max_len else 0
        rows.append(row[cut:])
        starts.append(len(prompt) - cut)
    scores = torch.empty(len(rows), dtype=torch.float64)
    greedy = [True] * len(rows)
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    batches = range(0, len(order), batch_size)
    if progress is not None:
        from tqdm.auto import tqdm

        batches = tqdm(batches, desc=progress, unit="batch")
    for first in batches:
        chunk = order[first : first + batch_size]
        batch = pad_rows([rows[i] for i in chunk], pad_id).to(device)
        logits = logits_fn(batch[:, :-1])
        spans = [(starts[i], len(rows[i])) for i in chunk]
        scores[chunk] = span_logprobs(logits, batch, spans)
        best = logits.argmax(dim=-1)
        for b, (i, (start, end)) in enumerate(zip(chunk, spans)):
            greedy[i] = bool((best[b, start - 1 : end - 1] == batch[b, start:end]).all())
    return scores, greedy


def candidate_logprobs(logits_fn: LogitsFn, prompts: Sequence[Sequence[int]],
                       candidates: Sequence[Sequence[int]], device: str | torch.device = "cpu",
                       batch_size: int = 16, max_len: int | None = None, pad_id: int = 0) -> torch.Tensor:
    """(P, K) float64: summed log-likelihood of every candidate continuation after every prompt."""
    pairs = [(p, c) for p in prompts for c in candidates]
    scores = continuation_logprobs(logits_fn, [p for p, _ in pairs], [c for _, c in pairs], device, batch_size,
                                   max_len, pad_id)
    return scores.view(len(prompts), len(candidates))


# ----------------------------------------------------------------------------- choice and exact match


def best_candidates(scores: Any) -> list[int]:
    """Constrained choice: per row of a (prompts, candidates) score matrix, the index of the best candidate
    (the first one on ties)."""
    scores = torch.as_tensor(np.asarray(scores, dtype=np.float64))
    if scores.ndim != 2:
        raise ValueError(f"scores must be (prompts, candidates), got shape {tuple(scores.shape)}")
    return scores.argmax(dim=1).tolist()


def argmax_matches(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[int, int]:
    """(correct, scored): positions (where ``mask`` is set, else all) whose argmax logit is the target.

    ``logits`` (..., V) and ``targets`` / ``mask`` (...) must line up: ``logits[:, t]`` scored against
    ``targets[:, t]``."""
    targets = targets.to(logits.device)
    mask = torch.ones_like(targets, dtype=torch.bool) if mask is None else mask.to(logits.device).bool()
    correct = (logits.argmax(dim=-1) == targets) & mask
    return int(correct.sum()), int(mask.sum())


@torch.no_grad()
def greedy_continuations(model: Any, prompts: Sequence[Sequence[int]], max_new: Sequence[int],
                         stop_id: int | None = None, device: str | torch.device = "cpu", batch_size: int = 16,
                         pad_id: int = 0, stop: Callable[[list[int]], bool] | None = None,
                         compile: bool = False) -> list[list[int]]:
    """Greedy decoding: per prompt, up to ``max_new[i]`` argmax tokens, through the first ``stop_id`` or the first
    token after which ``stop(tokens so far)`` holds. A ``Decoder`` decodes with its KV cache, prompts of different
    lengths in one batch (through the compiled step with ``compile``); any other logits function re-reads each
    prefix per step, to the same tokens."""
    if len(prompts) != len(max_new):
        raise ValueError(f"{len(prompts)} prompts but {len(max_new)} max_new: expected one limit per prompt")

    def stops(tokens: list[int]) -> bool:
        return (stop_id is not None and tokens[-1] == stop_id) or (stop is not None and stop(tokens))

    decoder = getattr(model, "model", model)
    decode = _greedy_uncached
    if isinstance(decoder, nn.Module) and hasattr(decoder, "new_cache"):
        try:
            decoder.new_cache()
            decode = functools.partial(_greedy_cached, compile=compile)
        except ValueError:  # the variant has no cached decoding
            decoder = as_logits_fn(decoder)
    else:
        decoder = as_logits_fn(model)
    outputs: list[list[int]] = [[] for _ in prompts]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    for first in range(0, len(order), batch_size):
        chunk = order[first : first + batch_size]
        generated = decode(decoder, [list(prompts[i]) for i in chunk], [max_new[i] for i in chunk], stops, device,
                           pad_id)
        for i, tokens in zip(chunk, generated):
            outputs[i] = tokens
    return outputs


def _greedy_cached(decoder, rows: list[list[int]], limits: list[int], stops, device, pad_id: int,
                   compile: bool = False) -> list[list[int]]:
    """Prefill up to the shortest prompt; longer rows then feed their remaining prompt tokens one per step while
    the shorter ones already generate."""
    generated: list[list[int]] = [[] for _ in rows]
    active = [limit > 0 for limit in limits]
    if not any(active):
        return generated
    needed = min(max(len(row) + limit for row, limit in zip(rows, limits)), decoder.cfg.max_seq_len)
    if compile and decoder.compile_decoding() is None:
        cache = decoder.new_cache(static_capacity(needed, decoder.cfg.max_seq_len), static=True)
    else:
        cache = decoder.new_cache(needed)
    position = min(len(row) for row in rows)  # the position the logits predict
    logits = decoder(torch.tensor([row[:position] for row in rows], device=device), cache=cache)[:, -1]
    while True:
        argmax = logits.argmax(dim=-1).tolist()
        feed = []
        for i, row in enumerate(rows):
            if position < len(row):  # still inside its prompt
                feed.append(row[position])
            elif active[i]:
                generated[i].append(argmax[i])
                active[i] = not stops(generated[i]) and len(generated[i]) < limits[i]
                feed.append(argmax[i])
            else:  # done: any token, no other row reads it
                feed.append(pad_id)
        if not any(active):
            return generated
        logits = decoder.decode_step(torch.tensor(feed, device=device)[:, None], cache)
        position += 1


def _greedy_uncached(logits_fn: LogitsFn, rows: list[list[int]], limits: list[int], stops, device,
                     pad_id: int) -> list[list[int]]:
    buffer = pad_rows([row + [pad_id] * limit for row, limit in zip(rows, limits)], pad_id).to(device)
    lengths = [len(row) for row in rows]
    generated: list[list[int]] = [[] for _ in rows]
    active = [limit > 0 for limit in limits]
    while any(active):
        width = max(length for length, on in zip(lengths, active) if on)
        logits = logits_fn(buffer[:, :width])
        for i in (i for i, on in enumerate(active) if on):
            token = int(logits[i, lengths[i] - 1].argmax())
            generated[i].append(token)
            buffer[i, lengths[i]] = token
            lengths[i] += 1
            active[i] = not stops(generated[i]) and len(generated[i]) < limits[i]
    return generated


# ----------------------------------------------------------------------------- attention


def span_mask(length: int, spans: Sequence[Span], device: str | torch.device | None = None) -> torch.Tensor:
    """(length,) bool: True on the positions of the spans (clipped to ``0 .. length - 1``)."""
    mask = torch.zeros(length, dtype=torch.bool, device=device)
    for start, end in spans:
        mask[max(0, start) : max(0, min(end, length))] = True
    return mask


def attention_shares(rows: torch.Tensor, query_position: int, regions: Sequence[torch.Tensor]) -> torch.Tensor:
    """(..., R): the share of each attention row ``rows`` (..., T) of query ``query_position`` on each of the R
    (T,) key masks ``regions``: by magnitude over the causal keys 0..q, normalised by their sum, so in [0, 1]
    whatever the signs (NaN where that sum is 0)."""
    T = rows.shape[-1]
    causal = torch.arange(T, device=rows.device) <= query_position
    weights = rows.detach().float().abs() * causal
    total = weights.sum(-1)
    shares = [(weights * region.to(rows.device)).sum(-1) / total for region in regions]
    return torch.stack(shares, dim=-1).where(total[..., None] > 0, torch.tensor(float("nan"), device=rows.device))


def attention_to_span(attention: torch.Tensor, query_positions: Sequence[int], spans: Sequence[Span]) -> torch.Tensor:
    """(..., Q): share of the attention from each query position that lands on the spans, e.g. how much the
    answer tokens attend to the needle. ``attention`` is a (..., T, T) map (rows: queries, columns: keys),
    such as one layer's (B, heads, T, T); see ``attention_shares`` for the normalisation."""
    region = span_mask(attention.shape[-1], spans, attention.device)
    return torch.stack([attention_shares(attention[..., q, :], q, [region])[..., 0] for q in query_positions], dim=-1)

"""Autoregressive decoding with the KV cache: the prompts in one prefill (each alone when their lengths differ),
then one token per row per step, eagerly or through the compiled step."""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence

import torch

from diffexp.generate.sampling import Sampling, next_token
from diffexp.model.cache import DecoderCache


@torch.no_grad()
def generate(model, prompt: torch.Tensor | Sequence, max_new_tokens: int, sampling: Sampling = Sampling(),
             stop_id: int | None = None, generator: torch.Generator | None = None,
             compile: bool = False) -> Iterator[torch.Tensor]:
    """Yield the next token ids (B,) of each sequence, up to max_new_tokens steps.

    model: a diffexp Decoder; prompt: (B, T) ids, or B sequences of ids of any lengths (each row then decodes
    as it would alone). A sequence that produced stop_id keeps yielding stop_id until every sequence has
    stopped; then decoding ends. The last token is never fed back, so the cache needs the longest prompt +
    max_new_tokens - 1 positions (max_seq_len bounds it: a ValueError before any work). compile: decode
    through the torch.compile'd step on a static cache (a warning, and eager decoding, where it cannot run).
    """
    rows = prompt_rows(prompt)
    if max_new_tokens < 1:
        return
    needed = max(len(row) for row in rows) + max_new_tokens - 1
    if needed > model.cfg.max_seq_len:
        raise ValueError(f"{max(len(row) for row in rows)} prompt + {max_new_tokens - 1} fed-back positions exceed "
                         f"the model's max_seq_len={model.cfg.max_seq_len}")
    if compile:
        reason = model.compile_decoding()
        if reason is not None:
            warnings.warn(f"torch.compile cannot run here ({reason}); decoding eagerly", stacklevel=2)
            compile = False
    capacity = static_capacity(needed, model.cfg.max_seq_len) if compile else needed
    cache, logits = prefill(model, rows, capacity, static=compile)
    stopped = torch.zeros(len(rows), dtype=torch.bool, device=logits.device)
    for step in range(max_new_tokens):
        token = next_token(logits, sampling, generator)
        if stop_id is not None:
            token = token.masked_fill(stopped, stop_id)
            stopped |= token == stop_id
        yield token
        if step + 1 == max_new_tokens or bool(stopped.all()):
            return
        logits = model.decode_step(token.unsqueeze(1), cache)


def prompt_rows(prompt: torch.Tensor | Sequence) -> list[torch.Tensor]:
    """The prompt as a list of 1-D id tensors, each at least one token."""
    if torch.is_tensor(prompt):
        if prompt.ndim != 2 or prompt.shape[1] == 0:
            raise ValueError(f"prompt must be (batch, T) ids with T >= 1, got shape {tuple(prompt.shape)}")
        return list(prompt)
    rows = [torch.as_tensor(row) for row in prompt]
    if not rows or any(row.ndim != 1 or len(row) == 0 for row in rows):
        raise ValueError("prompt must be a non-empty sequence of non-empty 1-D id sequences")
    return rows


def static_capacity(needed: int, max_seq_len: int) -> int:
    """The next power of two >= needed (at most max_seq_len): prompts of similar lengths share one compiled step."""
    return min(1 << (needed - 1).bit_length(), max_seq_len)


def prefill(model, rows: list[torch.Tensor], capacity: int, static: bool = False) -> tuple[DecoderCache, torch.Tensor]:
    """A cache holding every row's prompt and the logits (B, vocab) after each row's last token. Rows of one length
    prefill as one batch; otherwise each alone, joined into one cache of rows of different lengths."""
    if len({len(row) for row in rows}) == 1:
        cache = model.new_cache(capacity, static)
        return cache, model(torch.stack(rows), cache=cache)[:, -1]
    caches, logits = [], []
    for row in rows:
        caches.append(model.new_cache(capacity, static))
        logits.append(model(row[None], cache=caches[-1])[:, -1])
    return DecoderCache.stack(caches), torch.cat(logits)

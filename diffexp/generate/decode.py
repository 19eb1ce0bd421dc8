"""Autoregressive decoding with the KV cache: the prompt in one prefill, then one token per step."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from diffexp.generate.sampling import Sampling, next_token


@torch.no_grad()
def generate(model, prompt: torch.Tensor, max_new_tokens: int, sampling: Sampling = Sampling(),
             stop_id: int | None = None, generator: torch.Generator | None = None) -> Iterator[torch.Tensor]:
    """Yield the next token ids (B,) of each sequence, up to max_new_tokens steps.

    model: a diffexp Decoder; prompt: (B, T) ids. A sequence that produced stop_id keeps yielding stop_id
    until every sequence has stopped; then decoding ends. The last token is never fed back, so the cache
    needs T + max_new_tokens - 1 positions (Decoder's max_seq_len bounds it: a ValueError before any work).
    """
    if prompt.ndim != 2 or prompt.shape[1] == 0:
        raise ValueError(f"prompt must be (batch, T) ids with T >= 1, got shape {tuple(prompt.shape)}")
    if max_new_tokens < 1:
        return
    cache = model.new_cache()
    cache.check_room(prompt.shape[1] + max_new_tokens - 1)
    logits = model(prompt, cache=cache)[:, -1]
    stopped = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
    for step in range(max_new_tokens):
        token = next_token(logits, sampling, generator)
        if stop_id is not None:
            token = token.masked_fill(stopped, stop_id)
            stopped |= token == stop_id
        yield token
        if step + 1 == max_new_tokens or bool(stopped.all()):
            return
        logits = model(token.unsqueeze(1), cache=cache)[:, -1]

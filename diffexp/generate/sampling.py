"""How the next token is chosen from the logits: greedy (temperature 0), or sampled after temperature,
top-k and top-p (nucleus) filtering, in that order, as in Hugging Face's generate."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from diffexp.errors import UserError


@dataclass(frozen=True)
class Sampling:
    """temperature 0 picks the most likely token; top_k keeps the k most likely; top_p the smallest set
    whose probability reaches p (the most likely token always stays)."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def check(self) -> Sampling:
        """Raise a UserError naming the flag, as the command line writes it."""
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise UserError(f"--temperature={self.temperature} is invalid: expected a number >= 0 (0: greedy)")
        if self.top_k is not None and self.top_k < 1:
            raise UserError(f"--top-k={self.top_k} is invalid: expected a positive integer")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise UserError(f"--top-p={self.top_p} is invalid: expected a probability in (0, 1]")
        return self


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits (B, vocab) -> token ids (B,)."""
    if sampling.temperature == 0:
        return logits.argmax(dim=-1)
    scores = logits.float() / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < scores.shape[-1]:
        kth = scores.topk(sampling.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p is not None and sampling.top_p < 1:
        ordered, order = scores.sort(dim=-1, descending=True)
        before = ordered.softmax(dim=-1).cumsum(dim=-1) - ordered.softmax(dim=-1)  # mass of the better tokens
        drop = before >= sampling.top_p  # the first token has 0 before it: it always stays
        scores = scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)

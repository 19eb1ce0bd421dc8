"""Oracles the evaluation tests score in place of a trained model: each knows the task's hidden answer, so an
evaluation's bookkeeping (cells, orderings, files) is checked against a known accuracy of 1."""

from __future__ import annotations

import bisect
import itertools
import re
from collections.abc import Sequence

import numpy as np
import torch

from diffexp.data.icl import ICLTask
from diffexp.data.tokenizer import ByteTokenizer, TextTokenizer
from diffexp.evals.icl import _as_scorer
from diffexp.evals.scoring import best_candidates


class NeedleOracle:
    """A causal "model" that answers every needle question by copying the number from the needle earlier in the row.

    After a question's prompt (up to the answer's digits: for bytes, the space after "?" too) and after each correct
    token, ``confidence`` goes on the next token of ``<number>.`` (tokenized on its own, after whatever the prompt
    left before the digits); all other logits are 0. Rows are read as text through ``tokenizer`` (default bytes).
    """

    _question = re.compile(r"what is the magic number of (\w+)\?")

    def __init__(self, tokenizer: TextTokenizer | None = None, confidence: float = 30.0,
                 vocab_size: int | None = None) -> None:
        self.tokenizer = tokenizer or ByteTokenizer()
        self.vocab_size = vocab_size or self.tokenizer.vocab_size
        self.confidence = confidence
        self._texts: dict[int, str] = {}

    def _text(self, token: int) -> str:
        if token not in self._texts:  # at least one character: the end-of-document id (padding too) is "\0"
            self._texts[token] = self.tokenizer.decode([token]) or "\0"
        return self._texts[token]

    def __call__(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        logits = torch.zeros(B, T, self.vocab_size)
        for b in range(B):
            row = idx[b].tolist()
            pieces = [self._text(t) for t in row]
            ends = list(itertools.accumulate(len(piece) for piece in pieces))  # text offset after each token
            text = "".join(pieces)
            for match in self._question.finditer(text):
                city = match.group(1)
                needle = re.search(rf"the magic number of {re.escape(city)} is (\d+)\.", text[: match.start()])
                if needle is None:
                    continue
                mark = match.end() - 1  # the "?"
                last = bisect.bisect_right(ends, mark + 2) - 1  # the prompt's last token: the last to end by the digits
                while not "? ".startswith(text[mark : ends[last]]):  # padding after a prompt that ends at "?"
                    last -= 1
                # the continuation: what the prompt leaves of "? " (the space, with a BPE), the number and "."
                answer = self.tokenizer.encode("? "[ends[last] - mark :] + needle.group(1) + ".")
                for j, token in enumerate(answer):
                    pos = last + j
                    if pos >= T or row[last + 1 : pos + 1] != answer[:j]:
                        break
                    logits[b, pos, token] = self.confidence
        return logits.to(idx.device)


def oracle_scorer(task: ICLTask):
    """Knows the hidden rule: scores 1 for the true label of the prompt's last input, 0 for the others."""
    def score(prompts, candidates):
        scores = np.zeros((len(prompts), len(candidates)))
        for i, p in enumerate(prompts):
            x = task.decode(p).rsplit("input: ", 1)[1].split(" label:")[0]
            scores[i, task.label_of(x)] = 1.0
        return scores

    return score


def predict_labels(model, task, prompts: Sequence[str], device="cpu",
                   batch_size: int = 16) -> list[str]:
    """The label string chosen for each text prompt, among ``task.labels`` only."""
    scorer = _as_scorer(model, device, batch_size)
    scores = scorer([task.scored_prompt_ids(p) for p in prompts], task.scored_candidate_ids())
    return [task.labels[i] for i in best_candidates(scores)]

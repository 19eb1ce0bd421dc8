"""MQAR recall accuracy (zoology): argmax accuracy over the queried values of ``MQARDataModule`` batches, per batch
(``mqar_accuracy``) or over a loader (``evaluate_mqar``); the ``mqar`` evaluation (diffexp/evals/tasks/mqar.py) runs it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from diffexp.evals.scoring import argmax_matches, evaluating


def _tokens_and_mask(batch) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(batch, dict):
        tokens = batch["tokens"]
        mask = batch.get("loss_mask")
    else:
        tokens, mask = batch, None
    if mask is None:
        mask = torch.ones(tokens.shape[0], tokens.shape[1] - 1, dtype=torch.bool, device=tokens.device)
    return tokens, mask.bool()


def mqar_counts(logits: torch.Tensor, batch) -> tuple[int, int]:
    """(correct, scored) argmax predictions over the masked targets of one batch."""
    tokens, mask = _tokens_and_mask(batch)
    targets = tokens[:, 1:]
    if logits.shape[:2] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match targets {tuple(targets.shape)} "
                         "(logits must be the model's output on tokens[:, :-1])")
    return argmax_matches(logits, targets, mask)


def mqar_accuracy(logits: torch.Tensor, batch) -> float:
    """Argmax accuracy over the positions where ``loss_mask`` is set (NaN if none is)."""
    correct, total = mqar_counts(logits, batch)
    return correct / total if total else float("nan")


def _val_batches(data) -> Iterable:
    if hasattr(data, "val_dataloader"):  # a data module
        return data.val_dataloader()
    return data


@torch.no_grad()
def evaluate_mqar(model: nn.Module, data, device: str | torch.device | None = None,
                  max_batches: int | None = None) -> dict[str, float | int]:
    """Recall accuracy of ``model`` (``idx -> logits``: a ``Decoder`` or ``DiffexpLM``) over a data module's
    validation loader, or any iterable of batches. Returns ``{"mqar/accuracy": float, "mqar/n": int}``
    (``n``: number of scored queries). The model's train/eval mode is restored afterwards."""
    if device is None:
        device = next(model.parameters()).device
    correct = total = 0
    with evaluating(model):
        for i, batch in enumerate(_val_batches(data)):
            if max_batches is not None and i >= max_batches:
                break
            tokens, mask = _tokens_and_mask(batch)
            logits = model(tokens[:, :-1].to(device))
            c, t = mqar_counts(logits, {"tokens": tokens, "loss_mask": mask})
            correct, total = correct + c, total + t
    return {"mqar/accuracy": correct / total if total else float("nan"), "mqar/n": total}

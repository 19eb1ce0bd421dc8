"""MQAR recall accuracy (zoology): argmax accuracy over the queried values of ``MQARDataModule`` batches, per batch
(``mqar_accuracy``), over a loader (``evaluate_mqar``) or after every validation (the ``MQARAccuracy`` callback).
"""

from __future__ import annotations

from collections.abc import Iterable

import lightning as L
import torch
from torch import nn

from diffexp.evals import refuse_sharded_model
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
    if isinstance(data, L.LightningDataModule):
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


class MQARAccuracy(L.Callback):
    """Log ``val/mqar_accuracy`` (argmax recall over the validation loader) after every validation.

    Args:
        max_batches: cap on validation batches scored (None: as many as the trainer's validation ran).
    """

    def __init__(self, max_batches: int | None = None) -> None:
        self.max_batches = max_batches

    def setup(self, trainer, pl_module, stage: str) -> None:
        refuse_sharded_model(trainer, "MQARAccuracy", "diffexp eval mqar <run>/checkpoints/last.ckpt")

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        loaders = trainer.val_dataloaders
        loader = loaders[0] if isinstance(loaders, (list, tuple)) else loaders
        if loader is None:
            return
        limit = self.max_batches
        if limit is None and isinstance(trainer.num_val_batches, list) and trainer.num_val_batches:
            limit = int(trainer.num_val_batches[0]) if trainer.num_val_batches[0] != float("inf") else None
        result = evaluate_mqar(pl_module, loader, device=pl_module.device, max_batches=limit)
        pl_module.log("val/mqar_accuracy", result["mqar/accuracy"], sync_dist=True)

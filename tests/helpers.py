"""Test-only Lightning callbacks, loaded by class path from subprocess runs of the CLI."""

from __future__ import annotations

import json
import os

import lightning as L
import torch


class RecordBatches(L.Callback):
    """Append (step, batch checksum, loss) per training batch to a JSON-lines file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        record = {"step": trainer.global_step - 1, "checksum": int((batch * torch.arange(batch.numel())
                  .view_as(batch)).sum()), "loss": float(outputs["loss"])}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


class KillAtStep(L.Callback):
    """Die like a killed process (no cleanup, no exception handling) once `step` steps are done."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step >= self.step:
            os._exit(137)


class PoisonWeights(L.Callback):
    """Make the loss non-finite from step `step` on."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            with torch.no_grad():
                pl_module.model.final_norm.weight.fill_(float("nan"))


class KillAtFitEnd(L.Callback):
    """Die after the final checkpoint is written but before later callbacks' on_fit_end; keep val/loss."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_fit_end(self, trainer, pl_module) -> None:
        with open(self.path, "w") as f:
            json.dump({"val/loss": float(trainer.callback_metrics["val/loss"]), "step": trainer.global_step}, f)
        os._exit(137)

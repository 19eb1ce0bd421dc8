"""Stop at the first non-finite loss or gradient norm, before it reaches the weights or a checkpoint.

DiffexpLM checks the step's micro-batch train/loss values, then vitals/grad_norm, once per optimizer step and
before it, while the weights and optimizer state are still the step's finite ones: they are saved as
checkpoints/last-finite-step<N>.ckpt and the run stops with NonFiniteError, which says what to change and how to
resume, and carries {"step", "reason"} (`NonFiniteError.divergence`) for a sweep trial to record as "diverged".
"""

from __future__ import annotations

from pathlib import Path
from typing import NoReturn

import lightning as L
import torch

from diffexp import lightning_internals as internals
from diffexp.errors import UserError
from diffexp.training.checkpointing import flush_loggers
from diffexp.training.preemption import stop_requested_locally


class NonFiniteError(UserError):
    """train/loss or vitals/grad_norm became NaN/inf; the last finite state was saved."""

    def __init__(self, message: str, step: int | None = None, quantity: str = "", value: float = float("nan")):
        super().__init__(message)
        self.divergence = {"step": step, "reason": f"{quantity} is {value}"}


def any_rank_stops(trainer: L.Trainer, values: torch.Tensor) -> torch.Tensor:
    """(2,) on the device, the same on every rank: how many ranks hold a NaN or inf in their `values`, and how many
    received a stop signal (diffexp.training.preemption). An all-reduce and no host read: the caller reads it with the
    step's other values; all ranks must stop (and save) together."""
    non_finite = (~torch.isfinite(values)).any().to(values.dtype)
    signalled = values.new_full((), float(stop_requested_locally()))  # a fill on the device, no copy from the host
    return trainer.strategy.reduce(torch.stack([non_finite, signalled]), reduce_op="sum")


def _checkpoint_dir(trainer: L.Trainer) -> Path:
    callback = trainer.checkpoint_callback
    if callback is not None and getattr(callback, "dirpath", None):
        return Path(callback.dirpath)
    return Path(trainer.log_dir or trainer.default_root_dir) / "checkpoints"


def _config_file(trainer: L.Trainer) -> str:
    """The config this run saved (LightningCLI's SaveConfigCallback), to resume with."""
    from lightning.pytorch.cli import SaveConfigCallback

    for callback in trainer.callbacks:
        if isinstance(callback, SaveConfigCallback) and trainer.log_dir is not None:
            return str(Path(trainer.log_dir) / callback.config_filename)
    return "<your config>"


def stop_with_last_finite(trainer: L.Trainer, module: L.LightningModule, quantity: str, value: float,
                          lr: float) -> NoReturn:
    """Save the pre-step state (unless the weights are already non-finite) and raise NonFiniteError.

    Called on every rank at once (see any_rank_stops): under DDP/FSDP saving a checkpoint is collective.
    """
    step = trainer.global_step
    weights_finite = all(bool(torch.isfinite(p).all()) for p in module.parameters())
    weights_finite = bool(trainer.strategy.reduce_boolean_decision(weights_finite, all=True))
    previous = getattr(trainer.checkpoint_callback, "last_model_path", "") or ""
    path = _checkpoint_dir(trainer) / f"last-finite-step{step:06d}.ckpt"
    for logger in trainer.loggers:  # the run diverged here (a sweep records it so)
        logger.log_metrics({"vitals/diverged_step": float(step)}, step=step)
    flush_loggers(trainer)  # the logs up to this step are on disk (with the checkpoint)
    if weights_finite:
        # saved as a batch that ended without an optimizer step (the position of any checkpoint taken at a
        # batch end), so Lightning resumes at the next batch with consistent counters
        internals.count_batch_as_processed(trainer)
        trainer.save_checkpoint(path)
        saved = (f"Saved {path}: the weights and optimizer state from before step {step} and the data position "
                 "after that step's batch, so a run resumed from it skips the batch that failed.")
        resume_from = str(path)
    else:
        saved = ("The weights were already non-finite when the step began, so no checkpoint was saved; "
                 "resume from an earlier one.")
        resume_from = previous or "<an earlier checkpoint>"
    clip = trainer.gradient_clip_val
    if clip:
        clip_advice, new_clip = f"lower trainer.gradient_clip_val (now {clip:g})", clip / 2
    else:
        clip_advice, new_clip = "enable gradient clipping with trainer.gradient_clip_val (e.g. 1.0)", 1.0
    retrace = (f" To retrace the steps before it with the new settings instead, resume from {previous}."
               if previous and weights_finite else "")
    raise NonFiniteError(
        f"{quantity} is {value} at step {step}; training stopped before the optimizer step, so no weights "
        f"were updated with it. {saved} To continue, lower model.optim.lr (now {lr:g}) and {clip_advice}, then "
        f"resume: diffexp fit --config {_config_file(trainer)} --ckpt_path {resume_from} "
        f"--model.optim.lr {lr / 2:g} --trainer.gradient_clip_val {new_clip:g}.{retrace}",
        step=step, quantity=quantity, value=value,
    )

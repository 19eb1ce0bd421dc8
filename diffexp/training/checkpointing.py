"""A run's checkpoints (RunCheckpoint, the CLI's `checkpoint.*`): the best by the monitored metric, and last.ckpt.

Lightning ranks its top-k when its step trigger fires, when val/loss is still the previous validation's; here the
best files are saved at the end of each validation, for the weights that scored. last.ckpt follows the step, time
or epoch trigger and the end of training, after the validation that follows its step. The loggers are flushed
before a checkpoint appears; the step's metrics Lightning has not logged yet travel inside last.ckpt.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
from lightning.fabric.utilities.apply_func import convert_tensors_to_scalars
from lightning.pytorch.trainer.states import TrainerFn

from diffexp import lightning_internals as internals
from diffexp.errors import UserError, invalid
from diffexp.lightning_internals import CheckpointInternals
from diffexp.training.preemption import agree_now, agreed, stop, training_under_way
from diffexp.training.runs import remove_orphan_temp_files


def check_checkpoint_settings(checkpoint: dict[str, Any], trainer: dict[str, Any], subcommand: str) -> None:
    """Refuse the checkpoint.* values ModelCheckpoint refuses with a traceback (two triggers for last.ckpt among
    them: every_n_train_steps has a default, so a time or epoch trigger alone is one too many); in fit, warn when
    the settings leave a run that cannot be resumed (legitimate for a throw-away run)."""
    top_k = checkpoint.get("save_top_k", 1)
    if top_k < -1:
        raise invalid("checkpoint.save_top_k", top_k, "expected -1 (keep every best checkpoint), 0 (none) or the "
                      "number of best checkpoints to keep")
    for key in ("every_n_train_steps", "every_n_epochs"):
        if (checkpoint.get(key) or 0) < 0:
            raise invalid(f"checkpoint.{key}", checkpoint[key], "expected 0 (off) or a positive number")
    triggers = last_checkpoint_triggers(checkpoint)
    if len(triggers) > 1:
        given = " and ".join(f"checkpoint.{key}={value}" for key, value in triggers.items())
        fix = ""
        if "every_n_train_steps" in triggers:
            other = "time" if "train_time_interval" in triggers else "epoch"
            fix = f"; to save by {other} only, add --checkpoint.every_n_train_steps 0 (it is 100 unless set)"
        raise UserError(f"{given}: expected one trigger for last.ckpt{fix}")
    if checkpoint.get("monitor") is None and top_k not in (-1, 0, 1):
        raise invalid("checkpoint.save_top_k", top_k, "with checkpoint.monitor=null there is nothing to rank by: "
                      "expected -1, 0 or 1, or set checkpoint.monitor (val/loss)")
    if subcommand == "fit":
        warning = unresumable(checkpoint, trainer, triggers)
        if warning:
            print(f"warning: {warning}", file=sys.stderr)


def last_checkpoint_triggers(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint.* keys that trigger last.ckpt during training, with their values."""
    triggers = {key: checkpoint.get(key) for key in ("every_n_train_steps", "every_n_epochs")
                if (checkpoint.get(key) or 0) >= 1}
    if checkpoint.get("train_time_interval") is not None:
        triggers["train_time_interval"] = str(checkpoint["train_time_interval"])
    return triggers


def unresumable(checkpoint: dict[str, Any], trainer: dict[str, Any], triggers: dict[str, Any]) -> str | None:
    """Why a fit with these settings cannot be resumed (or not with --ckpt_path last), in one line; None if it can."""
    if trainer.get("enable_checkpointing") is False:
        return ("trainer.enable_checkpointing=false: this run saves no checkpoint (checkpoint.* is ignored), so it "
                "cannot be resumed, evaluated or exported")
    top_k, validates = checkpoint.get("save_top_k", 1), trainer.get("limit_val_batches") != 0
    if not checkpoint.get("save_last"):
        if top_k == 0 or not validates:
            why = "checkpoint.save_top_k=0" if top_k == 0 else "no validation (trainer.limit_val_batches=0)"
            return (f"checkpoint.save_last=false and {why}: this run saves no checkpoint, so it cannot be resumed, "
                    "evaluated or exported")
        return ("checkpoint.save_last=false: no last.ckpt, so this run cannot be resumed with --ckpt_path last, "
                "only from a checkpoint saved at a validation (checkpoint.save_top_k), by its path")
    max_steps, every = trainer.get("max_steps") or -1, triggers.get("every_n_train_steps")
    if every is not None and 0 < max_steps <= every:
        return (f"checkpoint.every_n_train_steps={every} is not below trainer.max_steps={max_steps}: last.ckpt is "
                "written only when training ends, so this run cannot be resumed if it stops before then")
    if not triggers and checkpoint.get("every_n_train_steps") is not None:  # all None: Lightning saves each epoch
        return ("checkpoint.every_n_train_steps=0 and no checkpoint.train_time_interval or checkpoint.every_n_epochs: "
                "last.ckpt is written only when training ends, so this run cannot be resumed if it stops before then")
    return None


def flush_loggers(trainer: L.Trainer) -> None:
    """Write what the loggers buffer (TensorBoard's event queue) to disk."""
    for logger in trainer.loggers:
        logger.save()


def unlogged_step_metrics(trainer: L.Trainer) -> dict[str, Any] | None:
    """The current training step's metrics that Lightning will send to the loggers after the callbacks'
    on_train_batch_end, with the step it will log them at; None when it logs nothing this step.

    Reads Lightning's logger connector (diffexp.lightning_internals).
    """
    if not trainer.loggers or not internals.logs_this_step(trainer):
        return None
    metrics = convert_tensors_to_scalars(internals.pending_step_metrics(trainer))
    if not metrics:
        return None
    step = metrics.pop("step", None)  # as Lightning's log_metrics reads it (DiffexpLM logs it: the steps done)
    if step is None:  # as Lightning's log_metrics falls back
        metrics.setdefault("epoch", trainer.current_epoch)
        step = internals.batches_that_stepped(trainer)
    return {"step": int(step), "metrics": metrics}


class RunCheckpoint(CheckpointInternals):
    """ModelCheckpoint whose best files are saved at validation end and whose last.ckpt follows the
    step, epoch or time trigger. Takes ModelCheckpoint's arguments; `save_last="link"` is refused, since
    last.ckpt is mostly written at steps that have no best file."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.save_last == "link":
            raise invalid("checkpoint.save_last", "link", "expected true or false: last.ckpt is written at "
                          "steps without a best checkpoint to link to")
        self._last_saved_step: int | None = None
        self._last_after_validation: int | None = None  # the step whose last.ckpt waits for its validation
        self._unlogged: dict[str, Any] | None = None  # goes into the last.ckpt being written
        self._replay: dict[str, Any] | None = None  # from the checkpoint this run resumed from

    @property
    def state_key(self) -> str:
        # ModelCheckpoint's key, so checkpoints written before this class existed resume with their state
        return "ModelCheckpoint" + super().state_key[len(type(self).__qualname__):]

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage == "fit" and trainer.is_global_zero and self.dirpath:
            remove_orphan_temp_files(Path(self.dirpath))

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        replay, self._replay = self._replay, None
        if replay and trainer.is_global_zero:  # the points the interrupted run logged after its last save
            for logger in trainer.loggers:
                logger.log_metrics(replay["metrics"], step=replay["step"])
                logger.save()

    # -- when ---------------------------------------------------------------------------------------------
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if 0 < trainer.max_steps <= trainer.global_step and trainer.enable_validation:
            # a stop request makes Lightning validate first: a last step off the validation grid is validated
            # inside fit, so that validation competes for the best file and last.ckpt is written after it
            trainer.should_stop = True
        if self._last_after_validation is not None and self._last_after_validation != trainer.global_step:
            self._last_after_validation = None  # that validation did not run (no batches): nothing waits
        signalled = agreed() and training_under_way()  # the optimizer step is done: every rank agreed to stop
        if self._skip(trainer):
            if signalled:  # last.ckpt of this step exists already (or this run saves none: fast_dev_run)
                stop(trainer, saved=self._last_saved_step == trainer.global_step, why="trainer.fast_dev_run is set")
            return
        if not (signalled or self._step_trigger(trainer)):
            return
        if internals.validation_follows(trainer):  # last.ckpt after it; a signal stops there (on_validation_end)
            self._last_after_validation = trainer.global_step
            return
        self._save_last_with_unlogged(trainer)
        if signalled:
            self.stop_for_signal(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if bool(trainer.fast_dev_run) or trainer.state.fn != TrainerFn.FITTING or trainer.sanity_checking:
            return
        candidates = self.monitor_candidates(trainer)
        self.save_top_k_now(trainer, candidates)  # this validation's value, these weights
        if self._last_after_validation == trainer.global_step:
            self._last_after_validation = None
            self.save_last_now(trainer, candidates)
        if training_under_way() and agree_now(trainer):  # a signal before or during this validation
            self.stop_for_signal(trainer)

    def stop_for_signal(self, trainer: L.Trainer) -> None:
        """A signal's stop at a step's end or after its validation: last.ckpt of this step (unless it exists), the
        summary with the resume command, then Preempted on every rank (diffexp.training.preemption)."""
        if self._last_saved_step != trainer.global_step:
            self._save_last_with_unlogged(trainer)
        saved = bool(self.save_last) and self._last_saved_step == trainer.global_step
        stop(trainer, saved=saved, why=None if saved else "checkpoint.save_last is false")

    def _save_last_with_unlogged(self, trainer: L.Trainer) -> None:
        self._unlogged = unlogged_step_metrics(trainer)
        try:
            self.save_last_now(trainer, self.monitor_candidates(trainer))
        finally:
            self._unlogged = None

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # runs after the epoch's validation and after the last step's metrics went to the loggers
        if self.every_n_epochs >= 1 and (trainer.current_epoch + 1) % self.every_n_epochs == 0:
            if not self._skip(trainer):
                self.save_last_now(trainer, self.monitor_candidates(trainer))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._skip(trainer):  # the final weights, whatever the trigger
            self.save_last_now(trainer, self.monitor_candidates(trainer))

    def _skip(self, trainer: L.Trainer) -> bool:
        return (bool(trainer.fast_dev_run) or trainer.state.fn != TrainerFn.FITTING or trainer.sanity_checking
                or self._last_saved_step == trainer.global_step)

    def _step_trigger(self, trainer: L.Trainer) -> bool:
        if self.every_n_train_steps >= 1 and trainer.global_step % self.every_n_train_steps == 0:
            return True
        if self.train_time_interval is None or self.last_time_checked is None:
            return False
        now = time.monotonic()
        # one decision for all ranks: their clocks differ
        due = trainer.strategy.broadcast(now - self.last_time_checked >= self.train_time_interval.total_seconds())
        if due:
            self.last_time_checked = now
        return due

    # -- how ----------------------------------------------------------------------------------------------
    def after_save_last(self, trainer: L.Trainer) -> None:
        if self.save_last:
            self._last_saved_step = trainer.global_step

    def before_save(self, trainer: L.Trainer) -> None:
        flush_loggers(trainer)  # what was logged so far is on disk before the checkpoint exists

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "unlogged_step_metrics": self._unlogged}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._replay = state_dict.get("unlogged_step_metrics")

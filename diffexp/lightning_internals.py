"""Every use diffexp makes of a private Lightning member, in this one module; nothing else touches one
(tests/test_architecture.py). Each is here because Lightning offers no public way to do what diffexp needs, and
each is exercised against the installed Lightning by tests/test_lightning_internals.py, which fails naming the
member when a release moves it. Checked against Lightning 2.6; pyproject bounds lightning below 2.7.

What and why:
- the logger connector's schedule and pending metrics (`logs_this_step`, `pending_step_metrics`): the shared step
  axis writes per-layer values at the steps Lightning writes `self.log`'s, and last.ckpt carries the metrics
  Lightning has not written yet; Lightning exposes neither;
- the epoch loop's count of stepped batches (`batches_that_stepped`): Lightning's own step axis, which its
  logger connector uses and which lags `global_step` by one after some resumes;
- whether a validation follows the batch that ended (`validation_follows`): last.ckpt is written after it, so it
  holds that validation's result; Lightning decides this inside its loop;
- whether the batch is a micro-batch of an accumulated step (`should_accumulate`);
- marking a batch processed (`count_batch_as_processed`): the non-finite stop saves before the optimizer step
  as a batch that ended without one;
- `ModelCheckpoint`'s save methods and trigger settings (`CheckpointInternals`): RunCheckpoint decides when to
  save itself and reuses ModelCheckpoint's top-k bookkeeping and file naming;
- `ThroughputMonitor`'s reading and writing (`ThroughputInternals`): one reading per optimizer step, a GPU sync
  only where the reading is logged, written at the shared step axis;
- `RichProgressBar`'s metric gathering and train description (`ProgressBarInternals`), and its `leave` and
  console settings (`progress_bar_settings`), which its constructor takes but does not expose;
- `LightningCLI`'s checkpoint-hparams re-parse, trainer construction and subcommand run (`CLIInternals`);
- `ModelParallelStrategy`'s process-group set-up and device mesh (`StrategyInternals`): diffexp's mesh names
  its dimensions for FSDP2 and HSDP.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar, ThroughputMonitor
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import ModelParallelStrategy

# -- the trainer's loops and logger connector --------------------------------------------------------------


def logs_this_step(trainer: L.Trainer) -> bool:
    """Whether Lightning writes the training metrics to the loggers at the end of this batch."""
    return bool(trainer._logger_connector.should_update_logs)


def pending_step_metrics(trainer: L.Trainer) -> dict[str, Any]:
    """The metrics `self.log` gathered this step that Lightning writes to the loggers after on_train_batch_end."""
    return dict(trainer._logger_connector.metrics["log"])


def batches_that_stepped(trainer: L.Trainer) -> int:
    """Lightning's count of training batches that ended with an optimizer step (its loggers' default step)."""
    return int(trainer.fit_loop.epoch_loop._batches_that_stepped)


def validation_follows(trainer: L.Trainer) -> bool:
    """Whether Lightning validates right after the training batch that just ended (its own test)."""
    loop = trainer.fit_loop.epoch_loop
    return not loop._skip_next_val and bool(loop._should_check_val_fx(trainer.fit_loop._data_fetcher))


def should_accumulate(trainer: L.Trainer) -> bool:
    """Whether the batch under way is a micro-batch whose step comes later (gradient accumulation)."""
    return bool(trainer.fit_loop._should_accumulate())


def count_batch_as_processed(trainer: L.Trainer) -> None:
    """Mark the batch under way processed, as at the end of a batch without an optimizer step, so that a checkpoint
    saved now resumes at the next batch with consistent counters."""
    trainer.fit_loop.epoch_loop.batch_progress.increment_processed()


# -- ModelCheckpoint ---------------------------------------------------------------------------------------


class CheckpointInternals(ModelCheckpoint):
    """ModelCheckpoint's private save methods and trigger settings under public names, with two hooks around its
    saves: `after_save_last(trainer)` and `before_save(trainer)`."""

    @property
    def every_n_train_steps(self) -> int:
        return self._every_n_train_steps

    @property
    def every_n_epochs(self) -> int:
        return self._every_n_epochs

    @property
    def train_time_interval(self):
        return self._train_time_interval

    @property
    def last_time_checked(self) -> float | None:
        return self._last_time_checked

    @last_time_checked.setter
    def last_time_checked(self, value: float) -> None:
        self._last_time_checked = value

    def monitor_candidates(self, trainer: L.Trainer) -> dict[str, Any]:
        return self._monitor_candidates(trainer)

    def save_top_k_now(self, trainer: L.Trainer, candidates: dict[str, Any]) -> None:
        self._save_topk_checkpoint(trainer, candidates)

    def save_last_now(self, trainer: L.Trainer, candidates: dict[str, Any]) -> None:
        self._save_last_checkpoint(trainer, candidates)

    def after_save_last(self, trainer: L.Trainer) -> None:
        """After every save of last.ckpt (whatever triggered it)."""

    def before_save(self, trainer: L.Trainer) -> None:
        """Before every checkpoint file this callback writes."""

    def _save_last_checkpoint(self, trainer: L.Trainer, monitor_candidates: dict[str, Any]) -> None:
        super()._save_last_checkpoint(trainer, monitor_candidates)
        self.after_save_last(trainer)

    def _save_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        self.before_save(trainer)
        super()._save_checkpoint(trainer, filepath)


# -- ThroughputMonitor -------------------------------------------------------------------------------------

#: ThroughputMonitor's state that ThroughputInternals reads and updates
THROUGHPUT_STATE = ("_t0s", "_lengths", "_samples", "_batches", "_throughputs", "_module_has_flops")


class ThroughputInternals(ThroughputMonitor):
    """ThroughputMonitor's per-stage counters under public names; its reading (`_update`) and writing (`_compute`)
    call `read(trainer, pl_module, batch, iter_num)` and `write(trainer, iter_num)`, which default to Lightning's."""

    def lightning_reading(self, trainer, pl_module, batch, iter_num: int) -> None:
        super()._update(trainer, pl_module, batch, iter_num)

    def lightning_writing(self, trainer, iter_num: int | None = None) -> None:
        super()._compute(trainer, iter_num)

    def read(self, trainer, pl_module, batch, iter_num: int) -> None:
        self.lightning_reading(trainer, pl_module, batch, iter_num)

    def write(self, trainer, iter_num: int | None = None) -> None:
        self.lightning_writing(trainer, iter_num)

    def _update(self, trainer, pl_module, batch, iter_num: int) -> None:
        self.read(trainer, pl_module, batch, iter_num)

    def _compute(self, trainer, iter_num: int | None = None) -> None:
        self.write(trainer, iter_num)

    def count(self, stage, samples: int, lengths: int, batches: int = 1) -> None:
        """Add a batch to the stage's running counts without a reading."""
        self._samples[stage] += samples
        self._lengths[stage] += lengths
        self._batches[stage] += batches

    def started_at(self, stage) -> float:
        return self._t0s[stage]

    def module_has_flops(self, pl_module) -> bool:
        if self._module_has_flops is None:
            self._module_has_flops = hasattr(pl_module, "flops_per_batch")
        return self._module_has_flops

    def counts(self, stage) -> tuple[int, int, int]:
        """(samples, lengths, batches) so far in the stage."""
        return self._samples[stage], self._lengths[stage], self._batches[stage]

    def stage_throughput(self, stage):
        """The stage's lightning.fabric Throughput (its `update` and `compute` are public)."""
        return self._throughputs[stage]

    def all_throughputs(self):
        return self._throughputs.values()


# -- RichProgressBar ---------------------------------------------------------------------------------------


class ProgressBarInternals(RichProgressBar):
    """RichProgressBar's metric gathering and train description, through `gather_metrics(trainer, pl_module)` and
    `train_description(current_epoch)`, which default to Lightning's."""

    def gather_metrics(self, trainer, pl_module) -> None:
        super()._update_metrics(trainer, pl_module)

    def train_description(self, current_epoch: int) -> str:
        return super()._get_train_description(current_epoch)

    def _update_metrics(self, trainer, pl_module) -> None:
        self.gather_metrics(trainer, pl_module)

    def _get_train_description(self, current_epoch: int) -> str:
        return self.train_description(current_epoch)


def progress_bar_settings(bar: RichProgressBar) -> dict[str, Any]:
    """The constructor arguments a RichProgressBar keeps without exposing: leave and console_kwargs."""
    return {"leave": bar._leave, "console_kwargs": bar._console_kwargs}


# -- LightningCLI ------------------------------------------------------------------------------------------


class CLIInternals(LightningCLI):
    """LightningCLI's private steps under public names: `load_checkpoint_hparams` (Lightning's re-parse of the
    config with a checkpoint's hyperparameters: off by default here), `build_trainer(config, callbacks)` and
    `run_subcommand(name)`."""

    def load_checkpoint_hparams(self) -> None:
        super()._parse_ckpt_path()

    def build_trainer(self, config: dict, callbacks: list) -> L.Trainer:
        return super()._instantiate_trainer(config, callbacks)

    def run_subcommand(self, subcommand: str) -> None:
        super()._run_subcommand(subcommand)

    def _parse_ckpt_path(self) -> None:
        self.load_checkpoint_hparams()

    def _instantiate_trainer(self, config: dict, callbacks: list) -> L.Trainer:
        return self.build_trainer(config, callbacks)

    def _run_subcommand(self, subcommand: str) -> None:
        self.run_subcommand(subcommand)


# -- ModelParallelStrategy ---------------------------------------------------------------------------------


class StrategyInternals(ModelParallelStrategy):
    """ModelParallelStrategy's process-group set-up and device mesh under public names."""

    def setup_distributed(self) -> None:
        self._setup_distributed()

    def use_device_mesh(self, mesh) -> None:
        """The mesh the strategy and its LightningModule (`device_mesh`) report."""
        self._device_mesh = mesh
        self.lightning_module._device_mesh = mesh

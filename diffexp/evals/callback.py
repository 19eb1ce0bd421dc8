"""`Evaluate`: any registered evaluation scored during `diffexp fit`, from its entry alone.

In a recipe:

    trainer:
      callbacks:
        - class_path: diffexp.evals.Evaluate
          init_args: {evaluation: mqar, options: {samples: 200}, every_n_validations: 1}

The options are the ones `diffexp eval NAME --help` lists, by their field names. The inputs are made once at
setup, before any training step, so a bad option stops the fit before it trains. The results' scalars go to the
TensorBoard logger at the optimizer step and into `trainer.callback_metrics` (a sweep's objective or compare
column); their files go to <log_dir>/<name>/step<step>/. Rank 0 scores; under FSDP the weights are sharded outside
the training forward, so it refuses at setup and names the `diffexp eval` command for a checkpoint.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch

from diffexp.errors import UserError
from diffexp.evals.registry import Context, evaluation

log = logging.getLogger(__name__)


def _tensorboard_writer(trainer):
    for logger in trainer.loggers:
        experiment = getattr(logger, "experiment", None)
        if hasattr(experiment, "add_scalar"):
            return experiment
    return None


class Evaluate(L.Callback):
    """Score a registered evaluation while training.

    Args:
        evaluation: its name (`diffexp eval --help` lists them).
        options: its options by field name (the defaults where left out).
        every_n_validations: score after every n-th validation (None: not at validations).
        at_fit_end: also score once when fit ends.
    """

    def __init__(self, evaluation: str, options: dict[str, Any] | None = None,
                 every_n_validations: int | None = 1, at_fit_end: bool = False) -> None:
        super().__init__()
        self.entry = _entry(evaluation)
        if not self.entry.on_fit:
            raise ValueError(f"evaluation {evaluation!r} scores a saved checkpoint only: run diffexp eval "
                             f"{evaluation} <run>/checkpoints/last.ckpt after the fit")
        if every_n_validations is not None and every_n_validations < 1:
            raise ValueError(f"every_n_validations={every_n_validations!r} is invalid: expected >= 1, or null to "
                             "score at the end of fit only (at_fit_end: true)")
        if every_n_validations is None and not at_fit_end:
            raise ValueError("every_n_validations=null with at_fit_end=false never scores; set one of them")
        self.values = dict(options or {})
        self.every, self.at_fit_end = every_n_validations, at_fit_end
        try:
            self.options = self.entry.make_options(self.values, Context({}, {}, 0, command="fit"))
        except UserError as err:
            raise ValueError(f"diffexp.evals.Evaluate(evaluation={evaluation!r}): {err}") from None
        self.inputs = None
        self.last = None
        self._validations = 0

    @property
    def state_key(self) -> str:
        return f"Evaluate[{self.entry.name}]"

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

        if isinstance(trainer.strategy, (FSDPStrategy, ModelParallelStrategy)):
            raise ValueError(f"Evaluate({self.entry.name!r}) cannot run under {type(trainer.strategy).__name__}: "
                             "the weights are sharded outside the training forward. Remove it from "
                             f"trainer.callbacks and evaluate a checkpoint instead: diffexp eval {self.entry.name} "
                             "<run>/checkpoints/last.ckpt")
        if stage == "fit":
            try:
                self.inputs = self.entry.inputs(self.options, self._context(trainer, pl_module))
            except UserError as err:  # its options.<key> words, under the callback that has them, as __init__'s
                raise UserError(f"diffexp.evals.Evaluate(evaluation={self.entry.name!r}): {err}") from None

    def _context(self, trainer: L.Trainer, pl_module: L.LightningModule) -> Context:
        arch = getattr(pl_module, "arch", None)
        arch = asdict(arch) if is_dataclass(arch) else dict(arch or {})
        datamodule = getattr(trainer, "datamodule", None)
        data = dict(getattr(datamodule, "hparams", None) or {})
        return Context(arch=arch, data={k: v for k, v in data.items() if not k.startswith("_")},
                       step=trainer.global_step, device=pl_module.device, command="fit",
                       fit_tokenizer=getattr(datamodule, "tokenizer", None))

    def score(self, trainer: L.Trainer, pl_module: L.LightningModule):
        """Score now (rank 0), log and save; returns the results (None on other ranks)."""
        if trainer.global_rank != 0:
            return None
        context = self._context(trainer, pl_module)
        if self.inputs is None:
            self.inputs = self.entry.inputs(self.options, context)
        results = self.entry.score(pl_module, self.inputs, self.options, context)
        step = trainer.global_step
        writer = _tensorboard_writer(trainer)
        if writer is not None:
            from diffexp.evals.run import publish

            publish(results, writer, step)
        for tag, value in results.scalars().items():
            trainer.callback_metrics[tag] = torch.tensor(float(value))
        if trainer.log_dir is not None:
            results.save(Path(trainer.log_dir) / results.name / f"step{step:06d}")
        print(results.summary())
        self.last = results
        return results

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or self.every is None:
            return
        self._validations += 1
        if (self._validations - 1) % self.every == 0:
            self.score(trainer, pl_module)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.at_fit_end:
            self.score(trainer, pl_module)


def _entry(name: str):
    try:
        return evaluation(name)
    except UserError as err:
        raise ValueError(str(err)) from None

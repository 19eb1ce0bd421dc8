"""The callback a sweep adds to each trial's `fit`: progress, pruning reports, HParams, trial.json.

A diverged run is recorded with the state "diverged", a result the runner does not retry. The storage URL
comes through the environment, so a password in it is written nowhere. The callback needs the storage only for
a pruner's reports: a report the storage cannot take (it is away) is skipped, and the run trains on.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import optuna
from lightning.pytorch.loggers import TensorBoardLogger

from diffexp.errors import UserError
from diffexp.sweep.layout import TRIAL_FILE
from diffexp.sweep.records import STORAGE_ENV, NoSpaceError, no_space_message, write_json_atomic  # noqa: F401
from diffexp.sweep.runs import CONFIG_FILE, saved_config_values
from diffexp.training.diagnostics import diverged_at
from diffexp.training.hparams import write_row

#: last values that say nothing about a run's result (tokens/s is recorded as a median instead)
NOT_RESULTS = {"train/lr", "lr", "epoch", "step", "vitals/throughput/tokens_per_s",
               "vitals/grad_norm"}  # "step": where val logs


def build_pruner(spec: dict[str, Any]) -> optuna.pruners.BasePruner:
    kind = spec.get("type", "none")
    options = {k: v for k, v in spec.items() if k != "type"}
    if kind == "median":
        return optuna.pruners.MedianPruner(**options)
    if kind == "percentile":
        return optuna.pruners.PercentilePruner(**options)
    if kind == "hyperband":
        return optuna.pruners.HyperbandPruner(**options)
    return optuna.pruners.NopPruner()


class SweepTrialCallback(L.Callback):
    """Reports to the Optuna trial by global step and records the trial's outcome in its run directory.

    Args:
        study: Optuna study name.
        trial_id: storage id of this trial.
        case: table row name.
        seed: the trial's seed.
        overrides: the dotted overrides that define this trial (case, grid, search, shared).
        hparam_keys: dotted keys any trial of the study sets; this trial records its own value of each
            (from its saved config), so rows that keep a recipe's value are not blank in the HParams table.
        metric: the objective metric, reported after each validation.
        pruner: the sweep's pruner spec ({"type": "median", ...}).
    """

    def __init__(self, study: str, trial_id: int, case: str, seed: int, overrides: dict[str, Any],
                 hparam_keys: list[str] | None = None, metric: str = "val/loss",
                 pruner: dict[str, Any] | None = None) -> None:
        self.study_name, self.trial_id, self.case, self.seed = study, trial_id, case, seed
        self.overrides, self.metric, self.pruner_spec = overrides, metric, pruner or {"type": "none"}
        self.hparam_keys = list(hparam_keys or [])
        self.pruned = False
        self._trial: optuna.Trial | None = None
        self._tokens_per_s: list[float] = []
        self._start = time.time()
        # results of the last validation, kept in the checkpoint: a run killed after its final checkpoint
        # but before writing trial.json resumes at max_steps, validates nothing and still needs them
        self._validated: dict[str, float] = {}
        self._validated_step: int | None = None
        # the training metrics at the end of fit: the CLI's final validation starts a new metric collection
        self._trained: dict[str, float] = {}

    def state_dict(self) -> dict[str, Any]:
        return {"validated": self._validated, "validated_step": self._validated_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._validated = dict(state_dict.get("validated", {}))
        self._validated_step = state_dict.get("validated_step")

    def _optuna_trial(self) -> optuna.Trial | None:
        url = os.environ.get(STORAGE_ENV)
        if url is None or self.pruner_spec.get("type", "none") == "none":
            return None
        if self._trial is None:
            from diffexp.sweep.outages import outage_of
            from diffexp.sweep.storage import open_storage

            try:
                study = optuna.load_study(study_name=self.study_name, storage=open_storage(url),
                                          pruner=build_pruner(self.pruner_spec))
                self._trial = optuna.Trial(study, self.trial_id)
            except Exception as exc:
                if outage_of(exc) is None and not isinstance(exc, UserError):
                    raise
                print(f"sweep: the storage cannot be reached for pruning reports ({type(exc).__name__}); "
                      "trying again at the next validation, training goes on", file=sys.stderr, flush=True)
                return None
        return self._trial

    def on_fit_start(self, trainer, pl_module) -> None:
        self._start = time.time()

    def _run_dir(self, trainer: L.Trainer) -> Path:
        return Path(trainer.log_dir)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        value = trainer.callback_metrics.get("vitals/throughput/tokens_per_s")
        if value is not None:
            self._tokens_per_s.append(float(value))
        if trainer.is_global_zero and trainer.global_step % 5 == 0:
            write_json_atomic(self._run_dir(trainer) / "progress.json",
                              {"step": trainer.global_step, "max_steps": trainer.max_steps})

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        self._validated, self._validated_step = _scalar_results(trainer), trainer.global_step
        if trainer.state.fn == "validate":  # the CLI's validation of the final weights, after fit
            self._write_record(trainer, pl_module)
            return
        if not trainer.is_global_zero:
            return
        value = trainer.callback_metrics.get(self.metric)
        trial = self._optuna_trial()
        if value is None or trial is None:
            return
        try:
            trial.report(float(value), step=trainer.global_step)  # by step: an epoch may hold many validations
            prune = trial.should_prune()
        except Exception as exc:
            from diffexp.sweep.outages import outage_of

            if outage_of(exc) is None:
                raise
            print(f"sweep: the storage did not take the report of step {trainer.global_step} "
                  f"({type(exc).__name__}); no pruning decision at this validation, training goes on",
                  file=sys.stderr, flush=True)
            return
        if prune:
            self.pruned = True
            trainer.should_stop = True

    def on_train_end(self, trainer, pl_module) -> None:
        self._trained = _scalar_results(trainer)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        divergence = diverged_at(trainer, exception)
        if divergence is not None:  # a result, not a crash: recorded so, and the runner does not retry it
            self._trained = _scalar_results(trainer)
            self._write_record(trainer, pl_module, exception)

    def on_fit_end(self, trainer, pl_module) -> None:
        needs_validation = getattr(pl_module, "needs_final_validation", None)
        if needs_validation is not None and needs_validation():
            return  # the CLI validates the final weights next; the record is written then
        self._write_record(trainer, pl_module)

    def _write_record(self, trainer, pl_module, exception: BaseException | None = None) -> None:
        if not trainer.is_global_zero:
            return
        metrics = {**self._trained, **self._validated, **_scalar_results(trainer)}
        divergence = diverged_at(trainer, exception)
        state = "diverged" if divergence is not None else "pruned" if self.pruned else "complete"
        if divergence is not None:
            metrics["vitals/diverged_step"] = float(divergence["step"])
        params = pl_module.model.parameter_report() if hasattr(pl_module, "model") else {}
        tokens_per_s = statistics.median(self._tokens_per_s) if self._tokens_per_s else None
        record = {"study": self.study_name, "case": self.case, "seed": self.seed, "overrides": self.overrides,
                  "params": params, "metrics": metrics, "tokens_per_s": tokens_per_s,
                  "state": state, "global_step": trainer.global_step,
                  "wall_s": time.time() - self._start, "trial_id": self.trial_id,
                  "validated_step": self._validated_step,
                  "diverged_step": None if divergence is None else divergence["step"],
                  "divergence": None if divergence is None else divergence["reason"]}
        run_dir = self._run_dir(trainer)
        record["case_slug"] = run_dir.parent.name
        if isinstance(trainer.logger, TensorBoardLogger):  # the HParams dashboard: one row per trial
            # its columns: case, seed and the varied keys first (marked as telling trials apart), then the size
            # and the spec's other keys; its metrics: the run's own val/ and train/loss curves, no copies of them
            saved = saved_config_values(run_dir / CONFIG_FILE, self.hparam_keys)
            columns = {"case": self.case, "seed": self.seed, **self.overrides, "params/total": params.get("total", 0),
                       **{k: v for k, v in saved.items() if k not in self.overrides}}
            tags = [k for k in metrics if k.startswith(("val/", "train/loss"))]
            write_row(trainer.logger, {k: _hparam_value(v) for k, v in columns.items()}, metrics=tags,
                      leading=2 + len(self.overrides))
        write_json_atomic(run_dir / TRIAL_FILE, record)


def _scalar_results(trainer: L.Trainer) -> dict[str, float]:
    return {k: float(v) for k, v in trainer.callback_metrics.items()
            if getattr(v, "numel", lambda: 1)() == 1 and k not in NOT_RESULTS and not k.startswith("vitals/layer_")}


def _hparam_value(value: Any) -> Any:
    # default=str: an override jsonargparse built into an object (a callback class_path) is shown by its repr
    return value if isinstance(value, (int, float, str, bool)) else json.dumps(value, default=str)

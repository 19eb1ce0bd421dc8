"""Every `diffexp fit` as one row of TensorBoard's HParams tab: its variant, the `model.arch` flags that variant reads
and its parameter counts, with its final and best `val/loss`, last train loss and median tokens/s as the row's
metrics.

The row's header and settings (the hparams plugin's experiment and session-start summaries) are written once per
run directory, when training starts, so a run that stops early still shows its settings; checkpoints remember that
they were written, so a resumed run adds no second copy. The final val/loss and the last train loss are the latest
points of the curves themselves; the best val/loss and the median tokens/s are written when fit ends (after the
final validation), beside them in `val/` and `train/`: the tab shows a metric's latest value, so a resumed run's row
ends with its new results. Runs with `trainer.enable_autolog_hparams` false (a sweep's trials, which write their own
row) write none.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger

from diffexp.model.attention.registry import variant
from diffexp.model.config import SHARED_FLAGS
from diffexp.secrets import mask_secrets
from diffexp.training.report import RunReport

#: the row's metrics: the curves' latest points, and two scalars written when fit ends
FINAL_VAL_LOSS = "val/loss"
BEST_VAL_LOSS = "val/loss_best"
TRAIN_LOSS = "train/loss"
TOKENS_PER_S = "vitals/throughput/tokens_per_s_median"
METRICS = (FINAL_VAL_LOSS, BEST_VAL_LOSS, TRAIN_LOSS, TOKENS_PER_S)


def hparam_value(value: Any, as_text: bool = False) -> int | float | str:
    """`value` as an HParams column takes it: a number as it is (as text with as_text), anything else as text
    (true/false and null as a recipe writes them, lists and mappings as JSON), with any password masked.
    TensorBoard drops None (the column would go missing) and refuses lists and mappings."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not as_text:
        return value
    if isinstance(value, str):
        text = value
    elif value is None or isinstance(value, (bool, list, tuple, dict)):
        text = json.dumps(value, default=str)  # default=str: an object inside (a class_path jsonargparse built)
    else:
        text = str(value)
    return mask_secrets(text)


def run_columns(pl_module: L.LightningModule) -> dict[str, int | float | str]:
    """The row's settings: `model.arch.attention`, then the flags the variant declares (its registry entry), then
    the shared flags, as `model.arch.<flag>`, and `params/<kind>` (parameter_report); no flag the variant does not
    read. The HParams tab shows five columns of a header until others are ticked, those marked as telling runs apart
    first (write_row's `leading`): the variant and its own flags. A column holds one type in every run: a flag that
    may be null or a word (n_kv_heads, lambda_init) is text even where it is a number."""
    arch = pl_module.arch
    own = variant(arch.attention).flags
    shared = [flag for flag in SHARED_FLAGS if flag.name != "attention" and flag.name not in {f.name for f in own}]
    ordered = [next(flag for flag in SHARED_FLAGS if flag.name == "attention"), *own, *shared]
    columns = {}
    for flag in ordered:
        numeric = flag.type in (int, float)
        columns[f"model.arch.{flag.name}"] = hparam_value(getattr(arch, flag.name), as_text=not numeric)
    return {**columns, **{f"params/{k}": v for k, v in pl_module.model.parameter_report().items()}}


def write_row(logger: TensorBoardLogger, columns: dict[str, int | float | str], metrics=METRICS,
              leading: int = 0) -> None:
    """The hparams plugin's experiment (the columns and metric tags) and session start (this run's values), as
    Lightning's log_hyperparams writes them, without its placeholder metric values at step 0. The first `leading`
    columns are marked as the ones that tell runs apart (the plugin's `differs`): the tab lists those first and
    shows five columns until others are ticked."""
    from tensorboard.plugins.hparams import plugin_data_pb2
    from torch.utils.tensorboard.summary import hparams

    experiment, session_start, _ = hparams(columns, dict.fromkeys(metrics, 0.0))  # only the metric names are used
    shown = set(list(columns)[:leading])
    value = experiment.value[0]
    data = plugin_data_pb2.HParamsPluginData.FromString(value.metadata.plugin_data.content)
    for info in data.experiment.hparam_infos:
        info.differs = info.name in shown
    value.metadata.plugin_data.content = data.SerializeToString()
    write_summaries(logger.experiment, [experiment, session_start])


def write_summaries(experiment, summaries: list) -> None:
    """`summaries` (Summary protos) into an event file in the run directory of the SummaryWriter `experiment`, where
    the HParams tab reads a run's row (its add_hparams would write them to a subdirectory, a run of their own, with
    placeholder metric values). Through the writer's `file_writer`, the FileWriter of its open event file (the
    attribute add_hparams itself writes through), or, once the logger closed it (a validation after fit), a
    FileWriter of their own in that directory: a new event file, as the SummaryWriter opens for its next value."""
    from torch.utils.tensorboard.writer import FileWriter

    writer = experiment.file_writer
    own = writer is None
    if own:
        writer = FileWriter(experiment.get_logdir())
    for summary in summaries:
        writer.add_summary(summary)
    if own:
        writer.close()


class RunHParams(L.Callback):
    """Writes the run's HParams row when training starts and its results when fit ends (see the module)."""

    def __init__(self) -> None:
        self.recorded_in: str | None = None  # the run directory whose row is written
        self.val_loss: float | None = None  # the last validation's, and the lowest of the run (resumes included)
        self.best_val_loss: float | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"recorded_in": self.recorded_in, "val_loss": self.val_loss, "best_val_loss": self.best_val_loss}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.recorded_in = state_dict.get("recorded_in")
        self.val_loss, self.best_val_loss = state_dict.get("val_loss"), state_dict.get("best_val_loss")

    def on_train_start(self, trainer, pl_module) -> None:  # after a resume restored this callback's state
        self._write_row(trainer, pl_module)

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        loss = trainer.callback_metrics.get("val/loss")
        if loss is not None:
            self.val_loss = float(loss)
            if self.best_val_loss is None or self.val_loss < self.best_val_loss:
                self.best_val_loss = self.val_loss
        if trainer.state.fn == "validate":  # the CLI's validation of the final weights, after fit
            self._write_results(trainer, pl_module)

    def on_fit_end(self, trainer, pl_module) -> None:
        needs_validation = getattr(pl_module, "needs_final_validation", None)
        if needs_validation is None or not needs_validation():  # else the results follow that validation
            self._write_results(trainer, pl_module)

    def _logger(self, trainer: L.Trainer) -> TensorBoardLogger | None:
        if not trainer.is_global_zero or not getattr(trainer, "enable_autolog_hparams", True):  # Lightning >= 2.5
            return None
        return next((logger for logger in trainer.loggers if isinstance(logger, TensorBoardLogger)), None)

    def _write_row(self, trainer, pl_module) -> None:
        logger = self._logger(trainer)
        if logger is None:
            return
        run_dir = str(Path(logger.log_dir).resolve())
        if self.recorded_in != run_dir:  # a resumed run's row is there already
            write_row(logger, run_columns(pl_module), leading=1 + len(variant(pl_module.arch.attention).flags))
            self.recorded_in = run_dir

    def _write_results(self, trainer, pl_module) -> None:
        logger = self._logger(trainer)
        if logger is None:
            return
        self._write_row(trainer, pl_module)  # a resume that trained no step has not written it
        report = next((c for c in trainer.callbacks if isinstance(c, RunReport)), None)  # the closing summary's
        results = {BEST_VAL_LOSS: self.best_val_loss,  # val/loss and train/loss: their curves' latest points
                   TOKENS_PER_S: report.median_tokens_per_s() if report else None}
        logger.log_metrics({k: v for k, v in results.items() if v is not None}, step=trainer.global_step)

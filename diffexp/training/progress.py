"""Lightning's rich progress bar, labelled for step-based runs."""

from __future__ import annotations

import math
from time import monotonic

from lightning.pytorch.callbacks import RichProgressBar

from diffexp.lightning_internals import ProgressBarInternals, progress_bar_settings


class StepProgressBar(ProgressBarInternals):
    """Runs bounded by max_steps have max_epochs = -1, which Lightning's bar shows as "Epoch 0/-2".

    After a training batch, the metrics shown are gathered again only when the bar is due to redraw (every
    1 / refresh_rate seconds): Lightning gathers them after every batch, from a result collection it walks
    whole, while its refresh thread draws a few times a second at most.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._metrics_gathered_at = -math.inf
        self._after_train_batch = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._after_train_batch = True
        try:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        finally:
            self._after_train_batch = False

    def gather_metrics(self, trainer, pl_module) -> None:
        now = monotonic()
        due = self.refresh_rate <= 0 or now - self._metrics_gathered_at >= 1 / self.refresh_rate
        if self._after_train_batch and not due:
            return  # the next redraw is not due yet; epoch and validation ends always gather
        self._metrics_gathered_at = now
        super().gather_metrics(trainer, pl_module)

    def get_metrics(self, trainer, pl_module):
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)  # the logger's version number is not a metric
        # the last optimizer step's loss, already on the host (DiffexpLM reads it with the step's finite check):
        # train/loss is logged only every trainer.log_every_n_steps and not to the bar, where Lightning would read
        # the device tensor at every redraw (waiting for the GPU)
        loss = getattr(pl_module, "shown_train_loss", None)
        if loss is not None:
            metrics["train/loss"] = f"{loss:.3f}"
        return metrics

    def train_description(self, current_epoch: int) -> str:
        max_epochs = self.trainer.max_epochs
        if max_epochs is None or max_epochs >= 0:
            return super().train_description(current_epoch)
        width = len(self.validation_description)  # padded like Lightning's, so the bars do not flicker
        return f"{f'Epoch {current_epoch}':{width}}"


#: redraws per second of the bar Lightning adds by default: Lightning's own (100) redraws after every step, on a
#: thread that takes a core from training; twice a second is enough to read.
DEFAULT_REFRESH_RATE = 2


def use_step_progress_bar(trainer, configured_callbacks=()) -> None:
    """Swap a plain RichProgressBar for StepProgressBar: one in `configured_callbacks` (trainer.callbacks as the
    user configured them) keeps its settings; Lightning's default one redraws DEFAULT_REFRESH_RATE times a second."""
    configured = {id(callback) for callback in configured_callbacks}
    for i, bar in enumerate(trainer.callbacks):
        if type(bar) is RichProgressBar:
            rate = bar.refresh_rate if id(bar) in configured else DEFAULT_REFRESH_RATE
            trainer.callbacks[i] = StepProgressBar(refresh_rate=rate, theme=bar.theme, **progress_bar_settings(bar))

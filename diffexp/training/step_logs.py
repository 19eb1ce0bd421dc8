"""When a training step's metrics reach the loggers, and a way to write many of them cheaply.

Reads Lightning's logger connector and epoch loop (private; checked against Lightning 2.6).
"""

from __future__ import annotations


def logs_this_step(trainer) -> bool:
    """Whether Lightning writes this training step's metrics to the loggers (every trainer.log_every_n_steps)."""
    return trainer._logger_connector.should_update_logs


def write_to_loggers(trainer, metrics: dict[str, float]) -> None:
    """Write `metrics` to the loggers now, at the step index Lightning gives this training step's own metrics.

    For values measured now and then, dozens at a time (per layer, per head): through `self.log` each costs
    about 0.2 ms, every key logged stays in Lightning's result collection, which each later step walks again
    (the progress bar's metrics, `callback_metrics`), and Lightning writes a value logged off its logging
    steps at the next one, then again at every one after. Values written here are not in
    `trainer.callback_metrics`. They are on disk before a checkpoint of this step is (RunCheckpoint flushes the
    loggers first), so a resumed run has them without a replay.
    """
    if not metrics:
        return
    step = trainer.fit_loop.epoch_loop._batches_that_stepped  # increments after the step's metrics are logged
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)

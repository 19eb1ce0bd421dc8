"""When a training step's metrics reach the loggers, at which step, and a way to write many of them cheaply.

Every metric of a run shares one step axis: the optimizer steps done when it was measured, so the 10th step's
train loss and a validation after 10 steps both sit at step 10. TensorBoard lists groups of tags by name:
`train/` and `val/` hold what a person reads first; everything else a run watches is under VITALS, which sorts
after them.

Lightning's logger schedule and its count of stepped batches come through diffexp.lightning_internals.
"""

from __future__ import annotations

import weakref

from diffexp import lightning_internals as internals

#: the prefix of the training diagnostics, lambda traces and throughput readings (after "train/" and "val/")
VITALS = "vitals/"


#: per trainer, optimizer steps done minus Lightning's count of stepped batches at the start of fit: 0 in a new run,
#: and 1 after resuming from a checkpoint written where Lightning does not correct its count (at a validation's end)
_OFFSETS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def note_fit_start(trainer) -> None:
    """At the start of fit (on_train_start), after a resume restored Lightning's loops: align the step axis."""
    _OFFSETS[trainer] = trainer.global_step - internals.batches_that_stepped(trainer)


def logged_step(trainer) -> int:
    """The step axis value of the training step under way: the optimizer steps done once it is (Lightning counts
    the step only after its metrics are logged), the same before and after a resume."""
    return internals.batches_that_stepped(trainer) + 1 + _OFFSETS.get(trainer, 0)


def logs_this_step(trainer) -> bool:
    """Whether this training step logs its per-step metrics: at the steps Lightning writes to the loggers (every
    trainer.log_every_n_steps), and at the run's last step (trainer.max_steps), so that `callback_metrics`, where
    sweeps read a run's results, ends with the last step's values and not those of an earlier logging step."""
    if internals.logs_this_step(trainer):
        return True
    # the same for every micro-batch of the step: Lightning counts the step after its metrics are logged
    return 0 < trainer.max_steps <= logged_step(trainer)


def write_to_loggers(trainer, metrics: dict[str, float]) -> None:
    """Write `metrics` to the loggers now, at the step this training step's own metrics are logged at.

    For values measured now and then, dozens at a time (per layer, per head): every key `self.log` takes stays in
    Lightning's result collection, walked again at each later step, and is written again at every logging step.
    They are not in `trainer.callback_metrics`, and are on disk before a checkpoint of this step is."""
    if not metrics:
        return
    step = logged_step(trainer)
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)

"""fit's checks of trainer.* values that need nothing built, without Lightning: `diffexp fit` runs them before any
work (diffexp.training.preflight), and `diffexp params` on every recipe it reads (diffexp.training.recipe), so that
it gives no figures for a recipe fit refuses.
"""

from __future__ import annotations

from typing import Any, Union

from diffexp.errors import invalid

#: the Trainer arguments check_trainer reads, with the types fit's parser holds them as (Lightning's annotations)
CHECKED_TYPES = {
    "max_steps": int,
    "max_epochs": Union[int, None],
    "gradient_clip_val": Union[int, float, None],
    "accumulate_grad_batches": int,
    "log_every_n_steps": Union[int, None],
    "val_check_interval": Union[int, float, None],
    "limit_train_batches": Union[int, float, None],
    "limit_val_batches": Union[int, float, None],
    "limit_test_batches": Union[int, float, None],
}


def check_trainer(trainer: dict[str, Any], subcommand: str) -> None:
    """Refuse a trainer value fit cannot run with (each key of CHECKED_TYPES, where set)."""
    if subcommand == "fit":
        max_steps, max_epochs = trainer.get("max_steps"), trainer.get("max_epochs")
        if max_steps is not None and max_steps != -1 and max_steps <= 0:
            raise invalid("trainer.max_steps", max_steps, "expected a positive number of optimizer steps "
                          "(or -1 together with a positive trainer.max_epochs)")
        if max_steps in (None, -1) and (max_epochs is None or max_epochs <= 0):
            raise invalid("trainer.max_steps", max_steps, "expected a positive number of optimizer steps; "
                          "without it, give a positive trainer.max_epochs")
    clip = trainer.get("gradient_clip_val")
    if clip is not None and not clip >= 0:
        raise invalid("trainer.gradient_clip_val", clip, "expected a number >= 0 (0 or null: no clipping)")
    accumulate = trainer.get("accumulate_grad_batches")
    if accumulate is not None and accumulate < 1:
        raise invalid("trainer.accumulate_grad_batches", accumulate, "expected a positive integer")
    every = trainer.get("log_every_n_steps")
    if every is not None and every < 1:
        raise invalid("trainer.log_every_n_steps", every, "expected a positive integer")
    interval = trainer.get("val_check_interval")
    if interval is not None and not interval > 0:
        raise invalid("trainer.val_check_interval", interval,
                      "expected a positive number of steps (int) or fraction of an epoch (float)")
    for key in ("limit_train_batches", "limit_val_batches", "limit_test_batches"):
        value = trainer.get(key)
        if value is not None and value < 0:
            raise invalid(f"trainer.{key}", value, "expected a number >= 0")

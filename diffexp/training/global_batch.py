"""`global_batch.rows`: the sequences per optimizer step over all ranks, kept whatever the number of processes.

Lightning's step is data.batch_size x ranks x trainer.accumulate_grad_batches rows, so a recipe on 4 GPUs instead
of 8 would silently train on half the tokens per step; with global_batch.rows the accumulation follows from the
world size. The training order is cut into the same global batches at any world size, so a resume may change the
world size or data.batch_size while the global batch stays (`resumed_layout` moves Lightning's batch counters).
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_info

from diffexp.errors import UserError, invalid


def accumulation_for(rows: int, micro_batch: int, world_size: int) -> int:
    """Micro-batches each rank accumulates per step so that the ranks' rows add up to `rows`."""
    per_micro_step = micro_batch * world_size
    if rows % per_micro_step:
        below = rows // per_micro_step * per_micro_step
        nearby = ", ".join(str(n) for n in (below, below + per_micro_step) if n > 0)
        raise UserError(f"global_batch.rows={rows}: {world_size} process(es) x data.batch_size {micro_batch} read "
                        f"{per_micro_step} rows per micro-step, which does not divide {rows}; use a multiple of "
                        f"{per_micro_step} (e.g. {nearby}), or devices and a data.batch_size whose product divides "
                        f"{rows}")
    return rows // per_micro_step


class GlobalBatch(L.Callback):
    """Args:
    rows: sequences per optimizer step over all ranks; trainer.accumulate_grad_batches is then derived at
        launch (rows / (ranks x data.batch_size)) and must not be set as well, and an integer
        trainer.val_check_interval counts optimizer steps (Lightning counts micro-batches), so validation
        falls on the same steps whatever the number of processes. null: Lightning's data.batch_size x ranks x
        trainer.accumulate_grad_batches.
    """

    def __init__(self, rows: int | None = None) -> None:
        if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
            raise invalid("global_batch.rows", rows, "expected a positive integer (sequences per optimizer step, "
                          "all ranks together) or null")
        self.rows = rows

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.rows is None or stage != "fit":
            return
        micro_batch = getattr(getattr(trainer, "datamodule", None), "batch_size", None)
        if micro_batch is None:
            raise UserError("global_batch.rows needs a data module with a batch_size (data.batch_size)")
        accumulate = accumulation_for(self.rows, int(micro_batch), trainer.world_size)
        trainer.accumulate_grad_batches = accumulate  # read by the fit loop and estimated_stepping_batches
        if isinstance(trainer.val_check_interval, int):  # Lightning counts micro-batches: keep it in steps
            trainer.val_check_interval *= accumulate
        rank_zero_info(f"global batch: {self.rows} rows per step = {trainer.world_size} process(es) x "
                       f"data.batch_size {micro_batch} x {accumulate} accumulated micro-batch(es)")


# what makes up the rows of one optimizer step, as the user writes it
GLOBAL_BATCH = "global batch (data.batch_size x world size x trainer.accumulate_grad_batches)"


def saved_layout(checkpoint: dict[str, Any]) -> tuple[int, int, int] | None:
    """(data.batch_size, world size, accumulation) of the run that wrote a checkpoint; None where it does not say."""
    run = checkpoint.get("diffexp_run") or {}
    micro_batch = run.get("batch_size") or (checkpoint.get("datamodule_hyper_parameters") or {}).get("batch_size")
    layout = (micro_batch, run.get("world_size"), run.get("accumulate_grad_batches"))
    return layout if all(isinstance(v, int) and not isinstance(v, bool) for v in layout) else None


def describe(layout: tuple[int, int, int]) -> str:
    micro_batch, world_size, accumulate = layout
    return f"{micro_batch * world_size * accumulate} rows ({micro_batch} x {world_size} x {accumulate})"


def resumed_layout(checkpoint: dict[str, Any], trainer: L.Trainer) -> None:
    """Refuse a resume whose global batch differs from the checkpoint's; where only data.batch_size or the world
    size changed, rescale the fit loop's batch counters in `checkpoint` (before Lightning restores them) from the
    saved micro-batches to this run's, so accumulation and epoch ends fall where the global order puts them."""
    saved = saved_layout(checkpoint)
    micro_batch = getattr(getattr(trainer, "datamodule", None), "batch_size", None)
    if saved is None or not isinstance(micro_batch, int):  # cannot tell: only the same world size is safe
        world_size = (checkpoint.get("diffexp_run") or {}).get("world_size")
        if world_size and world_size != trainer.world_size:
            raise UserError(f"--ckpt_path: cannot resume: the checkpoint was written by {world_size} process(es), "
                            f"this run has {trainer.world_size} (trainer.num_nodes x trainer.devices), and the "
                            f"checkpoint does not record its data.batch_size, so the global batch cannot be kept. "
                            f"Resume with {world_size}.")
        return
    now = (micro_batch, trainer.world_size, trainer.accumulate_grad_batches)
    rows = saved[0] * saved[1] * saved[2]
    if now[0] * now[1] * now[2] != rows:
        raise UserError(f"--ckpt_path: cannot resume: the {GLOBAL_BATCH} of the checkpoint's run is {describe(saved)}"
                        f", this run's is {describe(now)}; another global batch would train on other data with "
                        f"other steps. Resume with --global_batch.rows {rows} (the accumulation then follows from "
                        f"the number of processes and data.batch_size).")
    saved_micro, micro = saved[0] * saved[1], now[0] * now[1]
    progress = ((checkpoint.get("loops") or {}).get("fit_loop") or {}).get("epoch_loop.batch_progress")
    if saved_micro == micro or not progress:
        return
    current, total = progress["current"], progress["total"]
    served = current["ready"] * saved_micro  # rows of this epoch's global order all ranks have read
    if served % micro:
        raise UserError(f"--ckpt_path: cannot resume: the checkpoint was saved after {served} rows of its epoch, "
                        f"not a whole number of this run's micro-steps of {micro} rows (data.batch_size {now[0]} x "
                        f"world size {now[1]}); resume with the saved data.batch_size {saved[0]} and world size "
                        f"{saved[1]}, or a checkpoint saved on an optimizer step.")
    earlier = (total["ready"] - current["ready"]) * saved_micro // micro  # finished epochs' batches, rescaled
    shift_current, shift_total = served // micro - current["ready"], earlier + served // micro - total["ready"]
    for key in ("ready", "started", "processed", "completed"):  # their differences say where the save happened
        current[key] += shift_current
        total[key] += shift_total

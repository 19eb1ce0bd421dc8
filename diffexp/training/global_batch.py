"""`global_batch.rows`: the sequences per optimizer step over all ranks, kept whatever the number of processes.

Lightning's step is data.batch_size x ranks x trainer.accumulate_grad_batches rows, so the same recipe on 4 GPUs
instead of 8 would silently train on half the tokens per step. With global_batch.rows set, the accumulation is
derived at launch from the world size, and a world size that cannot make up the global batch is refused.
"""

from __future__ import annotations

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

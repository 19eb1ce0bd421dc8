"""A training DataLoader whose order depends on the seed alone, whatever the number of processes, and that
resumes mid-epoch, at another world size too.

Epoch ``e`` is a permutation of the N rows seeded by ``seed + e``, cut into global batches of G rows (one
optimizer step over all ranks; the last N mod G rows dropped); rank r of W takes positions r, r + W, ... of each.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from diffexp.errors import UserError


def training_order_seed(order_seed: int | None, data_seed: int) -> int:
    """The seed of the training order: ``data.order_seed`` when set, else the run's seed (``seed_everything``,
    which Lightning records in ``PL_GLOBAL_SEED`` before the data module is built), else ``data.seed``.

    Following the run's seed is what makes a sweep's seeds vary the data order as well as the weights, while the
    cases of one seed still read the same batches (paired). A resume reads the saved run's config, so the same
    seed; a checkpoint records the order seed and refuses another."""
    if order_seed is not None:
        return int(order_seed)
    run_seed = os.environ.get("PL_GLOBAL_SEED")
    return int(run_seed) if run_seed is not None else int(data_seed)


class PackedRows(Dataset):
    """Rows of token ids (a 2-D integer array, possibly memory-mapped) as int64 tensors."""

    def __init__(self, rows: np.ndarray) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.from_numpy(self.rows[index].astype(np.int64))

    def __getitems__(self, indices: Sequence[int]) -> torch.Tensor:
        # Whole-batch fancy indexing: one copy instead of batch_size small ones plus a stack.
        return torch.from_numpy(self.rows[np.asarray(indices)].astype(np.int64))


def collate_rows(batch: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    """``PackedRows.__getitems__`` already returns the batch tensor; plain lists get stacked."""
    return batch if isinstance(batch, torch.Tensor) else torch.stack(batch)


class EpochShuffleSampler(DistributedSampler):
    """This rank's share of the global order: positions rank, rank + W, ... of the epoch's permutation cut to whole
    global batches, after the first ``skip``. A ``DistributedSampler``, so Lightning keeps it under DDP."""

    def __init__(self, dataset: Dataset, seed: int, num_replicas: int = 1, rank: int = 0,
                 global_batch_rows: int | None = None) -> None:
        super().__init__(
            dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True
        )
        self.global_batch_rows = global_batch_rows or num_replicas
        # whole global batches only: every epoch ends on an optimizer step, at any world size
        self.total_size = len(dataset) // self.global_batch_rows * self.global_batch_rows
        self.num_samples = self.total_size // num_replicas
        self.skip = 0
        # Weak: a loader <-> sampler reference cycle would leave the loader to the cyclic GC,
        # and persistent workers freed that way take ~5 s each to shut down.
        self.loader_ref: weakref.ref[ResumableDataLoader] | None = None

    def set_epoch(self, epoch: int) -> None:
        loader = self.loader_ref() if self.loader_ref is not None else None
        if loader is not None:
            loader.set_epoch(epoch)
        else:
            self.epoch = epoch

    def epoch_indices(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed + epoch)
        permutation = torch.randperm(len(self.dataset), generator=generator)
        return permutation[self.rank : self.total_size : self.num_replicas].tolist()

    def __iter__(self) -> Iterator[int]:
        return iter(self.epoch_indices(self.epoch)[self.skip :])


class ResumableDataLoader(DataLoader):
    """Shuffled training batches of the global order with exact mid-epoch resume, at any world size.

    Lightning saves its ``state_dict`` (the rows of the epoch handed out by all ranks together) in every checkpoint;
    ``iter()`` starts the next epoch, or right after ``load_state_dict`` continues the saved one."""

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        seed: int,
        start_epoch: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
        global_batch_rows: int | None = None,
        num_workers: int = 0,
        pin_memory: bool = False,
        collate_fn: Any = collate_rows,
    ) -> None:
        micro_step_rows = batch_size * num_replicas
        global_batch_rows = global_batch_rows or micro_step_rows
        if global_batch_rows % micro_step_rows:
            raise ValueError(f"global_batch_rows={global_batch_rows} is not a multiple of batch_size x num_replicas "
                             f"= {micro_step_rows}")
        if len(dataset) < global_batch_rows:
            raise UserError(f"data.batch_size {batch_size} x world size {num_replicas} x "
                            f"trainer.accumulate_grad_batches {global_batch_rows // micro_step_rows} = "
                            f"{global_batch_rows} rows per optimizer step, but the training split has only "
                            f"{len(dataset)} rows; lower global_batch.rows or data.batch_size, or use more data")
        super().__init__(
            dataset,
            batch_size=batch_size,
            sampler=EpochShuffleSampler(dataset, seed, num_replicas, rank, global_batch_rows),
            drop_last=True,
            num_workers=num_workers,
            collate_fn=collate_fn,
            pin_memory=pin_memory,
            persistent_workers=num_workers > 0,
        )
        self.sampler.loader_ref = weakref.ref(self)
        self.seed = seed
        self.micro_step_rows = micro_step_rows  # rows all ranks read per batch this loader yields
        self.epoch = start_epoch
        self.batches_yielded = 0
        self._resume_pending = False
        self._generation = 0  # only the newest iterator may advance the count

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its first batch; a no-op if already in that epoch."""
        if epoch != self.epoch:
            self.epoch, self.batches_yielded, self._resume_pending = epoch, 0, False

    def __iter__(self) -> Iterator[torch.Tensor]:
        if self._resume_pending:
            self._resume_pending = False
        elif self.batches_yielded > 0:
            self.epoch, self.batches_yielded = self.epoch + 1, 0
        self._generation += 1
        return self._counted_batches(self._generation)

    def _counted_batches(self, generation: int) -> Iterator[torch.Tensor]:
        # A generator: nothing below runs (no workers start) until the first batch is requested, so a set_epoch
        # that Lightning calls after creating the iterator still decides the epoch.
        self.sampler.epoch = self.epoch
        self.sampler.skip = self.batches_yielded * self.batch_size
        for batch in super().__iter__():
            if generation == self._generation:
                # Counted here, in the main process, as the batch is handed out: worker
                # prefetching runs ahead of this point and must not count as consumed.
                self.batches_yielded += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            # every rank has handed out as many batches (Lightning saves at step boundaries), so the ranks
            # together have served this prefix of the epoch's global order
            "rows_served": self.batches_yielded * self.micro_step_rows,
            "global_batch_rows": self.sampler.global_batch_rows,
            "num_rows": len(self.dataset),
            "seed": self.seed,
            # the tokens themselves, where the rows know it (prepared shards): a re-prepared corpus is other data
            "data_identity": getattr(getattr(self.dataset, "rows", None), "identity", None),
            # the layout that wrote it, for messages: any layout with the same global batch may resume it
            "batch_size": self.batch_size,
            "world_size": self.sampler.num_replicas,
        }

    @staticmethod
    def saved_identity(checkpoint: dict[str, Any]) -> str | None:
        """The data identity a Lightning checkpoint's training loader recorded (``state_dict``), if any."""
        loader = (((checkpoint.get("loops") or {}).get("fit_loop") or {}).get("state_dict") or {}).get(
            "combined_loader")
        state = loader[0] if isinstance(loader, (list, tuple)) and loader else None
        return state.get("data_identity") if isinstance(state, dict) else None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "rows_served" in state_dict:
            served = int(state_dict["rows_served"])
        else:  # saved before the order was global: batches per rank of the layout that wrote it
            served = int(state_dict["batches_yielded"]) * int(state_dict["batch_size"]) * \
                int(state_dict["num_replicas"])
        self._check_same_order(state_dict, served)
        epoch = int(state_dict["epoch"])
        if served >= self.sampler.total_size:  # saved after the epoch's last step: continue with the next epoch
            epoch, served = epoch + 1, 0
        self.epoch, self.batches_yielded = epoch, served // self.micro_step_rows
        self._resume_pending = True

    def _check_same_order(self, saved: dict[str, Any], served: int) -> None:
        """A resume continues the saved run's order exactly, or is refused."""
        prefix = "cannot resume the training order of this checkpoint"
        now = self.state_dict()
        if saved.get("seed") != self.seed:
            raise UserError(f"{prefix}: its training order was shuffled with seed {saved.get('seed')}, this run's "
                            f"with {self.seed}; resume with the saved run's seed_everything and data.* settings (text "
                            f"data orders by data.order_seed, else seed_everything: --data.order_seed "
                            f"{saved.get('seed')} restores it)")
        if saved.get("data_identity") and now["data_identity"] and saved["data_identity"] != now["data_identity"]:
            raise UserError(f"{prefix}: its training rows came from other token shards (data identity "
                            f"{saved['data_identity']}, this run's {now['data_identity']}): the prepared data "
                            "(data.source, or its cache entry) was prepared again or replaced since; resume on the "
                            "data that run read")
        if saved.get("num_rows") != now["num_rows"]:
            raise UserError(f"{prefix}: its training split had {saved.get('num_rows')} rows, this run's has "
                            f"{now['num_rows']}; the data settings (data.*) must be the saved run's")
        rows, accumulate = now["global_batch_rows"], now["global_batch_rows"] // self.micro_step_rows
        if "global_batch_rows" in saved and saved["global_batch_rows"] != rows:
            raise UserError(f"{prefix}: it was written with global batches of {saved['global_batch_rows']} rows "
                            f"per optimizer step, this run's are {rows} (data.batch_size {self.batch_size} x world "
                            f"size {now['world_size']} x trainer.accumulate_grad_batches {accumulate}); resume "
                            f"with --global_batch.rows {saved['global_batch_rows']}")
        if served % self.micro_step_rows:
            raise UserError(f"{prefix}: it was saved after {served} rows of epoch {saved.get('epoch')}, which is not "
                            f"a whole number of this run's micro-steps of {self.micro_step_rows} rows (data.batch_size "
                            f"{self.batch_size} x world size {now['world_size']}); resume with a data.batch_size and "
                            f"world size whose product divides {served}, e.g. the saved run's "
                            f"{saved.get('batch_size')} x {saved.get('world_size', saved.get('num_replicas'))}")


def epoch_about_to_run(trainer: L.Trainer | None) -> int:
    """The epoch Lightning will run next; it is what ``set_epoch`` receives from Lightning.

    Needed when no loader state is restored: fresh runs, rebuilt loaders
    (``reload_dataloaders_every_n_epochs``), and resuming from a checkpoint saved at the end of an
    epoch, where Lightning skips ``load_state_dict`` and ``trainer.current_epoch`` still names the
    finished epoch while this loader is created.
    """
    if trainer is None:
        return 0
    return trainer.fit_loop.epoch_progress.current.processed


def resumable_train_loader(dataset: Dataset, trainer: L.Trainer | None, batch_size: int, seed: int,
                           num_workers: int = 0, collate_fn: Any = collate_rows) -> ResumableDataLoader:
    """The training loader every data module uses: this rank's share of the global order, placed at the epoch to
    run. The global batch is the trainer's: global_batch.rows has set its accumulation (in a callback's setup) by
    the time the loader is requested."""
    world_size = trainer.world_size if trainer else 1
    accumulate = trainer.accumulate_grad_batches if trainer else 1
    return ResumableDataLoader(
        dataset,
        batch_size=batch_size,
        seed=seed,
        start_epoch=epoch_about_to_run(trainer),
        num_replicas=world_size,
        rank=trainer.global_rank if trainer else 0,
        global_batch_rows=batch_size * world_size * accumulate,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        collate_fn=collate_fn,
    )

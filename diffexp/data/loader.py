"""A training DataLoader whose order is a pure function of (seed, epoch) and that resumes mid-epoch.

Lightning 2.x treats any train dataloader with ``state_dict``/``load_state_dict`` as stateful:
it stores ``state_dict()`` in every checkpoint and, when it restarts inside an epoch, calls
``load_state_dict()`` before creating that epoch's iterator (a checkpoint from an epoch's end
may be resumed without it; then ``start_epoch`` and ``set_epoch`` place the loader).
``ResumableDataLoader`` counts the batches its iterator has handed out *in the main process*
(worker prefetching runs ahead but is not counted), so a checkpoint taken after batch ``k``
resumes at batch ``k + 1`` of the same permutation.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler


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
    """This rank's share of a permutation seeded by ``seed + epoch``, optionally skipping a prefix.

    Subclassing ``DistributedSampler`` makes Lightning keep this sampler under DDP (instead of
    wrapping it and rebuilding the loader); each rank takes every ``num_replicas``-th index.
    ``epoch`` and ``skip`` are set by ``ResumableDataLoader``; Lightning's ``set_epoch`` calls
    are forwarded to the loader, which owns the epoch.
    """

    def __init__(self, dataset: Dataset, seed: int, num_replicas: int = 1, rank: int = 0) -> None:
        super().__init__(
            dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True
        )
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
    """Shuffled, ``drop_last`` training batches with exact mid-epoch resume.

    State is ``epoch`` and ``batches_yielded`` (batches of that epoch already returned by the
    iterator). Each ``iter()`` starts the next epoch once the current one has yielded anything;
    right after ``load_state_dict`` it instead continues the saved epoch at the next batch.
    ``set_epoch(e)`` (Lightning calls it on the sampler at every epoch start, *after* creating
    the first iterator) moves to the start of epoch ``e`` unless the loader is already in ``e``;
    that is why the iterator only reads the position when its first batch is requested.
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        seed: int,
        start_epoch: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
        num_workers: int = 0,
        pin_memory: bool = False,
        collate_fn: Any = collate_rows,
    ) -> None:
        super().__init__(
            dataset,
            batch_size=batch_size,
            sampler=EpochShuffleSampler(dataset, seed, num_replicas, rank),
            drop_last=True,
            num_workers=num_workers,
            collate_fn=collate_fn,
            pin_memory=pin_memory,
            persistent_workers=num_workers > 0,
        )
        self.sampler.loader_ref = weakref.ref(self)
        self.seed = seed
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
        # A generator: nothing below runs (no workers start) until the first batch is requested.
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
            "batches_yielded": self.batches_yielded,
            "seed": self.seed,
            "num_rows": len(self.dataset),
            "batch_size": self.batch_size,
            "num_replicas": self.sampler.num_replicas,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        current = self.state_dict()
        changed = [
            k for k in ("seed", "num_rows", "batch_size", "num_replicas") if state_dict.get(k) != current[k]
        ]
        if changed:
            warnings.warn(
                f"resuming the train dataloader with different {', '.join(changed)} "
                f"(saved {[state_dict.get(k) for k in changed]}, now {[current[k] for k in changed]}); "
                "the batch order will not match the interrupted run",
                stacklevel=2,
            )
        epoch, done = int(state_dict["epoch"]), int(state_dict["batches_yielded"])
        if done >= len(self):  # saved after the epoch's last batch: continue with the next epoch
            epoch, done = epoch + 1, 0
        self.epoch, self.batches_yielded = epoch, done
        self._resume_pending = True


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
    """The training loader every data module uses: this rank's shuffled share, placed at the epoch to run."""
    return ResumableDataLoader(
        dataset,
        batch_size=batch_size,
        seed=seed,
        start_epoch=epoch_about_to_run(trainer),
        num_replicas=trainer.world_size if trainer else 1,
        rank=trainer.global_rank if trainer else 0,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        collate_fn=collate_fn,
    )

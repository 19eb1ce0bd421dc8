"""Run directories: where a run logs, and which run `--ckpt_path last` resumes.

Layout: <save_dir>/<name>/<version>/ holds the TensorBoard events, config.yaml and checkpoints/ (and, for a
run trained inside SLURM jobs, slurm-jobs.txt: diffexp.training.slurm_jobs).
A new run always gets a new version, reserved with an atomic mkdir; a resumed run appends to the
version it resumes. `diffexp validate` / `test` log into <run>/eval/<subcommand>-<time>/ of the run
whose checkpoint they evaluate (<save_dir>/<name>/eval/... for other checkpoints), never into a new
version_<k> that would look like a training run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only

from diffexp.checkpoint_io import no_space_error, save_failed_for_space, tensor_bytes, verify_checkpoint
from diffexp.errors import UserError
from diffexp.training.slurm_jobs import current_job, run_of_job

log = logging.getLogger(__name__)

VERSION_DIR = re.compile(r"version_(\d+)")
# AtomicCheckpointIO's temporary files: .<target name>.<random>.tmp beside the target
TEMP_CHECKPOINT = re.compile(r"\..+\.ckpt\.[^.]+\.tmp")



def find_last_checkpoint(experiment_dir: Path) -> Path | None:
    """The most recently written checkpoints/last.ckpt (a file, or FSDP's sharded directory) of an experiment."""
    candidates = list(experiment_dir.glob("*/checkpoints/last.ckpt"))
    return max(candidates, key=lambda p: p.stat().st_mtime) if candidates else None


def runs_newest_first(experiment_dir: Path) -> list[Path]:
    """The version_<k> run directories of an experiment, highest k first."""
    if not experiment_dir.is_dir():
        return []
    runs = [(int(m.group(1)), p) for p in experiment_dir.iterdir() if (m := VERSION_DIR.fullmatch(p.name))]
    return [run for _, run in sorted(runs, reverse=True)]


def resolve_resume(ckpt_path: str, save_dir: str, name: str) -> tuple[Path | None, str | None]:
    """Map --ckpt_path (a file or "last") to (checkpoint file, version of the run it belongs to).

    The version is None when the checkpoint lies outside <save_dir>/<name>: the resumed run then
    starts a new version rather than writing into someone else's directory. Inside a SLURM job, "last" is
    the run this job trained (diffexp.training.slurm_jobs); (None, None) when that run saved nothing yet,
    and the fit starts a new run.
    """
    experiment_dir = Path(save_dir) / name
    if ckpt_path == "last":
        job = current_job()
        own = run_of_job(runs_newest_first(experiment_dir), job) if job else None
        if own is not None:
            last = own / "checkpoints" / "last.ckpt"
            if not last.exists():
                saved = sorted(p.name for p in (own / "checkpoints").glob("*.ckpt")) if (
                    own / "checkpoints").is_dir() else []
                if saved:  # checkpoint.save_last=false: the run's own checkpoints are not thrown away
                    raise UserError(
                        f"--ckpt_path last: SLURM job {job}'s run {own} has no checkpoints/last.ckpt but saved "
                        f"{', '.join(saved)}; pass one of them as --ckpt_path")
                if rank_zero_only.rank == 0:
                    print(f"SLURM job {job} started {own} before and saved no checkpoint there: starting a new run",
                          file=sys.stderr)
                return None, None
            return last, own.name
        found = find_last_checkpoint(experiment_dir)
        if found is None:
            raise UserError(
                f"--ckpt_path last: no run under {experiment_dir}/ has checkpoints/last.ckpt; "
                "pass the path of a .ckpt file, or start a new run without --ckpt_path"
            )
        path = found
    else:
        path = Path(ckpt_path)
        if not path.exists():  # a file, or a directory for FSDP's sharded checkpoints
            raise UserError(f"--ckpt_path {ckpt_path!r}: no such file; expected a .ckpt file or 'last'")
    run_dir = path.parent.parent
    in_experiment = path.parent.name == "checkpoints" and run_dir.parent.resolve() == experiment_dir.resolve()
    return path, run_dir.name if in_experiment else None


class AtomicCheckpointIO(TorchCheckpointIO):
    """torch.save to a temporary file beside the target, fsync, then os.replace.

    A kill at any moment leaves either the previous checkpoint or the new one, never a partial file.
    (Lightning's default writes through a temporary file that may sit on another file system, where
    the final move is a copy.) A full disk removes the partial file and raises one UserError that says
    how much space the checkpoint needs and how much is left. A load first verifies the file's CRC-32s
    (diffexp.checkpoint_io.verify_checkpoint; done once per process, so the resume checks' read counts).
    """

    def load_checkpoint(self, path, *args: Any, **kwargs: Any) -> dict[str, Any]:
        verify_checkpoint(path, "--ckpt_path")
        return super().load_checkpoint(path, *args, **kwargs)

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp_name, target)
        except BaseException as err:
            needed = tensor_bytes(checkpoint)
            no_space = save_failed_for_space(err, target, needed)  # asked before the partial file gives space back
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp_name)
            if no_space:
                raise no_space_error(target, needed) from err
            raise


class RemoveRefusedRun(L.Callback):
    """A new run refused at its setup, before its first step (a callback's or the data's check of what the user
    gave: a UserError), leaves no version_<k> behind: the directory holds only what the start wrote (config.yaml,
    an event file), and the refused command is as if never run. A run that trained, or saved, keeps everything."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, UserError) or trainer.global_step > 0 or any(self.run_dir.glob("checkpoints/*")):
            return
        shutil.rmtree(self.run_dir, ignore_errors=True)


def remove_orphan_temp_files(checkpoint_dir: Path) -> list[Path]:
    """Delete the temporary files (or sharded staging directories) a kill during a checkpoint save left behind."""
    if not checkpoint_dir.is_dir():
        return []
    orphans = [p for p in checkpoint_dir.iterdir() if TEMP_CHECKPOINT.fullmatch(p.name)]
    for orphan in orphans:
        if orphan.is_dir():  # a sharded checkpoint's staging directory (diffexp.parallel.FSDP2Strategy)
            shutil.rmtree(orphan, ignore_errors=True)
            continue
        with contextlib.suppress(FileNotFoundError):  # another process of this run got there first
            orphan.unlink()
    if orphans:
        log.info("removed %d incomplete checkpoint file(s) of an interrupted save from %s", len(orphans),
                 checkpoint_dir)
    return orphans


def reserve_version(experiment_dir: Path) -> int:
    """Create <experiment_dir>/version_<k> for a new run and return k.

    os.mkdir fails when the directory exists, so two runs started at the same moment never share one
    (TensorBoardLogger alone lists the directories and picks the next number, which both would pick).
    """
    experiment_dir.mkdir(parents=True, exist_ok=True)
    taken = [int(m.group(1)) for p in experiment_dir.iterdir() if (m := VERSION_DIR.fullmatch(p.name))]
    k = max(taken, default=-1) + 1
    while True:
        try:
            (experiment_dir / f"version_{k}").mkdir()
            return k
        except FileExistsError:
            k += 1


def reserve_dir(parent: Path, stem: str) -> Path:
    """Create and return parent/stem, or parent/stem-1, stem-2, ... when that exists."""
    parent.mkdir(parents=True, exist_ok=True)
    suffix = 0
    while True:
        path = parent / (stem if suffix == 0 else f"{stem}-{suffix}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            suffix += 1


def eval_dir_parent(ckpt_path: str | None, save_dir: str, name: str) -> Path:
    """Where validate/test runs log: <run>/eval when the checkpoint lies in <run>/checkpoints/ of a run
    directory (one holding config.yaml or TensorBoard events), else <save_dir>/<name>/eval."""
    if ckpt_path:
        path = Path(ckpt_path)
        run_dir = path.parent.parent
        if path.parent.name == "checkpoints" and (
            (run_dir / "config.yaml").is_file() or any(run_dir.glob("events.out.tfevents.*"))
        ):
            return run_dir / "eval"
    return Path(save_dir) / name / "eval"


def run_logger(subcommand: str | None, logger: Any, logger_config: Any,
               ckpt_path: str | None) -> TensorBoardLogger | None:
    """The TensorBoard logger a command should use instead of the configured one, or None to keep that.

    fit: a new run's version directory is reserved now, before anything logs (resumed runs and runs
    given a version keep theirs). validate/test: a fresh <run>/eval/<subcommand>-<time>/ directory.
    `logger` is the instantiated logger and `logger_config` its parsed config (class_path, init_args),
    from which the replacement is built; other loggers are left alone.
    """
    init_args = getattr(logger_config, "init_args", None)
    if not isinstance(logger, TensorBoardLogger) or not hasattr(init_args, "as_dict"):
        return None
    init_args = init_args.as_dict()
    if subcommand in ("validate", "test"):
        parent = eval_dir_parent(ckpt_path, init_args["save_dir"], init_args.get("name") or "")
        stem = f"{subcommand}-{time.strftime('%Y%m%d-%H%M%S')}"
        # only global rank 0 creates it; the other ranks' loggers never write
        version = reserve_dir(parent, stem).name if rank_zero_only.rank == 0 else stem
        return type(logger)(**{**init_args, "save_dir": str(parent), "name": "", "version": version})
    if init_args.get("version") is None and rank_zero_only.rank == 0:
        experiment_dir = Path(init_args["save_dir"]) / (init_args.get("name") or "")
        return type(logger)(**{**init_args, "version": reserve_version(experiment_dir)})
    return None

"""Run directories: where a run logs, and which run `--ckpt_path last` resumes.

Layout: <save_dir>/<name>/<version>/ holds the TensorBoard events, config.yaml and checkpoints/.
A new run always gets a new version; a resumed run appends to the version it resumes.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from diffexp.errors import UserError


def find_last_checkpoint(experiment_dir: Path) -> Path | None:
    """The most recently written checkpoints/last.ckpt (a file, or FSDP's sharded directory) of an experiment."""
    candidates = list(experiment_dir.glob("*/checkpoints/last.ckpt"))
    return max(candidates, key=lambda p: p.stat().st_mtime) if candidates else None


def resolve_resume(ckpt_path: str, save_dir: str, name: str) -> tuple[Path, str | None]:
    """Map --ckpt_path (a file or "last") to (checkpoint file, version of the run it belongs to).

    The version is None when the checkpoint lies outside <save_dir>/<name>: the resumed run then
    starts a new version rather than writing into someone else's directory.
    """
    experiment_dir = Path(save_dir) / name
    if ckpt_path == "last":
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
    the final move is a copy.)
    """

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
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp_name)
            raise

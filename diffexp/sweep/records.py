"""A sweep's small records (progress.json, trial.json, sweep.json), written whole or not at all, and the one
paragraph of a full disk; light (no Lightning), for the worker and for each trial's callback alike."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from typing import Any

from diffexp.errors import UserError

#: the storage URL reaches each trial's fit through the environment, so a password in it is written nowhere
STORAGE_ENV = "DIFFEXP_SWEEP_STORAGE"


class NoSpaceError(UserError):
    """A sweep's small record (progress.json, trial.json, sweep.json) did not fit on its disk."""


def write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    """`path` replaced whole by the JSON of `payload`, or left as it was; a full disk is a NoSpaceError."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(json.dumps(payload, indent=2, default=str))
        os.replace(tmp, path)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        tmp.unlink(missing_ok=True)
        raise NoSpaceError(no_space_message(path)) from None


def no_space_message(path: Path) -> str:
    """The one paragraph of a sweep file that did not fit: where, how much is free, what to do."""
    try:
        free = f"{shutil.disk_usage(path.parent).free / 2**20:.1f} MiB"
    except OSError:
        free = "nothing"
    return (f"no space left on the device to write {path}: {free} is free on that file system. The checkpoints "
            "saved before are intact. Free space there, then run the same `diffexp sweep` command again: the "
            "trial resumes from its last checkpoint, and a trial stopped by a full disk uses none of max_attempts")

"""Trials stopped by the machine, not by themselves: a signal (preemption, Ctrl-C), a full disk, a storage outage.

Such a trial is recorded as Optuna's FAIL with the user attribute `outcome` set to one of INFRA_OUTCOMES; it uses
none of its point's `max_attempts`, and its point is enqueued again at once, to resume from its checkpoint.
Before it records that in the storage (which may be the very thing that is away), the worker writes the same
record to the trial's run directory (MARKER); any later worker that finds a running trial with a marker of its
id records it so, without waiting for `stale_after_s`.

`SignalWatch` is the worker's handler of SIGTERM, SIGINT and SIGUSR1: the first passes the signal on to the
running trial's `diffexp fit` (which saves its checkpoint and exits 128 + the signal's number); a second of them
stops the trial at once.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

INTERRUPTED, NO_SPACE, STORAGE = "interrupted", "no space", "storage outage"
INFRA_OUTCOMES = (INTERRUPTED, NO_SPACE, STORAGE)
MARKER = "stopped.json"
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def stopped_by_signal(returncode: int | None) -> int | None:
    """The signal a trial's fit reported stopping for (it exits 128 + n on SIGTERM, SIGINT or SIGUSR1), else None."""
    if returncode is not None and returncode - 128 in [int(s) for s in SIGNALS]:
        return returncode - 128
    return None


def write_marker(run_dir: Path, trial_id: int, outcome: str, failure: str) -> None:
    """The trial's infrastructure outcome in its run directory; skipped when even that cannot be written (the
    disk is full: the storage record, or the stale rule, stands in)."""
    try:
        (run_dir / MARKER).write_text(json.dumps({"trial_id": trial_id, "outcome": outcome, "failure": failure,
                                                  "time": time.time()}))
    except OSError:
        pass


def read_marker(run_dir: str | None, trial_id: int) -> dict[str, Any] | None:
    """The marker a worker left for trial `trial_id` in `run_dir`, or None."""
    if not run_dir:
        return None
    try:
        record = json.loads((Path(run_dir) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("trial_id") != trial_id or \
            record.get("outcome") not in INFRA_OUTCOMES:
        return None
    return record


def is_no_space(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in NO_SPACE_ERRNOS


class WorkerSignalled(Exception):
    """The worker got a signal and has recorded its trial (if any): it exits with 128 + the signal number."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum


class SignalWatch:
    """Installs the worker's handlers of SIGNALS (in the main thread) and remembers the first signal."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.count = 0
        self.child: subprocess.Popen | None = None
        self.forwarded_at: float | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> SignalWatch:
        for sig in SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: no handlers (a test driving the runner in a thread)
                break
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, _frame: object) -> None:
        self.count += 1
        if self.signum is None:
            self.signum = signum
        self.pass_on()

    def pass_on(self) -> None:
        """Give the running trial the signal (once); a second signal to the worker stops the trial at once."""
        child = self.child
        if child is None or child.poll() is not None or self.signum is None:
            return
        if self.forwarded_at is None:
            self.forwarded_at = time.monotonic()
            _send(child, self.signum)
        elif self.count > 1:
            _send(child, signal.SIGKILL)

    def attach(self, child: subprocess.Popen | None) -> None:
        """The trial now running (None: none); a signal that came before it started reaches it at once."""
        self.child, self.forwarded_at = child, None
        if child is not None:
            self.pass_on()


def _send(child: subprocess.Popen, signum: int) -> None:
    """The signal to the trial's fit alone (it stops its own data loader workers); SIGKILL to its whole process
    group (start_new_session), so no loader worker outlives it."""
    try:
        if signum == signal.SIGKILL:
            os.killpg(child.pid, signum)
        else:
            child.send_signal(signum)
    except (ProcessLookupError, PermissionError):
        pass

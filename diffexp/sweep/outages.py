"""A sweep worker's storage calls, retried while the storage is away: a database server restarting, a network gap.

Every call a worker makes goes through `RetryingStorage`, which retries what `outage_of` calls an outage (the
driver lost or could not make its connection) with exponential backoff for up to the spec's `storage_retry_s`,
then raises `StorageGaveUp`: one paragraph with the masked URL, what failed and for how long, and the command
that resumes (exit code 75, EX_TEMPFAIL: try again later). A storage on a full disk (SQLite's "database or disk
is full", a journal file's ENOSPC) is no outage that waiting mends: `StorageFull` is raised at once. Any other
error (a real data error) is raised as it is.

Optuna wraps a failed commit into StorageInternalError with a hint about "exceeding max length" that misleads
here; `outage_of` looks through it to the driver's error, so that hint never reaches the user.
"""

from __future__ import annotations

import errno
import inspect
import time
from collections.abc import Callable
from typing import Any

import optuna
from optuna.storages import BaseStorage

from diffexp.errors import UserError
from diffexp.secrets import mask_secrets_of

EXIT_TEMPFAIL = 75  # sysexits.h EX_TEMPFAIL: a temporary failure, the same command may be run again later
FIRST_DELAY_S, MAX_DELAY_S = 0.5, 15.0
OUTAGE, FULL = "outage", "full"
_FULL_WORDS = ("database or disk is full", "no space left on device", "disk full")


class StorageGaveUp(UserError):
    """The storage did not answer within storage_retry_s: the worker stops, the study is intact."""

    exit_code = EXIT_TEMPFAIL


class StorageFull(UserError):
    """The storage's disk is full: the worker stops with the usual one-paragraph error (exit 2)."""


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


def outage_of(exc: BaseException) -> tuple[str, BaseException] | None:
    """(OUTAGE or FULL, the driver's own error) when `exc` says the storage is unreachable or its disk is full;
    None for any other error. Looks through Optuna's StorageInternalError to the error it wraps."""
    from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

    for error in _chain(exc):
        text = str(error).lower()
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return FULL, error
        if isinstance(error, (OperationalError, InterfaceError)) or \
                isinstance(error, DBAPIError) and error.connection_invalidated:
            return (FULL if any(word in text for word in _FULL_WORDS) else OUTAGE), error
    return None


def reason_of(error: BaseException, url: str) -> str:
    """The driver's message on one line, without SQLAlchemy's background link or the password."""
    text = str(error)
    for tail in ("[SQL:", "[parameters:", "(Background on this error"):  # the statement and a link: not the reason
        text = text.split(tail)[0]
    return mask_secrets_of(f"{type(error).__name__}: {' '.join(text.split())}", url)


class RetryingStorage(BaseStorage):
    """An Optuna storage whose every call is retried through an outage for up to `retry_s` seconds.

    Args:
        inner: the storage opened by diffexp.sweep.storage.open_storage.
        url: its URL, for messages (only ever shown masked).
        what: how messages name it, e.g. `DIFFEXP_STORAGE='postgresql+psycopg://u:***@db/optuna'`.
        retry_s: the bound of one call's retries.
        resume: the command that resumes the sweep, for the give-up message.
        wait: sleeps between tries (the worker's, which stops early when it is signalled).
        say: prints a line (the first failure of an outage, and its end).
    """

    def __init__(self, inner: BaseStorage, url: str, what: str, retry_s: float, resume: str,
                 wait: Callable[[float], None] = time.sleep, say: Callable[[str], None] = print) -> None:
        self.inner, self.url, self.what, self.retry_s, self.resume = inner, url, what, retry_s, resume
        self.wait, self.say = wait, say
        self.down_since: float | None = None  # when the current outage began (None: the storage answers)

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """inner.<name>(*args, **kwargs), retried through an outage."""
        delay = FIRST_DELAY_S
        while True:
            try:
                result = getattr(self.inner, name)(*args, **kwargs)
            except Exception as exc:
                self.check(exc, name)
                self.wait(delay)
                delay = min(2 * delay, MAX_DELAY_S)
                continue
            self.answered()
            return result

    def try_once(self, name: str, *args: Any, **kwargs: Any) -> bool:
        """One try of inner.<name>: True when it went through, False during an outage still within the bound
        (a heartbeat: the trial keeps training, the next beat tries again)."""
        try:
            getattr(self.inner, name)(*args, **kwargs)
        except Exception as exc:
            self.check(exc, name)
            return False
        self.answered()
        return True

    def check(self, exc: Exception, doing: str) -> None:
        """Return when `exc` is an outage within the bound; raise StorageFull, StorageGaveUp or `exc` itself."""
        found = outage_of(exc)
        if found is None:
            raise exc
        kind, error = found
        if kind == FULL:
            raise StorageFull(
                f"{self.what}: the storage's disk is full ({reason_of(error, self.url)}, while {_doing(doing)}). "
                "The study in it is intact up to its last write. Free space on the file system that holds it, "
                f"then resume with: {self.resume}") from None
        now = time.monotonic()
        if self.down_since is None:
            self.down_since = now
            self.say(mask_secrets_of(f"storage {self.what} does not answer ({reason_of(error, self.url)}); "
                                     f"retrying for up to {self.retry_s:.0f} s (storage_retry_s), a running "
                                     "trial keeps training", self.url))
        if now - self.down_since >= self.retry_s:
            raise StorageGaveUp(
                f"{self.what} did not answer for {now - self.down_since:.0f} s (storage_retry_s="
                f"{self.retry_s:g}) while {_doing(doing)}: {reason_of(error, self.url)}. The worker stopped; "
                "the study is intact and nothing it recorded is lost. Check that the database server is up and "
                f"reachable from this machine (or set a longer storage_retry_s in the spec), then resume with: "
                f"{self.resume}") from None

    def answered(self) -> None:
        if self.down_since is not None:
            self.say(f"storage {self.what} answers again after {time.monotonic() - self.down_since:.0f} s")
            self.down_since = None


def _doing(name: str) -> str:
    return {"set_trial_system_attr": "writing a trial's heartbeat", "set_trial_state_values": "recording a trial's "
            "state (claim or result)", "create_new_trial": "enqueueing a trial", "get_all_trials": "reading the "
            "study's trials"}.get(name, f"calling the storage ({name})")


def _delegate(name: str) -> Callable[..., Any]:
    def method(self: RetryingStorage, *args: Any, **kwargs: Any) -> Any:
        return self.call(name, *args, **kwargs)

    method.__name__ = name
    method.__doc__ = f"BaseStorage.{name}, retried through an outage."
    return method


# every public method of Optuna's storage interface, so whatever Optuna's Study and Trial call goes through call()
for _name, _ in inspect.getmembers(BaseStorage, inspect.isfunction):
    if not _name.startswith("_"):
        setattr(RetryingStorage, _name, _delegate(_name))
RetryingStorage.__abstractmethods__ = frozenset()
assert issubclass(RetryingStorage, optuna.storages.BaseStorage)

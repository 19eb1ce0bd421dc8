"""Optuna storages by URL: SQLite (default), a journal file for shared file systems, or any RDB URL."""

from __future__ import annotations

import contextlib
import fcntl
import re
from collections.abc import Iterator
from pathlib import Path

import optuna
from optuna.storages import JournalStorage, RDBStorage
from optuna.storages.journal import JournalFileBackend


def mask_url(url: str) -> str:
    """The URL with any password replaced by ***, safe to print or log."""
    return re.sub(r"(://[^:/@]+:)[^@]*@", r"\1***@", url)


def journal_path(url: str) -> Path | None:
    """`journal:<path>` or a path ending in .log/.journal names a journal file."""
    if url.startswith("journal:"):
        return Path(url[len("journal:"):])
    if "://" not in url and url.endswith((".log", ".journal")):
        return Path(url)
    return None


def sqlite_path(url: str) -> Path | None:
    return Path(url[len("sqlite:///"):]) if url.startswith("sqlite:///") else None


def open_storage(url: str) -> optuna.storages.BaseStorage:
    path = journal_path(url)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        return JournalStorage(JournalFileBackend(str(path)))
    db = sqlite_path(url)
    if db is not None:
        db.parent.mkdir(parents=True, exist_ok=True)
        # several worker processes on one file: wait for the lock instead of failing at once
        return RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 60}})
    if "://" not in url:
        raise ValueError(f"storage={url!r}: expected a sqlite:/// or other SQLAlchemy URL, or journal:<path>")
    return RDBStorage(url)


@contextlib.contextmanager
def setup_lock(url: str) -> Iterator[None]:
    """Serialise study set-up among workers sharing a local storage file (a no-op for server URLs)."""
    path = journal_path(url) or sqlite_path(url)
    if path is None:
        yield
        return
    lock_path = path.with_name(path.name + ".setup-lock")
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)

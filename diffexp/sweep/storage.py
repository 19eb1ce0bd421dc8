"""Optuna storages by URL: SQLite (default), a journal file for shared file systems, or any RDB URL.

The URL comes from, first found: the `--storage` flag, the environment variable DIFFEXP_STORAGE (so a
password need not be on a command line), the spec's `storage:`, then `sqlite:///runs/<study>/study.db`.
It is only ever shown masked (diffexp.secrets). A storage that cannot be opened (bad host, wrong password,
driver not installed, no such file) is a StorageError, a UserError naming the masked URL and the reason.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path

import optuna
from optuna.storages import JournalStorage, RDBStorage
from optuna.storages.journal import JournalFileBackend

from diffexp.errors import UserError
from diffexp.secrets import mask_secrets_of, mask_url

STORAGE_URL_ENV = "DIFFEXP_STORAGE"
SQLITE_SUFFIXES = (".db", ".sqlite", ".sqlite3")
FORMS = ("sqlite:///<path>, journal:<path> or an SQLAlchemy URL such as "
         "postgresql+psycopg://user:pass@host/db")


class StorageError(UserError):
    """The storage URL is malformed, or the storage cannot be opened or reached."""


def resolve_url(flag: str | None, spec_value: str | None = None) -> tuple[str | None, str]:
    """(URL, where it came from): `--storage` > $DIFFEXP_STORAGE > the spec's `storage:`; (None, "") if none."""
    env = os.environ.get(STORAGE_URL_ENV, "").strip()
    for value, origin in ((flag, "--storage"), (env, STORAGE_URL_ENV), (spec_value, "storage")):
        if value:
            return value, origin
    return None, ""


def journal_path(url: str) -> Path | None:
    """`journal:<path>` or a path ending in .log/.journal names a journal file."""
    return _file_path(url, "journal:", (".log", ".journal"))


def sqlite_path(url: str) -> Path | None:
    """`sqlite:///<path>` or a bare path ending in .db/.sqlite/.sqlite3 names a SQLite file."""
    return _file_path(url, "sqlite:///", SQLITE_SUFFIXES)


def _file_path(url: str, prefix: str, suffixes: tuple[str, ...]) -> Path | None:
    if url.startswith(prefix):
        return Path(url[len(prefix):])
    if "://" not in url and url.endswith(suffixes):
        return Path(url)
    return None


def describe(url: str, origin: str = "storage") -> str:
    """`origin='masked URL'`, e.g. DIFFEXP_STORAGE='postgresql+psycopg://optuna:***@db/optuna'."""
    return f"{origin}={mask_url(url)!r}"


def open_storage(url: str, origin: str = "storage", create: bool = True) -> optuna.storages.BaseStorage:
    """The Optuna storage behind `url`. With create=False (reading a study), a file storage must exist."""
    what = describe(url, origin)
    path = journal_path(url)
    if path is not None:
        _local_file(path, what, "journal file", create)
        return JournalStorage(JournalFileBackend(str(path)))
    db = sqlite_path(url)
    if db is not None:
        _local_file(db, what, "SQLite file", create)
        # several worker processes on one file: wait for the lock instead of failing at once
        rdb_url = url if "://" in url else f"sqlite:///{db.resolve()}"
        return _open_rdb(rdb_url, url, what, engine_kwargs={"connect_args": {"timeout": 60}})
    if "://" not in url:
        raise StorageError(f"{what} is not a storage: expected {FORMS}")
    return _open_rdb(url, url, what)


def _local_file(path: Path, what: str, kind: str, create: bool) -> None:
    """A storage file's folder made (create), or the file found (reading a study)."""
    if not create and not path.is_file():
        raise StorageError(f"{what}: no such {kind} {str(path)!r}")
    if create:
        path.parent.mkdir(parents=True, exist_ok=True)


def _open_rdb(url: str, given: str, what: str, **kwargs) -> RDBStorage:
    from sqlalchemy.exc import IntegrityError, ProgrammingError

    for attempt in range(4):
        try:
            return RDBStorage(url, **kwargs)
        except (IntegrityError, ProgrammingError) as exc:
            # workers starting together on an empty server database race to create Optuna's tables
            if attempt == 3:
                raise failure(given, what, exc) from None
            time.sleep(0.5 + attempt)
        except Exception as exc:  # connection refused, wrong password, unknown driver, bad URL ...
            raise failure(given, what, exc) from None
    raise AssertionError("unreachable")


def failure(url: str, what: str, exc: BaseException, doing: str = "cannot open the storage") -> StorageError:
    """A StorageError for an exception raised by the storage, its message free of the password."""
    reason = " ".join(line.strip() for line in str(exc).splitlines()
                      if line.strip() and not line.strip().startswith("(Background on this error"))
    hint = ""
    if isinstance(exc, ImportError) or "Can't load plugin" in reason:
        hint = ("; install the database driver, e.g. pip install 'diffexp[postgres]' and use a "
                "postgresql+psycopg:// URL")
    return StorageError(mask_secrets_of(f"{what}: {doing}: {type(exc).__name__}: {reason}{hint}", url))


@contextlib.contextmanager
def translated_errors(url: str, origin: str = "storage") -> Iterator[None]:
    """Database errors while using an open storage (server gone, permission denied) become StorageErrors; Optuna's
    StorageInternalError is told by the error it wraps (its own hint, "e.g. exceeding max length", misleads)."""
    from sqlalchemy.exc import SQLAlchemyError

    try:
        yield
    except SQLAlchemyError as exc:
        raise failure(url, describe(url, origin), exc, doing="the storage failed") from None
    except optuna.exceptions.StorageInternalError as exc:
        raise failure(url, describe(url, origin), exc.__cause__ or exc, doing="the storage failed") from None


@contextlib.contextmanager
def local_lock(url: str) -> Iterator[None]:
    """Serialise study set-up and trial claims among workers sharing a local storage file.

    SQLite ignores the row lock of Optuna's compare-and-set on a trial's state, so two workers could both
    claim one waiting trial; a server storage (PostgreSQL, MySQL) holds that lock itself: a no-op there.
    """
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

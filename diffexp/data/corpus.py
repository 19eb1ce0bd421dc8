"""The embedded default corpus: the Python standard library's own ``.py`` files, so a fresh checkout can train,
test and benchmark with no download.

Tests, IDLE, lib2to3 and third-party packages are skipped; the total is capped (8 M characters by default) so
its size barely depends on the Python version.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Iterable
from pathlib import Path

DEFAULT_MAX_CHARS = 8_000_000
SKIPPED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
)


def stdlib_root() -> Path:
    """Directory of the running interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_source_files() -> list[Path]:
    """All corpus files, sorted by their path relative to the stdlib root (deterministic)."""
    root = stdlib_root()
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIPPED_DIRS]
        files.extend(Path(dirpath) / name for name in filenames if name.endswith(".py"))
    return sorted(files, key=lambda path: path.relative_to(root).as_posix())


def stdlib_fingerprint() -> str:
    """Cheap identity of the corpus (paths, sizes, mtimes; no file reads) for cache keys."""
    root = stdlib_root()
    digest = hashlib.sha256(str(root).encode())
    for path in stdlib_source_files():
        stat = path.stat()
        digest.update(f"{path.relative_to(root).as_posix()}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def load_stdlib_corpus(max_chars: int | None = DEFAULT_MAX_CHARS) -> list[str]:
    """Return the standard-library sources as a list of documents (one per file).

    Args:
        max_chars: Stop once this many characters are collected (the last document is
            truncated); ``None`` returns every file.
    """
    return take_chars(map(_read_or_empty, stdlib_source_files()), max_chars)


def _read_or_empty(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return ""  # a broken or non-UTF-8 file is not worth failing over; skipping is deterministic


def take_chars(texts: Iterable[str], max_chars: int | None) -> list[str]:
    """Non-empty documents in order until ``max_chars`` characters (the last one truncated)."""
    documents: list[str] = []
    total = 0
    for text in texts:
        if not text or not text.strip():
            continue
        if max_chars is not None and total + len(text) >= max_chars:
            documents.append(text[: max_chars - total])
            break
        documents.append(text)
        total += len(text)
    return documents

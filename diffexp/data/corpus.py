"""The embedded default corpus: the Python standard library's own source code.

Every machine that can run diffexp already has a CPython installation, and with it several
megabytes of real, human-written, consistently styled text: the ``.py`` files of the standard
library. Using them as the default corpus means a fresh checkout can train, test and benchmark
language models with no download, no network and no data shipped in this repository.

The corpus is one document per ``.py`` file under ``sysconfig.get_paths()["stdlib"]``,
in sorted relative-path order. Third-party packages (``site-packages``), the test suites
(``test``, ``tests``), the IDLE GUI (``idlelib``), the deprecated ``lib2to3`` and caches are
skipped so the text is maintained library code only. The total is capped (default 8 M
characters) so that its size does not depend much on the Python version; the last document is
truncated to hit the cap exactly.
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

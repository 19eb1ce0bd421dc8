"""Token shards on disk: how a prepared corpus is written, checked and read back as training rows.

A prepared directory holds ``shards/<split>-<unit>-<piece>.bin`` (raw token ids, uint16 or uint32, each document
followed by the end-of-document id; renamed into place once whole), ``manifest.json`` (per split the pieces with
their documents, tokens, bytes and SHA-256; written last, so it means the directory is complete) and
``tokenizer.json`` for a `tokenizers` tokenizer.
"""

from __future__ import annotations

import bisect
import errno
import hashlib
import json
import os
import resource
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from diffexp.errors import UserError

FORMAT = "diffexp-shards/1"
SPLITS = ("train", "val", "test")
MANIFEST = "manifest.json"
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype holding every id: half the bytes for vocabularies up to 65536."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


class DiskFull(Exception):
    """The disk filled while writing ``path``; ``written`` bytes of it were on disk when it failed."""

    def __init__(self, path: Path, written: int) -> None:
        super().__init__(f"no space left on the device writing {path}")
        self.path, self.written = path, written

    def __reduce__(self):  # crosses from a worker process to the main one
        return DiskFull, (self.path, self.written)


def write_atomic(path: Path, data: bytes) -> None:
    """``data`` to ``path`` through a synced hidden temporary file and a rename: readers see all or nothing."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        if err.errno in DISK_FULL:
            raise DiskFull(path, 0) from None
        raise


def write_json(path: Path, value: dict) -> None:
    write_atomic(path, (json.dumps(value, indent=1, sort_keys=True) + "\n").encode())


class PieceWriter:
    """One split's tokens of one unit, as pieces of at most ``max_tokens`` tokens, each written atomically."""

    def __init__(self, directory: Path, stem: str, dtype: np.dtype, eos_id: int, max_tokens: int) -> None:
        self.directory, self.stem, self.dtype, self.eos_id, self.max_tokens = directory, stem, dtype, eos_id, max_tokens
        self.pieces: list[dict] = []
        self._file = None

    def write(self, tokens: np.ndarray) -> None:
        tokens = tokens.astype(self.dtype, copy=False)
        while len(tokens):
            if self._file is None:
                self._open()
            room = self.max_tokens - self._tokens
            chunk, tokens = tokens[:room], tokens[room:]
            data = chunk.tobytes()
            try:
                self._file.write(data)
            except OSError as err:
                self._abandon()
                if err.errno in DISK_FULL:
                    raise DiskFull(self._path, self._tokens * self.dtype.itemsize) from None
                raise
            self._hash.update(data)
            self._tokens += len(chunk)
            self._documents += int(np.count_nonzero(chunk == self.eos_id))
            if self._tokens == self.max_tokens:
                self._finish()

    def close(self) -> list[dict]:
        """Finish the last piece; the pieces' records in order."""
        if self._file is not None:
            self._finish()
        return self.pieces

    def _open(self) -> None:
        self._path = self.directory / f"{self.stem}-{len(self.pieces):03d}.bin"
        self._tmp = self._path.with_name(f".{self._path.name}.tmp")
        self._file = open(self._tmp, "wb")
        self._hash, self._tokens, self._documents = hashlib.sha256(), 0, 0

    def _finish(self) -> None:
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self._tmp, self._path)
        except OSError as err:
            self._abandon()
            if err.errno in DISK_FULL:
                raise DiskFull(self._path, self._tokens * self.dtype.itemsize) from None
            raise
        self._file = None
        self.pieces.append({"file": f"{self.directory.name}/{self._path.name}", "documents": self._documents,
                            "tokens": self._tokens, "bytes": self._tokens * self.dtype.itemsize,
                            "sha256": self._hash.hexdigest()})

    def _abandon(self) -> None:
        try:
            self._file.close()
        except OSError:
            pass
        self._tmp.unlink(missing_ok=True)
        self._file = None


# -- reading -----------------------------------------------------------------------------------------------
def read_manifest(directory: Path, rebuild: str) -> dict:
    """The manifest of a prepared directory; a missing or damaged one is a UserError saying how to rebuild."""
    path = directory / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{directory} is not a finished preparation ({MANIFEST} is missing); {rebuild}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"{path} is damaged ({err}); {rebuild}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise UserError(f"{path} is not a diffexp shard manifest (format {found!r}, expected {FORMAT!r}); {rebuild}")
    return manifest


def verify_shards(directory: Path, manifest: dict, rebuild: str, checksums: bool = True) -> None:
    """Every piece is there with its size and (``checksums``) its SHA-256, or a UserError names the file.

    Sizes are checked first (a truncated file costs nothing to find); checksums are read in parallel threads
    (hashlib releases the GIL)."""
    pieces = [piece for split in SPLITS for piece in manifest["splits"][split]["pieces"]]
    for piece in pieces:
        path = directory / piece["file"]
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise UserError(f"{path} is missing from the prepared data in {directory}; {rebuild}") from None
        if size != piece["bytes"]:
            raise UserError(f"{path} is truncated or overwritten: {size:,} bytes where the manifest says "
                            f"{piece['bytes']:,}; {rebuild}")
    if not checksums:
        return

    def sha256_of(piece: dict) -> str:
        hasher = hashlib.sha256()
        with open(directory / piece["file"], "rb") as f:
            while block := f.read(8 << 20):
                hasher.update(block)
        return hasher.hexdigest()

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        for piece, found in zip(pieces, pool.map(sha256_of, pieces)):
            if found != piece["sha256"]:
                raise UserError(f"{directory / piece['file']} is corrupted or comes from another preparation: its "
                                f"SHA-256 differs from the manifest's; {rebuild}")


def _allow_open_files(count: int) -> None:
    """Each memory map holds a file descriptor: raise the soft limit when a corpus has many pieces."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = count + 256
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted if hard == resource.RLIM_INFINITY else min(wanted, hard),
                                                    hard))


class TokenStream:
    """A split's pieces as one sequence of token ids, each piece memory-mapped when first read."""

    def __init__(self, directory: Path, pieces: Sequence[dict], dtype: np.dtype) -> None:
        self.paths = [directory / piece["file"] for piece in pieces]
        self.dtype = np.dtype(dtype)
        self.starts = [0]
        for piece in pieces:
            self.starts.append(self.starts[-1] + int(piece["tokens"]))
        self._maps: dict[int, np.ndarray] = {}
        _allow_open_files(len(self.paths))

    def __len__(self) -> int:
        return self.starts[-1]

    def piece(self, k: int) -> np.ndarray:
        if k not in self._maps:
            self._maps[k] = np.memmap(self.paths[k], dtype=self.dtype, mode="r")
        return self._maps[k]

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``start:stop`` (a view where they lie in one piece)."""
        k = bisect.bisect_right(self.starts, start) - 1
        if stop <= self.starts[k + 1]:
            return self.piece(k)[start - self.starts[k] : stop - self.starts[k]]
        parts = []
        while start < stop:
            end = min(stop, self.starts[k + 1])
            parts.append(self.piece(k)[start - self.starts[k] : end - self.starts[k]])
            start, k = end, k + 1
        return np.concatenate(parts)

    def __getstate__(self) -> dict:  # memory maps are reopened in another process, not pickled
        return {**self.__dict__, "_maps": {}}


class TokenRows:
    """Rows of ``row_len`` tokens cut from a stream, the incomplete tail dropped: a read-only 2-D array."""

    def __init__(self, stream: TokenStream, row_len: int) -> None:
        self.stream, self.row_len = stream, row_len
        self.shape = (len(stream) // row_len, row_len)
        self.dtype = stream.dtype
        self.identity: str | None = None  # set by the data module: what a resumed run checks it reads again

    def __len__(self) -> int:
        return self.shape[0]

    def row(self, i: int) -> np.ndarray:
        if not -len(self) <= i < len(self):
            raise IndexError(f"row {i} of {len(self)}")
        i %= len(self)
        return self.stream.read(i * self.row_len, (i + 1) * self.row_len)

    def __getitem__(self, index) -> np.ndarray:
        if isinstance(index, (int, np.integer)):
            return self.row(int(index))
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step == 1:
                return self.stream.read(start * self.row_len, max(start, stop) * self.row_len).reshape(-1, self.row_len)
            index = np.arange(start, stop, step)
        rows = [self.row(int(i)) for i in np.asarray(index).reshape(-1)]
        return np.stack(rows) if rows else np.zeros((0, self.row_len), self.dtype)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        array = self[:]
        return array if dtype is None else array.astype(dtype)

"""A prepared directory, opened for reading: its manifest checked, its tokenizer loaded, its splits as rows.

``open_prepared`` finds every storage fault before any training: a missing or damaged manifest, a shard that
is missing, truncated or corrupted (SHA-256), a tokenizer.json that is not the one the shards were made with.
Each is a UserError naming the file and what rebuilds it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from diffexp.data.shards import MANIFEST, SPLITS, TokenRows, TokenStream, read_manifest, verify_shards
from diffexp.data.tokenizer import ByteTokenizer, HFTokenizer, TextTokenizer
from diffexp.errors import UserError

READ_TOKENS = 1 << 20  # decoded a chunk at a time, whatever the size of a shard


class Prepared:
    """A verified prepared directory: ``manifest``, ``tokenizer``, and each split as a stream or as rows."""

    def __init__(self, directory: Path, manifest: dict, tokenizer: TextTokenizer) -> None:
        self.directory, self.manifest, self.tokenizer = directory, manifest, tokenizer
        self.dtype = np.dtype(manifest["dtype"])
        self.identity = manifest_identity(manifest)

    def stream(self, split: str) -> TokenStream:
        return TokenStream(self.directory, self.manifest["splits"][split]["pieces"], self.dtype)

    def rows(self, split: str, seq_len: int) -> TokenRows:
        """The split's token stream cut into rows of ``seq_len + 1`` tokens."""
        return TokenRows(self.stream(split), seq_len + 1)

    def texts(self, split: str) -> Iterator[str]:
        """The split's documents decoded back to text, in order (read a piece at a time)."""
        stream, eos = self.stream(split), self.tokenizer.eos_id
        pending = np.zeros(0, dtype=self.dtype)
        for start in range(0, len(stream), READ_TOKENS):
            tokens = np.concatenate([pending, stream.read(start, min(start + READ_TOKENS, len(stream)))])
            ends = np.flatnonzero(tokens == eos)
            begin = 0
            for end in ends:
                yield self.tokenizer.decode(tokens[begin:end].tolist())
                begin = end + 1
            pending = tokens[begin:]


def manifest_identity(manifest: dict) -> str:
    """What a resumed run or an evaluation checks: the same tokens in the same splits and order, wherever the
    directory lives now (a hash of every shard's checksum, by split)."""
    return hashlib.sha256(repr([(s, manifest["splits"][s]["pieces"]) for s in SPLITS]).encode()).hexdigest()[:16]


def check_finished(directory: Path, key: str, rebuild: str | None = None) -> dict:
    """A finished preparation's manifest, or a UserError naming ``key``: no directory, an unfinished preparation
    (a part of several, or a killed run), a missing or damaged manifest. Reads no shard."""
    from diffexp.data.prepare import SETTINGS

    directory = Path(directory).expanduser()
    if not directory.is_dir():
        raise UserError(f"{key}={str(directory)!r} is invalid: no such directory; expected a directory written by "
                        "`diffexp data prepare`")
    if not (directory / MANIFEST).is_file() and (directory / SETTINGS).is_file():
        raise UserError(f"{key}={str(directory)!r} is invalid: the preparation there is unfinished (no {MANIFEST}); "
                        "run the `diffexp data prepare` command that started it again to finish it, or, if its parts "
                        f"ran on several machines, `diffexp data join {directory}` once all are done")
    return read_manifest(directory, rebuild or _rebuild_hint(directory))


def open_prepared(directory: Path, key: str, checksums: bool = True, rebuild: str | None = None) -> Prepared:
    """Open and check a prepared directory (``key`` names the setting that points at it, for the messages)."""
    directory = Path(directory).expanduser()
    manifest = check_finished(directory, key, rebuild)
    hint = rebuild or _rebuild_hint(directory, manifest)
    verify_shards(directory, manifest, hint, checksums=checksums)
    return Prepared(directory, manifest, load_tokenizer(directory, manifest["tokenizer"], hint))


def _rebuild_hint(directory: Path, manifest: dict | None = None) -> str:
    command = (manifest or {}).get("command")
    how = f"`{command.replace('{directory}', str(directory))}`" if command else \
        "the `diffexp data prepare` command that made it"
    return f"rebuild it: delete {directory} and run {how}"


def load_tokenizer(directory: Path, info: dict, hint: str) -> TextTokenizer:
    if info["identity"] == "byte":
        return ByteTokenizer()
    from tokenizers import Tokenizer

    path = directory / info.get("file", "tokenizer.json")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"{path} cannot be read ({err}); {hint}") from None
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    if not info["identity"].endswith(digest):
        raise UserError(f"{path} is not the tokenizer these shards were made with (its SHA-256 starts {digest}, the "
                        f"manifest names {info['identity']}); {hint}")
    tokenizer = HFTokenizer(Tokenizer.from_str(text), info["identity"])
    if (tokenizer.vocab_size, tokenizer.eos_id) != (info["vocab_size"], info["eos_id"]):
        raise UserError(f"{path}: vocabulary {tokenizer.vocab_size} / end-of-document id {tokenizer.eos_id}, the "
                        f"manifest says {info['vocab_size']} / {info['eos_id']}; {hint}")
    return tokenizer

"""Where documents come from: the embedded stdlib corpus, local files, or a Hugging Face Hub dataset.

Local ``.json``/``.jsonl``/``.parquet`` files give one document per record (``text_field``), ``.txt`` files one per
paragraph (blank-line separated), so even a single text file splits into train/val by document. A directory that
holds a preparation (``prepare.json``: `diffexp data prepare`'s output, or a data module's cache entry) is never
read as corpus, wherever it lies under a source directory or glob.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from diffexp.data import checks
from diffexp.data.corpus import stdlib_fingerprint
from diffexp.errors import UserError

BUILDER_BY_SUFFIX = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
EXPECTED_SOURCES = (
    "expected 'stdlib', 'hf:<name>', or an existing .txt/.jsonl/.json/.parquet file, directory or glob"
)


@dataclass(frozen=True)
class Source:
    """A validated ``data.source``: ``kind`` is "stdlib", "files" or "hf"."""

    spec: str
    kind: str
    files: tuple[Path, ...] = ()
    hf_name: str = ""
    hf_config: str | None = None
    left_out: tuple[Path, ...] = ()  # preparations found under a directory or glob, never read as corpus


def _source_error(spec: str, problem: str) -> UserError:
    return UserError(f"data.source={spec!r}: {problem}; {EXPECTED_SOURCES}")


#: the file that marks a directory as a preparation (diffexp.data.prepare.SETTINGS)
PREPARATION = "prepare.json"


def _supported_files(paths: Iterable[Path], root: Path) -> tuple[list[Path], list[Path]]:
    """The corpus files among `paths` (all under `root`), and the preparations left out: directories below `root`,
    or `root` itself, holding prepare.json."""
    files = [p for p in paths if p.is_file() and p.suffix.lower() in BUILDER_BY_SUFFIX]
    marked = functools.cache(lambda directory: (directory / PREPARATION).is_file())

    def preparation(file: Path) -> Path | None:
        below = [d for d in file.resolve().parents if d == root or root in d.parents]
        return next((d for d in below if marked(d)), None)

    prepared = {p: preparation(p) for p in files}
    return sorted(p for p, d in prepared.items() if d is None), sorted({d for d in prepared.values() if d})


def _left_out(prepared: list[Path]) -> str:
    if not prepared:
        return ""
    return f" besides preparations ({', '.join(map(str, prepared))}), which are never read as corpus"


def source_root(spec: str) -> Path | None:
    """The directory a local source reads files under: the directory itself, or a glob's fixed leading part; None
    for a single file, the embedded corpus or the Hub."""
    if spec == "stdlib" or spec.startswith("hf:"):
        return None
    path = Path(spec).expanduser()
    if path.is_dir():
        return path.resolve()
    if glob.has_magic(spec):
        fixed = []
        for part in path.parts:
            if glob.has_magic(part):
                break
            fixed.append(part)
        return Path(*fixed).resolve() if fixed else Path.cwd()
    return None


def check_out_outside(spec: str, out: Path, key: str = "OUT") -> None:
    """Refuse an output directory inside the source's directory (nothing is written yet)."""
    root = source_root(spec)
    out = Path(out).expanduser().resolve()
    if root is not None and (out == root or root in out.parents):
        raise UserError(f"{key}={str(out)!r} is invalid: it lies inside SOURCE={spec!r}, whose files are the corpus; "
                        "expected a directory outside it (e.g. data/<name>). A preparation found inside a source "
                        "directory is never read as corpus (its prepare.json marks it), but it belongs beside the "
                        "corpus, not in it")


def resolve_source(spec: str) -> Source:
    """Check ``spec`` and list its files; raises ``UserError`` naming ``spec`` if unusable."""
    if spec == "stdlib":
        return Source(spec, "stdlib")
    if spec.startswith("hf:"):
        name, _, config = spec[3:].partition(":")
        if not name:
            raise _source_error(spec, "missing dataset name after 'hf:'")
        return Source(spec, "hf", hf_name=name, hf_config=config or None)

    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix.lower() not in BUILDER_BY_SUFFIX:
            raise _source_error(spec, f"unsupported file type {path.suffix!r}")
        return Source(spec, "files", files=(path.resolve(),))
    if path.is_dir():
        # Hidden entries (.git, .cache with tokenizer .json files, ...) are never corpus data.
        files, left_out = _supported_files(
            (p for p in path.rglob("*") if not any(part.startswith(".") for part in p.relative_to(path).parts)),
            path.resolve())
        if not files:
            raise _source_error(spec, "directory contains no .txt/.jsonl/.json/.parquet files" + _left_out(left_out))
        return Source(spec, "files", files=tuple(p.resolve() for p in files), left_out=tuple(left_out))
    if glob.has_magic(spec):
        files, left_out = _supported_files((Path(p) for p in glob.glob(os.path.expanduser(spec), recursive=True)),
                                           source_root(spec))
        if not files:
            raise _source_error(spec, "glob matches no .txt/.jsonl/.json/.parquet files" + _left_out(left_out))
        return Source(spec, "files", files=tuple(p.resolve() for p in files), left_out=tuple(left_out))
    if not path.suffix:
        raise _source_error(spec, "no such file or directory (a directory of token shards is made once by `diffexp "
                                  f"data prepare SOURCE {spec}`)")
    raise _source_error(spec, "no such file or directory")


def fingerprint(source: Source) -> str:
    """Identity of the source's content for cache keys: changes when any file changes."""
    if source.kind == "stdlib":
        return f"stdlib-{stdlib_fingerprint()}"
    if source.kind == "hf":
        return f"hf-{source.hf_name}-{source.hf_config}"
    digest = hashlib.sha256()
    for path in source.files:
        stat = path.stat()
        digest.update(f"{path}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
    return f"files-{digest.hexdigest()[:16]}"


def check_source(source: Source, text_field: str) -> None:
    """Sniff every local file (a prefix or a Parquet footer each) for problems the user can fix."""
    if source.kind == "files":
        checks.check_files(source.spec, source.files, text_field)


def root_cause(err: BaseException) -> str:
    """The innermost message of a chained error (`datasets` wraps the useful one in DatasetGenerationError)."""
    while err.__cause__ is not None or (err.__context__ is not None and not err.__suppress_context__):
        err = err.__cause__ or err.__context__
    return (str(err).strip().splitlines() or [type(err).__name__])[0]

"""Where documents come from: the embedded stdlib corpus, local files, or a Hugging Face Hub dataset.

``resolve_source`` validates a ``data.source`` string without reading any data, ``check_source``
sniffs local files for problems (``checks``), ``fingerprint`` gives a cheap identity for cache keys
(paths, sizes and mtimes; never file contents), and ``load_documents`` returns the documents as a
list of strings. Every problem the user can fix is a ``UserError`` naming the key and the file.

Local files are read with Hugging Face ``datasets``: ``.json``/``.jsonl`` and ``.parquet`` give
one document per record (from ``text_field``); ``.txt`` files give one document per paragraph
(blank-line separated), so that even a single text file can be split into train/val by document.
"""

from __future__ import annotations

import glob
import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from diffexp.data import checks
from diffexp.data.corpus import DEFAULT_MAX_CHARS, load_stdlib_corpus, stdlib_fingerprint, take_chars
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


def _source_error(spec: str, problem: str) -> UserError:
    return UserError(f"data.source={spec!r}: {problem}; {EXPECTED_SOURCES}")


def _supported(paths: Iterable[Path]) -> list[Path]:
    return sorted(p for p in paths if p.is_file() and p.suffix.lower() in BUILDER_BY_SUFFIX)


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
        files = _supported(
            p for p in path.rglob("*") if not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
        if not files:
            raise _source_error(spec, "directory contains no .txt/.jsonl/.json/.parquet files")
        return Source(spec, "files", files=tuple(p.resolve() for p in files))
    if glob.has_magic(spec):
        files = _supported(Path(p) for p in glob.glob(os.path.expanduser(spec), recursive=True))
        if not files:
            raise _source_error(spec, "glob matches no .txt/.jsonl/.json/.parquet files")
        return Source(spec, "files", files=tuple(p.resolve() for p in files))
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


def _read_error(spec: str, data_files: list[str], err: Exception) -> UserError:
    """A reader failed on something the prefix checks could not see: find the file, or name the group."""
    found = checks.first_bad_utf8([Path(p) for p in data_files])
    if found:
        return checks.file_error(spec, *found)
    where = data_files[0] if len(data_files) == 1 else f"one of {len(data_files)} files (first: {data_files[0]})"
    return UserError(f"data.source={spec!r}: could not read {where}: {root_cause(err)}")


def _text_or_error(value: object, text_field: str, spec: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise UserError(f"data.text_field={text_field!r}: records of data.source={spec!r} hold "
                    f"{type(value).__name__} values in this field, not text")


def _iter_local_texts(source: Source, text_field: str, hf_cache_dir: str) -> Iterable[str]:
    from datasets import load_dataset  # heavy import; only needed for local/hub sources

    # One load_dataset call per builder (not per file) keeps many-file directories fast.
    for builder in dict.fromkeys(BUILDER_BY_SUFFIX.values()):
        data_files = [str(p) for p in source.files
                      if BUILDER_BY_SUFFIX[p.suffix.lower()] == builder and p.stat().st_size > 0]
        if not data_files:
            continue
        extra = {"sample_by": "paragraph"} if builder == "text" else {}
        try:
            dataset = load_dataset(builder, data_files=data_files, split="train", cache_dir=hf_cache_dir, **extra)
        except Exception as err:  # `datasets` raises many types; all mean "this file cannot be read"
            raise _read_error(source.spec, data_files, err) from err
        field = "text" if builder == "text" else text_field
        if field not in dataset.column_names:
            raise UserError(
                f"data.text_field={text_field!r}: no such column in {data_files[0]!r} "
                f"(columns: {dataset.column_names})"
            )
        for text in dataset[field]:
            if builder == "text":
                yield text.strip("\n")
            else:
                yield _text_or_error(text, text_field, source.spec)


def _iter_hub_texts(source: Source, text_field: str, hf_cache_dir: str) -> Iterable[str]:
    from datasets import load_dataset

    # Streaming reads only as many records as max_chars needs instead of the whole dataset.
    try:
        dataset = load_dataset(
            source.hf_name, source.hf_config, split="train", streaming=True, cache_dir=hf_cache_dir
        )
    except Exception as err:  # offline, no such dataset or config, no "train" split, ...
        raise UserError(f"data.source={source.spec!r}: could not open the Hub dataset: {root_cause(err)}") from err
    for record in dataset:
        if text_field not in record:
            raise UserError(
                f"data.text_field={text_field!r}: no such column in {source.spec!r} (columns: {list(record)})"
            )
        yield _text_or_error(record[text_field], text_field, source.spec)


def load_documents(source: Source, text_field: str, max_chars: int | None, hf_cache_dir: str) -> list[str]:
    """All documents of ``source``, capped at ``max_chars`` (stdlib default: 8 M characters)."""
    if source.kind == "stdlib":
        return load_stdlib_corpus(DEFAULT_MAX_CHARS if max_chars is None else max_chars)
    if source.kind == "hf":
        return take_chars(_iter_hub_texts(source, text_field, hf_cache_dir), max_chars)
    return take_chars(_iter_local_texts(source, text_field, hf_cache_dir), max_chars)

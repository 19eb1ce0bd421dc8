"""Cheap checks of local data files and tokenizer files, before any tokenization or training.

Each check reads a prefix of the file (or a Parquet file's footer), never the whole file, and turns
what `datasets`/`tokenizers` would report as a generic error with a traceback (an empty file, random
bytes named .txt, a .parquet that is not one, a missing text column, Latin-1 text) into a `UserError`
that names the config key as the user writes it, the file and the problem.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Sequence
from pathlib import Path

from diffexp.errors import UserError

SNIFF_BYTES = 16 * 1024  # enough to tell text from binary and UTF-8 from not, at every run, for every file
RECORD_BYTES = 1 << 20  # how far to read when the first JSON record is longer than that
TEXT_CONTROL = frozenset(b"\t\n\v\f\r\b\x1b")  # control bytes ordinary text files do hold
PARQUET_MAGIC = b"PAR1"
TOKENIZER_CHOICES = ("expected 'byte', 'bpe', a path to an existing tokenizer.json file, or a Hugging Face Hub "
                     "tokenizer name (online only)")


def _read_prefix(path: Path, size: int) -> tuple[bytes, bool]:
    """The first `size` bytes of the file, and whether that is the whole file."""
    with open(path, "rb") as f:
        data = f.read(size + 1)
    return data[:size], len(data) <= size


def _decode_prefix(data: bytes, complete: bool) -> tuple[str | None, str | None]:
    """(text, None) or (None, problem) for a prefix: binary data, or text that is not UTF-8."""
    if b"\x00" in data:
        return None, "is binary, not text (it holds NUL bytes; UTF-16 text must be re-saved as UTF-8)"
    try:
        # incremental: a multi-byte character cut at the end of the prefix is not an error
        return codecs.getincrementaldecoder("utf-8")().decode(data, final=complete), None
    except UnicodeDecodeError as err:
        controls = sum(1 for b in data if b < 32 and b not in TEXT_CONTROL)
        if controls > 0.05 * len(data):
            return None, "is binary, not text"
        return None, (f"is not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start}); "
                      "re-encode it, e.g. iconv -f latin1 -t utf-8")


def _field_problem(record: object, text_field: str) -> str | None:
    """Why the first record cannot give a document through data.text_field (None: it can)."""
    if not isinstance(record, dict):
        return f"holds {type(record).__name__} records, expected JSON objects with a {text_field!r} field"
    if text_field not in record:
        fields = ", ".join(map(repr, record)) or "none"
        return f"data.text_field={text_field!r}: its records have no such field (fields: {fields})"
    value = record[text_field]
    if value is not None and not isinstance(value, str):
        return f"data.text_field={text_field!r}: the field holds {type(value).__name__} values, not text"
    return None


def _first_jsonl_record(text: str, complete: bool) -> tuple[object | None, str | None]:
    """Parse every whole line of the prefix: (first record, None) or (None, problem)."""
    lines = text.split("\n")
    if not complete:
        lines = lines[:-1]  # cut by the prefix
    first = None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if number == 1 and not line.lstrip("\ufeff \t\r").startswith("{"):
                return None, f"is not JSON lines: it starts with {line[:20]!r}, expected '{{'"
            return None, f"is not valid JSON lines: line {number}: {err.msg} (column {err.colno})"
        first = record if first is None else first
    if first is None and complete:
        return None, "contains no text (only whitespace)"
    return first, None


def _first_json_record(text: str, complete: bool) -> tuple[object | None, str | None]:
    """A .json file: an array of records or JSON lines. (first record, None), (None, problem), or
    (None, None) when the first record is longer than the prefix."""
    stripped = text.lstrip("\ufeff \t\r\n")
    if not stripped:
        return None, "contains no text (only whitespace)" if complete else None
    if stripped[0] == "[":
        rest = stripped[1:].lstrip()
        if rest.startswith("]"):
            return None, "holds an empty JSON array: no records"
    elif stripped[0] == "{":
        rest = stripped
    else:
        return None, f"is not JSON records: it starts with {stripped[:20]!r}, expected '[' or '{{'"
    try:
        return json.JSONDecoder().raw_decode(rest)[0], None
    except json.JSONDecodeError as err:
        if not complete:
            return None, None  # leave it to the reader
        return None, f"is not valid JSON: {err.msg} at line {err.lineno} column {err.colno}"


def _parquet_problem(path: Path, text_field: str) -> str | None:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(4)
        f.seek(max(0, size - 4))
        tail = f.read(4)
    if head != PARQUET_MAGIC or tail != PARQUET_MAGIC:
        return "is not a Parquet file (no PAR1 marker at its start and end: mis-named, or cut short)"
    import pyarrow.parquet as pq  # reads only the footer

    try:
        metadata = pq.ParquetFile(path).metadata
    except Exception as err:  # pyarrow raises several types for a damaged footer
        return f"is a damaged Parquet file ({str(err).splitlines()[0]})"
    schema = metadata.schema.to_arrow_schema()
    if text_field not in schema.names:
        return f"data.text_field={text_field!r}: no such column (columns: {', '.join(map(repr, schema.names))})"
    kind = str(schema.field(text_field).type)
    if kind not in ("string", "large_string", "string_view"):
        return f"data.text_field={text_field!r}: the column holds {kind} values, not text"
    if metadata.num_rows == 0:
        return "has no rows"
    return None


def file_problem(path: Path, text_field: str) -> str | None:
    """What makes one non-empty local data file unusable, from a prefix of it (None: nothing found)."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return _parquet_problem(path, text_field)
    read = _first_jsonl_record if suffix == ".jsonl" else _first_json_record
    for size in (SNIFF_BYTES, RECORD_BYTES):
        data, complete = _read_prefix(path, size)
        text, problem = _decode_prefix(data, complete)
        if problem or text is None:
            return problem
        if suffix == ".txt":
            return "contains no text (only whitespace)" if complete and not text.strip() else None
        record, problem = read(text, complete)
        if problem or record is not None or complete:
            break  # else the first record is longer than the prefix: read further, once
    if problem or record is None:
        return problem
    return _field_problem(record, text_field)


def file_error(spec: str, path: Path, problem: str) -> UserError:
    """The message for a bad file: problems about the field lead with data.text_field, others data.source."""
    if problem.startswith("data.text_field="):
        key, _, rest = problem.partition(": ")
        return UserError(f"{key}: {path} (from data.source={spec!r}): {rest}")
    return UserError(f"data.source={spec!r}: {path} {problem}")


def check_files(spec: str, files: Sequence[Path], text_field: str) -> None:
    """Raise a UserError for the first local file that cannot give documents. Empty files are skipped
    (they add no documents), unless every file is empty."""
    nonempty = [p for p in files if p.stat().st_size > 0]
    if not nonempty:
        what = f"{files[0]} is empty (0 bytes)" if len(files) == 1 else f"all {len(files)} files are empty"
        raise UserError(f"data.source={spec!r}: {what}; expected text to train on")
    for path in nonempty:
        problem = file_problem(path, text_field)
        if problem:
            raise file_error(spec, path, problem)


def tokenizer_path(spec: str) -> Path | None:
    """Validate data.tokenizer: the path of an existing tokenizer.json file, or None for 'byte', 'bpe' and a
    name that is no path (a Hub tokenizer, checked when it is loaded)."""
    if spec in ("byte", "bpe"):
        return None
    path = Path(spec).expanduser()
    if path.is_dir():
        inside = path / "tokenizer.json"
        hint = f"; did you mean {str(inside)!r}?" if inside.is_file() else ""
        raise UserError(f"data.tokenizer={spec!r}: {path} is a directory, not a tokenizer.json file{hint}")
    if not path.is_file():
        if looks_like_path(spec):
            raise UserError(f"data.tokenizer={spec!r}: no such file; {TOKENIZER_CHOICES}")
        return None
    return path.resolve()


def looks_like_path(spec: str) -> bool:
    """A tokenizer setting that names a file; a Hub repository is 'name' or 'org/name'."""
    return spec.endswith(".json") or spec.startswith((".", "/", "~")) or "\\" in spec or spec.count("/") > 1


def tokenizer_error(spec: str, path: Path, err: Exception) -> UserError:
    reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return UserError(f"data.tokenizer={spec!r}: {path} is not a Hugging Face tokenizer.json ({reason}); "
                     f"{TOKENIZER_CHOICES} (as written by tokenizers.Tokenizer.save)")

"""A corpus as units of work: each unit is a piece of the source that one process reads on its own.

``plan_units`` cuts a source without reading it whole (byte ranges ending at a record boundary, runs of Parquet
row groups or stdlib files, Hub shards); the plan depends only on the content, so every machine preparing a part
makes the same plan.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from diffexp.data.sources import Source, root_cause
from diffexp.errors import UserError

MIB = 1 << 20
MIN_UNIT_BYTES, MAX_UNIT_BYTES = 8 * MIB, 256 * MIB
UNITS_TARGET = 64  # enough units to keep every core busy and a kill cheap to redo, few enough files
READ_BLOCK = 1 * MIB


@dataclass(frozen=True)
class Unit:
    """One unit of work: ``kind`` says how to read it; ``start``/``stop`` are bytes, row groups or files."""

    index: int
    kind: str  # "lines" (JSON lines), "paragraphs" (.txt), "json" (a JSON array), "row_groups", "files", "hub"
    path: str  # the file ("" for the embedded corpus and the Hub)
    start: int
    stop: int
    size: int  # bytes of source it covers (an estimate for the Hub: 0)
    max_chars: int | None = None  # the cap's remainder when the cap falls in this unit

    def to_json(self) -> dict:
        return asdict(self)


def unit_bytes_for(total_bytes: int) -> int:
    """Unit size from the corpus size alone (never from the process count, so every machine plans alike)."""
    return int(min(MAX_UNIT_BYTES, max(MIN_UNIT_BYTES, total_bytes // UNITS_TARGET)))


def _next_boundary(f, offset: int, separators: tuple[bytes, ...], size: int) -> int:
    """The first offset >= ``offset`` just past a separator (a record boundary), or the file's end."""
    longest = max(map(len, separators))
    base = max(0, offset - longest)
    f.seek(base)
    data = b""
    while True:
        block = f.read(READ_BLOCK)
        data += block
        hits = [i + len(s) for s in separators if (i := data.find(s, max(0, offset - len(s) - base))) >= 0]
        if hits:
            return base + min(hits)
        if not block:
            return size
        keep = longest - 1  # a separator may straddle two blocks
        base, data = base + len(data) - keep, data[len(data) - keep:]


def _record_ranges(path: Path, separators: tuple[bytes, ...], unit_bytes: int) -> list[tuple[int, int]]:
    size = path.stat().st_size
    cuts = [0]
    with open(path, "rb") as f:
        while cuts[-1] < size:
            cuts.append(_next_boundary(f, cuts[-1] + unit_bytes, separators, size))
    return list(zip(cuts[:-1], cuts[1:]))


PARAGRAPH_ENDS = (b"\n\n", b"\n\r\n")  # .txt documents are paragraphs; CRLF text ends them with \r\n\r\n


def _file_units(path: Path, unit_bytes: int) -> list[tuple[str, int, int, int]]:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        metadata = pq.ParquetFile(path).metadata
        groups, start, size = [], 0, 0
        for group in range(metadata.num_row_groups):
            size += metadata.row_group(group).total_byte_size
            if size >= unit_bytes or group == metadata.num_row_groups - 1:
                groups.append(("row_groups", start, group + 1, size))
                start, size = group + 1, 0
        return groups
    if suffix == ".json" and _starts_with_array(path):
        return [("json", 0, 0, path.stat().st_size)]
    if suffix == ".txt":
        return [("paragraphs", a, b, b - a) for a, b in _record_ranges(path, PARAGRAPH_ENDS, unit_bytes)]
    return [("lines", a, b, b - a) for a, b in _record_ranges(path, (b"\n",), unit_bytes)]


def _starts_with_array(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"[")


def plan_units(source: Source, text_field: str, max_chars: int | None, hf_cache_dir: str,
               unit_bytes: int | None = None) -> list[Unit]:
    """The corpus as units, in corpus order (see the module docstring); ``unit_bytes`` overrides the size
    ``unit_bytes_for`` gives."""
    if source.kind == "stdlib":
        from diffexp.data.corpus import DEFAULT_MAX_CHARS, stdlib_source_files

        files = stdlib_source_files()
        sizes = [p.stat().st_size for p in files]
        unit_bytes = unit_bytes or unit_bytes_for(sum(sizes))
        pieces, start, size = [], 0, 0
        for i, file_size in enumerate(sizes):
            size += file_size
            if size >= unit_bytes or i == len(files) - 1:
                pieces.append(("", "files", start, i + 1, size))
                start, size = i + 1, 0
        max_chars = DEFAULT_MAX_CHARS if max_chars is None else max_chars
    elif source.kind == "hf":
        shards = _hub_shards(source, hf_cache_dir) if max_chars is None else 1  # a cap reads the stream in order
        pieces = [("", "hub", k, k + 1, 0) for k in range(shards)]
    else:
        files = [p for p in source.files if p.stat().st_size > 0]
        unit_bytes = unit_bytes or unit_bytes_for(sum(p.stat().st_size for p in files))
        pieces = [(str(p), kind, a, b, size) for p in files for kind, a, b, size in _file_units(p, unit_bytes)]
    units = [Unit(i, kind, path, a, b, size) for i, (path, kind, a, b, size) in enumerate(pieces)]
    return units if max_chars is None else _capped_units(units, source, text_field, max_chars, hf_cache_dir)


def _capped_units(units: list[Unit], source: Source, text_field: str, max_chars: int, hf_cache_dir: str) -> list[Unit]:
    """The units up to the one where ``max_chars`` characters of documents are reached, that one carrying
    the characters left, read in order (the cap is for small corpora: reading up to it is cheap)."""
    total = 0
    for unit in units:
        before = total
        for text in unit_documents(unit, source, text_field, hf_cache_dir):
            if total + len(text) >= max_chars:
                last = Unit(**{**unit.to_json(), "max_chars": max_chars - before})
                return [*units[: unit.index], last]
            total += len(text)
    return units


def _hub_shards(source: Source, hf_cache_dir: str) -> int:
    dataset = _open_hub(source, hf_cache_dir)
    return int(getattr(dataset, "n_shards", 1) or 1) if hasattr(dataset, "shard") else 1


def _open_hub(source: Source, hf_cache_dir: str):
    from datasets import load_dataset

    try:
        return load_dataset(source.hf_name, source.hf_config, split="train", streaming=True, cache_dir=hf_cache_dir)
    except Exception as err:  # offline, no such dataset or config, no "train" split, ...
        raise UserError(f"data.source={source.spec!r}: could not open the Hub dataset: {root_cause(err)}") from err


# -- reading one unit --------------------------------------------------------------------------------------
def unit_documents(unit: Unit, source: Source, text_field: str, hf_cache_dir: str = "") -> Iterator[str]:
    """The unit's non-empty documents in order, the last one truncated where ``unit.max_chars`` runs out."""
    left = unit.max_chars
    for text in _raw_documents(unit, source, text_field, hf_cache_dir):
        if not text or not text.strip():
            continue
        if left is not None:
            if len(text) >= left:
                yield text[:left]
                return
            left -= len(text)
        yield text


def _raw_documents(unit: Unit, source: Source, text_field: str, hf_cache_dir: str) -> Iterator[str | None]:
    if unit.kind == "files":
        from diffexp.data.corpus import _read_or_empty, stdlib_source_files

        yield from map(_read_or_empty, stdlib_source_files()[unit.start : unit.stop])
    elif unit.kind == "hub":
        dataset = _open_hub(source, hf_cache_dir)
        if unit.max_chars is None and hasattr(dataset, "shard") and getattr(dataset, "n_shards", 1) > 1:
            dataset = dataset.shard(num_shards=dataset.n_shards, index=unit.start)
        for record in dataset:
            if text_field not in record:
                raise UserError(f"data.text_field={text_field!r}: no such column in {source.spec!r} "
                                f"(columns: {list(record)})")
            yield _text_value(record[text_field], text_field, source.spec)
    elif unit.kind == "row_groups":
        import pyarrow.parquet as pq

        parquet = pq.ParquetFile(unit.path)
        for group in range(unit.start, unit.stop):
            yield from parquet.read_row_group(group, columns=[text_field]).column(0).to_pylist()
    elif unit.kind == "json":
        records = json.loads(Path(unit.path).read_text(encoding="utf-8"))
        for number, record in enumerate(records, 1):
            yield _field_text(record, text_field, source.spec, unit.path, number)
    else:
        yield from _range_documents(unit, source, text_field)


def _range_documents(unit: Unit, source: Source, text_field: str) -> Iterator[str | None]:
    """JSON lines or paragraphs of a byte range, read in blocks (a range never holds a cut record)."""
    with open(unit.path, "rb") as f:
        f.seek(unit.start)
        left, carry = unit.stop - unit.start, b""
        separator = b"\n" if unit.kind == "lines" else None
        while left > 0 or carry:
            block = f.read(min(READ_BLOCK, left)) if left > 0 else b""
            left -= len(block)
            data = carry + block
            if left > 0:  # keep the tail after the last boundary for the next block
                cut = data.rfind(b"\n") + 1 if separator else _last_paragraph_end(data)
                data, carry = data[:cut], data[cut:]
            else:
                carry = b""
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as err:
                at = unit.stop - left - len(carry) - len(data) + err.start
                raise UserError(f"data.source={source.spec!r}: {unit.path} is not UTF-8 text (byte "
                                f"0x{data[err.start]:02x} at offset {at}); re-encode it, e.g. iconv -f latin1 "
                                "-t utf-8") from None
            if unit.kind == "lines":
                for line in text.split("\n"):
                    if line.strip():
                        yield _json_line(line, text_field, source.spec, unit.path)
            else:
                text = text.replace("\r\n", "\n").replace("\r", "\n")  # universal newlines, as `datasets` reads
                for paragraph in text.split("\n\n"):
                    yield paragraph.strip("\n")


def _last_paragraph_end(data: bytes) -> int:
    return max(data.rfind(b"\n\n") + 2 if b"\n\n" in data else 0, data.rfind(b"\n\r\n") + 3 if b"\n\r\n" in data else 0)


def _json_line(line: str, text_field: str, spec: str, path: str) -> str | None:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise UserError(f"data.source={spec!r}: {path} is not valid JSON lines: {err.msg} in the line "
                        f"{line[:60]!r}") from None
    return _field_text(record, text_field, spec, path, None)


def _field_text(record: object, text_field: str, spec: str, path: str, number: int | None) -> str | None:
    if not isinstance(record, dict) or text_field not in record:
        where = f"record {number} of {path}" if number else f"a record of {path}"
        fields = ", ".join(map(repr, record)) if isinstance(record, dict) else type(record).__name__
        raise UserError(f"data.text_field={text_field!r}: {where} has no such field (it holds: {fields})")
    return _text_value(record[text_field], text_field, spec)


def _text_value(value: object, text_field: str, spec: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise UserError(f"data.text_field={text_field!r}: records of data.source={spec!r} hold "
                    f"{type(value).__name__} values in this field, not text")


# -- identity ----------------------------------------------------------------------------------------------
def content_fingerprint(source: Source) -> str:
    """The source's identity from its content, the same on every machine that holds a copy of it: relative
    names, sizes and the first and last MiB of each file (the embedded corpus: its own fingerprint; the Hub:
    the dataset's name and config)."""
    if source.kind == "stdlib":
        from diffexp.data.corpus import stdlib_fingerprint

        return f"stdlib-{stdlib_fingerprint()}"
    if source.kind == "hf":
        return f"hf-{source.hf_name}-{source.hf_config}"
    root = Path(source.files[0]).parent if len(source.files) == 1 else Path(*_common_parts(source.files))
    digest = hashlib.sha256()
    for path in source.files:
        size = path.stat().st_size
        digest.update(f"{path.relative_to(root).as_posix()}:{size}\n".encode())
        with open(path, "rb") as f:
            digest.update(f.read(MIB))
            if size > 2 * MIB:
                f.seek(size - MIB)
                digest.update(f.read(MIB))
    return f"files-{digest.hexdigest()[:16]}"


def _common_parts(paths) -> tuple[str, ...]:
    parts = [Path(p).parent.parts for p in paths]
    common = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return tuple(common) or ("/",)

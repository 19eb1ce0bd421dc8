"""Columns of a table the evaluations read: a local .jsonl, .csv or .parquet file, or a Hugging Face Hub
dataset (``hf:<name>[:<config>]``, or a bare name that is not a local path).

``open_table`` reads the whole table, so every problem is a ``UserError`` naming the command's flag before any
model is built; ``ClassLabel`` columns keep their class names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diffexp.data.sources import root_cause
from diffexp.errors import Flag, UserError, cli_flag

TABLE_SUFFIXES = (".jsonl", ".csv", ".parquet")
EXPECTED = ("expected a local .jsonl, .csv or .parquet file, or a Hugging Face Hub dataset as hf:<name> or "
            "hf:<name>:<config> (needs network the first time)")


@dataclass
class Table:
    """A table's columns as Python lists; ``class_names[column]`` lists the names of a ClassLabel column.
    ``flag``: the options as the user writes them (``--dataset``, or ``options.dataset`` in a fit)."""

    spec: str
    columns: dict[str, list[Any]]
    class_names: dict[str, list[str]] = field(default_factory=dict)
    flag: Flag = cli_flag

    @property
    def where(self) -> str:
        """The table as the user named it: ``--dataset='rows.jsonl'``."""
        return f"{self.flag('dataset')}={self.spec!r}"

    @property
    def name(self) -> str:
        """A short name for files and plots: the file's stem, or the Hub dataset's name and config."""
        if self.spec.startswith("hf:") or not Path(self.spec).suffix:
            return self.spec.removeprefix("hf:").rstrip(":").replace(":", "-").rsplit("/", 1)[-1]
        return Path(self.spec).stem

    def column(self, name: str, option: str) -> list[Any]:
        """A column by name, given as ``option`` (``text_column``); a missing one is a UserError naming that option
        and the columns there are."""
        if name not in self.columns:
            raise UserError(f"{self.flag(option)}={name!r} is invalid: {self.where} has no such column; "
                            f"its columns: {', '.join(self.columns)}")
        return self.columns[name]


def open_table(spec: str, split: str | None = None, flag: Flag = cli_flag) -> Table:
    """The table ``spec`` (option ``dataset``) names; ``split`` (option ``split``) selects a Hub dataset's split
    (default: train). ``flag``: the options as the user writes them."""
    given = f"{flag('dataset')}={spec!r}"
    hub = spec.startswith("hf:")
    path = Path(spec).expanduser()
    if not hub and path.exists():
        if split is not None:
            raise UserError(f"{flag('split')}={split!r} is invalid: a local file is one table; {flag('split')} "
                            f"selects a split of a Hub dataset ({flag('dataset')}=hf:<name>)")
        if not path.is_file():
            raise UserError(f"{given} is invalid: it is a directory; {EXPECTED}")
        if path.suffix.lower() not in TABLE_SUFFIXES:
            raise UserError(f"{given} is invalid: unknown extension {path.suffix!r}; {EXPECTED}")
        table = _read_local(spec, path, given)
    elif not hub and (path.suffix or spec.startswith((".", "/", "~"))):
        raise UserError(f"{given} is invalid: no such file; {EXPECTED}")
    else:
        table = _read_hub(spec, split or "train", given)
    table.flag = flag
    return table


def _read_local(spec: str, path: Path, given: str) -> Table:
    import pyarrow.csv
    import pyarrow.json
    import pyarrow.parquet

    csv_options = pyarrow.csv.ParseOptions(newlines_in_values=True)  # quoted texts may hold newlines
    reader = {".jsonl": pyarrow.json.read_json, ".parquet": pyarrow.parquet.read_table,
              ".csv": lambda p: pyarrow.csv.read_csv(p, parse_options=csv_options)}[path.suffix.lower()]
    try:
        table = reader(str(path))
    except Exception as err:  # pyarrow raises ArrowInvalid, OSError, ... for a file it cannot parse
        raise UserError(f"{given} is invalid: could not read it as {path.suffix.lower()[1:]}: "
                        f"{root_cause(err)}") from None
    return Table(spec, {name: table.column(name).to_pylist() for name in table.column_names},
                 _class_names(table.schema))


def _class_names(schema) -> dict[str, list[str]]:
    """Names of the ClassLabel columns a schema's `datasets` metadata declares (none for plain files)."""
    if not schema.metadata or b"huggingface" not in schema.metadata:
        return {}
    from datasets import ClassLabel, Features

    features = Features.from_arrow_schema(schema)
    return {name: list(f.names) for name, f in features.items() if isinstance(f, ClassLabel)}


def _read_hub(spec: str, split: str, given: str) -> Table:
    from datasets import ClassLabel, load_dataset

    name, _, config = spec.removeprefix("hf:").partition(":")
    if not name:
        raise UserError(f"{given} is invalid: no dataset name after 'hf:'; {EXPECTED}")
    local = "" if spec.startswith("hf:") else "it is not a local file, and "
    try:
        dataset = load_dataset(name, config or None, split=split)
    except Exception as err:  # offline, no such dataset, config or split: `datasets` raises many types
        raise UserError(f"{given} is invalid: {local}the Hugging Face Hub dataset could not be "
                        f"loaded (split {split!r}; offline, only datasets already in the local Hub cache load): "
                        f"{root_cause(err)}; {EXPECTED}") from None
    names = {c: list(f.names) for c, f in dataset.features.items() if isinstance(f, ClassLabel)}
    return Table(spec, {c: list(dataset[c]) for c in dataset.column_names}, names)

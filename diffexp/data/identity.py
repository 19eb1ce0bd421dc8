"""What a text data config will read, known before any work: whether it can be read at all, its prepared directory,
whether that is still the one a checkpoint's run read, and its tokenizer.

A directory prepared again in place (other settings, another corpus) holds other tokens under the same name: a
resume would continue on other data, and its validation split would no longer be the documents that run held out.
A checkpoint's weights (`model.init_from`) mean something only with the tokenizer they were trained with. Both are
found from the manifest and the config alone, before any file is written.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from diffexp.data.prepare import SETTINGS
from diffexp.data.prepared import check_finished, load_tokenizer, manifest_identity
from diffexp.data.shards import MANIFEST, read_manifest
from diffexp.errors import UserError


def check_text_data(data_args: dict[str, Any]) -> None:
    """What building a TextDataModule and opening its data would refuse, found without any work: a prepared
    data.source that is unfinished (a part of several) or damaged; a raw source that is missing, empty, binary or
    lacks data.text_field, and bad tokenizer or split settings. `diffexp fit` and a sweep, before any trial, run
    this one check."""
    from diffexp.data.datamodule import TextDataModule

    if is_prepared_source(data_args):
        check_finished(Path(str(data_args["source"])), "data.source")
        return
    accepted = inspect.signature(TextDataModule.__init__).parameters
    args = {k: v for k, v in data_args.items() if k in accepted}
    if args.get("batch_size") == "auto":  # sized later (training/auto_batch.py); the data does not depend on it
        args.pop("batch_size")
    try:
        TextDataModule(**args)
    except TypeError:  # a value of the wrong type: the config's parser names it
        pass


def prepared_again(directory: Path, saved_identity: str | None) -> str | None:
    """The identity of the preparation in ``directory`` where it is not the one a checkpoint recorded
    (``saved_identity``: ``<identity>-<seq_len>``, as the training loader records it), else None: the same, or
    nothing to compare (no identity recorded, nothing prepared there yet, a damaged manifest that opening the
    directory reports)."""
    if not saved_identity:
        return None
    try:
        identity = manifest_identity(read_manifest(Path(directory).expanduser(), ""))
    except (UserError, KeyError, TypeError):
        return None
    return identity if identity != str(saved_identity).rsplit("-", 1)[0] else None


def prepared_dir_for(data_args: dict[str, Any]) -> Path | None:
    """The prepared directory a TextDataModule with these init args reads: its source, or its raw source's cache
    entry (nothing is prepared); None where the args make no data module (building it reports why)."""
    from diffexp.data.datamodule import TextDataModule

    accepted = inspect.signature(TextDataModule.__init__).parameters
    if is_prepared_source(data_args):
        return Path(str(data_args["source"])).expanduser()
    try:
        return TextDataModule(**{k: v for k, v in data_args.items() if k in accepted}).prepared_dir
    except (UserError, TypeError):
        return None


def check_same_preparation(data_args: dict[str, Any], saved_identity: str | None, key: str, consequence: str,
                           remedy: str) -> None:
    """Refuse data prepared again since a checkpoint's run read it: ``key`` names where the source comes from
    (``data.source``, or the checkpoint's), ``consequence`` what reading it would do, ``remedy`` what works."""
    directory = prepared_dir_for(data_args)
    now = prepared_again(directory, saved_identity) if directory is not None else None
    if now is None:
        return
    source = str(data_args.get("source") or "stdlib")
    entry = "" if directory == Path(source).expanduser() else f" (its prepared cache entry {directory})"
    raise UserError(f"{key}={source!r}{entry} was prepared again since the checkpoint's run read it: its shards hold "
                    f"other tokens (data identity {now} now, {str(saved_identity).rsplit('-', 1)[0]} when that run "
                    f"trained), so {consequence}; {remedy}")


def planned_tokenizer(data_args: dict[str, Any]):
    """The tokenizer a TextDataModule with these init args will train with, where it is known before any work:
    its prepared directory's (the source, or the raw source's cache entry once prepared), the byte tokenizer or a
    tokenizer file; None for a BPE not trained yet, or where reading it fails (building the data module reports
    why)."""
    from tokenizers import Tokenizer

    from diffexp.data.checks import tokenizer_path
    from diffexp.data.tokenizer import ByteTokenizer, HFTokenizer, load_named_tokenizer

    directory = prepared_dir_for(data_args)
    if directory is None:
        return None
    try:
        if (directory / MANIFEST).is_file():
            return load_tokenizer(directory, read_manifest(directory, "")["tokenizer"], "")
        if is_prepared_source(data_args):
            return None  # an unfinished preparation: opening it reports that
        spec = str(data_args.get("tokenizer") or "byte")
        if spec == "byte":
            return ByteTokenizer()
        if spec == "bpe":
            return None
        named = tokenizer_path(spec)
        text = load_named_tokenizer(str(named) if named is not None else spec, "data.tokenizer")[1]
        wrapped = HFTokenizer(Tokenizer.from_str(text), "")  # as the preparation saves it (diffexp.data.prepare)
        return HFTokenizer(Tokenizer.from_str(wrapped.tokenizer.to_str()), "")
    except (UserError, KeyError, OSError):
        return None


def is_prepared_source(data_args: dict[str, Any]) -> bool:
    """data.source names a prepared directory (its tokenizer and splits are fixed there)."""
    source = Path(str(data_args.get("source") or "stdlib")).expanduser()
    return source.is_dir() and ((source / MANIFEST).is_file() or (source / SETTINGS).is_file())

"""Long held-out documents as token rows, for the loss-by-position evaluation (``diffexp eval nll``).

The documents come from the checkpoint's own training data (the validation split of its
``TextDataModule``: the same documents, split the same way, never trained on), from text files (one
document per file) or from a table's text column (one document per row; ``diffexp.data.tables``).
``long_token_rows`` keeps the first documents, in order, that are long enough and truncates them.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from pathlib import Path

from diffexp.data.tables import open_table
from diffexp.errors import Flag, UserError


def validation_texts(data: dict, flag: Flag, saved_identity: str | None = None,
                     tables: bool = False) -> tuple[Iterable[str], str]:
    """The validation documents of the text data a checkpoint was trained on (its ``data`` hyperparameters),
    and a description of them: decoded from its prepared shards where they exist, else read from its source.
    ``saved_identity``: the data identity the checkpoint recorded; shards prepared again since are refused.
    ``tables``: the evaluation also reads a table's rows (option `dataset`), which the refusals then offer."""
    from diffexp.data.datamodule import TextDataModule
    from diffexp.data.identity import check_same_preparation
    from diffexp.data.shards import MANIFEST

    # the way out every refusal below ends with
    instead = f"give documents with {flag('text_file')} FILE ..." + (f" or {flag('dataset')} PATH" if tables else "")
    if "source" not in data:
        raise UserError(f"the checkpoint was not trained on text documents (its data module has no data.source), "
                        f"so it has no validation documents; {instead}")
    source = str(data["source"])
    check_same_preparation(data, saved_identity, "the checkpoint's data.source", "its validation split is not the "
                           "documents that run held out (some may be ones it trained on)", "restore the preparation "
                           f"that run read, or {instead}")
    accepted = inspect.signature(TextDataModule.__init__).parameters
    try:
        module = TextDataModule(**{k: v for k, v in data.items() if k in accepted})
        if module.prepared_source is not None or (module.prepared_dir / MANIFEST).is_file():
            return module.prepared.texts("val"), f"the validation split of {source}"
        if source.startswith("hf:") and data.get("max_chars") is None:
            raise UserError(f"the checkpoint was trained on all of data.source={source!r}, which is not prepared "
                            f"here: finding its validation documents would read the whole Hub dataset; {instead}"
                            + (f" (a Hub dataset's own split: {flag('dataset')} hf:<name> {flag('split')} validation)"
                               if tables else ""))
        texts = module.splits()["val"]
    except UserError as err:
        raise UserError(f"the checkpoint's validation documents cannot be read back ({err}); {instead}") from None
    return texts, f"the validation split of {source}"


def file_texts(paths: Sequence[str], flag: Flag) -> list[str]:
    """Each file one document (UTF-8 text): the files of option `text_file`."""
    texts = []
    for name in paths:
        path = Path(name).expanduser()
        if not path.is_file():
            raise UserError(f"{flag('text_file')}={name!r} is invalid: no such file; expected UTF-8 text files")
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            raise UserError(f"{flag('text_file')}={name!r} is invalid: not UTF-8 text") from None
    return texts


def table_texts(spec: str, text_column: str, split: str | None, flag: Flag) -> list[str]:
    """Each row's text one document (empty rows dropped): option `text_column` of the table `spec`."""
    column = open_table(spec, split, flag).column(text_column, "text_column")
    return [str(text) for text in column if text is not None and str(text).strip()]


def long_token_rows(texts: Iterable[str], tokenizer, n_tokens: int, count: int, source: str,
                    flag: Flag) -> list[list[int]]:
    """The first ``count`` documents (option `documents`) of at least ``n_tokens`` tokens (option `context_len`
    + 1), each cut to its first ``n_tokens``."""
    rows, seen = [], 0
    for text in texts:
        seen += 1
        ids = list(tokenizer.encode(text))
        if len(ids) >= n_tokens:
            rows.append(ids[:n_tokens])
            if len(rows) == count:
                return rows
    documents, context_len = flag("documents"), flag("context_len")
    raise UserError(f"{documents}={count} is invalid: only {len(rows)} of the {seen} documents of {source} have "
                    f"at least {n_tokens} tokens ({context_len} + 1: the context and the token after it); lower "
                    f"{documents} or {context_len}, or give longer documents")

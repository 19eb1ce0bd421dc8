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
from diffexp.errors import UserError

ELSEWHERE = "give documents with --text-file FILE ... or --dataset PATH"


def validation_texts(data: dict, saved_identity: str | None = None) -> tuple[Iterable[str], str]:
    """The validation documents of the text data a checkpoint was trained on (its ``data`` hyperparameters),
    and a description of them: decoded from its prepared shards where they exist, else read from its source.
    ``saved_identity``: the data identity the checkpoint recorded; shards prepared again since are refused."""
    from diffexp.data.datamodule import TextDataModule
    from diffexp.data.identity import check_same_preparation
    from diffexp.data.shards import MANIFEST

    if "source" not in data:
        raise UserError(f"the checkpoint was not trained on text documents (its data module has no data.source), "
                        f"so it has no validation documents; {ELSEWHERE}")
    source = str(data["source"])
    check_same_preparation(data, saved_identity, "the checkpoint's data.source", "its validation split is not the "
                           "documents that run held out (some may be ones it trained on)", "restore the preparation "
                           f"that run read, or {ELSEWHERE}")
    accepted = inspect.signature(TextDataModule.__init__).parameters
    try:
        module = TextDataModule(**{k: v for k, v in data.items() if k in accepted})
        if module.prepared_source is not None or (module.prepared_dir / MANIFEST).is_file():
            return module.prepared.texts("val"), f"the validation split of {source}"
        if source.startswith("hf:") and data.get("max_chars") is None:
            raise UserError(f"the checkpoint was trained on all of data.source={source!r}, which is not prepared "
                            f"here: finding its validation documents would read the whole Hub dataset; {ELSEWHERE} "
                            "(a Hub dataset's own split: --dataset hf:<name> --split validation)")
        texts = module.splits()["val"]
    except UserError as err:
        raise UserError(f"the checkpoint's validation documents cannot be read back ({err}); {ELSEWHERE}") from None
    return texts, f"the validation split of {source}"


def file_texts(paths: Sequence[str]) -> list[str]:
    """Each file one document (UTF-8 text)."""
    texts = []
    for name in paths:
        path = Path(name).expanduser()
        if not path.is_file():
            raise UserError(f"--text-file={name!r} is invalid: no such file; expected UTF-8 text files")
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            raise UserError(f"--text-file={name!r} is invalid: not UTF-8 text") from None
    return texts


def table_texts(spec: str, text_column: str, split: str | None) -> list[str]:
    """Each row's text one document (empty rows dropped)."""
    column = open_table(spec, split).column(text_column, "--text-column")
    return [str(text) for text in column if text is not None and str(text).strip()]


def long_token_rows(texts: Iterable[str], tokenizer, n_tokens: int, count: int, source: str) -> list[list[int]]:
    """The first ``count`` documents of at least ``n_tokens`` tokens, each cut to its first ``n_tokens``."""
    rows, seen = [], 0
    for text in texts:
        seen += 1
        ids = list(tokenizer.encode(text))
        if len(ids) >= n_tokens:
            rows.append(ids[:n_tokens])
            if len(rows) == count:
                return rows
    raise UserError(f"--documents={count} is invalid: only {len(rows)} of the {seen} documents of {source} have "
                    f"at least {n_tokens} tokens (--context-len + 1: the context and the token after it); lower "
                    f"--documents or --context-len, or give longer documents")

"""Held-out token rows for the evaluations that read the model's own maps (outliers, quantize, rounding): windows of
context_len + 1 tokens (the inputs and, one position on, the targets) of the checkpoint's validation documents (as
`diffexp eval nll` finds them) or of --text-file. Each document is cut into consecutive windows, and the rows are
taken from the documents in turn (the first window of each, then the second of each, ...), so a few long
documents still give many rows, and many documents give rows from as many of them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from diffexp.evals.registry import Context, option


@dataclass
class HeldOutOptions:
    text_file: list[str] | None = option(None, "UTF-8 text files, one document each (default: the validation "
                                               "documents of the checkpoint's own training data)")
    context_len: int | None = option(None, "tokens per row (default: the length the model was trained at, "
                                           "data.seq_len, else its max_seq_len); a document needs one more",
                                     minimum=1)
    rows: int = option(32, "held-out rows: windows of context_len + 1 tokens, from the documents in turn", minimum=1)
    batch_size: int = option(4, "rows per forward", minimum=1)


def held_out_rows(options: HeldOutOptions, context: Context) -> tuple[list[list[int]], str]:
    """(rows of context_len + 1 token ids, where they come from); a UserError naming the flag otherwise."""
    from diffexp.data import documents

    context_len = checked_context_len(options.context_len, context)
    tokenizer = context.tokenizer()
    if options.text_file:
        texts = documents.file_texts(options.text_file, context.flag)
        source = f"the {context.flag('text_file')} files"
    else:
        texts, source = validation_texts(context)
    return windows(texts, tokenizer, context_len + 1, options.rows, source, context.flag("rows")), source


def checked_context_len(given: int | None, context: Context) -> int:
    """The tokens of context per row: `given`, else the length the model was trained at (data.seq_len, else its
    max_seq_len); a UserError naming context_len when longer than the model's max_seq_len."""
    from diffexp.evals.common import at_most_max_seq_len

    arch = context.arch
    trained = min(context.data.get("seq_len") or arch["max_seq_len"], arch["max_seq_len"])
    context_len = given if given is not None else trained
    at_most_max_seq_len(context.flag("context_len"), context_len, arch)
    return context_len


def validation_texts(context: Context, tables: bool = False):
    """(the validation documents of the model's own training data, a description of them); a checkpoint's data
    prepared again since it was saved is refused. `tables`: the evaluation reads tables too (option `dataset`)."""
    from diffexp.data import documents

    saved = None
    if context.checkpoint is not None:
        from diffexp.data.loader import ResumableDataLoader

        saved = ResumableDataLoader.saved_identity(context.checkpoint)
    return documents.validation_texts(context.data, context.flag, saved, tables)


def windows(texts, tokenizer, n_tokens: int, count: int, source: str, flag: str) -> list[list[int]]:
    """`count` windows of `n_tokens` ids, from the documents in turn; documents are read until there are at least
    `count` windows from at least `count` documents (or no more documents)."""
    from diffexp.errors import UserError

    per_document, total = [], 0
    for text in texts:
        ids = list(tokenizer.encode(text))
        cut = [ids[start:start + n_tokens] for start in range(0, len(ids) - n_tokens + 1, n_tokens)]
        if cut:
            per_document.append(cut)
            total += len(cut)
        if total >= count and len(per_document) >= count:
            break
    if total < count:
        raise UserError(f"{flag}={count} is invalid: the documents of {source} give {total} windows of {n_tokens} "
                        f"tokens (the context and the token after it); lower {flag} or the context length, or give "
                        "longer documents")
    rows = []
    for turn in range(max(len(cut) for cut in per_document)):
        rows += [cut[turn] for cut in per_document if turn < len(cut)][:count - len(rows)]
        if len(rows) == count:
            return rows
    return rows


def batches(rows: list[list[int]], batch_size: int, device) -> Iterator:
    """(B, context_len + 1) long tensors on `device`, in order."""
    import torch

    for first in range(0, len(rows), batch_size):
        yield torch.tensor(rows[first:first + batch_size], dtype=torch.long, device=device)


def decoder_of(model):
    """The `Decoder` of a `DiffexpLM` (or the decoder itself)."""
    return getattr(model, "model", model)


def variant_of(context: Context) -> str:
    return str(context.arch.get("attention", "?"))

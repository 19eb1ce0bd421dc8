"""Held-out token rows for the evaluations that read the model's own maps (outliers, quantize, rounding): the first
documents long enough of the checkpoint's validation documents (as `diffexp eval nll` finds them) or of
--text-file, each cut to context_len + 1 tokens (the inputs and, one position on, the targets).
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
    documents: int = option(8, "held-out rows: the first documents long enough, in order", minimum=1)
    batch_size: int = option(4, "rows per forward", minimum=1)


def held_out_rows(options: HeldOutOptions, context: Context) -> tuple[list[list[int]], str]:
    """(rows of context_len + 1 token ids, where they come from); a UserError naming the flag otherwise."""
    from diffexp.data import documents
    from diffexp.evals.common import at_most_max_seq_len

    arch = context.arch
    trained = min(context.data.get("seq_len") or arch["max_seq_len"], arch["max_seq_len"])
    context_len = options.context_len if options.context_len is not None else trained
    at_most_max_seq_len(context.flag("context_len"), context_len, arch)
    tokenizer = context.tokenizer()
    if options.text_file:
        texts, source = documents.file_texts(options.text_file), "the --text-file files"
    else:
        saved = None
        if context.checkpoint is not None:
            from diffexp.data.loader import ResumableDataLoader

            saved = ResumableDataLoader.saved_identity(context.checkpoint)
        texts, source = documents.validation_texts(context.data, saved)
    return documents.long_token_rows(texts, tokenizer, context_len + 1, options.documents, source), source


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

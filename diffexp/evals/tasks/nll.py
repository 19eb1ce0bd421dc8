"""NLL by position: the loss at each token position of long held-out documents, and its cumulative average.

The documents are the validation documents of the model's own training data, unless --text-file or --dataset
names others. The first `documents` documents long enough are scored, each cut to context_len + 1 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from diffexp.errors import UserError
from diffexp.evals.registry import Context, Evaluation, option, register


@dataclass
class NLLOptions:
    text_file: list[str] | None = option(None, "UTF-8 text files, one document each (default: the validation "
                                               "documents of the checkpoint's own training data)")
    dataset: str | None = option(None, "documents as the rows of a local .jsonl, .csv or .parquet file, or of a "
                                       "Hugging Face Hub dataset, hf:<name>[:<config>]")
    text_column: str = option("text", "--dataset's column of text")
    split: str | None = option(None, "a Hub dataset's split (default: train)")
    context_len: int | None = option(None, "tokens of context per document (default: the length the model was "
                                           "trained at, data.seq_len, else its max_seq_len); a document needs one "
                                           "more, the token after them", minimum=1)
    documents: int = option(32, "documents to average over: the first ones long enough, in order", minimum=1)
    batch_size: int = option(4, "documents per forward", minimum=1)


def inputs(options: NLLOptions, context: Context):
    from diffexp.data import documents
    from diffexp.evals.held_out import checked_context_len, validation_texts

    if options.text_file and options.dataset:
        raise UserError(f"{context.flag('text_file')} and {context.flag('dataset')} are exclusive: give the "
                        "documents one way")
    if options.split is not None and options.dataset is None:
        raise UserError(f"{context.flag('split')}={options.split!r} is invalid without {context.flag('dataset')}: "
                        "it selects a Hub dataset's split")
    context_len = checked_context_len(options.context_len, context)
    tokenizer = context.tokenizer()
    if options.text_file:
        texts = documents.file_texts(options.text_file, context.flag)
        source = f"the {context.flag('text_file')} files"
    elif options.dataset:
        texts = documents.table_texts(options.dataset, options.text_column, options.split, context.flag)
        source = repr(options.dataset)
    else:
        texts, source = validation_texts(context, tables=True)
    rows = documents.long_token_rows(texts, tokenizer, context_len + 1, options.documents, source, context.flag)
    return rows, source


def score(model, rows_and_source, options: NLLOptions, context: Context):
    from diffexp.evals.nll import NLLResults, token_nlls

    rows, source = rows_and_source
    return NLLResults.from_losses(token_nlls(model, rows, context.device, options.batch_size), source)


NLL = register(Evaluation(
    name="nll",
    summary="loss by token position on long held-out documents (cumulative average NLL vs position)",
    paper="The long-context loss curves of DIFF V1 (Figure 5) and DINT.",
    options=NLLOptions, inputs=inputs, score=score, tags=("nll/",), reads_text=True,
))

"""ICL: many-shot in-context classification, accuracy against the number of demonstrations, and its spread
over orderings of the same demonstrations (DIFF V1's Figure 6 and its robustness to order, Figure 7).

The task is synthetic by default: the shape left out is the model's own ICL training data's (ICLDataModule),
else K=4 classes of 10 words, 3 words per input. --dataset scores (text, label) rows instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from diffexp.errors import UserError
from diffexp.evals.registry import Context, Evaluation, option, register

Ordering = Literal["random", "alternating", "grouped"]
SHAPE = {"k_classes": 4, "group_size": 10, "words_per_input": 3, "random_label_names": False}
SYNTHETIC = tuple(SHAPE)


@dataclass
class ICLOptions:
    k_classes: int | None = option(None, "classes of the synthetic task (default: the checkpoint's ICLDataModule "
                                         "setting, else 4; also for the next three)", minimum=1)
    group_size: int | None = option(None, "words per class (default 10)", minimum=1)
    words_per_input: int | None = option(None, "words per input (default 3)", minimum=1)
    random_label_names: bool | None = option(None, "label names drawn per task (default false)")
    dataset: str | None = option(None, "(text, label) rows instead of the synthetic task: a local .jsonl, .csv or "
                                       ".parquet file, or a Hugging Face Hub dataset, hf:<name>[:<config>]")
    text_column: str | None = option(None, "--dataset's column of the inputs (default: text)")
    label_column: str | None = option(None, "--dataset's column of the classes: names, or integer ids "
                                            "(default: label)")
    split: str | None = option(None, "a Hub dataset's split (default: train)")
    n_demos: list[int] = option([1, 4, 16, 64], "numbers of demonstrations", minimum=1)
    orderings: list[Ordering] = option(["random", "alternating"], "ordering schemes of the demonstrations")
    n_orderings: int = option(5, "orders per scheme", minimum=1)
    n_tests: int = option(50, "held-out test inputs", minimum=1)
    seed: int = option(0, "seeds the demonstrations, the test inputs and the orders")


def _flags(context: Context) -> dict[str, str]:
    return {name: context.flag(name) for name in (*SYNTHETIC, "n_tests", "n_demos")}


def _synthetic(options: ICLOptions, context: Context):
    from diffexp.data.icl import ICLTask
    from diffexp.evals.common import as_flags

    trained = context.data if "k_classes" in context.data else {}
    shape = {key: getattr(options, key) if getattr(options, key) is not None else trained.get(key, default)
             for key, default in SHAPE.items()}
    source = "the checkpoint's ICLDataModule" if trained else "defaults"
    summary = (f"ICL task: K={shape['k_classes']}, {shape['group_size']} words per class, "
               f"{shape['words_per_input']} per input, random label names {shape['random_label_names']} "
               f"(options, else {source})")
    try:
        task = ICLTask(shape.pop("k_classes"), seed=options.seed, tokenizer=context.tokenizer(), **shape)
    except ValueError as err:
        raise UserError(as_flags(str(err), _flags(context))) from None
    hint = f"lower it, or raise {context.flag('group_size')} or {context.flag('words_per_input')}"
    if max(options.n_demos) > task.max_demos:
        raise UserError(f"{context.flag('n_demos')}={max(options.n_demos)} is invalid: this task has at most "
                        f"{task.max_demos} class-balanced distinct demonstrations; {hint}")
    if options.n_tests > task.max_tests:
        raise UserError(f"{context.flag('n_tests')}={options.n_tests} is invalid: this task has at most "
                        f"{task.max_tests} class-balanced held-out test inputs; {hint}")
    return task, summary, "icl", "the synthetic task"


def _dataset(options: ICLOptions, context: Context):
    from diffexp.data.classification import ClassificationTask, labelled_rows
    from diffexp.evals.common import as_flags

    given = [f"{context.flag(key)}={getattr(options, key)!r}" for key in SYNTHETIC if getattr(options, key) is not None]
    if given:
        raise UserError(f"{given[0]} is invalid with {context.flag('dataset')}={options.dataset!r}: it shapes the "
                        "synthetic task; a dataset's classes are its labels")
    rows = labelled_rows(options.dataset, options.text_column or "text", options.label_column or "label",
                         options.split, context.flag)
    try:
        task = ClassificationTask(rows, options.n_tests, seed=options.seed, tokenizer=context.tokenizer())
    except ValueError as err:
        raise UserError(as_flags(str(err), _flags(context))) from None
    if max(options.n_demos) > task.max_demos:
        raise UserError(f"{context.flag('n_demos')}={max(options.n_demos)} is invalid: {context.flag('dataset')}="
                        f"{options.dataset!r} gives at most {task.max_demos} class-balanced distinct demonstrations "
                        f"({task.demos_limit()}); lower {context.flag('n_demos')} or {context.flag('n_tests')}")
    summary = (f"ICL dataset {rows.source}: {len(rows.texts)} distinct texts, K={task.k_classes} labels "
               f"({', '.join(task.labels[:8])}{', ...' if task.k_classes > 8 else ''})")
    name = "icl_" + (re.sub(r"[^0-9A-Za-z]+", "_", rows.source).strip("_").lower() or "dataset")  # a tag, a file
    return task, summary, name, rows.source


def inputs(options: ICLOptions, context: Context):
    """(task, its description, the results' name, its source)."""
    for key in ("text_column", "label_column", "split"):
        if options.dataset is None and getattr(options, key) is not None:
            raise UserError(f"{context.flag(key)}={getattr(options, key)!r} is invalid without "
                            f"{context.flag('dataset')}: it describes a dataset's rows; give "
                            f"{context.flag('dataset')} PATH, or leave it out for the synthetic task")
    return _synthetic(options, context) if options.dataset is None else _dataset(options, context)


def score(model, task_inputs, options: ICLOptions, context: Context):
    from diffexp.evals.icl import evaluate_icl

    task, summary, name, source = task_inputs
    print(summary)
    return evaluate_icl(model, task, options.n_demos, options.orderings, options.n_orderings, options.n_tests,
                        device=context.device, seed=options.seed, max_seq_len=context.arch["max_seq_len"],
                        name=name, source=source)


ICL = register(Evaluation(
    name="icl",
    summary="many-shot in-context classification: accuracy vs demonstrations, spread over orderings",
    paper="DIFF V1 (arXiv 2410.05258), many-shot ICL (Figure 6) and robustness to demonstration order (Figure 7).",
    options=ICLOptions, inputs=inputs, score=score, tags=("icl/", "icl_std/", "icl_range/", "icl_"),
    reads_text=True,
))

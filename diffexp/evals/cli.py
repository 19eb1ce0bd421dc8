"""`diffexp eval <task> CKPT ...`: the papers' evaluations on a trained checkpoint.

Results go to files (default <run>/eval/) and into the run's own TensorBoard at the checkpoint's step.
A bad checkpoint or flag is a UserError, found before the model is built or any output exists
(diffexp.evals.common); diffexp.cli's guard prints it as one paragraph and exits 2.
"""

from __future__ import annotations

import argparse
import re
import sys

import torch

from diffexp.errors import UserError
from diffexp.evals.common import (
    CKPT_KEY,
    as_flags,
    at_most_max_seq_len,
    check_device,
    check_out,
    checkpoint_tokenizer,
    eval_output,
    load_checkpoint,
    load_model,
    positive,
    save_results,
)

TASKS = {
    "needle": "multi-needle retrieval (context length x depth x N,R) and attention to the answer vs noise",
    "icl": "many-shot in-context classification: accuracy vs demonstrations, spread over orderings",
    "mqar": "multi-query associative recall accuracy on held-out MQAR sequences",
    "nll": "loss by token position on long held-out documents (cumulative average NLL vs position)",
    "harness": "EleutherAI LM-Eval harness tasks (e.g. --tasks table2: the papers' zero-shot table)",
}
ICL_FLAGS = {"k_classes": "--k-classes", "group_size": "--group-size", "words_per_input": "--words-per-input",
             "n_tests": "--n-tests", "n_demos": "--n-demos"}
MQAR_FLAGS = {"seq_len": "--seq-len", "num_kv_pairs": "--num-kv-pairs", "val_size": "--samples",
              "vocab_size": "the checkpoint's model.arch.vocab_size"}


def usage() -> str:
    width = max(map(len, TASKS))
    lines = ["usage: diffexp eval TASK CKPT [options]", "",
             "Evaluate a trained checkpoint (CKPT: a .ckpt file or a sharded checkpoint directory). Results go",
             "to <run>/eval/ (or --out) and into the run's TensorBoard at the checkpoint's step.", "", "tasks:"]
    lines += [f"  {name:<{width}}  {text}" for name, text in TASKS.items()]
    lines += ["", "`diffexp eval TASK --help` lists the options of a task."]
    return "\n".join(lines)


def _task_parser(task: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog=f"diffexp eval {task}", description=description)
    parser.add_argument("checkpoint", metavar=CKPT_KEY,
                        help="a .ckpt file, a sharded checkpoint directory or a `diffexp export` directory")
    return parser


def _add_device_and_out(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None, help="default: <run>/eval/")


def _add_tokenizer_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokenizer", default=None,
                        help="'byte' or a tokenizer.json, for checkpoints saved without their tokenizer")


def _icl_task(args, trained: dict, tokenizer):
    """The synthetic ICL task the flags (else the checkpoint's ICLDataModule, else the defaults) describe."""
    from diffexp.data.icl import ICLTask

    shape = {"k_classes": 4, "group_size": 10, "words_per_input": 3, "random_label_names": False}
    for key in shape:
        given = getattr(args, key)
        shape[key] = given if given is not None else trained.get(key, shape[key])
    source = "the checkpoint's ICLDataModule" if trained else "defaults"
    summary = (f"ICL task: K={shape['k_classes']}, {shape['group_size']} words per class, "
               f"{shape['words_per_input']} per input, random label names {shape['random_label_names']} "
               f"(flags, else {source})")
    try:
        task = ICLTask(shape.pop("k_classes"), seed=args.seed, tokenizer=tokenizer, **shape)
    except ValueError as err:
        raise UserError(as_flags(str(err), ICL_FLAGS)) from None
    hint = "lower it, or raise --group-size or --words-per-input"
    if max(args.n_demos) > task.max_demos:
        raise UserError(f"--n-demos={max(args.n_demos)} is invalid: this task has at most {task.max_demos} "
                        f"class-balanced distinct demonstrations; {hint}")
    if args.n_tests > task.max_tests:
        raise UserError(f"--n-tests={args.n_tests} is invalid: this task has at most {task.max_tests} "
                        f"class-balanced held-out test inputs; {hint}")
    return task, summary


def _dataset_task(args, tokenizer):
    """The ICL task of --dataset's (text, label) rows, checked against --n-tests and --n-demos."""
    from diffexp.data.classification import ClassificationTask, labelled_rows

    synthetic = ("k_classes", "group_size", "words_per_input", "random_label_names")
    given = [f"--{key.replace('_', '-')}={getattr(args, key)!r}" for key in synthetic if getattr(args, key) is not None]
    if given:
        raise UserError(f"{given[0]} is invalid with --dataset={args.dataset!r}: it shapes the synthetic task; "
                        "a dataset's classes are its labels")
    rows = labelled_rows(args.dataset, args.text_column or "text", args.label_column or "label", args.split)
    try:
        task = ClassificationTask(rows, args.n_tests, seed=args.seed, tokenizer=tokenizer)
    except ValueError as err:
        raise UserError(as_flags(str(err), ICL_FLAGS)) from None
    if max(args.n_demos) > task.max_demos:
        raise UserError(f"--n-demos={max(args.n_demos)} is invalid: --dataset={args.dataset!r} gives at most "
                        f"{task.max_demos} class-balanced distinct demonstrations ({task.demos_limit()}); lower "
                        "--n-demos or --n-tests")
    summary = (f"ICL dataset {rows.source}: {len(rows.texts)} distinct texts, K={task.k_classes} labels "
               f"({', '.join(task.labels[:8])}{', ...' if task.k_classes > 8 else ''})")
    return task, summary, rows.source


def icl_main(argv: list[str]) -> int:
    """Many-shot in-context classification: accuracy vs demonstrations, spread over orderings."""
    from diffexp.evals.icl import ORDERINGS, evaluate_icl

    parser = _task_parser("icl", icl_main.__doc__)
    synthetic = parser.add_argument_group("the synthetic task (the default)")
    synthetic.add_argument("--k-classes", type=int, default=None,
                           help="default: the checkpoint's ICLDataModule setting, else 4 (also for the next three)")
    synthetic.add_argument("--group-size", type=int, default=None, help="words per class (default 10)")
    synthetic.add_argument("--words-per-input", type=int, default=None, help="default 3")
    synthetic.add_argument("--random-label-names", action=argparse.BooleanOptionalAction, default=None)
    dataset = parser.add_argument_group("a classification dataset instead")
    dataset.add_argument("--dataset", default=None,
                         help="(text, label) rows: a local .jsonl, .csv or .parquet file, or a Hugging Face Hub "
                              "dataset, hf:<name>[:<config>] (e.g. hf:clinc_oos:plus; needs network the first time)")
    dataset.add_argument("--text-column", default=None, help="the column of the inputs (default: text)")
    dataset.add_argument("--label-column", default=None,
                         help="the column of the classes: names, or integer ids (a ClassLabel's names are used) "
                              "(default: label)")
    dataset.add_argument("--split", default=None, help="a Hub dataset's split (default: train)")
    parser.add_argument("--n-demos", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--orderings", nargs="+", choices=ORDERINGS, default=["random", "alternating"])
    parser.add_argument("--n-orderings", type=int, default=5)
    parser.add_argument("--n-tests", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    _add_tokenizer_flag(parser)
    _add_device_and_out(parser)
    args = parser.parse_args(argv)
    # everything is checked before the model is built and before any output exists
    checkpoint, hparams = load_checkpoint(args.checkpoint)
    positive("--n-demos", args.n_demos)
    positive("--n-orderings", args.n_orderings)
    positive("--n-tests", args.n_tests)
    for flag in ("k_classes", "group_size", "words_per_input"):
        if getattr(args, flag) is not None:
            positive(ICL_FLAGS[flag], getattr(args, flag))
    for flag in ("text_column", "label_column", "split"):
        if args.dataset is None and getattr(args, flag) is not None:
            raise UserError(f"--{flag.replace('_', '-')}={getattr(args, flag)!r} is invalid without --dataset: it "
                            "describes a dataset's rows; give --dataset PATH, or leave it out for the synthetic task")
    tokenizer = checkpoint_tokenizer(checkpoint, hparams, args.tokenizer)
    check_device(args.device)
    check_out(args.out)
    if args.dataset is None:  # evaluate the task shape the model was trained on
        task, summary = _icl_task(args, hparams["data"] if "k_classes" in hparams["data"] else {}, tokenizer)
        name, source = "icl", "the synthetic task"
    else:
        task, summary, source = _dataset_task(args, tokenizer)
        name = "icl_" + (re.sub(r"[^0-9A-Za-z]+", "_", source).strip("_").lower() or "dataset")  # a tag, a file
    model = load_model(checkpoint, args.checkpoint, args.device)
    print(summary)
    results = evaluate_icl(model, task, args.n_demos, args.orderings,
                           args.n_orderings, args.n_tests, device=args.device, seed=args.seed,
                           max_seq_len=model.arch.max_seq_len, name=name, source=source)
    print(results.summary())
    out = save_results(results, args.checkpoint, args.out, hparams["global_step"])
    print(f"wrote {out}/{name}.*")
    return 0


def mqar_main(argv: list[str]) -> int:
    """Multi-query associative recall accuracy on held-out MQAR sequences."""
    parser = _task_parser("mqar", mqar_main.__doc__)
    parser.add_argument("--seq-len", type=int, default=256, help="tokens the model sees per sequence")
    parser.add_argument("--num-kv-pairs", type=int, default=16)
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=1234)
    _add_device_and_out(parser)
    args = parser.parse_args(argv)
    import json  # here, after --help: the MQAR modules import Lightning

    from diffexp.data.mqar import MQARDataModule
    from diffexp.evals.mqar import evaluate_mqar

    checkpoint, hparams = load_checkpoint(args.checkpoint)
    positive("--seq-len", args.seq_len)
    positive("--num-kv-pairs", args.num_kv_pairs)
    positive("--samples", args.samples)
    at_most_max_seq_len("--seq-len", args.seq_len, hparams["arch"])
    check_device(args.device)
    check_out(args.out)
    try:
        data = MQARDataModule(vocab_size=hparams["arch"]["vocab_size"], seq_len=args.seq_len,
                              num_kv_pairs=args.num_kv_pairs, val_size=args.samples, seed=args.seed)
    except ValueError as err:
        raise UserError(as_flags(str(err), MQAR_FLAGS)) from None
    model = load_model(checkpoint, args.checkpoint, args.device)
    result = evaluate_mqar(model, data, device=args.device)
    print(json.dumps(result))
    out, writer, step = eval_output(args.checkpoint, args.out, hparams["global_step"])
    (out / f"mqar-seq{args.seq_len}-kv{args.num_kv_pairs}.json").write_text(json.dumps(result, indent=2))
    if writer is not None:
        writer.add_scalar(f"mqar/accuracy_seq{args.seq_len}_kv{args.num_kv_pairs}", result["mqar/accuracy"], step)
        writer.close()
    return 0


def nll_main(argv: list[str]) -> int:
    """Loss by token position on long held-out documents: the cumulative average NLL against position."""
    parser = _task_parser("nll", nll_main.__doc__)
    given = parser.add_mutually_exclusive_group()
    given.add_argument("--text-file", nargs="+", default=None, metavar="FILE",
                       help="UTF-8 text files, one document each (default: the validation documents of the "
                            "checkpoint's own training data)")
    given.add_argument("--dataset", default=None,
                       help="documents as the rows of a local .jsonl, .csv or .parquet file, or of a Hugging Face "
                            "Hub dataset, hf:<name>[:<config>]")
    parser.add_argument("--text-column", default="text", help="--dataset's column of text (default: text)")
    parser.add_argument("--split", default=None, help="a Hub dataset's split (default: train)")
    parser.add_argument("--context-len", type=int, default=None,
                        help="tokens of context per document (default: the length the checkpoint was trained at, "
                             "data.seq_len, else its max_seq_len); a document needs one more, the token after them")
    parser.add_argument("--documents", type=int, default=32,
                        help="documents to average over: the first ones long enough, in order (default 32)")
    parser.add_argument("--batch-size", type=int, default=4, help="documents per forward (default 4)")
    _add_tokenizer_flag(parser)
    _add_device_and_out(parser)
    args = parser.parse_args(argv)
    from diffexp.data import documents  # here, after --help
    from diffexp.evals.nll import NLLResults, token_nlls

    checkpoint, hparams = load_checkpoint(args.checkpoint)
    trained = min(hparams["data"].get("seq_len") or hparams["arch"]["max_seq_len"], hparams["arch"]["max_seq_len"])
    context_len = args.context_len if args.context_len is not None else trained
    positive("--context-len", context_len)
    at_most_max_seq_len("--context-len", context_len, hparams["arch"])
    positive("--documents", args.documents)
    positive("--batch-size", args.batch_size)
    if args.split is not None and args.dataset is None:
        raise UserError(f"--split={args.split!r} is invalid without --dataset: it selects a Hub dataset's split")
    tokenizer = checkpoint_tokenizer(checkpoint, hparams, args.tokenizer)
    check_device(args.device)
    check_out(args.out)
    if args.text_file:
        texts, source = documents.file_texts(args.text_file), "the --text-file files"
    elif args.dataset:
        texts, source = documents.table_texts(args.dataset, args.text_column, args.split), repr(args.dataset)
    else:
        from diffexp.data.loader import ResumableDataLoader

        texts, source = documents.validation_texts(hparams["data"], ResumableDataLoader.saved_identity(checkpoint))
    rows = documents.long_token_rows(texts, tokenizer, context_len + 1, args.documents, source)
    model = load_model(checkpoint, args.checkpoint, args.device)
    results = NLLResults.from_losses(token_nlls(model, rows, args.device, args.batch_size), source)
    print(results.summary())
    out = save_results(results, args.checkpoint, args.out, hparams["global_step"])
    print(f"wrote {out}/{results.name}.*")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(usage())
        return 0
    if not argv or argv[0] not in TASKS:
        given = f"{argv[0]!r}" if argv else "no task"
        raise UserError(f"diffexp eval TASK: got {given}; expected one of {', '.join(TASKS)} "
                        "(`diffexp eval --help` describes them)")
    if argv[0] == "needle":
        from diffexp.evals.needle import needle_main

        return needle_main(argv[1:])
    if argv[0] == "harness":
        from diffexp.evals.harness import harness_main

        return harness_main(argv[1:])
    return {"icl": icl_main, "mqar": mqar_main, "nll": nll_main}[argv[0]](argv[1:])

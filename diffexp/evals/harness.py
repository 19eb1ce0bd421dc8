"""`diffexp eval harness CKPT --tasks ...`: EleutherAI LM-Eval harness tasks on a trained checkpoint.

``--tasks table2`` is the papers' zero-shot Table 2 (its datasets load from the Hugging Face hub). The metrics go
to ``harness.json`` in <run>/eval/ (or --out), which `diffexp compare` gathers, and to ``harness/<task>/<metric>``
in the run's TensorBoard at the checkpoint's step.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import json
import math
from pathlib import Path

import torch

from diffexp.errors import UserError
from diffexp.evals import HARNESS_RESULTS_FILE, common

#: the papers' zero-shot LM-Eval table (Shared DIFF and DINT Table 2), as LM-Eval names the tasks
TABLE2_TASKS = ("arc_challenge", "arc_easy", "boolq", "hellaswag", "openbookqa", "piqa", "winogrande")
PRESETS = {"table2": TABLE2_TASKS}


def _import_lm_eval():
    try:
        import lm_eval
    except ImportError:
        raise UserError("diffexp eval harness needs EleutherAI's LM-Eval harness: pip install 'lm-eval>=0.4,<0.5' "
                        "(or pip install 'diffexp[eval]')") from None
    return lm_eval


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, prog="diffexp eval harness", description=__doc__.split("\n\n")[0].split(": ")[1])
    parser.add_argument("checkpoint", metavar=common.CKPT_KEY,
                        help="a .ckpt file, a sharded checkpoint directory or a `diffexp export` directory")
    parser.add_argument("--tasks", nargs="+", required=True,
                        help="LM-Eval task or group names, or 'table2' (the papers' seven zero-shot tasks)")
    parser.add_argument("--include-path", action="append", default=[], metavar="DIR",
                        help="a directory of local task YAMLs (repeatable)")
    parser.add_argument("--num-fewshot", type=int, default=None, help="default: each task's own (0 for table2)")
    parser.add_argument("--limit", type=float, default=None,
                        help="documents per task (a fraction if < 1): for quick checks, not for reporting")
    parser.add_argument("--batch-size", type=int, default=16, help="rows per forward pass (default 16)")
    parser.add_argument("--bootstrap-iters", type=int, default=1000,
                        help="bootstrap resamples for the standard errors (0: none; default 1000)")
    parser.add_argument("--seed", type=int, default=1234, help="the harness's sampling and few-shot seed")
    parser.add_argument("--tokenizer", default=None,
                        help="'byte' or a tokenizer.json, for checkpoints saved without their tokenizer")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--compile", action="store_true",
                        help="generate through the torch.compile'd decoding step (CUDA graphs on a GPU)")
    parser.add_argument("--out", default=None, help=f"directory for {HARNESS_RESULTS_FILE} (default: <run>/eval/)")
    return parser


def expand_tasks(names: list[str]) -> list[str]:
    tasks = []
    for name in names:
        tasks += [t for t in PRESETS.get(name, (name,)) if t not in tasks]
    return tasks


@functools.lru_cache(maxsize=4)
def task_manager(include_paths: tuple[str, ...] = ()):
    """LM-Eval's TaskManager over its own tasks and include_paths (indexed once per process: seconds)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=list(include_paths) or None)


def check_tasks(tasks: list[str], include_paths: list[str]):
    """The TaskManager that knows every task, once each name and local task has been checked (datasets
    loaded) - before the model is built."""
    lm_eval = _import_lm_eval()
    from lm_eval.tasks import TaskManager

    for path in include_paths:
        if not Path(path).is_dir():
            raise UserError(f"--include-path={path!r} is invalid: no such directory; expected a directory of "
                            "task YAML files")
    # local tasks alone need no index of LM-Eval's thousands of task files (seconds to build)
    local = TaskManager(include_path=include_paths, include_defaults=False) if include_paths else None
    local_names = set(local.all_tasks) if local else set()
    manager = local if local and set(tasks) <= local_names else task_manager()
    known = local_names | set(manager.all_tasks)
    for task in tasks:
        if task not in known:
            close = difflib.get_close_matches(task, sorted(known), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise UserError(f"--tasks: {task!r} is not an LM-Eval {lm_eval.__version__} task, group or tag{hint} "
                            f"(presets: {', '.join(PRESETS)}; local tasks: --include-path DIR)")
    if manager is not local and set(tasks) & local_names:  # local and LM-Eval tasks together
        manager = task_manager(tuple(include_paths))
    try:
        manager.load(tasks)  # reads the datasets now: a missing download fails here, not after the model
    except Exception as err:  # datasets and the hub raise many types; the message is what helps
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"--tasks {' '.join(tasks)}: a task's dataset could not be loaded ({reason}). Hub tasks "
                        "(table2 among them) need hub access or its datasets cache; local tasks need their "
                        "data files") from None
    return manager


def table(results: dict) -> str:
    """The tasks' metrics as a markdown table (value ± stderr)."""
    lines = ["| task | metric | value | stderr |", "|---|---|---|---|"]
    for task, metrics in results["tasks"].items():
        for name, value in metrics.items():
            if name.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            stderr = metrics.get(f"{name}_stderr")
            shown = f"{stderr:.4f}" if isinstance(stderr, (int, float)) and math.isfinite(stderr) else "-"
            lines.append(f"| {task} | {name} | {value:.4f} | {shown} |")
    return "\n".join(lines)


def summarize(raw: dict, checkpoint: str, step: int, args) -> dict:
    """harness.json: metrics per task without LM-Eval's ",none" filter suffix, plus the run's settings."""
    tasks = {}
    for task, metrics in raw["results"].items():
        values = {}
        for key, value in metrics.items():
            name, _, filter_name = key.partition(",")
            if not filter_name or isinstance(value, str):
                continue  # "alias" and other labels
            name = name if filter_name == "none" else f"{name}[{filter_name}]"
            values[name] = float(value) if isinstance(value, (int, float)) else None
        tasks[task] = values
    import lm_eval

    return {"checkpoint": str(checkpoint), "step": step, "tasks": tasks,
            "n_samples": {task: n.get("effective") for task, n in (raw.get("n-samples") or {}).items()},
            "num_fewshot": raw.get("n-shot"), "limit": args.limit, "lm_eval_version": lm_eval.__version__,
            "seed": args.seed}


def harness_main(argv: list[str]) -> int:
    """Run LM-Eval harness tasks on a checkpoint (its own tokenizer) and save the metrics."""
    from diffexp.generate.cli import resolve_tokenizer

    args = build_parser().parse_args(argv)
    checkpoint, hparams = common.load_checkpoint(args.checkpoint)
    common.positive("--batch-size", args.batch_size)
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise UserError(f"--num-fewshot={args.num_fewshot} is invalid: expected an integer >= 0")
    if args.limit is not None and not args.limit > 0:
        raise UserError(f"--limit={args.limit} is invalid: expected a positive number (documents, or a fraction < 1)")
    if args.bootstrap_iters < 0:
        raise UserError(f"--bootstrap-iters={args.bootstrap_iters} is invalid: expected an integer >= 0")
    tokenizer = resolve_tokenizer(checkpoint, hparams, args.tokenizer)
    if tokenizer.vocab_size > hparams["arch"]["vocab_size"]:
        raise UserError(f"--tokenizer: its {tokenizer.vocab_size} ids do not fit the model's vocab_size="
                        f"{hparams['arch']['vocab_size']}; expected the tokenizer the model was trained with")
    common.check_device(args.device)
    common.check_out(args.out)
    if args.compile:
        common.check_compile(args.device)
    tasks = expand_tasks(args.tasks)
    manager = check_tasks(tasks, args.include_path)

    from lm_eval import simple_evaluate

    from diffexp.evals.harness_lm import DiffexpHarnessLM

    model = common.load_model(checkpoint, args.checkpoint, args.device)
    lm = DiffexpHarnessLM(model, tokenizer, args.batch_size, args.device, args.seed, compile=args.compile)
    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    raw = simple_evaluate(model=lm, tasks=tasks, num_fewshot=args.num_fewshot, limit=limit,
                          bootstrap_iters=args.bootstrap_iters, task_manager=manager, log_samples=False,
                          random_seed=args.seed, numpy_random_seed=args.seed, torch_random_seed=args.seed,
                          fewshot_random_seed=args.seed)
    results = summarize(raw, args.checkpoint, hparams["global_step"], args)
    print(table(results))
    out, writer, step = common.eval_output(args.checkpoint, args.out, hparams["global_step"])
    (out / HARNESS_RESULTS_FILE).write_text(json.dumps(results, indent=2) + "\n")
    if writer is not None:
        for task, metrics in results["tasks"].items():
            for name, value in metrics.items():
                if value is not None and math.isfinite(value):
                    writer.add_scalar(f"harness/{task}/{name}", value, step)
        writer.close()
    print(f"wrote {out / HARNESS_RESULTS_FILE}")
    return 0

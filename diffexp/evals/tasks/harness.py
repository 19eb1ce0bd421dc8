"""Harness: EleutherAI's LM-Eval harness tasks on the model, through diffexp's own decoding
(diffexp.evals.harness_lm). `--tasks table2` is the papers' zero-shot Table 2.

The metrics go to harness.json (which `diffexp compare` gathers into the study's Table 2) and to
harness/<task>/<metric> in TensorBoard.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from diffexp.errors import UserError
from diffexp.evals.layout import HARNESS_RESULTS_FILE
from diffexp.evals.registry import Context, Evaluation, option, register


@dataclass
class HarnessOptions:
    tasks: list[str] | None = option(None, "LM-Eval task or group names, or 'table2' (the papers' seven zero-shot "
                                           "tasks); required")
    include_path: list[str] = option([], "directories of local task YAMLs")
    num_fewshot: int | None = option(None, "default: each task's own (0 for table2)", minimum=0)
    limit: float | None = option(None, "documents per task (a fraction if < 1): for quick checks, not for reporting")
    batch_size: int = option(16, "rows per forward pass", minimum=1)
    bootstrap_iters: int = option(1000, "bootstrap resamples for the standard errors (0: none)", minimum=0)
    seed: int = option(1234, "the harness's sampling and few-shot seed")
    compile: bool = option(False, "generate through the torch.compile'd decoding step (CUDA graphs on a GPU)")


@dataclass
class HarnessResults:
    results: dict
    name: str = "harness"

    def scalars(self) -> dict[str, float]:
        return {f"harness/{task}/{metric}": value for task, metrics in self.results["tasks"].items()
                for metric, value in metrics.items() if value is not None and math.isfinite(value)}

    def summary(self) -> str:
        from diffexp.evals.harness import table

        return table(self.results)

    def save(self, directory) -> Path:
        path = Path(directory) / HARNESS_RESULTS_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.results, indent=2) + "\n")
        return path


def inputs(options: HarnessOptions, context: Context, likelihood_only: str | None = None):
    """(the task names, LM-Eval's TaskManager with their datasets loaded, the tokenizer). `likelihood_only`: why
    generation tasks cannot be scored (an evaluation that reaches only the model's whole-sequence forward)."""
    from diffexp.evals.harness import check_tasks, expand_tasks

    if not options.tasks:
        raise UserError(f"{context.flag('tasks')} is required: LM-Eval task or group names, or 'table2'")
    if options.limit is not None and not options.limit > 0:
        raise UserError(f"{context.flag('limit')}={options.limit} is invalid: expected a positive number "
                        "(documents, or a fraction < 1)")
    tokenizer = context.tokenizer()
    if options.compile:
        from diffexp.training.loading import check_compile

        check_compile(str(context.device))
    tasks = expand_tasks(options.tasks)
    return tasks, check_tasks(tasks, options.include_path, context.flag, likelihood_only), tokenizer


def score(model, prepared, options: HarnessOptions, context: Context) -> HarnessResults:
    from lm_eval import simple_evaluate

    from diffexp.evals.harness import summarize
    from diffexp.evals.harness_lm import DiffexpHarnessLM

    tasks, manager, tokenizer = prepared
    lm = DiffexpHarnessLM(model, tokenizer, options.batch_size, str(context.device), options.seed,
                          compile=options.compile)
    limit = int(options.limit) if options.limit is not None and options.limit >= 1 else options.limit
    raw = simple_evaluate(model=lm, tasks=tasks, num_fewshot=options.num_fewshot, limit=limit,
                          bootstrap_iters=options.bootstrap_iters, task_manager=manager, log_samples=False,
                          random_seed=options.seed, numpy_random_seed=options.seed, torch_random_seed=options.seed,
                          fewshot_random_seed=options.seed)
    return HarnessResults(summarize(raw, context.checkpoint_path, context.step, options.limit, options.seed))


HARNESS = register(Evaluation(
    name="harness",
    summary="EleutherAI LM-Eval harness tasks (e.g. --tasks table2: the papers' zero-shot table)",
    paper="The zero-shot table of Shared DIFF and DINT (Table 2) and DIFF V1 (Table 1), through LM-Eval.",
    options=HarnessOptions, inputs=inputs, score=score, tags=("harness/",), reads_text=True,
))

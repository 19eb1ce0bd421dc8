"""EleutherAI's LM-Eval harness for `diffexp eval harness` (diffexp/evals/tasks/harness.py): task names and
presets checked before the model loads, and its raw results summarised.

``--tasks table2`` is the papers' zero-shot Table 2 (its datasets load from the Hugging Face hub). The metrics go
to ``harness.json`` in <run>/eval/ (or --out), which `diffexp compare` gathers, and to ``harness/<task>/<metric>``
in the run's TensorBoard at the checkpoint's step.
"""

from __future__ import annotations

import difflib
import functools
import math
from pathlib import Path

from diffexp.errors import Flag, UserError, cli_flag

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


#: what a model's whole-sequence forward answers; generate_until decodes token by token on the KV cache instead
LIKELIHOOD_OUTPUTS = ("multiple_choice", "loglikelihood", "loglikelihood_rolling")


def output_types(manager, name: str) -> dict[str, str | None]:
    """Each task that `name` (a task, group or tag) runs -> its output_type, read from the task configs in the
    manager's index (its YAML, includes resolved, read when the index was built: no dataset, no network); None
    for a Python task, whose class says it once built. A group's settings for its tasks apply, as LM-Eval's."""
    import dataclasses

    from lm_eval.config.group import GroupConfig
    from lm_eval.config.task import TaskConfig

    index = manager.task_index
    default = next(f.default for f in dataclasses.fields(TaskConfig) if f.name == "output_type")
    group_keys = {f.name for f in dataclasses.fields(GroupConfig)}
    found: dict[str, str | None] = {}

    def visit(member: str, overrides: dict) -> None:
        entry = index.get(member)
        if entry is None:
            return  # not in the index: the loaded task says (check_tasks)
        kind = entry.kind.name
        if kind == "TAG":
            for task in sorted(entry.tags):
                visit(task, overrides)
        elif kind == "GROUP":
            group(member, entry.cfg or {}, overrides)
        elif kind == "PY_TASK":
            found[member] = overrides.get("output_type")
        else:
            found[member] = overrides.get("output_type", (entry.cfg or {}).get("output_type", default))

    def group(group_name: str, cfg: dict, overrides: dict) -> None:
        overrides = {**{k: v for k, v in cfg.items() if k not in group_keys}, **overrides}
        for item in cfg.get("task") if isinstance(cfg.get("task"), list) else []:
            if isinstance(item, str):
                visit(item, overrides)
            elif isinstance(item, dict) and "group" in item:
                inline = item["group"] not in index
                if inline:
                    group(f"{group_name}::{item['group']}", item, overrides)
                else:
                    visit(item["group"], {**overrides, **{k: v for k, v in item.items() if k != "group"}})
            elif isinstance(item, dict) and "task" in item:
                merged = {**overrides, **item}
                if item["task"] in index:
                    visit(item["task"], merged)
                else:  # a task defined inside the group
                    found[f"{group_name}::{item['task']}"] = merged.get("output_type", default)

    visit(name, {})
    return found


def _refuse_generation(requested: str, types: dict[str, str | None], flag: Flag, why: str) -> None:
    """A UserError naming the generation tasks among `types` (what `requested` runs -> its output_type), if any."""
    generating = sorted(task for task, kind in types.items() if kind is not None and kind not in LIKELIHOOD_OUTPUTS)
    if not generating:
        return
    kinds = ", ".join(sorted({types[task] for task in generating}))
    if generating == [requested]:
        what = f"{requested!r} is a generation task (output_type: {kinds})"
    else:
        shown = ", ".join(generating[:3]) + (f" and {len(generating) - 3} more" if len(generating) > 3 else "")
        what = f"{requested!r} holds generation tasks (output_type: {kinds}: {shown})"
    raise UserError(f"{flag('tasks')}: {what}; {why}; expected log-likelihood tasks (output_type: "
                    f"{', '.join(LIKELIHOOD_OUTPUTS)}), e.g. hellaswag")


def check_tasks(tasks: list[str], include_paths: list[str], flag: Flag = cli_flag,
                likelihood_only: str | None = None):
    """The TaskManager that knows every task, once each name and local task has been checked (datasets
    loaded) - before the model is built. `flag`: an option's name as the user writes it (Context.flag).
    `likelihood_only`: why generation tasks cannot be scored here, if they cannot; they are refused from their
    configs before any dataset is read (a Python task's class, once loaded)."""
    lm_eval = _import_lm_eval()
    from lm_eval.tasks import TaskManager

    for path in include_paths:
        if not Path(path).is_dir():
            raise UserError(f"{flag('include_path')}={path!r} is invalid: no such directory; expected a directory "
                            "of task YAML files")
    # local tasks alone need no index of LM-Eval's thousands of task files (seconds to build)
    local = TaskManager(include_path=include_paths, include_defaults=False) if include_paths else None
    local_names = set(local.all_tasks) if local else set()
    manager = local if local and set(tasks) <= local_names else task_manager()
    known = local_names | set(manager.all_tasks)
    for task in tasks:
        if task not in known:
            close = difflib.get_close_matches(task, sorted(known), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise UserError(f"{flag('tasks')}: {task!r} is not an LM-Eval {lm_eval.__version__} task, group or tag"
                            f"{hint} (presets: {', '.join(PRESETS)}; local tasks: {flag('include_path')} DIR)")
    if manager is not local and set(tasks) & local_names:  # local and LM-Eval tasks together
        manager = task_manager(tuple(include_paths))
    if likelihood_only:
        for task in tasks:
            _refuse_generation(task, output_types(manager, task), flag, likelihood_only)
    try:
        loaded = manager.load(tasks)  # reads the datasets now: a missing download fails here, not after the model
    except Exception as err:  # datasets and the hub raise many types; the message is what helps
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"{flag('tasks')} {' '.join(tasks)}: a task's dataset could not be loaded ({reason}). Hub "
                        "tasks (table2 among them) need hub access or its datasets cache; local tasks need their "
                        "data files") from None
    if likelihood_only:  # what only a built task tells: a Python task's class
        built = {name: task.OUTPUT_TYPE for name, task in loaded["tasks"].items()}
        _refuse_generation(" ".join(tasks), built, flag, likelihood_only)
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


def summarize(raw: dict, checkpoint: str | None, step: int, limit, seed: int) -> dict:
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

    return {"checkpoint": None if checkpoint is None else str(checkpoint), "step": step, "tasks": tasks,
            "n_samples": {task: n.get("effective") for task, n in (raw.get("n-samples") or {}).items()},
            "num_fewshot": raw.get("n-shot"), "limit": limit, "lm_eval_version": lm_eval.__version__,
            "seed": seed}

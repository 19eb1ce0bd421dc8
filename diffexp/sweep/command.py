"""The `diffexp fit` arguments of one trial: what the runner starts, and what the spec check validates."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from diffexp.sweep.spec import Point, SweepSpec, recipe_files


def cli_value(value: Any) -> str:
    """A YAML value as jsonargparse reads it from the command line."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


def fit_args(spec: SweepSpec, point: Point, overrides: dict[str, Any], trial_id: int = 0,
             resume: Path | None = None) -> list[str]:
    """`--config base [--config ...] --key=value ...` for `diffexp fit` (base: the case's own recipe, else the
    spec's, each of its files in order): the spec's overrides, the trial's logger and callback."""
    callback = {"class_path": "diffexp.sweep.trial.SweepTrialCallback", "init_args": {
        "study": spec.study, "trial_id": trial_id, "case": point.case, "seed": point.seed,
        "overrides": overrides, "hparam_keys": spec.varied_keys(), "metric": spec.objective_metric,
        "pruner": spec.pruner}}
    args = [arg for path in recipe_files(point.base or spec.base) for arg in ("--config", str(path))]
    args += [f"--{key}={cli_value(value)}" for key, value in overrides.items()]
    args += [
        f"--seed_everything={point.seed}",
        "--trainer.logger=lightning.pytorch.loggers.TensorBoardLogger",
        f"--trainer.logger.init_args.save_dir={spec.runs_dir}",
        f"--trainer.logger.init_args.name={spec.study}/{point.slug}",
        f"--trainer.logger.init_args.version={point.run_name}",
        "--trainer.logger.init_args.default_hp_metric=false",
        "--trainer.enable_autolog_hparams=false",
        "--trainer.enable_progress_bar=false",
        f"--trainer.callbacks+={json.dumps(callback)}",
    ]
    if resume is not None:
        args.append(f"--ckpt_path={resume}")
    return args

"""Every trial of a sweep spec, checked the way `diffexp fit` will check it, before anything is created.

Each distinct set of overrides (search spaces at both bounds and at every choice) is parsed and preflighted
without building a model; all the bad rows, and every problem of the spec's structure, are reported together in
one SpecError.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diffexp.errors import UserError
from diffexp.sweep.command import cli_value, fit_args
from diffexp.sweep.spec import Point, SweepSpec, read_spec_file, slugify, spec_error

SEED_ENV = ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")  # what Lightning's seed_everything leaves in os.environ


@dataclass(frozen=True)
class TrialConfig:
    """What one kind of trial of the spec is: where it comes from (for messages) and its overrides."""

    where: str
    point: Point
    overrides: dict[str, Any]


def validate_fit_args(args: list[str]) -> None:
    """Raise UserError when `diffexp fit ARGS` would refuse its config (parse_config, then preflight)."""
    from diffexp.training.cli import parse_config
    from diffexp.training.preflight import validate_fit_config

    output = io.StringIO()
    previous = logging.root.manager.disable
    logging.disable(logging.INFO)  # "Seed set to ..." for every row
    seed_env = {key: os.environ.get(key) for key in SEED_ENV}  # parsing seeds this process; trials inherit its env
    try:
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = parse_config(args)
            validate_fit_config(config, words=args)
    except SystemExit:  # a parse error jsonargparse printed itself (DIFFEXP_DEBUG=1)
        text = output.getvalue()
        message = " ".join(text[text.rfind("error:") + len("error:"):].split()) if "error:" in text else ""
        raise UserError(message or "the config does not parse") from None
    except UserError:
        raise
    except (ValueError, TypeError) as exc:  # a class's own check that is not (yet) a UserError
        raise UserError(str(exc)) from None
    finally:
        logging.disable(previous)
        for key, value in seed_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def trial_configs(spec: SweepSpec) -> list[TrialConfig]:
    """Each row of the table, once per corner of the search spaces (every bound and choice appears). A trial of a
    variant that is not registered is left out: the spec's own check names it (read_spec)."""
    from diffexp.model.attention import variant_names

    configs = []
    for label, case, assignment, row_overrides in spec.table():
        point = Point(label, slugify(label), spec.seeds[0], 0, row_overrides, spec.case_bases.get(case))
        for sampled, described in _search_corners(spec.search):
            overrides = spec.trial_overrides(point.base, row_overrides, sampled)
            if spec.variant_of(point.base, overrides) not in (*variant_names(), None):
                continue
            parts = [f"case {case!r}"] if case else []
            parts += [f"grid {key}={cli_value(value)}" for key, value in assignment.items()]
            parts += [text for text, key in described if key in overrides]
            config = TrialConfig(", ".join(parts), point, overrides)
            if config not in configs:  # a search key its variant does not read: the same trial at each corner
                configs.append(config)
    return configs


def _search_corners(search: dict[str, dict[str, Any]]) -> list[tuple[dict[str, Any], list[tuple[str, str]]]]:
    """Values for the search keys such that each key takes its low and high bound (or each choice) once, each with
    its description and key."""
    if not search:
        return [({}, [])]
    count = max([2] + [len(space["choices"]) for space in search.values() if space["type"] == "categorical"])
    corners = []
    for i in range(count):
        values, described = {}, []
        for key, space in search.items():
            if space["type"] == "categorical":
                value = space["choices"][i % len(space["choices"])]
                described.append((f"search {key} choice {cli_value(value)}", key))
            else:
                bound = "low" if i % 2 == 0 else "high"
                value = space[bound]
                described.append((f"search {key} {bound}={cli_value(value)}", key))
            values[key] = value
        corners.append((values, described))
    return corners


@dataclass(frozen=True)
class Refused:
    """The trial configurations of a spec that `diffexp fit` would refuse: a line per row (one line when every row
    is refused alike), how many, out of how many."""

    lines: tuple[str, ...] = ()
    count: int = 0
    total: int = 0

    def __add__(self, other: Refused) -> Refused:
        return Refused(self.lines + other.lines, self.count + other.count, self.total + other.total)


def refused_trials(spec: SweepSpec) -> Refused:
    """Every trial configuration of `spec` that `diffexp fit` would refuse (each distinct one checked once)."""
    configs = trial_configs(spec)
    verdicts: dict[str, str | None] = {}

    def key_of(config: TrialConfig) -> str:  # what is checked: the recipe and the overrides
        return json.dumps([str(config.point.base or spec.base), config.overrides], sort_keys=True, default=str)

    for config in configs:
        key = key_of(config)
        if key not in verdicts:
            try:
                validate_fit_args(fit_args(spec, config.point, config.overrides))
                verdicts[key] = None
            except UserError as err:
                verdicts[key] = " ".join(str(err).split())
    bad = [(config.where, verdicts[key_of(config)]) for config in configs]
    bad = [(where, message) for where, message in bad if message is not None]
    messages = {message for _, message in bad}
    if len(configs) > 1 and bad and len(bad) == len(configs) and len(messages) == 1:
        return Refused((f"every row: {messages.pop()}",), len(bad), len(configs))
    return Refused(tuple(f"{row or 'the table'}: {message}" for row, message in bad), len(bad), len(configs))


def check_trials(spec: SweepSpec) -> None:
    """Raise one SpecError naming every trial configuration of `spec` that `diffexp fit` would refuse."""
    refused = refused_trials(spec)
    if refused.count:
        raise spec_error(spec.source, [], refused.lines, refused.count, refused.total)


def load_checked_spec(path: str | Path, repo_root: Path | None = None, runs_dir: str | None = None) -> SweepSpec:
    """The spec at `path` (its runs under `runs_dir` when given), its structure and every trial (a tune_lr spec's
    short runs too) checked as `diffexp fit` will check them; one SpecError lists every problem of both, before
    any study, storage or file is made."""
    from diffexp.sweep.tune import tuning_spec

    spec, problems = read_spec_file(path, repo_root)
    refused = Refused()
    if spec is not None:
        if runs_dir:
            spec.runs_dir = Path(runs_dir)
        for checked in ([tuning_spec(spec)] if spec.tune_lr is not None else []) + [spec]:
            refused += refused_trials(checked)
    if problems or refused.count:
        raise spec_error(Path(path), problems, refused.lines, refused.count, refused.total)
    return spec

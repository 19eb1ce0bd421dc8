"""Every trial of a sweep spec, checked the way `diffexp fit` will check it, before anything is created.

Each distinct set of overrides (search spaces at both bounds and at every choice) is parsed and preflighted
without building a model; all the bad rows are reported together in one SpecError.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import warnings
from dataclasses import dataclass
from typing import Any

from diffexp.errors import UserError
from diffexp.sweep.command import cli_value, fit_args
from diffexp.sweep.spec import Point, SpecError, SweepSpec, slugify

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
    """Each row of the table, once per corner of the search spaces (every bound and choice appears)."""
    configs = []
    for label, case, assignment, row_overrides in spec.table():
        point = Point(label, slugify(label), spec.seeds[0], 0, row_overrides, spec.case_bases.get(case))
        for sampled, described in _search_corners(spec.search):
            parts = [f"case {case!r}"] if case else []
            parts += [f"grid {key}={cli_value(value)}" for key, value in assignment.items()]
            parts += described
            configs.append(TrialConfig(", ".join(parts), point, {**spec.overrides, **row_overrides, **sampled}))
    return configs


def _search_corners(search: dict[str, dict[str, Any]]) -> list[tuple[dict[str, Any], list[str]]]:
    """Values for the search keys such that each key takes its low and high bound (or each choice) once."""
    if not search:
        return [({}, [])]
    count = max([2] + [len(space["choices"]) for space in search.values() if space["type"] == "categorical"])
    corners = []
    for i in range(count):
        values, described = {}, []
        for key, space in search.items():
            if space["type"] == "categorical":
                value = space["choices"][i % len(space["choices"])]
                described.append(f"search {key} choice {cli_value(value)}")
            else:
                bound = "low" if i % 2 == 0 else "high"
                value = space[bound]
                described.append(f"search {key} {bound}={cli_value(value)}")
            values[key] = value
        corners.append((values, described))
    return corners


def check_trials(spec: SweepSpec) -> None:
    """Raise one SpecError naming every trial configuration of `spec` that `diffexp fit` would refuse."""
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
    if not bad:
        return
    where = f"{spec.source}: " if spec.source else ""
    messages = {message for _, message in bad}
    if len(configs) > 1 and len(bad) == len(configs) and len(messages) == 1:
        lines = [f"  - every row: {messages.pop()}"]
    else:
        lines = [f"  - {row or 'the table'}: {message}" for row, message in bad]
    raise SpecError(f"{where}{len(bad)} of {len(configs)} trial configurations would be refused by `diffexp fit`; "
                    "nothing was started or written:\n" + "\n".join(lines))

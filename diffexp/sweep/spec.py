"""Sweep specs: ablation tables as data (the format: docs/sweeps.md, examples: sweeps/*.yaml).

Every (case x grid point x seed x search draw) is one trial, one `fit` run; a case may name its own recipe
with a `base` key. A recipe is one file or a list of files applied in order (the GPU recipes' base, size and
variant), as repeated --config flags.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from diffexp.errors import UserError
from diffexp.sweep import layout
from diffexp.sweep.paper import parse_paper

#: metrics a trial records at the end of fit (the objective must be one of them)
KNOWN_METRICS = ("val/loss", "val/ppl", "val/loss_ar_hit", "val/loss_others", "val/share_ar_hit", "train/loss",
                 "vitals/grad_spikes", "vitals/act_max_abs", "vitals/attn_logit_max", "vitals/loss_spikes",
                 "vitals/grad_norm_max", "vitals/context_rms", "vitals/attn_sink")
#: evaluation callbacks record these (e.g. needle/rank/N4R2, attention/noise, mqar/accuracy, icl/random/n16)
EVAL_PREFIXES = ("needle/", "attention/", "mqar/", "icl/", "val/mqar")
SPEC_KEYS = {"study", "base", "overrides", "cases", "grid", "seeds", "search", "n_trials", "objective", "pruner",
             "storage", "runs_dir", "stale_after_s", "max_attempts", "grace_s", "storage_retry_s", "description",
             "paper", "tune_lr"}
SEARCH_TYPES = {"float", "int", "categorical"}
PRUNERS = {"none", "median", "percentile", "hyperband"}
#: top-level sections of a `diffexp fit` config that overrides, grid and search keys may name
CONFIG_SECTIONS = ("model", "data", "trainer", "checkpoint", "diagnostics", "throughput")
MAX_SEED = 2**32 - 1  # Lightning's seed_everything accepts 0 .. 2**32 - 1
CASE_BASE = "base"  # the one key of a case that is not a dotted override: the case's own recipe
#: a recipe: one file, or the files given as repeated --config flags, in order
Recipe = Path | tuple[Path, ...]


def recipe_files(recipe: Recipe) -> tuple[Path, ...]:
    return recipe if isinstance(recipe, tuple) else (recipe,)


def recipe_record(recipe: Recipe) -> str | list[str]:
    """A recipe as JSON (sweep.json, the fingerprint): its path, or the list of its files."""
    return [str(p) for p in recipe] if isinstance(recipe, tuple) else str(recipe)


class SpecError(UserError):
    """A sweep spec that cannot run as written; raised before any study, storage or file is made."""


LR_KEY = "model.optim.lr"
TUNE_LR_KEYS = {"values", "overrides", "seeds"}


@dataclass(frozen=True)
class LrTuning:
    """`tune_lr:` of a spec: each case first tried at every lr of `values` on a short budget (`overrides` on
    top of the spec's, `seeds`), then compared at the spec's lr and at its own best (diffexp.sweep.tune)."""

    values: tuple[float, ...]
    overrides: dict[str, Any]
    seeds: tuple[int, ...]


@dataclass(frozen=True)
class Point:
    """One trial to run: a row of the table, a seed and (with search spaces) a draw index."""

    case: str
    slug: str
    seed: int
    draw: int
    overrides: dict[str, Any]
    base: Recipe | None = None  # the case's own recipe; None: the spec's base

    @property
    def key(self) -> str:
        return f"{self.slug}/seed{self.seed}" + (f"/draw{self.draw}" if self.draw else "")

    @property
    def run_name(self) -> str:
        return layout.run_name(self.seed, self.draw)


@dataclass
class SweepSpec:
    study: str
    base: Recipe
    cases: dict[str, dict[str, Any]]
    grid: dict[str, list[Any]]
    seeds: list[int]
    overrides: dict[str, Any] = field(default_factory=dict)
    search: dict[str, dict[str, Any]] = field(default_factory=dict)
    n_trials: int = 1
    objective_metric: str = "val/loss"
    direction: str = "minimize"
    pruner: dict[str, Any] = field(default_factory=lambda: {"type": "none"})
    storage: str | None = None
    runs_dir: Path = Path("runs")
    stale_after_s: float = 120.0
    max_attempts: int = 2  # failed runs of a point by itself (a crash, no result); interruptions are not counted
    grace_s: float = 60.0  # a signalled worker waits this long for its trial to save its checkpoint and stop
    storage_retry_s: float = 300.0  # how long a worker retries a storage that does not answer before it stops
    source: Path | None = None
    paper: dict[str, Any] | None = None  # the reproduced table's published numbers (sweep/paper.py)
    case_bases: dict[str, Recipe] = field(default_factory=dict)  # case -> its own recipe (CASE_BASE)
    tune_lr: LrTuning | None = None  # a fair lr per case: two stages from this spec (diffexp.sweep.tune)
    views: dict[str, dict[str, str]] | None = None  # view -> case -> its row, written to sweep.json for compare
    tuned: dict[str, Any] | None = None  # the lr tuning's result, written to sweep.json for compare

    def base_of(self, case: str) -> Recipe:
        """The recipe a case's trials start from: its own `base`, else the spec's."""
        return self.case_bases.get(case, self.base)

    @property
    def study_dir(self) -> Path:
        return self.runs_dir / self.study

    @property
    def storage_url(self) -> str:
        return self.storage or f"sqlite:///{self.study_dir / 'study.db'}"

    def table(self) -> list[tuple[str, str, dict[str, Any], dict[str, Any]]]:
        """(label, case, grid assignment, overrides) per row: each case crossed with each grid point."""
        keys = list(self.grid)
        grid_points = list(itertools.product(*self.grid.values())) if keys else [()]
        table = []
        for case, case_overrides in self.cases.items():
            for values in grid_points:
                assignment = dict(zip(keys, values))
                parts = [case] if case else []  # a grid-only spec has one unnamed case
                label = ", ".join(parts + [f"{k.split('.')[-1]}={_label_value(v)}" for k, v in assignment.items()])
                table.append((label, case, assignment, {**case_overrides, **assignment}))
        return table

    def grid_views(self) -> dict[str, dict[str, str]] | None:
        """With a grid and two or more named cases, one view per grid point ("lr=0.01": case -> its row there),
        so `compare` sets each case against the reference case at the same grid point; else None."""
        if not self.grid or len([case for case in self.cases if case]) < 2:
            return None
        views: dict[str, dict[str, str]] = {}
        for label, case, assignment, _ in self.table():
            point = ", ".join(f"{k.split('.')[-1]}={_label_value(v)}" for k, v in assignment.items())
            views.setdefault(point, {})[case] = label
        return views

    def rows(self) -> list[tuple[str, dict[str, Any]]]:
        """Table rows: each case crossed with each grid point, named "case, key=value"."""
        return [(label, overrides) for label, _, _, overrides in self.table()]

    def points(self) -> list[Point]:
        points = []
        for label, case, _, overrides in self.table():
            for seed in self.seeds:
                for draw in range(self.n_trials):
                    points.append(Point(label, slugify(label), seed, draw, overrides, self.case_bases.get(case)))
        return points

    def varied_keys(self) -> list[str]:
        """Every dotted key any trial sets: each trial records its value of all of them as HParams."""
        keys = dict.fromkeys(self.overrides)
        for _, overrides in self.rows():
            keys.update(dict.fromkeys(overrides))
        keys.update(dict.fromkeys(self.search))
        return list(keys)

    def fingerprint(self) -> str:
        """Identity of what the study runs; a study name reused with another spec is refused."""
        payload = {"base": recipe_record(self.base), "rows": self.rows(), "seeds": self.seeds,
                   "overrides": self.overrides, "search": self.search, "n_trials": self.n_trials,
                   "objective": self.objective_metric}
        if self.case_bases:  # only then: a spec without per-case recipes keeps its fingerprint
            payload["bases"] = {case: recipe_record(path) for case, path in self.case_bases.items()}
        if self.tune_lr:
            payload["tune_lr"] = [self.tune_lr.values, self.tune_lr.overrides, self.tune_lr.seeds]
        return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _label_value(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, str) else value


def slugify(label: str) -> str:
    slug = re.sub(r"[^a-z0-9.]+", "-", label.lower()).strip("-")
    return slug or "case"


def load_spec(path: str | Path, repo_root: Path | None = None) -> SweepSpec:
    """Parse and check a spec's structure (diffexp.sweep.check then checks each trial's config)."""
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"sweep spec {str(path)!r}: no such file")
    raw = read_yaml(path) or {}
    if not isinstance(raw, dict):
        raise SpecError(f"{path}: expected a mapping of keys, got {type(raw).__name__}")
    return parse_spec(raw, source=path, repo_root=repo_root)


def read_yaml(path: Path) -> Any:
    """The YAML document of `path`; a repeated mapping key (two cases of one name, say) is an error, since
    YAML would keep only the last of them and a row of the table would silently disappear."""
    try:
        with open(path) as handle:
            root = yaml.compose(handle, Loader=yaml.SafeLoader)
        duplicates = _duplicate_keys(root, "") if root is not None else []
        if duplicates:
            raise SpecError(f"{path}: " + "; ".join(duplicates) + " (YAML keeps only the last one: rename or merge)")
        with open(path) as handle:
            return yaml.safe_load(handle)
    except yaml.YAMLError as exc:
        raise SpecError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None
    except OSError as exc:
        raise SpecError(f"sweep spec {str(path)!r}: cannot read it ({exc.strerror or exc})") from None


def _duplicate_keys(node: yaml.Node, where: str) -> list[str]:
    found = []
    if isinstance(node, yaml.MappingNode):
        first_line: dict[tuple[str, str], int] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = (key_node.tag, key_node.value)
            line = key_node.start_mark.line + 1
            if key in first_line:
                inside = f" in {where}" if where else ""
                found.append(f"duplicate key {key_node.value!r}{inside} at line {line} "
                             f"(first at line {first_line[key]})")
            else:
                first_line[key] = line
            found += _duplicate_keys(value_node, f"{where}.{key_node.value}" if where else key_node.value)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            found += _duplicate_keys(item, f"{where}[{i}]")
    return found


def parse_spec(raw: dict[str, Any], source: Path | None = None, repo_root: Path | None = None) -> SweepSpec:
    where = f"{source}: " if source else ""

    def fail(message: str) -> SpecError:
        return SpecError(where + message)

    unknown = sorted(set(raw) - SPEC_KEYS)
    if unknown:
        raise fail(f"unknown key(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(sorted(SPEC_KEYS))}")

    def typed(key: str, types: type | tuple[type, ...], default: Any = None, required: bool = False) -> Any:
        if key not in raw or raw[key] is None:
            if required:
                raise fail(f"missing required key {key!r}")
            return default
        value = raw[key]
        if not isinstance(value, types) or isinstance(value, bool) and bool not in _as_tuple(types):
            names = "/".join(t.__name__ for t in _as_tuple(types))
            raise fail(f"{key}={value!r} has the wrong type: expected {names}")
        return value

    study = typed("study", str, required=True)
    if not re.fullmatch(r"[A-Za-z0-9_.\-]+", study):
        raise fail(f"study={study!r}: use letters, digits, '.', '_' and '-' only (it names a directory)")
    def recipe(value: Any, where: str) -> Recipe:
        """A recipe path, or a non-empty list of them (applied in order), each resolved to a file."""
        if isinstance(value, list):
            if not value or not all(isinstance(item, str) for item in value):
                raise fail(f"{where}={value!r}: expected a recipe path or a non-empty list of recipe paths")
            return tuple(recipe_file(item, f"{where}[{i}]") for i, item in enumerate(value))
        if not isinstance(value, str):
            raise fail(f"{where}={value!r} has the wrong type: expected a recipe path or a list of them")
        return recipe_file(value, where)

    def recipe_file(value: str, where: str) -> Path:
        path = Path(value)
        if not path.is_absolute():
            candidates = [Path.cwd() / path] + ([repo_root / path] if repo_root else []) + \
                ([source.parent / path] if source else [])
            path = next((c for c in candidates if c.is_file()), candidates[0])
        if not path.is_file():
            raise fail(f"{where}={value!r}: recipe not found")
        return path.resolve()

    base = recipe(typed("base", (str, list), required=True), "base")

    cases = typed("cases", dict, default=None)
    grid = typed("grid", dict, default={})
    if not cases and not grid:
        given = "`cases` is empty and there is no `grid`" if cases is not None else "neither `cases` nor `grid`"
        raise fail(f"no trials: {given}; give `cases` (named rows of overrides, `NAME: {{}}` for a row that "
                   "changes nothing) and/or a non-empty `grid`")
    cases = dict(cases) if cases else {"": {}}
    case_bases = {}
    for name, overrides in cases.items():
        if overrides is None:
            overrides = {}
        elif not isinstance(overrides, dict):
            raise fail(f"cases[{name!r}]={overrides!r} has the wrong type: expected a mapping of dotted overrides")
        overrides = dict(overrides)
        if CASE_BASE in overrides:
            own = overrides.pop(CASE_BASE)
            case_bases[name] = recipe(own, f"cases[{name!r}].{CASE_BASE}")
        cases[name] = overrides
        _check_dotted(overrides, f"cases[{name!r}]", fail)
    for key, values in grid.items():
        if not isinstance(values, list):
            raise fail(f"grid[{key!r}]={values!r} has the wrong type: expected a list of values")
        if not values:
            raise fail(f"grid[{key!r}] is empty: the grid would have no points")
    _check_dotted(grid, "grid", fail)

    seeds = typed("seeds", (list, int), default=[0])
    seeds = list(range(seeds)) if isinstance(seeds, int) else seeds
    if not seeds or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
        raise fail(f"seeds={raw.get('seeds')!r}: expected a non-empty list of integers (or a count)")
    repeated = sorted({s for s in seeds if seeds.count(s) > 1})
    if repeated:
        raise fail(f"seeds={seeds!r}: seed(s) {', '.join(map(str, repeated))} listed more than once; "
                   "expected distinct seeds (each runs once per row)")
    out_of_range = [s for s in seeds if not 0 <= s <= MAX_SEED]
    if out_of_range:
        raise fail(f"seeds={seeds!r}: {', '.join(map(str, out_of_range))} out of range; expected integers "
                   f"from 0 to {MAX_SEED}")

    overrides = typed("overrides", dict, default={})
    _check_dotted(overrides, "overrides", fail)
    search = typed("search", dict, default={})
    _check_dotted(search, "search", fail)
    for key, space in search.items():
        _check_search_space(key, space, fail)
    n_trials = typed("n_trials", int, default=1)
    if n_trials < 1 or (n_trials > 1 and not search):
        raise fail(f"n_trials={n_trials}: expected 1, or more than 1 together with `search` spaces")

    objective = typed("objective", dict, default={"metric": "val/loss", "direction": "minimize"})
    metric = objective.get("metric", "val/loss")
    if not metric_known(metric):
        raise fail(f"objective.metric={metric!r} is not a metric trials record; known: {', '.join(KNOWN_METRICS)}, "
                   f"or an evaluation's {', '.join(p + '...' for p in EVAL_PREFIXES)}")
    direction = objective.get("direction", "minimize")
    if direction not in ("minimize", "maximize"):
        raise fail(f"objective.direction={direction!r}: expected 'minimize' or 'maximize'")
    pruner = typed("pruner", dict, default={"type": "none"})
    if pruner.get("type", "none") not in PRUNERS:
        raise fail(f"pruner.type={pruner.get('type')!r}: expected one of {', '.join(sorted(PRUNERS))}")

    stale = typed("stale_after_s", (int, float), default=120.0)
    if stale <= 0:
        raise fail(f"stale_after_s={stale!r}: expected a positive number of seconds")
    max_attempts = typed("max_attempts", int, default=2)
    if max_attempts < 1:
        raise fail(f"max_attempts={max_attempts!r}: expected at least 1")
    grace = typed("grace_s", (int, float), default=60.0)
    if grace <= 0:
        raise fail(f"grace_s={grace!r}: expected a positive number of seconds (how long a signalled worker waits "
                   "for its trial to save its checkpoint)")
    retry = typed("storage_retry_s", (int, float), default=300.0)
    if retry < 0:
        raise fail(f"storage_retry_s={retry!r}: expected a number of seconds, 0 or more (how long a worker retries "
                   "a storage that does not answer)")
    spec = SweepSpec(study=study, base=base, cases=cases, grid=grid, seeds=seeds, overrides=overrides,
                     search=search, n_trials=n_trials, objective_metric=metric, direction=direction, pruner=pruner,
                     storage=typed("storage", str), runs_dir=Path(typed("runs_dir", str, default="runs")),
                     stale_after_s=float(stale), max_attempts=max_attempts, grace_s=float(grace),
                     storage_retry_s=float(retry), source=source, case_bases=case_bases)
    slugs = [slugify(label) for label, _ in spec.rows()]
    if len(set(slugs)) != len(slugs):
        raise fail(f"two table rows map to the same directory name: {sorted(slugs)}")
    if raw.get("tune_lr") is not None:
        if grid or search:
            raise fail("tune_lr cannot be combined with `grid` or `search`: its first stage is a grid over "
                       f"{LR_KEY} per case; put the other keys in `cases`")
        spec.tune_lr = _parse_tune_lr(raw["tune_lr"], seeds, fail)
    if raw.get("paper") is not None:
        try:
            spec.paper = parse_paper(raw["paper"], [label for label, _ in spec.rows()], metric_known)
        except ValueError as err:
            raise fail(str(err)) from None
    return spec


def _parse_tune_lr(raw: Any, seeds: list[int], fail) -> LrTuning:
    if not isinstance(raw, dict):
        raise fail(f"tune_lr={raw!r} has the wrong type: expected a mapping with `values` (the learning rates "
                   "each case is tried at), optional `overrides` (the short budget) and `seeds`")
    unknown = sorted(set(raw) - TUNE_LR_KEYS)
    if unknown:
        raise fail(f"tune_lr: unknown key(s) {', '.join(map(repr, unknown))}; allowed: "
                   f"{', '.join(sorted(TUNE_LR_KEYS))}")
    values = raw.get("values")
    if (not isinstance(values, list) or len(values) < 2
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in values)
            or len(set(values)) != len(values)):
        raise fail(f"tune_lr.values={values!r}: expected a list of 2 or more distinct positive learning rates")
    overrides = raw.get("overrides") or {}
    if not isinstance(overrides, dict):
        raise fail(f"tune_lr.overrides={overrides!r} has the wrong type: expected a mapping of dotted overrides")
    _check_dotted(overrides, "tune_lr.overrides", fail)
    if LR_KEY in overrides:
        raise fail(f"tune_lr.overrides: {LR_KEY!r} is what tune_lr.values sets; remove it")
    tune_seeds = raw.get("seeds", seeds[:1])
    if (not isinstance(tune_seeds, list) or not tune_seeds or len(set(tune_seeds)) != len(tune_seeds)
            or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= MAX_SEED for s in tune_seeds)):
        raise fail(f"tune_lr.seeds={tune_seeds!r}: expected a non-empty list of distinct seeds from 0 to {MAX_SEED}")
    return LrTuning(tuple(float(v) for v in values), dict(overrides), tuple(tune_seeds))


def metric_known(name: str) -> bool:
    """A metric trials record at the end of fit, or one an evaluation callback records."""
    return name in KNOWN_METRICS or name.startswith(EVAL_PREFIXES)


def _as_tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def _check_dotted(mapping: dict[str, Any], where: str, fail) -> None:
    for key in mapping:
        if not isinstance(key, str) or not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_+][\w+]*)*", key):
            raise fail(f"{where}: {key!r} is not a dotted config key such as model.arch.head_norm")
        if key == "seed_everything":
            raise fail(f"{where}: {key!r} is set per trial from `seeds`; list the seeds there instead")
        if key.split(".")[0] not in CONFIG_SECTIONS:
            raise fail(f"{where}: {key!r} must start with " + ", ".join(f"{s}." for s in CONFIG_SECTIONS[:-1])
                       + f" or {CONFIG_SECTIONS[-1]}. (a dotted key of the `diffexp fit` config)")


def _check_search_space(key: str, space: Any, fail) -> None:
    if not isinstance(space, dict) or space.get("type") not in SEARCH_TYPES:
        raise fail(f"search[{key!r}]={space!r}: expected {{type: float|int|categorical, ...}}")
    if space["type"] == "categorical":
        if not isinstance(space.get("choices"), list) or not space["choices"]:
            raise fail(f"search[{key!r}]: categorical needs a non-empty `choices` list")
        return
    for bound in ("low", "high"):
        if not isinstance(space.get(bound), (int, float)) or isinstance(space.get(bound), bool):
            raise fail(f"search[{key!r}].{bound}={space.get(bound)!r}: expected a number")
    if space["low"] >= space["high"]:
        raise fail(f"search[{key!r}]: low={space['low']} must be below high={space['high']}")
    if space.get("log") and space["low"] <= 0:
        raise fail(f"search[{key!r}]: log=true needs low > 0, got {space['low']}")

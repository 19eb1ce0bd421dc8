"""Sweep specs: ablation tables as data (the format: docs/sweeps.md, examples: sweeps/*.yaml).

Every (case x grid point x seed x search draw) is one trial, one `fit` run; a case may name its own recipe
with a `base` key. A recipe is one file or a list of files applied in order (the GPU recipes' base, size and
variant), as repeated --config flags.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import re
from collections.abc import Callable, Sequence
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
#: what MQAR's callback recorded before MQAR was a registered evaluation (older studies' objective)
LEGACY_EVAL_PREFIXES = ("val/mqar",)
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


@functools.lru_cache(maxsize=256)
def recipe_attention(recipe: Recipe) -> str | None:
    """The model.arch.attention a recipe sets (its last file that sets one), None when none does or a file does
    not read (the trial check reports such a file)."""
    attention = None
    for path in recipe_files(recipe):
        try:
            config = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError):
            return None
        arch = ((config.get("model") or {}) if isinstance(config, dict) else {}).get("arch")
        if isinstance(arch, dict) and "attention" in arch:
            attention = arch["attention"]
    return attention


def recipe_record(recipe: Recipe) -> str | list[str]:
    """A recipe as JSON (sweep.json, the fingerprint): its path, or the list of its files."""
    return [str(p) for p in recipe] if isinstance(recipe, tuple) else str(recipe)


class SpecError(UserError):
    """A sweep spec that cannot run as written; raised before any study, storage or file is made."""


LR_KEY = "model.optim.lr"
ATTENTION_KEY = "model.arch.attention"  # the dotted key naming a trial's attention variant
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
    #: each variant's own flag (model.arch.rank) -> the variants that read it; a shared setting of such a flag only
    #: reaches their trials (empty: every shared setting reaches every trial)
    flag_readers: dict[str, frozenset[str]] = field(default_factory=dict)
    default_variant: str | None = None  # what a recipe that names no model.arch.attention trains

    def base_of(self, case: str) -> Recipe:
        """The recipe a case's trials start from: its own `base`, else the spec's."""
        return self.case_bases.get(case, self.base)

    @property
    def study_dir(self) -> Path:
        return self.runs_dir / self.study

    @property
    def storage_url(self) -> str:
        return self.storage or f"sqlite:///{self.study_dir / 'study.db'}"

    def grid_points(self) -> list[dict[str, Any]]:
        """Every point of the grid, key -> value ([{}] without a grid)."""
        return [dict(zip(self.grid, values)) for values in itertools.product(*self.grid.values())]

    def variant_of(self, recipe: Recipe | None, overrides: dict[str, Any]) -> str | None:
        """The attention variant a trial trains: its overrides' model.arch.attention, else its recipe's (None: the
        spec's base), else the default."""
        if ATTENTION_KEY in overrides:
            return overrides[ATTENTION_KEY]
        return recipe_attention(recipe or self.base) or self.default_variant

    def applies(self, key: str, variant: str | None) -> bool:
        """Whether a shared setting of `key` (overrides, grid, search) reaches a trial of `variant`: a variant's own
        flag reaches only the variants that read it, so a spec may mix variants under one shared setting."""
        readers = self.flag_readers.get(key)
        return readers is None or variant in readers

    def trial_overrides(self, recipe: Recipe | None, row: dict[str, Any], sampled: dict[str, Any]) -> dict[str, Any]:
        """What one trial sets: the shared overrides, its row's (case and grid point) and its search draw, each
        shared one only where the trial's variant reads it."""
        variant = self.variant_of(recipe, {**self.overrides, **row, **sampled})
        return {**{k: v for k, v in self.overrides.items() if self.applies(k, variant)}, **row,
                **{k: v for k, v in sampled.items() if self.applies(k, variant)}}

    def _assignment(self, case: str, point: dict[str, Any]) -> dict[str, Any]:
        """The settings of a grid point that reach a case's trials (a flag its variant does not read does not)."""
        variant = self.variant_of(self.case_bases.get(case), {**self.overrides, **self.cases[case], **point})
        return {key: value for key, value in point.items() if self.applies(key, variant)}

    @staticmethod
    def _label(case: str, assignment: dict[str, Any]) -> str:
        parts = [case] if case else []  # a grid-only spec has one unnamed case
        return ", ".join(parts + [f"{k.split('.')[-1]}={_label_value(v)}" for k, v in assignment.items()])

    def table(self) -> list[tuple[str, str, dict[str, Any], dict[str, Any]]]:
        """(label, case, grid assignment, overrides) per row: each case crossed with each grid point. A case whose
        variant does not read a grid key has one row per value of the keys it reads, not a copy per value."""
        table = []
        for case, case_overrides in self.cases.items():
            seen = []
            for point in self.grid_points():
                assignment = self._assignment(case, point)
                if assignment in seen:
                    continue
                seen.append(assignment)
                table.append((self._label(case, assignment), case, assignment, {**case_overrides, **assignment}))
        return table

    def grid_views(self) -> dict[str, dict[str, str]] | None:
        """With a grid and two or more named cases, one view per grid point ("lr=0.01": case -> its row there),
        so `compare` sets each case against the reference case at the same grid point; else None."""
        if not self.grid or len([case for case in self.cases if case]) < 2:
            return None
        views: dict[str, dict[str, str]] = {}
        for point in self.grid_points():
            name = ", ".join(f"{k.split('.')[-1]}={_label_value(v)}" for k, v in point.items())
            for case in self.cases:
                views.setdefault(name, {})[case] = self._label(case, self._assignment(case, point))
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
    spec, problems = read_spec_file(path, repo_root)
    if problems:
        raise spec_error(Path(path), problems)
    return spec


def read_spec_file(path: str | Path, repo_root: Path | None = None) -> tuple[SweepSpec | None, list[str]]:
    """read_spec of the file at `path`, its repeated keys first among the problems; a file that does not read as a
    YAML mapping raises SpecError at once."""
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"sweep spec {str(path)!r}: no such file")
    raw, duplicates = read_yaml(path)
    raw = raw or {}
    if not isinstance(raw, dict):
        raise SpecError(f"{path}: expected a mapping of keys, got {type(raw).__name__}")
    spec, problems = read_spec(raw, source=path, repo_root=repo_root)
    return spec, duplicates + problems


def read_yaml(path: Path) -> tuple[Any, list[str]]:
    """(the YAML document of `path`, a problem per repeated mapping key): two cases of one name, say, since YAML
    keeps only the last of them and a row of the table would silently disappear."""
    try:
        with open(path) as handle:
            root = yaml.compose(handle, Loader=yaml.SafeLoader)
        duplicates = _duplicate_keys(root, "") if root is not None else []
        with open(path) as handle:
            return yaml.safe_load(handle), [f"{d} (YAML keeps only the last one: rename or merge)" for d in duplicates]
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
    """The spec of `raw`; one SpecError naming every problem of its structure (read_spec)."""
    spec, problems = read_spec(raw, source, repo_root)
    if problems:
        raise spec_error(source, problems)
    return spec


def spec_error(source: Path | None, problems: list[str], refused: Sequence[str] = (), count: int = 0,
               total: int = 0) -> SpecError:
    """One SpecError for every problem of a spec's structure and the `count` of its `total` trial configurations
    that `diffexp fit` would refuse (`refused`: their lines)."""
    where = f"{source}: " if source else ""
    if len(problems) == 1 and not count:
        return SpecError(where + problems[0])
    parts = [f"{len(problems)} problem(s) in the spec"] if problems else []
    if count:
        parts.append(f"{count} of {total} trial configurations would be refused by `diffexp fit`")
    lines = [f"  - {line}" for line in [*problems, *refused]]
    return SpecError(f"{where}{' and '.join(parts)}; nothing was started or written:\n" + "\n".join(lines))


def read_spec(raw: dict[str, Any], source: Path | None = None,
              repo_root: Path | None = None) -> tuple[SweepSpec | None, list[str]]:
    """A spec's structure, checked whole: (the spec as far as it reads, every problem found, each naming its key).
    A bad value is left out of the spec (or its default taken) so that the rest is still checked; the spec is None
    when it has no recipe or no trials to check."""
    problems: list[str] = []
    problem = problems.append

    unknown = sorted(set(raw) - SPEC_KEYS)
    if unknown:
        problem(f"unknown key(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(sorted(SPEC_KEYS))}")

    def typed(key: str, types: type | tuple[type, ...], default: Any = None, required: bool = False) -> Any:
        if key not in raw or raw[key] is None:
            if required:
                problem(f"missing required key {key!r}")
            return default
        value = raw[key]
        if not isinstance(value, types) or isinstance(value, bool) and bool not in _as_tuple(types):
            names = "/".join(t.__name__ for t in _as_tuple(types))
            problem(f"{key}={value!r} has the wrong type: expected {names}")
            return default
        return value

    study = typed("study", str, required=True)
    if study is not None and not re.fullmatch(r"[A-Za-z0-9_.\-]+", study):
        problem(f"study={study!r}: use letters, digits, '.', '_' and '-' only (it names a directory)")

    def recipe(value: Any, where: str) -> Recipe | None:
        """A recipe path, or a non-empty list of them (applied in order), each resolved to a file."""
        if isinstance(value, list):
            if not value or not all(isinstance(item, str) for item in value):
                problem(f"{where}={value!r}: expected a recipe path or a non-empty list of recipe paths")
                return None
            files = tuple(recipe_file(item, f"{where}[{i}]") for i, item in enumerate(value))
            return files if None not in files else None
        if not isinstance(value, str):
            problem(f"{where}={value!r} has the wrong type: expected a recipe path or a list of them")
            return None
        return recipe_file(value, where)

    def recipe_file(value: str, where: str) -> Path | None:
        path = Path(value)
        if not path.is_absolute():
            candidates = [Path.cwd() / path] + ([repo_root / path] if repo_root else []) + \
                ([source.parent / path] if source else [])
            path = next((c for c in candidates if c.is_file()), candidates[0])
        if not path.is_file():
            problem(f"{where}={value!r}: recipe not found")
            return None
        return path.resolve()

    base_value = typed("base", (str, list), required=True)
    base = recipe(base_value, "base") if base_value is not None else None

    cases = typed("cases", dict, default=None)
    grid = dict(typed("grid", dict, default={}))
    no_trials = not cases and not grid
    if no_trials:
        given = "`cases` is empty and there is no `grid`" if cases is not None else "neither `cases` nor `grid`"
        problem(f"no trials: {given}; give `cases` (named rows of overrides, `NAME: {{}}` for a row that "
                "changes nothing) and/or a non-empty `grid`")
    cases = dict(cases) if cases else {"": {}}
    case_bases = {}
    for name, overrides in list(cases.items()):
        if overrides is None:
            overrides = {}
        elif not isinstance(overrides, dict):
            problem(f"cases[{name!r}]={overrides!r} has the wrong type: expected a mapping of dotted overrides")
            del cases[name]
            continue
        overrides = dict(overrides)
        if CASE_BASE in overrides:
            own = recipe(overrides.pop(CASE_BASE), f"cases[{name!r}].{CASE_BASE}")
            if own is None:
                del cases[name]
                continue
            case_bases[name] = own
        cases[name] = _dotted_only(overrides, f"cases[{name!r}]", problem)
    for key, values in list(grid.items()):
        if not isinstance(values, list) or not values:
            problem(f"grid[{key!r}]={values!r} has the wrong type: expected a list of values" if not
                    isinstance(values, list) else f"grid[{key!r}] is empty: the grid would have no points")
            del grid[key]
    grid = _dotted_only(grid, "grid", problem)

    seeds = _seeds(typed("seeds", (list, int), default=[0]), raw.get("seeds"), problem)

    overrides = _dotted_only(typed("overrides", dict, default={}), "overrides", problem)
    search = _dotted_only(typed("search", dict, default={}), "search", problem)
    for key, space in list(search.items()):
        bad = _search_space_problem(key, space)
        if bad:
            problem(bad)
            del search[key]
    n_trials = typed("n_trials", int, default=1)
    if n_trials < 1 or (n_trials > 1 and not search):
        problem(f"n_trials={n_trials}: expected 1, or more than 1 together with `search` spaces")
        n_trials = 1

    objective = typed("objective", dict, default={"metric": "val/loss", "direction": "minimize"})
    metric = objective.get("metric", "val/loss")
    if not metric_known(metric):
        problem(f"objective.metric={metric!r} is not a metric trials record; known: {', '.join(KNOWN_METRICS)}, "
                f"or an evaluation's {', '.join(p + '...' for p in eval_prefixes())}")
    direction = objective.get("direction", "minimize")
    if direction not in ("minimize", "maximize"):
        problem(f"objective.direction={direction!r}: expected 'minimize' or 'maximize'")
        direction = "minimize"
    pruner = typed("pruner", dict, default={"type": "none"})
    if pruner.get("type", "none") not in PRUNERS:
        problem(f"pruner.type={pruner.get('type')!r}: expected one of {', '.join(sorted(PRUNERS))}")
        pruner = {"type": "none"}

    def number(key: str, default: float, allowed: Callable[[float], bool], expected: str) -> float:
        value = typed(key, (int, float), default=default)
        if not allowed(value):
            problem(f"{key}={value!r}: {expected}")
            return default
        return value

    stale = number("stale_after_s", 120.0, lambda v: v > 0, "expected a positive number of seconds")
    max_attempts = typed("max_attempts", int, default=2)
    if max_attempts < 1:
        problem(f"max_attempts={max_attempts!r}: expected at least 1")
        max_attempts = 2
    grace = number("grace_s", 60.0, lambda v: v > 0, "expected a positive number of seconds (how long a signalled "
                   "worker waits for its trial to save its checkpoint)")
    retry = number("storage_retry_s", 300.0, lambda v: v >= 0, "expected a number of seconds, 0 or more (how long a "
                   "worker retries a storage that does not answer)")
    if base is None or no_trials or not cases:
        return None, problems
    spec = SweepSpec(study=study or "study", base=base, cases=cases, grid=grid, seeds=seeds, overrides=overrides,
                     search=search, n_trials=n_trials, objective_metric=metric, direction=direction, pruner=pruner,
                     storage=typed("storage", str), runs_dir=Path(typed("runs_dir", str, default="runs")),
                     stale_after_s=float(stale), max_attempts=max_attempts, grace_s=float(grace),
                     storage_retry_s=float(retry), source=source, case_bases=case_bases)
    if raw.get("tune_lr") is not None:
        if grid or search:
            problem("tune_lr cannot be combined with `grid` or `search`: its first stage is a grid over "
                    f"{LR_KEY} per case; put the other keys in `cases`")
        else:
            spec.tune_lr = _parse_tune_lr(raw["tune_lr"], seeds, problem)
    _check_variants(spec, problem)  # after tune_lr: its overrides are shared settings too
    problems += _clashes(spec)
    slugs = [slugify(label) for label, _ in spec.rows()]
    if len(set(slugs)) != len(slugs):
        problem(f"two table rows map to the same directory name: {sorted(slugs)}")
    if raw.get("paper") is not None:
        try:
            spec.paper = parse_paper(raw["paper"], [label for label, _ in spec.rows()], metric_known)
        except ValueError as err:
            problem(str(err))
    return spec, problems


def _seeds(seeds: list | int, given: Any, problem: Callable[[str], None]) -> list[int]:
    """The distinct seeds in range of `seeds: ...` (a count or a list); [0] when none is left."""
    seeds = list(range(seeds)) if isinstance(seeds, int) else seeds
    if not seeds or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
        problem(f"seeds={given!r}: expected a non-empty list of integers (or a count)")
        return [0]
    repeated = sorted({s for s in seeds if seeds.count(s) > 1})
    if repeated:
        problem(f"seeds={seeds!r}: seed(s) {', '.join(map(str, repeated))} listed more than once; "
                "expected distinct seeds (each runs once per row)")
    out_of_range = [s for s in seeds if not 0 <= s <= MAX_SEED]
    if out_of_range:
        problem(f"seeds={seeds!r}: {', '.join(map(str, out_of_range))} out of range; expected integers "
                f"from 0 to {MAX_SEED}")
    return [s for s in dict.fromkeys(seeds) if 0 <= s <= MAX_SEED] or [0]


def _check_variants(spec: SweepSpec, problem: Callable[[str], None]) -> None:
    """Every variant a spec names is registered, and every variant's flag a shared setting (overrides, grid,
    search, tune_lr.overrides) sets reaches a trial of a variant that reads it. Fills in what the spec needs to
    give a variant's flag only to the trials that read it (SweepSpec.applies)."""
    from diffexp.model.attention import variants
    from diffexp.model.attention.registry import reference_variant

    names = [entry.name for entry in variants()]
    spec.default_variant = reference_variant().name
    spec.flag_readers = {f"model.arch.{flag}": frozenset(e.name for e in variants() if flag in e.fields)
                         for entry in variants() for flag in entry.fields}

    def known(value: Any, where: str) -> bool:
        if value in names:
            return True
        problem(f"{where}: {ATTENTION_KEY}={value!r} is not a variant; known: {', '.join(names)}")
        return False

    for where, recipe in [("base", spec.base), *((f"cases[{c}].base", r) for c, r in spec.case_bases.items())]:
        attention = recipe_attention(recipe)
        if attention is not None:
            known(attention, f"{where} {', '.join(str(p) for p in recipe_files(recipe))}")
    shared = {"overrides": spec.overrides, "grid": spec.grid, "search": spec.search,
              **({"tune_lr.overrides": spec.tune_lr.overrides} if spec.tune_lr else {})}
    named: list[tuple[str, Any]] = [(f"cases[{case!r}]", o[ATTENTION_KEY]) for case, o in spec.cases.items()
                                    if ATTENTION_KEY in o]
    named += [(where, values[ATTENTION_KEY]) for where, values in shared.items() if ATTENTION_KEY in values]
    for where, value in named:
        choices = value if where == "grid" else value.get("choices", []) if where == "search" else [value]
        for choice in choices:
            known(choice, where)
    trained = {str(spec.variant_of(spec.case_bases.get(case), {**spec.overrides, **overrides, **point}))
               for case, overrides in spec.cases.items() for point in spec.grid_points()}
    if ATTENTION_KEY in spec.search:
        trained |= {str(choice) for choice in spec.search[ATTENTION_KEY].get("choices", [])}
    for where, values in shared.items():
        for key in values:
            readers = spec.flag_readers.get(key)
            if readers is not None and not readers & trained:
                problem(f"{where}: {key} is read by {', '.join(sorted(readers))} only, and no trial of this spec "
                        f"trains {'it' if len(readers) == 1 else 'one of them'} (they train "
                        f"{', '.join(sorted(trained))}); set it in the case it is for, or drop it")


def _clashes(spec: SweepSpec) -> list[str]:
    """A key set in two places of which one silently replaces the other: a case's or the shared overrides' value
    that the grid or a search replaces in every row, a grid key a search draws too. (A case's value replacing
    the shared overrides' is what cases are for.)"""
    found = []
    replaced = [(f"cases[{case!r}]", overrides) for case, overrides in spec.cases.items()]
    replaced.append(("overrides", spec.overrides))
    for where, overrides in replaced:
        for key, value in overrides.items():
            for place, values in (("grid", spec.grid), ("search", spec.search)):
                if key in values:
                    found.append(f"{where} sets {key}={_label_value(value)} and {place} sets it too "
                                 f"({place}: {_label_value(values[key])}): the {place}'s value would replace the "
                                 f"one {where} sets, in every row; set {key} in one place")
    for key in spec.grid:
        if key in spec.search:
            found.append(f"grid sets {key} ({_label_value(spec.grid[key])}) and search draws it too: the search's "
                         f"value would replace the grid's in every trial; set {key} in one place")
    return found


def _parse_tune_lr(raw: Any, seeds: list[int], problem: Callable[[str], None]) -> LrTuning | None:
    """The `tune_lr:` block, or None (with its problems) when it cannot be read."""
    if not isinstance(raw, dict):
        problem(f"tune_lr={raw!r} has the wrong type: expected a mapping with `values` (the learning rates "
                "each case is tried at), optional `overrides` (the short budget) and `seeds`")
        return None
    found: list[str] = []
    unknown = sorted(set(raw) - TUNE_LR_KEYS)
    if unknown:
        found.append(f"tune_lr: unknown key(s) {', '.join(map(repr, unknown))}; allowed: "
                     f"{', '.join(sorted(TUNE_LR_KEYS))}")
    values = raw.get("values")
    if (not isinstance(values, list) or len(values) < 2
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in values)
            or len(set(values)) != len(values)):
        found.append(f"tune_lr.values={values!r}: expected a list of 2 or more distinct positive learning rates")
    overrides = raw.get("overrides") or {}
    if not isinstance(overrides, dict):
        found.append(f"tune_lr.overrides={overrides!r} has the wrong type: expected a mapping of dotted overrides")
        overrides = {}
    overrides = _dotted_only(overrides, "tune_lr.overrides", found.append)
    if LR_KEY in overrides:
        found.append(f"tune_lr.overrides: {LR_KEY!r} is what tune_lr.values sets; remove it")
    tune_seeds = raw.get("seeds", seeds[:1])
    if (not isinstance(tune_seeds, list) or not tune_seeds or len(set(tune_seeds)) != len(tune_seeds)
            or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= MAX_SEED for s in tune_seeds)):
        found.append(f"tune_lr.seeds={tune_seeds!r}: expected a non-empty list of distinct seeds from 0 to {MAX_SEED}")
    for line in found:
        problem(line)
    if found:
        return None
    return LrTuning(tuple(float(v) for v in values), dict(overrides), tuple(tune_seeds))


def eval_prefixes() -> tuple[str, ...]:
    """The tag prefixes of every registered evaluation (diffexp.evals.registry): what its fit-time callback
    records (e.g. needle/rank/N4R2, attention/noise, mqar/accuracy, icl/random/n16)."""
    from diffexp.evals.registry import scalar_prefixes

    return tuple(dict.fromkeys(scalar_prefixes() + LEGACY_EVAL_PREFIXES))


def metric_known(name: str) -> bool:
    """A metric trials record at the end of fit, or one an evaluation callback records."""
    return name in KNOWN_METRICS or name.startswith(eval_prefixes())


def _as_tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def _dotted_only(mapping: dict[Any, Any], where: str, problem: Callable[[str], None]) -> dict[str, Any]:
    """`mapping` without its keys that are no dotted key of the `diffexp fit` config, each one a problem."""
    kept = {}
    for key, value in mapping.items():
        if not isinstance(key, str) or not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_+][\w+]*)*", key):
            problem(f"{where}: {key!r} is not a dotted config key such as model.arch.head_norm")
        elif key == "seed_everything":
            problem(f"{where}: {key!r} is set per trial from `seeds`; list the seeds there instead")
        elif key.split(".")[0] not in CONFIG_SECTIONS:
            problem(f"{where}: {key!r} must start with " + ", ".join(f"{s}." for s in CONFIG_SECTIONS[:-1])
                    + f" or {CONFIG_SECTIONS[-1]}. (a dotted key of the `diffexp fit` config)")
        else:
            kept[key] = value
    return kept


def _search_space_problem(key: str, space: Any) -> str | None:
    if not isinstance(space, dict) or space.get("type") not in SEARCH_TYPES:
        return f"search[{key!r}]={space!r}: expected {{type: float|int|categorical, ...}}"
    if space["type"] == "categorical":
        if not isinstance(space.get("choices"), list) or not space["choices"]:
            return f"search[{key!r}]: categorical needs a non-empty `choices` list"
        return None
    for bound in ("low", "high"):
        if not isinstance(space.get(bound), (int, float)) or isinstance(space.get(bound), bool):
            return f"search[{key!r}].{bound}={space.get(bound)!r}: expected a number"
    if space["low"] >= space["high"]:
        return f"search[{key!r}]: low={space['low']} must be below high={space['high']}"
    if space.get("log") and space["low"] <= 0:
        return f"search[{key!r}]: log=true needs low > 0, got {space['low']}"
    return None

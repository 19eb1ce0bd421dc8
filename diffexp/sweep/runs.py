"""Reading a study's run directory as the sweep runner wrote it: sweep.json, each trial's trial.json,
config.yaml and TensorBoard events. The directory names come from diffexp.sweep.layout, the one naming
the runner writes with, so a reader cannot drift from the writer.

Nothing here summarizes or prints: diffexp.compare does that on top of `load_study_runs`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diffexp.errors import UserError
from diffexp.evals.layout import EVAL_DIR, EVAL_SCALARS_SUFFIX
from diffexp.sweep import layout
from diffexp.sweep.layout import SWEEP_FILE, TRIAL_FILE
from diffexp.sweep.paper import parse_paper
from diffexp.sweep.spec import ATTENTION_KEY

CONFIG_FILE = "config.yaml"  # written into the trial directory by LightningCLI's SaveConfigCallback
METRIC_GROUPS = ("val", "test", "train")  # metric name prefixes, in column order
DIVERGED_STEP = "vitals/diverged_step"  # a diverged trial's metric; its record's `diverged_step` as well
#: names trials recorded before TensorBoard's first groups, train/ and val/, began with their losses (the
#: diagnostics moved under vitals/, the AR-Hit split after val/loss)
FORMER_PREFIXES = (("diag/", "vitals/"), ("train/grad_norm", "vitals/grad_norm"),
                   ("val/ar_hit_loss", "val/loss_ar_hit"), ("val/others_loss", "val/loss_others"),
                   ("val/ar_hit_share", "val/share_ar_hit"))


def current_name(name: str) -> str:
    """A metric's name today, for one an older trial recorded under a former prefix."""
    for old, new in FORMER_PREFIXES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


class LayoutError(UserError):
    """A directory that is not a study run directory as the runner lays it out (no or bad sweep.json)."""


@dataclass(frozen=True)
class Case:
    name: str
    slug: str
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass
class TrialRun:
    """One (case, seed, draw) of the grid. `record` is trial.json (None when it does not exist or cannot be read)."""

    case: Case
    seed: int
    path: Path
    record: dict[str, Any] | None = None
    curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    error: str | None = None  # trial.json exists but could not be read
    draw: int = 0  # search draw (0 without search spaces)
    variant: str | None = None  # the attention variant the trial ran, when its run records it
    #: scalars `diffexp eval NAME <trial>/checkpoints/CKPT` wrote into <trial>/eval/ (read_eval_scalars)
    evaluated: dict[str, float] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"seed {self.seed}" + (f" draw {self.draw}" if self.draw else "")

    @property
    def state(self) -> str:
        """complete | pruned | diverged | <other state from trial.json> | unreadable | running-or-crashed |
        not-started."""
        if self.error is not None:
            return "unreadable"
        if self.record is not None:
            return str(self.record.get("state", "unknown"))
        return "running-or-crashed" if self.path.is_dir() else "not-started"

    @property
    def metrics(self) -> dict[str, float]:
        """The numeric values under trial.json's "metrics" (bools and non-numbers left out), and the latest value
        of each evaluation's scalar that `diffexp eval NAME <trial>/checkpoints/...` wrote into the trial's
        eval/ after it finished (`evaluated`)."""
        raw = (self.record or {}).get("metrics") or {}
        if not isinstance(raw, dict):
            return {}
        metrics = {current_name(str(k)): float(v) for k, v in raw.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)}
        return metrics | {tag: value for tag, value in self.evaluated.items() if tag not in metrics}

    @property
    def last_step(self) -> int | None:
        steps = [points[-1][0] for points in self.curves.values() if points]
        return max(steps) if steps else None

    @property
    def last_write(self) -> float | None:
        """mtime of the newest file in the trial directory."""
        if not self.path.is_dir():
            return None
        times = [p.stat().st_mtime for p in self.path.iterdir() if p.is_file()]
        return max(times) if times else None


def _metric_order(name: str) -> tuple[int, str]:
    """val/* first, then test/*, train/*, the rest; alphabetical within each."""
    head = name.partition("/")[0]
    return (METRIC_GROUPS.index(head) if head in METRIC_GROUPS else len(METRIC_GROUPS), name)


@dataclass
class StudyRuns:
    study_dir: Path
    study: str
    spec: str | None
    cases: list[Case]
    seeds: list[int]
    objective: str
    direction: str  # minimize | maximize
    trials: dict[tuple[str, int, int], TrialRun]  # (case slug, seed, draw) -> run, for every trial of the grid
    unexpected: list[Path] = field(default_factory=list)  # trial dirs outside the grid of sweep.json
    draws: int = 1  # search draws per case and seed (sweep.json's n_trials)
    paper: dict[str, Any] | None = None  # the published numbers of the reproduced table (sweep/paper.py)
    views: dict[str, dict[str, str]] | None = None  # view -> case -> its row's name (a tune_lr study)
    tuned: dict[str, Any] | None = None  # the lr tuning behind the "best lr" view (sweep/tune.py)

    def trials_of(self, case: Case) -> list[TrialRun]:
        return [self.trials[(case.slug, seed, draw)] for seed in self.seeds for draw in range(self.draws)]

    def metric_names(self) -> list[str]:
        """Every numeric metric recorded by a complete or diverged trial: the objective first, then sorted.
        The step a run diverged at is its record's `diverged_step`, not a column."""
        names = {name for trial in self.trials.values() if trial.state in ("complete", "diverged")
                 for name in trial.metrics}
        return [self.objective, *sorted(names - {self.objective, DIVERGED_STEP}, key=_metric_order)]


def load_curves(trial_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """All scalar series of the event files of a trial: tag -> [(step, value)] sorted by step.

    Each folder's events files are read as TensorBoard's EventAccumulator reads them (diffexp.sweep.events: every
    events file in it, a resumed run appending a new one; simple values and 0-d tensors); events files in
    sub-directories (a logger with its own version folder) are merged in as well.
    Where a step was logged more than once, the value written last (by wall time) is kept.
    """
    trial_dir = Path(trial_dir)
    if not trial_dir.is_dir():
        return {}
    folders = sorted({p.parent for p in trial_dir.rglob("events.out.tfevents*") if p.is_file()})
    if not folders:
        return {}
    from diffexp.sweep.events import scalar_events

    raw: dict[str, list[tuple[float, int, float]]] = {}
    for folder in folders:
        for tag, points in scalar_events(folder).items():
            raw.setdefault(tag, []).extend(points)
    curves = {}
    for tag, points in raw.items():
        by_step: dict[int, float] = {}
        for _, step, value in sorted(points, key=lambda p: p[0]):  # stable: equal times keep the read order
            by_step[step] = value
        curves[tag] = sorted(by_step.items())
    return curves


def saved_config_values(config_path: Path, keys: list[str]) -> dict[str, Any]:
    """The value of each dotted key in a run's saved config; `init_args` levels are looked through, so
    `data.seq_len` finds `data.init_args.seq_len`. Keys the config does not hold are left out."""
    import yaml

    try:
        config = yaml.safe_load(config_path.read_text())
    except (OSError, yaml.YAMLError):
        return {}
    values = {}
    for key in keys:
        node: Any = config
        for part in key.split("."):
            if isinstance(node, dict) and part not in node and isinstance(node.get("init_args"), dict):
                node = node["init_args"]
            if not isinstance(node, dict) or part not in node:
                break
            node = node[part]
        else:
            values[key] = node
    return values


def trial_variant(record: dict[str, Any] | None, trial_dir: Path) -> str | None:
    """The attention variant a trial ran: its overrides in trial.json, else its saved config (a case that
    keeps the base recipe's attention overrides nothing). None when neither records one."""
    overrides = (record or {}).get("overrides")
    value = overrides.get(ATTENTION_KEY) if isinstance(overrides, dict) else None
    if value is None:
        value = saved_config_values(trial_dir / CONFIG_FILE, [ATTENTION_KEY]).get(ATTENTION_KEY)
    return str(value) if value is not None else None


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except OSError as exc:
        raise LayoutError(f"cannot read {what} {str(path)!r}: {exc.strerror or exc}") from exc
    except json.JSONDecodeError as exc:
        raise LayoutError(f"{what} {str(path)!r} is not valid JSON: {exc}") from exc


@dataclass(frozen=True)
class SweepTable:
    """What sweep.json says: the study's cases (table order), seeds, draws and objective."""

    study: str
    spec: str | None
    cases: list[Case]
    seeds: list[int]
    objective: str
    direction: str
    draws: int
    paper: dict[str, Any] | None = None
    views: dict[str, dict[str, str]] | None = None
    tuned: dict[str, Any] | None = None


def parse_sweep(path: Path) -> SweepTable:
    """sweep.json, checked: LayoutError naming the file and the bad key otherwise."""
    data = _read_json(path, SWEEP_FILE)
    where = f"{str(path)!r}"
    if not isinstance(data, dict):
        raise LayoutError(f"{where}: expected a JSON object with study, cases, seeds, objective")
    missing = [k for k in ("cases", "seeds", "objective") if k not in data]
    if missing:
        raise LayoutError(f"{where}: missing key(s) {', '.join(missing)} (expected study, cases, seeds, objective)")
    cases = []
    if not isinstance(data["cases"], list) or not data["cases"]:
        raise LayoutError(f"{where}: 'cases' must be a non-empty list of {{name, slug, overrides}}")
    for i, item in enumerate(data["cases"]):
        if not isinstance(item, dict) or not item.get("name") or not item.get("slug"):
            raise LayoutError(f"{where}: cases[{i}]={item!r} needs a 'name' and a 'slug'")
        cases.append(Case(str(item["name"]), str(item["slug"]), dict(item.get("overrides") or {})))
    slugs = [c.slug for c in cases]
    dupes = sorted({s for s in slugs if slugs.count(s) > 1})
    if dupes:
        raise LayoutError(f"{where}: duplicate case slug(s) {', '.join(dupes)}")
    seeds = data["seeds"]
    if (not isinstance(seeds, list) or not seeds
            or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds)):
        raise LayoutError(f"{where}: 'seeds'={seeds!r} must be a non-empty list of integers")
    objective = data["objective"]
    if not isinstance(objective, dict) or not objective.get("metric"):
        raise LayoutError(f"{where}: 'objective'={objective!r} must be {{\"metric\": ..., \"direction\": ...}}")
    direction = str(objective.get("direction", "minimize"))
    if direction not in ("minimize", "maximize"):
        raise LayoutError(f"{where}: objective direction {direction!r} must be 'minimize' or 'maximize'")
    draws = data.get("n_trials", 1)
    if not isinstance(draws, int) or isinstance(draws, bool) or draws < 1:
        raise LayoutError(f"{where}: 'n_trials'={draws!r} must be a positive integer (search draws per seed)")
    paper = None
    if data.get("paper") is not None:
        try:
            paper = parse_paper(data["paper"], [c.name for c in cases], lambda metric: True)
        except ValueError as err:
            raise LayoutError(f"{where}: {err}") from None
    views = data.get("views")
    names = {c.name for c in cases}
    if views is not None and (not isinstance(views, dict) or not all(
            isinstance(rows, dict) and set(rows.values()) <= names for rows in views.values())):
        raise LayoutError(f"{where}: 'views'={views!r} must map each view to {{case: one of the study's cases}}")
    return SweepTable(study=str(data.get("study") or path.parent.name), spec=data.get("spec"), cases=cases,
                      seeds=list(dict.fromkeys(seeds)), objective=str(objective["metric"]), direction=direction,
                      draws=draws, paper=paper, views=views, tuned=data.get("tuned"))


def _read_trial(case: Case, seed: int, draw: int, path: Path) -> TrialRun:
    trial = TrialRun(case, seed, path, draw=draw)
    record_path = path / TRIAL_FILE
    if record_path.is_file():
        try:
            record = json.loads(record_path.read_text())
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
            trial.record = record
        except (OSError, ValueError) as exc:
            trial.error = f"{TRIAL_FILE} unreadable: {exc}"
    trial.variant = trial_variant(trial.record, path)
    return trial


def read_eval_scalars(run_dir: Path) -> dict[str, float]:
    """Every scalar of the `<name>.scalars.json` files `diffexp eval` writes into <run>/eval/ (the latest
    step's where two files give one tag); unreadable files are skipped."""
    found: dict[str, tuple[int, float]] = {}
    for path in sorted((run_dir / EVAL_DIR).glob(f"*{EVAL_SCALARS_SUFFIX}")):
        try:
            saved = json.loads(path.read_text())
            step, scalars = int(saved["step"]), dict(saved["scalars"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        for tag, value in scalars.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and step >= found.get(tag, (-1, 0))[0]:
                found[tag] = (step, float(value))
    return {tag: value for tag, (_, value) in found.items()}


def load_study_runs(study_dir: str | Path, *, curves: bool = True) -> StudyRuns:
    """Read sweep.json, every trial.json of the (case, seed, draw) grid and (with `curves`) their event files.

    Raises LayoutError when `study_dir` is not a study run directory.
    """
    study_dir = Path(study_dir)
    if not study_dir.is_dir():
        raise LayoutError(f"{str(study_dir)!r} is not a directory: expected a study run directory "
                          f"(runs/<study>/ holding {SWEEP_FILE}, written by the sweep runner)")
    sweep = study_dir / SWEEP_FILE
    if not sweep.is_file():
        hint = ""
        children = sorted(p.parent.name for p in study_dir.glob(f"*/{SWEEP_FILE}"))
        if children:
            hint = f"; studies found below it: {', '.join(children)}"
        raise LayoutError(f"{str(study_dir)!r} has no {SWEEP_FILE}: expected a study run directory "
                          f"(runs/<study>/ with {SWEEP_FILE} and <case_slug>/seed<k>/{TRIAL_FILE}){hint}")
    table = parse_sweep(sweep)
    trials: dict[tuple[str, int, int], TrialRun] = {}
    for case in table.cases:
        for seed in table.seeds:
            for draw in range(table.draws):
                trial = _read_trial(case, seed, draw, layout.trial_dir(study_dir, case.slug, seed, draw))
                trial.evaluated = read_eval_scalars(trial.path)
                # events of an unfinished trial tell how far it got; a trial.json without the objective
                # falls back on them
                if curves or trial.record is None or table.objective not in trial.metrics:
                    trial.curves = load_curves(trial.path)
                trials[(case.slug, seed, draw)] = trial
    expected = {trial.path.resolve() for trial in trials.values()}
    unexpected = [p for p in layout.trial_dirs(study_dir) if p.resolve() not in expected]
    return StudyRuns(study_dir, table.study, table.spec, table.cases, table.seeds, table.objective,
                     table.direction, trials, unexpected, table.draws, table.paper, table.views, table.tuned)

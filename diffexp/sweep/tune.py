"""A fair learning rate per case, from one spec's `tune_lr:` block, in two stages.

One lr for every case favours whichever case it was tuned for. Stage one, study `<study>-lr`: every case at
every lr of `tune_lr.values` on the short budget of `tune_lr.overrides`, on `tune_lr.seeds`. Each case's
best lr is the one whose mean objective over those seeds is best. Stage two, study `<study>`: every case at
the spec's own lr ("same lr" view) and, where its best differs, a row `<case> @ best lr` ("best lr" view),
on the spec's seeds and budget. sweep.json records both views and the tuning, so `compare` shows each.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from diffexp.sweep.spec import LR_KEY, SpecError, SweepSpec

TUNING_SUFFIX = "-lr"  # stage one's study name: <study>-lr
BEST_SUFFIX = " @ best lr"  # a case's row at its own best lr
SAME_LR, BEST_LR = "same lr", "best lr"


def tuning_spec(spec: SweepSpec) -> SweepSpec:
    """Stage one: each case crossed with the lr values, the short budget's overrides on top of the spec's."""
    tune = spec.tune_lr
    return replace(spec, study=spec.study + TUNING_SUFFIX, grid={LR_KEY: list(tune.values)},
                   seeds=list(tune.seeds), overrides={**spec.overrides, **tune.overrides}, tune_lr=None, paper=None,
                   search={}, n_trials=1)


def best_lrs(tuning: SweepSpec, results: dict[str, float]) -> tuple[dict[str, float], dict[str, dict[float, float]]]:
    """(case -> its best lr, case -> lr -> mean objective over the seeds that finished) from stage one's
    `results` (point key -> objective of its complete trial). A lr with no finished seed is left out; a
    case with none at all is a SpecError naming it."""
    sign = 1 if tuning.direction == "minimize" else -1
    values: dict[str, dict[float, list[float]]] = {}
    for label, case, assignment, _ in tuning.table():
        per_lr = values.setdefault(case, {}).setdefault(float(assignment[LR_KEY]), [])
        for point in tuning.points():
            if point.case == label and point.key in results and math.isfinite(results[point.key]):
                per_lr.append(results[point.key])
    means = {case: {lr: sum(v) / len(v) for lr, v in per_lr.items() if v} for case, per_lr in values.items()}
    missing = [case for case, per_lr in means.items() if not per_lr]
    if missing:
        raise SpecError(f"study {tuning.study!r}: no learning rate of case(s) {', '.join(map(repr, missing))} "
                        f"finished, so their best lr is unknown; see the trial logs under {tuning.study_dir}/")
    best = {case: min(per_lr, key=lambda lr: sign * per_lr[lr]) for case, per_lr in means.items()}
    return best, means


def spec_lr(spec: SweepSpec, case: str) -> float | None:
    """The lr a case runs at as the spec is written: its override, the spec's, else its recipe's."""
    for overrides in (spec.cases[case], spec.overrides):
        if LR_KEY in overrides:
            return float(overrides[LR_KEY])
    try:
        recipe = yaml.safe_load(Path(spec.base_of(case)).read_text()) or {}
        return float(recipe["model"]["optim"]["lr"])
    except (OSError, KeyError, TypeError, ValueError, yaml.YAMLError):
        return None  # unknown: the best-lr row is run even if it may repeat the same-lr one


def final_spec(spec: SweepSpec, best: dict[str, float], means: dict[str, dict[float, float]],
               tuning_dir: Path) -> SweepSpec:
    """Stage two: each case as written, plus `<case> @ best lr` where its best lr is not the one it has."""
    cases, bases = dict(spec.cases), dict(spec.case_bases)
    views: dict[str, dict[str, str]] = {SAME_LR: {}, BEST_LR: {}}
    for case, overrides in spec.cases.items():
        views[SAME_LR][case] = case
        if spec_lr(spec, case) == best[case]:
            views[BEST_LR][case] = case
            continue
        row = case + BEST_SUFFIX
        if row in cases:
            raise SpecError(f"case {row!r} clashes with the row tune_lr adds for case {case!r} at its best lr; "
                            "rename it")
        cases[row] = {**overrides, LR_KEY: best[case]}
        views[BEST_LR][case] = row
        if case in spec.case_bases:
            bases[row] = spec.case_bases[case]
    tuned = {"study_dir": str(tuning_dir), "key": LR_KEY, "values": list(spec.tune_lr.values),
             "seeds": list(spec.tune_lr.seeds), "overrides": spec.tune_lr.overrides,
             "best": best, "means": {case: {repr(lr): m for lr, m in per_lr.items()} for case, per_lr in means.items()},
             "spec_lr": {case: spec_lr(spec, case) for case in spec.cases}}
    return replace(spec, cases=cases, case_bases=bases, views=views, tuned=tuned)


def describe(best: dict[str, float], means: dict[str, dict[float, float]], metric: str) -> str:
    """'best lr per case: Transformer 0.004 (val/loss 2.01), DIFF 0.002 (2.05)'."""
    parts = [f"{case} {lr:g} ({metric} {means[case][lr]:.4f})" for case, lr in best.items()]
    return "best lr per case: " + ", ".join(parts)


def views_of(spec: SweepSpec) -> dict[str, Any]:
    """What sweep.json records of a study's views: a tuned study's two and its tuning, a grid study's one per grid
    point (SweepSpec.grid_views), else nothing."""
    if spec.views:
        return {"views": spec.views, "tuned": spec.tuned}
    grid = spec.grid_views()
    return {"views": grid} if grid else {}

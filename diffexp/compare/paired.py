"""Paired differences against a reference case: per seed, case minus reference, with a Student t interval,
a verdict, and how many seeds a difference of a given size needs.

Every case of a study starts from the same initial weights under a seed and sees the same batches, so what the
seed changes moves both cases alike; their per-seed difference cancels it, and its spread over seeds (not the
spread of either case's loss) is the noise a difference has to stand out of. Only seeds both cases have
finished (complete trials) are paired. With search draws, a seed's value is its draw best in the objective.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from diffexp.compare.errors import CompareError
from diffexp.compare.stats import CaseSummary, Stat, t_quantile, trial_value
from diffexp.sweep.runs import StudyRuns

LEVEL = 0.95  # the default confidence level of the intervals and the power statement
POWER = 0.8  # the power the seed counts of the power statement are for
POWER_DELTAS = (0.01, 0.02)  # differences (in the objective's unit, nats for a loss) the power line prices

BETTER, WORSE, NOISE, TOO_FEW, REFERENCE = "better", "worse", "within seed noise", "too few seeds", "reference"
AGREES, DISAGREES, INCONCLUSIVE = "agrees", "disagrees", "inconclusive"


def check_level(value: object) -> float:
    """`--level` as a float strictly between 0 and 1; a CompareError naming the flag and the value otherwise."""
    try:
        level = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        level = math.nan
    if not 0 < level < 1:  # NaN fails too
        raise CompareError(f"--level {value!r} is invalid: the confidence level must be a number strictly "
                           "between 0 and 1 (0.95 for a 95% interval, 0.9 for 90%)")
    return level


def t_critical(level: float, df: int) -> float:
    """The two-sided Student t multiplier of a `level` interval with `df` degrees of freedom."""
    return t_quantile(0.5 + level / 2, df)  # t_quantile_975 at the default level


def seed_values(runs: StudyRuns, row: CaseSummary, metric: str) -> dict[int, float]:
    """Seed -> the case's final `metric` over its complete trials (finite values only); of several draws of a
    seed, the one best in the objective."""
    sign = 1 if runs.direction == "minimize" else -1
    best: dict[int, tuple[float, float]] = {}  # seed -> (objective, metric) of the best draw so far
    for trial in row.complete:
        objective, value = trial_value(runs, trial, runs.objective), trial_value(runs, trial, metric)
        if objective is None or value is None or not (math.isfinite(objective) and math.isfinite(value)):
            continue
        if trial.seed not in best or sign * objective < sign * best[trial.seed][0]:
            best[trial.seed] = (objective, value)
    return {seed: value for seed, (_, value) in sorted(best.items())}


@dataclass(frozen=True)
class PairedDiff:
    """case - reference per seed both finished, its mean, sample std and `level` interval (Student t, n-1 df)."""

    case: str
    reference: str
    metric: str
    direction: str  # the study's objective direction: which sign of the difference is better
    level: float
    seeds: tuple[int, ...]
    diffs: tuple[float, ...]

    @property
    def n(self) -> int:
        return len(self.diffs)

    @property
    def stat(self) -> Stat:
        """The summary of the differences (mean, sample std, t interval): the one every table uses."""
        return Stat(list(self.diffs))

    @property
    def mean(self) -> float | None:
        return self.stat.mean

    @property
    def sd(self) -> float | None:
        return self.stat.std

    @property
    def half_width(self) -> float | None:
        return self.stat.half_width(self.level)

    @property
    def low(self) -> float | None:
        return self.mean - self.half_width if self.n > 1 else None

    @property
    def high(self) -> float | None:
        return self.mean + self.half_width if self.n > 1 else None

    @property
    def sign(self) -> int | None:
        """+1 / -1 when the interval lies above / below 0, 0 when it holds 0, None with fewer than 2 seeds."""
        if self.n < 2:
            return None
        return 1 if self.low > 0 else -1 if self.high < 0 else 0

    @property
    def verdict(self) -> str:
        """better / worse (the interval excludes 0; below 0 is better when minimizing), within seed noise, or
        too few seeds (fewer than 2 paired seeds)."""
        if self.sign is None:
            return TOO_FEW
        if self.sign == 0:
            return NOISE
        return BETTER if (self.sign < 0) == (self.direction == "minimize") else WORSE


def paired_difference(runs: StudyRuns, row: CaseSummary, reference: CaseSummary, metric: str | None = None,
                      level: float = LEVEL) -> PairedDiff:
    """`row` minus `reference` in `metric` (default: the objective), over the seeds both have finished."""
    metric = metric or runs.objective
    ours, theirs = seed_values(runs, row, metric), seed_values(runs, reference, metric)
    seeds = tuple(s for s in ours if s in theirs)
    return PairedDiff(row.case.name, reference.case.name, metric, runs.direction, level, seeds,
                      tuple(ours[s] - theirs[s] for s in seeds))


def paper_agreement(paper_diff: float, measured: PairedDiff) -> str:
    """A paper's difference (first - second) against the paired one of the same two rows: agrees / disagrees
    when the measured interval excludes 0 with the same / the other sign, else inconclusive (within seed noise
    or fewer than 2 paired seeds)."""
    if not measured.sign or not paper_diff:
        return INCONCLUSIVE
    return AGREES if (measured.sign > 0) == (paper_diff > 0) else DISAGREES


MIN_PRICED_SEEDS = 3  # below this a paired t test has 1 df: its 95% interval is +-12.7 sd / sqrt(2) wide
MAX_SEEDS = 100_000  # seeds_for gives up (returns None) past this


def paired_t_power(delta: float, sd: float, seeds: int, level: float) -> float:
    """The power of a two-sided paired t test at `level` on `seeds` seeds against a true difference `delta`
    with per-seed sd `sd`: P(|T| > t_crit) for T noncentral t with seeds - 1 df and noncentrality
    delta sqrt(seeds) / sd (the exact power; the normal approximation overstates it at few seeds)."""
    from scipy.stats import nct

    df, crit = seeds - 1, t_critical(level, seeds - 1)
    noncentrality = abs(delta) * math.sqrt(seeds) / sd
    lower = float(nct.cdf(-crit, df, noncentrality))  # the wrong-sign rejections: below alpha / 2, often ~1e-18,
    return float(nct.sf(crit, df, noncentrality)) + (lower if math.isfinite(lower) else 0.0)  # where scipy says NaN


@dataclass(frozen=True)
class Power:
    """What a paired two-sided t test at `level` detects with power POWER, from the measured sd of the paired
    differences (pooled over the cases: sum (n_i - 1) s_i^2 / sum (n_i - 1)) taken as the true one. Exact for a
    t test: the power is the noncentral t's (`paired_t_power`), so the differences it resolves are never
    narrower than the t interval the table prints beside it."""

    sd: float
    cases: int  # cases whose differences the sd pools
    seeds: int  # the study's seed count
    level: float
    power: float = POWER

    @property
    def priced(self) -> bool:
        """False below MIN_PRICED_SEEDS seeds: the test has too few degrees of freedom to price a difference."""
        return self.seeds >= MIN_PRICED_SEEDS

    def power_at(self, delta: float, seeds: int | None = None) -> float:
        return paired_t_power(delta, self.sd, seeds or self.seeds, self.level)

    def seeds_for(self, delta: float) -> int | None:
        """The fewest seeds (at least 2) whose paired t test detects `delta` with power POWER; None past
        MAX_SEEDS. The power grows with the seeds, so a doubling search then bisection finds it."""
        if self.sd == 0:
            return 2
        high = 2
        while self.power_at(delta, high) < self.power:
            if high >= MAX_SEEDS:
                return None
            high = min(2 * high, MAX_SEEDS)
        low = max(2, high // 2)  # power_at(low) < power unless low == high == 2
        while low < high:
            mid = (low + high) // 2
            low, high = (mid + 1, high) if self.power_at(delta, mid) < self.power else (low, mid)
        return high

    def resolvable(self, seeds: int | None = None) -> float:
        """The smallest difference `seeds` (default: the study's) detect with power POWER: the root in delta
        of paired_t_power(delta) = POWER. Always wider than the interval's half width t_crit sd / sqrt(n)."""
        from scipy.optimize import brentq

        n = seeds or self.seeds
        if self.sd == 0:
            return 0.0
        high = 2 * t_critical(self.level, n - 1) * self.sd / math.sqrt(n)  # twice the interval's half width
        while self.power_at(high, n) < self.power:
            high *= 2
        return float(brentq(lambda d: self.power_at(d, n) - self.power, 0.0, high, xtol=1e-12 * high))


def pooled_power(runs: StudyRuns, diffs: Sequence[PairedDiff], level: float) -> Power | None:
    """The power statement from the cases with 2 or more paired seeds; None when there is none."""
    measured = [d for d in diffs if d.n > 1]
    if not measured:
        return None
    df = sum(d.n - 1 for d in measured)
    sd = math.sqrt(sum((d.n - 1) * d.sd ** 2 for d in measured) / df)
    return Power(sd, len(measured), len(runs.seeds), level)


@dataclass
class PairedReport:
    """Every case against the reference case in the objective, and the study's power statement."""

    reference: CaseSummary
    chosen_by: str  # why this case is the reference, for the note under the table
    level: float
    diffs: dict[str, PairedDiff]  # case name -> its difference; the reference has none
    power: Power | None

    def of(self, row: CaseSummary) -> PairedDiff | None:
        return self.diffs.get(row.case.name)


def reference_variant_name() -> str:
    """The registry's reference variant (diffexp.model.attention.registry.reference_variant), read from the
    variants' source: importing the registry imports every variant, so torch, seconds that `compare` needs for
    nothing else. The one `Variant(name=..., reference_variant=True)` in diffexp/model/attention/; the registry
    itself where the source does not state exactly one (tests/test_compare_paired.py checks they agree)."""
    import ast
    import importlib.util
    from pathlib import Path

    folder = Path(importlib.util.find_spec("diffexp.model").submodule_search_locations[0]) / "attention"
    names = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Variant":
                given = {keyword.arg: keyword.value for keyword in node.keywords}
                if isinstance(given.get("reference_variant"), ast.Constant) \
                        and given["reference_variant"].value is True and isinstance(given.get("name"), ast.Constant):
                    names.append(given["name"].value)
    if len(names) == 1:
        return names[0]
    from diffexp.model.attention.registry import reference_variant

    return reference_variant().name


def reference_row(rows: Sequence[CaseSummary], name: str | None = None, study: str = "") -> tuple[CaseSummary, str]:
    """The reference case and why: `name` (a case's name or slug, from --reference), else the first case that
    runs the registry's reference variant, else the first case of sweep.json."""
    if name is not None:
        found = next((r for r in rows if name in (r.case.name, r.case.slug)), None)
        if found is None:
            cases = ", ".join(repr(r.case.name) for r in rows)
            raise CompareError(f"--reference {name!r} is not a case of study {study!r}: give one of its cases "
                               f"by name or slug: {cases}")
        return found, "--reference"
    variant = reference_variant_name()
    found = next((r for r in rows if r.variant == variant), None)
    if found is not None:
        return found, f"the first case running the reference variant {variant}"
    return rows[0], f"the first case, as none runs the reference variant {variant}"


def paired_report(runs: StudyRuns, rows: Sequence[CaseSummary], reference: str | None = None,
                  level: float = LEVEL) -> PairedReport:
    """Each case minus the reference case (--reference, else the baseline) in the objective, at `level`."""
    level = check_level(level)
    ref, chosen_by = reference_row(rows, reference, runs.study)
    diffs = {row.case.name: paired_difference(runs, row, ref, level=level) for row in rows if row is not ref}
    return PairedReport(ref, chosen_by, level, diffs, pooled_power(runs, list(diffs.values()), level))


def paired_reports(runs: StudyRuns, rows: Sequence[CaseSummary], reference: str | None = None,
                   level: float = LEVEL) -> dict[str, PairedReport]:
    """One report per view of the study (a tune_lr study's "same lr" and "best lr": each case's row in that
    view against the reference's row in it; --reference names the case), else one report, view ""."""
    if not runs.views:
        return {"": paired_report(runs, rows, reference, level)}
    by_name = {row.case.name: row for row in rows}
    reports = {}
    for view, case_rows in runs.views.items():
        view_rows = [by_name[name] for name in case_rows.values()]
        reports[view] = paired_report(runs, view_rows, case_rows.get(reference, reference), level)
    return reports

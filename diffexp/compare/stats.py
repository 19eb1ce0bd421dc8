"""The numbers of a comparison: per case, mean, sample std and 95% CI over complete seeds; what is missing.

Means are over the complete trials of a case (a single seed's std is n/a, never 0); pruned and diverged trials
are counted but left out, except that the training diagnostics (vitals/*) average over the diverged ones too,
since how a run went unstable is what they show. A search's draws are trials of their case like its seeds.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from diffexp.compare.errors import CompareError
from diffexp.sweep.layout import SWEEP_FILE
from diffexp.sweep.runs import ATTENTION_KEY, Case, StudyRuns, TrialRun

NA = "n/a"  # the std of a single seed
EMPTY = "—"  # a case with no complete seed
#: metrics of how training went (spikes, gradient norms, context RMS, ...): over complete and diverged trials
DIAGNOSTIC_PREFIX = "vitals/"


def over_diverged_too(name: str) -> bool:
    """True for the metrics averaged over diverged trials as well as complete ones."""
    return name.startswith(DIAGNOSTIC_PREFIX)


def t_quantile(q: float, df: int) -> float:
    """The q quantile of Student's t with `df` degrees of freedom (df >= 1)."""
    from scipy.stats import t as student_t  # here: scipy.stats takes a second to import, `compare --help` none

    return float(student_t.ppf(q, df))


def t_quantile_975(df: int) -> float:
    """The 97.5% quantile of Student's t with `df` degrees of freedom (df >= 1): a 95% interval's."""
    return t_quantile(0.975, df)


#: below this a number's three decimals keep one significant digit or none ('0.002', '0.000'): it gets three
SMALL = 1e-2
#: below this three significant digits are written as an exponent, as the paired tables' differences are
TINY = 1e-3


def format_number(x: float, scale: float | None = None) -> str:
    """'1,234.5' from 1000 up, '1.920' down to 0.01, then three significant digits of `scale` (default |x|):
    '0.00213', and below 0.001 '2.13e-05', so that a small metric (a rounding error) does not read as '0.000'.

    A mean and its std share the mean's scale (see Stat.format), so the std gets the mean's decimals."""
    if not math.isfinite(x):
        return str(x)
    scale = abs(x) if scale is None or not math.isfinite(scale) else scale
    if abs(x) >= 1000:
        return f"{x:,.1f}"
    if scale == 0 or scale >= SMALL:
        return f"{x:.3f}"
    if scale < TINY:
        return f"{x:.2e}"
    return f"{x:.{2 - math.floor(math.log10(scale))}f}"


@dataclass
class Stat:
    """Mean, sample std (ddof=1) and 95% CI half-width of the complete seeds' values.

    std and ci95 are None with one value, all three None with none."""

    values: list[float]

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float | None:
        return float(np.mean(self.values)) if self.values else None

    @property
    def std(self) -> float | None:
        return float(np.std(self.values, ddof=1)) if self.n > 1 else None

    def half_width(self, level: float) -> float | None:
        """Half-width of the `level` confidence interval of the mean: t(0.5 + level/2, n-1) * std / sqrt(n)."""
        return t_quantile(0.5 + level / 2, self.n - 1) * self.std / math.sqrt(self.n) if self.n > 1 else None

    @property
    def ci95(self) -> float | None:
        """Half-width of the 95% confidence interval of the mean: t(0.975, n-1) * std / sqrt(n)."""
        return self.half_width(0.95)

    def format(self) -> str:
        if self.mean is None:
            return EMPTY
        # the larger of the two sets the digits: '0.00213 ± 0.00004', and '0.000 ± 0.500' for a mean lost in noise
        scale = max(abs(self.mean), self.std or 0.0)
        return (f"{format_number(self.mean, scale)} ± "
                f"{NA if self.std is None else format_number(self.std, scale)}")


@dataclass
class CaseSummary:
    case: Case
    n_expected: int
    complete: list[TrialRun]
    pruned: list[TrialRun]
    diverged: list[TrialRun]
    failed: list[TrialRun]  # trial.json with another state, or unreadable
    missing: list[TrialRun]  # no trial.json
    stats: dict[str, Stat]
    params_total: int | None
    params_non_embedding: int | None
    tokens_per_s: float | None
    wall_s: float | None
    variant: str | None = None  # attention variant(s) the case's runs used, as they record it
    tracks_divergence: bool = False  # some trial.json of the case records whether its run diverged

    @property
    def seeds_text(self) -> str:
        notes = [f"{len(group)} {word}" for group, word in
                 ((self.pruned, "pruned"), (self.diverged, "diverged"), (self.failed, "failed"),
                  (self.missing, "missing")) if group]
        return f"{len(self.complete)}/{self.n_expected}" + (f" ({', '.join(notes)})" if notes else "")

    @property
    def diverged_text(self) -> str:
        """diverged/total, e.g. "1/2"."""
        return f"{len(self.diverged)}/{self.n_expected}"


def _mean(values: Iterable[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None


def _as_number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _param_count(trials: Sequence[TrialRun], key: str) -> int | None:
    for trial in trials:  # the same for every seed of a case: take the first that has it
        value = _as_number(((trial.record or {}).get("params") or {}).get(key))
        if value is not None:
            return int(value)
    return None


def case_variant(case: Case, trials: Sequence[TrialRun]) -> str | None:
    """The variant(s) the case's trials ran (a search may draw several), else what sweep.json's case sets."""
    found = list(dict.fromkeys(t.variant for t in trials if t.variant is not None))
    if found:
        return ", ".join(found)
    planned = case.overrides.get(ATTENTION_KEY)
    return str(planned) if planned is not None else None


def check_metrics(runs: StudyRuns, metrics: Sequence[str] | None) -> list[str]:
    """The metric columns: the objective then `metrics` (default: every recorded metric). Unknown -> CompareError."""
    available = runs.metric_names()
    if not metrics:
        return available
    unknown = [m for m in metrics if m not in available]
    if unknown:
        have = ", ".join(available[1:]) if len(available) > 1 else "none besides the objective yet"
        raise CompareError(f"unknown --metric {', '.join(map(repr, unknown))}: available metrics of study "
                           f"{runs.study!r} are {runs.objective} (objective), {have}")
    return list(dict.fromkeys([runs.objective, *metrics]))


def trial_value(runs: StudyRuns, trial: TrialRun, name: str) -> float | None:
    """A trial's final value of metric `name`: trial.json's, else (the objective only) its last logged value."""
    value = trial.metrics.get(name)
    if value is None and name == runs.objective and trial.curves.get(name):
        value = trial.curves[name][-1][1]  # not in trial.json: the last logged value of the objective tag
    return value


def _metric_values(runs: StudyRuns, trials: Sequence[TrialRun], name: str) -> list[float]:
    return [v for v in (trial_value(runs, t, name) for t in trials) if v is not None]


def summarize(runs: StudyRuns, metrics: Sequence[str] | None = None) -> list[CaseSummary]:
    """One CaseSummary per case of sweep.json, in its order, whether or not any of its trials finished; a trial
    without trial.json is missing, one whose state is not complete, pruned or diverged failed."""
    columns = check_metrics(runs, metrics)
    rows = []
    for case in runs.cases:
        trials = runs.trials_of(case)
        complete = [t for t in trials if t.state == "complete"]
        pruned = [t for t in trials if t.state == "pruned"]
        diverged = [t for t in trials if t.state == "diverged"]
        missing = [t for t in trials if t.record is None and t.error is None]
        failed = [t for t in trials if (t.record is not None and t.state not in ("complete", "pruned", "diverged"))
                  or t.error]
        ran = complete + pruned + diverged + failed
        rows.append(CaseSummary(
            case=case, n_expected=len(trials), complete=complete, pruned=pruned, diverged=diverged, failed=failed,
            missing=missing,
            stats={name: Stat(_metric_values(runs, complete + diverged if over_diverged_too(name) else complete, name))
                   for name in columns},
            params_total=_param_count(ran, "total"),
            params_non_embedding=_param_count(ran, "non_embedding"),
            tokens_per_s=_mean(_as_number((t.record or {}).get("tokens_per_s")) for t in complete),
            wall_s=_mean(_as_number((t.record or {}).get("wall_s")) for t in complete),
            variant=case_variant(case, trials),
            tracks_divergence=any("diverged_step" in (t.record or {}) for t in trials),
        ))
    return rows


def best_case(runs: StudyRuns, rows: Sequence[CaseSummary]) -> CaseSummary | None:
    scored = [r for r in rows if r.stats[runs.objective].mean is not None]
    if not scored:
        return None
    pick = min if runs.direction == "minimize" else max
    return pick(scored, key=lambda r: r.stats[runs.objective].mean)


def _duration_text(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def _missing_detail(trial: TrialRun, now: float) -> str:
    if not trial.path.is_dir():
        return "not started (no run dir)"
    detail = "run dir exists, no trial.json (running or crashed)"
    step, written = trial.last_step, trial.last_write
    if step is not None:
        detail += f"; last logged step {step}"
    if written is not None:
        detail += f"; last write {_duration_text(max(0.0, now - written))} ago"
    return detail


def issues(runs: StudyRuns, rows: Sequence[CaseSummary], now: float | None = None) -> dict[str, list[str]]:
    """Plain-text lines of the sections below the table: missing, no completed seed, pruned, failed, unexpected."""
    now = time.time() if now is None else now
    out: dict[str, list[str]] = {"missing": [], "no completed seed": [], "diverged": [], "pruned": [],
                                 "failed": [], "unexpected": []}
    for row in rows:
        for trial in row.missing:
            out["missing"].append(f"{row.case.name}, {trial.label}: {_missing_detail(trial, now)}")
        if not row.complete:
            out["no completed seed"].append(row.case.name)
        for trial in row.pruned:
            step = (trial.record or {}).get("global_step")
            value = trial.metrics.get(runs.objective)
            where = f" at step {step}" if step is not None else ""
            last = f" ({runs.objective} {format_number(value)})" if value is not None else ""
            out["pruned"].append(f"{row.case.name}, {trial.label}: pruned{where}{last}")
        for trial in row.diverged:
            record = trial.record or {}
            step = record.get("diverged_step")
            why = f" ({record['divergence']})" if record.get("divergence") else ""
            out["diverged"].append(f"{row.case.name}, {trial.label}: diverged at step {step}{why}")
        for trial in row.failed:
            why = trial.error or f"state {trial.state!r}"
            out["failed"].append(f"{row.case.name}, {trial.label}: {why}")
    for path in runs.unexpected:
        out["unexpected"].append(f"{path.relative_to(runs.study_dir)}: not a trial of {SWEEP_FILE}; ignored")
    return {k: v for k, v in out.items() if v}

"""The scaling section of a comparison: which runs form size series, their fits, and the parameter ratios.

Points: every complete trial with the metric (val/loss) in its trial.json and a non-embedding parameter
count in its parameter report (trial.json "params" -> "non_embedding"), grouped by the attention variant
the trial ran (diffexp.sweep.runs reads it from the run). A study has a scaling section when some variant
spans MIN_SIZES distinct non-embedding counts or more, the largest at least MIN_SPAN times the smallest:
an ordinary table (cases at one size, or ablations that move N by a few percent) has none.

The question answered, per variant: how many parameters does it need to reach the reference's loss?

* reference: the registry's reference variant (the plain softmax Transformer) when it has a fit, else the
  first variant in the study's case order that has one;
* N_ref: the reference's largest size; L*: the reference's fitted loss there;
* N needed: the N at which the variant's fit reaches L* (PowerLaw.params_for); ratio = N needed / N_ref,
  below 1 when the variant needs fewer parameters than the reference for the same loss;
* pooled: fits to each size's mean loss over seeds; per seed: each seed's points refit (the reference's
  too, with that seed's L*), the ratios summarized as mean ± sample std and 95% CI over seeds (Stat).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from diffexp.compare.scaling import PowerLaw, fit_power_law
from diffexp.compare.stats import Stat
from diffexp.sweep.runs import StudyRuns, TrialRun

METRIC = "val/loss"
PARAMS_KEY = "non_embedding"  # the key of trial.json's "params" (Decoder.parameter_report) that is N
MIN_SIZES = 3  # distinct non-embedding counts of one variant that make a study a scaling study
MIN_SPAN = 2.0  # ... spanning at least this factor (largest / smallest)


@dataclass(frozen=True)
class SizePoint:
    n: int  # non-embedding parameters
    loss: float
    seed: int
    case: str


@dataclass
class Series:
    """One variant's (N, loss) points over the study's cases and seeds."""

    variant: str
    points: list[SizePoint] = field(default_factory=list)

    @property
    def sizes(self) -> list[int]:
        return sorted({p.n for p in self.points})

    @property
    def seeds(self) -> list[int]:
        return sorted({p.seed for p in self.points})

    def means(self) -> tuple[np.ndarray, np.ndarray]:
        """(sizes, mean loss over the seeds at each size)."""
        sizes = self.sizes
        return np.array(sizes, float), np.array([np.mean([p.loss for p in self.points if p.n == n]) for n in sizes])

    def of_seed(self, seed: int) -> tuple[np.ndarray, np.ndarray]:
        chosen = [p for p in self.points if p.seed == seed]
        return np.array([p.n for p in chosen], float), np.array([p.loss for p in chosen])

    def spans(self) -> bool:
        sizes = self.sizes
        return len(sizes) >= MIN_SIZES and sizes[-1] >= MIN_SPAN * sizes[0]


@dataclass
class VariantScaling:
    """A variant's fits and the parameters it needs to reach the reference's loss at N_ref."""

    series: Series
    fit: PowerLaw | None  # pooled: each size's mean loss over seeds
    seed_fits: dict[int, PowerLaw | None]
    n_needed: float | None  # pooled fit's N at L*
    ratio: float | None  # n_needed / N_ref
    seed_ratios: dict[int, float]  # per seed: that seed's fit against that seed's reference L*

    @property
    def variant(self) -> str:
        return self.series.variant

    @property
    def ratio_stat(self) -> Stat:
        return Stat(list(self.seed_ratios.values()))

    @property
    def extrapolated(self) -> bool:
        """N needed lies outside the sizes this variant ran: the fit's extrapolation, not a measurement."""
        sizes, slack = self.series.sizes, 1e-6  # the reference's own N_ref, found again to rounding
        return self.n_needed is not None and not sizes[0] * (1 - slack) <= self.n_needed <= sizes[-1] * (1 + slack)


@dataclass
class ScalingReport:
    metric: str
    reference: str  # the variant ratios are relative to
    n_ref: int  # the reference's largest size
    target: float  # L*: the reference's pooled fitted loss at n_ref
    rows: list[VariantScaling]  # every variant with a series, study order; the reference first
    unfitted: list[Series]  # variants no fit could be made for (fewer than MIN_POINTS sizes, say)

    @property
    def seeds(self) -> list[int]:
        return sorted({s for row in self.rows for s in row.series.seeds})


def _non_embedding(trial: TrialRun) -> int | None:
    value = ((trial.record or {}).get("params") or {}).get(PARAMS_KEY)
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None


def collect_series(runs: StudyRuns, metric: str = METRIC) -> list[Series]:
    """One Series per variant, in the order its first case appears in sweep.json; complete trials only."""
    series: dict[str, Series] = {}
    for case in runs.cases:
        for trial in runs.trials_of(case):
            n, loss = _non_embedding(trial), trial.metrics.get(metric)
            if trial.state != "complete" or trial.variant is None or n is None or loss is None:
                continue
            series.setdefault(trial.variant, Series(trial.variant)).points.append(
                SizePoint(n, loss, trial.seed, case.name))
    return list(series.values())


def is_scaling_study(series: Sequence[Series]) -> bool:
    """Some variant spans MIN_SIZES sizes or more over a factor MIN_SPAN (see the module docstring)."""
    return any(s.spans() for s in series)


def _reference_name() -> str:
    from diffexp.model.attention.registry import reference_variant

    return reference_variant().name


def _ratio(fit: PowerLaw | None, target: float | None, n_ref: int) -> tuple[float | None, float | None]:
    if fit is None or target is None:
        return None, None
    needed = fit.params_for(target)
    return needed, (needed / n_ref if needed is not None else None)


def scaling_report(runs: StudyRuns, metric: str = METRIC, reference: str | None = None) -> ScalingReport | None:
    """The scaling section, or None when the study is not a scaling study (or no variant can be fitted)."""
    series = collect_series(runs, metric)
    if not is_scaling_study(series):
        return None
    fits = {s.variant: fit_power_law(*s.means()) for s in series}
    fitted = [s for s in series if fits[s.variant] is not None]
    if not fitted:
        return None
    wanted = reference or _reference_name()
    ref = next((s for s in fitted if s.variant == wanted), fitted[0])
    n_ref = ref.sizes[-1]
    target = float(fits[ref.variant].loss(n_ref))
    ref_seed_targets = {}
    for seed in ref.seeds:
        seed_fit = fit_power_law(*ref.of_seed(seed))
        ref_seed_targets[seed] = float(seed_fit.loss(n_ref)) if seed_fit is not None else None
    rows = []
    for s in [ref] + [s for s in fitted if s is not ref]:
        seed_fits = {seed: fit_power_law(*s.of_seed(seed)) for seed in s.seeds}
        n_needed, ratio = _ratio(fits[s.variant], target, n_ref)
        seed_ratios = {}
        for seed, seed_fit in seed_fits.items():
            _, seed_ratio = _ratio(seed_fit, ref_seed_targets.get(seed), n_ref)
            if seed_ratio is not None:
                seed_ratios[seed] = seed_ratio
        rows.append(VariantScaling(s, fits[s.variant], seed_fits, n_needed, ratio, seed_ratios))
    return ScalingReport(metric, ref.variant, n_ref, target, rows, [s for s in series if fits[s.variant] is None])

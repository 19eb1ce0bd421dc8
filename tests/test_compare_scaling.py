"""The scaling fit (loss = a N^-b + c) on synthetic data from known a, b, c, and the scaling section of compare."""

from __future__ import annotations

import csv

import numpy as np
import pytest

from diffexp import compare
from diffexp.compare.scaling import CURVE_FIT, LOG_LINEAR, fit_power_law, scaling_report
from tests.fixtures_compare import make_study, write_sweep, write_trial
from tests.helpers import markdown_tables

SIZES = np.array([1.0e5, 3.0e5, 1.0e6, 3.0e6, 1.0e7])
A, B, C = 60.0, 0.35, 1.6  # the reference's law
EFFICIENCY = 0.62  # the other variant reaches any loss with 62% of the reference's parameters
EMBEDDING = 67_000  # write_trial records non_embedding = params - 67_000


def law(n, a=A, b=B, c=C):
    return a * np.asarray(n, float) ** -b + c


def variant_loss(n):
    """loss_v(N) = loss_ref(N / EFFICIENCY): at N = EFFICIENCY * N_ref it equals the reference's loss at N_ref."""
    return law(np.asarray(n, float) / EFFICIENCY)


def test_fit_recovers_known_exponent_and_asymptote():
    rng = np.random.default_rng(0)
    loss = law(SIZES) + rng.normal(0, 0.003, len(SIZES))
    fit = fit_power_law(SIZES, loss)
    assert fit.method == CURVE_FIT and fit.note is None and fit.n_points == 5
    assert fit.b == pytest.approx(B, abs=0.03)
    assert fit.c == pytest.approx(C, abs=0.03)
    assert fit.params_for(float(law(2e6))) == pytest.approx(2e6, rel=0.05)


def test_fit_of_repeated_sizes_recovers_the_parameter_ratio():
    """Several seeds per size; the N where the second law meets the first's loss at N_ref is 0.62 N_ref."""
    rng = np.random.default_rng(1)
    n = np.repeat(SIZES, 3)
    ref = fit_power_law(n, law(n) + rng.normal(0, 0.002, len(n)))
    other = fit_power_law(n, variant_loss(n) + rng.normal(0, 0.002, len(n)))
    target = float(ref.loss(SIZES[-1]))
    assert other.params_for(target) / SIZES[-1] == pytest.approx(EFFICIENCY, rel=0.06)


@pytest.mark.parametrize("count", [2, 3])
def test_too_few_sizes_fall_back_to_log_linear_with_c_fixed(count):
    fit = fit_power_law(SIZES[:count], law(SIZES[:count], c=0.0))
    assert fit.method == LOG_LINEAR and fit.c == 0.0 and fit.n_points == count
    assert fit.note == f"{count} sizes < 4" and "log-linear, c fixed at 0" in fit.describe()
    assert fit.b == pytest.approx(B, rel=1e-6) and fit.a == pytest.approx(A, rel=1e-6)  # exact: c really is 0


def test_degenerate_inputs():
    assert fit_power_law(SIZES[:1], [2.0]) is None  # one size: no fit
    assert fit_power_law([1e5, 1e5, 1e5], [2.0, 2.1, 2.2]) is None  # three seeds of one size: still one size
    rising = fit_power_law(SIZES[:4], [5.0, 5.1, 5.3, 5.2])  # loss does not fall with N
    assert rising.method == LOG_LINEAR and "does not fall" in rising.note
    assert rising.params_for(5.0) is None  # never reaches a target: no ratio, not a wrong one
    assert fit_power_law(SIZES[:4], law(SIZES[:4])).params_for(C - 0.1) is None  # below the asymptote


def make_scaling_study(root, seeds=(0, 1, 2), sizes=SIZES[:4], noise=0.002):
    """Two variants at four sizes, three seeds: 'baseline' (the registry's reference) follows the law,
    'diff_v1' reaches each loss with 62% of the parameters. Cases listed variant first, reference second."""
    rng = np.random.default_rng(2)
    study = root / "scaling"
    cases = [(f"{v} N{i}", f"{v}-n{i}") for v in ("diff_v1", "baseline") for i in range(len(sizes))]
    write_sweep(study, cases, list(seeds))
    for name, slug in cases:
        variant, i = name.split(" N")
        n = sizes[int(i)]
        for seed in seeds:
            loss = float((variant_loss(n) if variant == "diff_v1" else law(n)) + rng.normal(0, noise))
            trial = write_trial(study, name, slug, seed, {"val/loss": loss}, params=int(n) + EMBEDDING, curve=[])
            record = trial / "trial.json"
            record.write_text(record.read_text().replace(f'"model.arch.attention": "{slug}"',
                                                         f'"model.arch.attention": "{variant}"'))
    return study


def test_scaling_report_ratio_and_its_spread_over_seeds(tmp_path):
    runs = compare.load_study_runs(make_scaling_study(tmp_path), curves=False)
    report = scaling_report(runs)
    assert report.reference == "baseline" and report.n_ref == int(SIZES[3])  # the registry's, not the first case
    assert report.target == pytest.approx(float(law(SIZES[3])), abs=0.01)
    ref, other = report.rows
    assert (ref.variant, other.variant) == ("baseline", "diff_v1")
    assert ref.ratio == pytest.approx(1.0, abs=1e-6)
    assert other.fit.method == CURVE_FIT and other.fit.b == pytest.approx(B, abs=0.08)
    assert other.ratio == pytest.approx(EFFICIENCY, rel=0.08)
    stat = other.ratio_stat
    assert stat.n == 3 and stat.mean == pytest.approx(EFFICIENCY, rel=0.1)
    assert 0 < stat.std < 0.1 and stat.ci95 > stat.std  # noise per seed: a spread, and t(2) widens it
    assert not other.extrapolated and not ref.extrapolated  # 0.62 N_ref lies inside the sizes it ran


def test_compare_writes_the_scaling_section_only_for_a_scaling_study(tmp_path):
    out = tmp_path / "out"
    assert compare.main([str(make_scaling_study(tmp_path)), "--out", str(out)]) == 0
    md = (out / "compare.md").read_text()
    assert len(markdown_tables(md)) == 2  # the comparison's and the scaling's, both drawn
    assert "## Scaling: parameters needed to reach the reference's loss" in md
    line = next(row for row in md.splitlines() if row.startswith("| diff_v1 |"))
    assert " curve_fit " in line and " 4 " in line
    rows = {r["variant"]: r for r in csv.DictReader((out / "scaling.csv").open())}
    assert float(rows["diff_v1"]["ratio"]) == pytest.approx(EFFICIENCY, rel=0.08)
    assert rows["diff_v1"]["ratio_seed_n"] == "3" and rows["baseline"]["reference"] == "baseline"
    assert (out / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    plain = tmp_path / "plain"  # an ordinary table: one size per case, no section, no files
    assert compare.main([str(make_study(tmp_path)), "--out", str(plain), "--no-plots"]) == 0
    assert "Scaling" not in (plain / "compare.md").read_text() and not (plain / "scaling.csv").exists()


def test_sizes_a_few_percent_apart_are_not_a_scaling_study(tmp_path):
    """An ablation that moves N slightly (a rank, a norm) spans less than 2x: no scaling section."""
    runs = compare.load_study_runs(make_scaling_study(tmp_path, seeds=(0,), sizes=[1.0e6, 1.1e6, 1.2e6, 1.3e6]),
                                   curves=False)
    assert scaling_report(runs) is None

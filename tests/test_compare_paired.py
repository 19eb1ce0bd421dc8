"""compare's paired report: each case minus the reference case seed by seed, its interval, verdict and the
power statement, on a synthetic sweep with known offsets and a seed effect common to every case."""

from __future__ import annotations

import csv
import io
import math
import re
import subprocess
import sys

import numpy as np
import pytest
from rich.console import Console
from scipy.stats import nct, norm
from scipy.stats import t as student_t

from diffexp import compare
from diffexp.compare.paired import (
    AGREES,
    BETTER,
    DISAGREES,
    INCONCLUSIVE,
    MIN_PRICED_SEEDS,
    NOISE,
    TOO_FEW,
    WORSE,
    Power,
    paired_difference,
    paired_report,
    paper_agreement,
    seed_values,
)
from diffexp.model.attention.registry import reference_variant
from tests.fixtures_compare import make_study, write_loss_table, write_sweep, write_trial
from tests.helpers import exit_code, markdown_tables, subprocess_env

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SEEDS = [0, 1, 2, 3, 4, 5]
SEED_EFFECT = np.array([0.00, 0.06, -0.04, 0.09, -0.07, 0.03])  # what a seed does to every case alike: large
BASE = 3.40 + SEED_EFFECT
FAR = BASE - 0.05 + np.array([0.004, -0.003, 0.002, -0.005, 0.001, 0.003])  # far outside the seed noise
NEAR = BASE[:5] + 0.002 + np.array([0.012, -0.010, 0.006, -0.014, 0.009])  # within it; seed 5 pruned
WORSE_ = BASE + 0.08 + np.array([-0.006, 0.004, 0.002, -0.001, 0.005, -0.004])
CASES = {"Baseline": BASE, "Far": FAR, "Near": NEAR, "Worse": WORSE_}


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """Baseline runs the registry's reference variant; Few has one seed; Near's last seed was pruned."""
    losses = {("Baseline", reference_variant().name): dict(enumerate(BASE)),
              ("Far", "far"): dict(enumerate(FAR)),
              ("Near", "near"): {**dict(enumerate(NEAR)), 5: None},
              ("Worse", "worse"): dict(enumerate(WORSE_)),
              ("Few", "few"): {0: 3.30}}
    return write_loss_table(tmp_path_factory.mktemp("runs") / "paired", losses, SEEDS)


@pytest.fixture(scope="module")
def runs(study):
    return compare.load_study_runs(study, curves=False)


def _row(rows, name):
    return next(r for r in rows if r.case.name == name)


def _by_hand(case: np.ndarray, reference: np.ndarray, level: float = 0.95) -> tuple[float, float, float]:
    """mean, low, high of the paired difference over the seeds both have (numpy and scipy's t only)."""
    diffs = case - reference[:len(case)]
    n = len(diffs)
    half = student_t.ppf(0.5 + level / 2, n - 1) * diffs.std(ddof=1) / math.sqrt(n)
    return float(diffs.mean()), float(diffs.mean() - half), float(diffs.mean() + half)


def _print(study, out, *args, width=200, **kwargs) -> str:
    buffer = io.StringIO()
    compare.compare(study, out=out, plots=False, console=Console(file=buffer, width=width, color_system=None),
                    **kwargs)
    return buffer.getvalue()


def _csv(path) -> dict[str, dict[str, str]]:
    with open(path, newline="") as f:
        return {r["case"]: r for r in csv.DictReader(f)}


def test_differences_intervals_and_verdicts_match_a_hand_computation(runs):
    rows = compare.summarize(runs)
    report = paired_report(runs, rows)
    assert report.reference.case.name == "Baseline"  # the case that runs the reference variant
    assert "reference variant" in report.chosen_by
    for name, values in (("Far", FAR), ("Near", NEAR), ("Worse", WORSE_)):
        diff = report.of(_row(rows, name))
        mean, low, high = _by_hand(values, BASE)
        assert (diff.mean, diff.low, diff.high) == (pytest.approx(mean), pytest.approx(low), pytest.approx(high))
    far, near, worse = (report.of(_row(rows, n)) for n in ("Far", "Near", "Worse"))
    assert far.verdict == BETTER and far.high < 0 and far.mean == pytest.approx(-0.05, abs=0.002)
    assert worse.verdict == WORSE and worse.low > 0
    assert near.verdict == NOISE and near.low < 0 < near.high
    assert near.seeds == (0, 1, 2, 3, 4) and near.n == 5  # seed 5 pruned: only the seeds both finished
    assert report.of(_row(rows, "Baseline")) is None


def test_pairing_removes_the_seed_effect_the_unpaired_means_carry(runs):
    """Far's mean ± 95% CI overlaps the baseline's (the seed effect dominates each case's spread), yet its
    per-seed difference is far from 0: the paired design is what resolves it."""
    rows = compare.summarize(runs)
    base, far = _row(rows, "Baseline").stats["val/loss"], _row(rows, "Far").stats["val/loss"]
    assert far.mean + far.ci95 > base.mean - base.ci95
    assert paired_report(runs, rows).of(_row(rows, "Far")).verdict == BETTER


def test_too_few_seeds(runs):
    rows = compare.summarize(runs)
    few = paired_report(runs, rows).of(_row(rows, "Few"))
    assert (few.n, few.verdict, few.low, few.high) == (1, TOO_FEW, None, None)
    assert few.mean == pytest.approx(3.30 - BASE[0])
    nothing = paired_difference(runs, _row(rows, "Near"), _row(rows, "Few"))  # Near has seed 0, Few too: 1 pair
    assert nothing.n == 1 and nothing.verdict == TOO_FEW


def test_reference_flag_switches_the_reference(study, runs, tmp_path):
    printed = _print(study, tmp_path / "by-name", reference="Far")
    assert "Paired differences vs Far" in printed and "given by --reference" in printed
    records = _csv(tmp_path / "by-name" / "compare.csv")
    assert records["Far"]["paired_verdict"] == "reference" and records["Far"]["paired_diff_mean"] == ""
    mean, low, high = _by_hand(BASE, FAR)
    baseline = records["Baseline"]
    assert baseline["paired_reference"] == "Far" and baseline["paired_verdict"] == WORSE  # 0.05 above Far
    assert [float(baseline[k]) for k in ("paired_diff_mean", "paired_diff_low", "paired_diff_high")] == [
        pytest.approx(mean), pytest.approx(low), pytest.approx(high)]
    assert compare.main([str(study), "--out", str(tmp_path / "by-slug"), "--no-plots", "--reference", "far"]) == 0
    assert _csv(tmp_path / "by-slug" / "compare.csv")["Baseline"]["paired_reference"] == "Far"


def test_level_changes_the_interval(runs):
    rows = compare.summarize(runs)
    near = paired_report(runs, rows, level=0.5).of(_row(rows, "Near"))
    mean, low, high = _by_hand(NEAR, BASE, level=0.5)
    assert (near.low, near.high) == (pytest.approx(low), pytest.approx(high))
    assert near.high - near.low < paired_report(runs, rows).of(_row(rows, "Near")).half_width * 2


def test_markdown_and_csv_columns(study, tmp_path):
    printed = _print(study, tmp_path / "out")
    md = (tmp_path / "out" / "compare.md").read_text()
    assert len(markdown_tables(md)) == 1
    header = next(line for line in md.splitlines() if line.startswith("| Case"))
    assert "| Valid loss ↓ | Δ vs Baseline | 95% CI | Paired seeds | Verdict | Seeds |" in header
    far_line = next(line for line in md.splitlines() if line.startswith("| Far |"))
    mean, low, high = _by_hand(FAR, BASE)
    assert f"| {mean:+.4f} | [{low:+.4f}, {high:+.4f}] | 6 | better |" in far_line
    assert "| Baseline |" in md and "| — | — | — | reference |" in md
    assert "| 1 | too few seeds |" in next(line for line in md.splitlines() if line.startswith("| Few |"))
    assert "within seed noise" in next(line for line in md.splitlines() if line.startswith("| Near |"))
    assert "Power: with 6 seeds" in md

    records = _csv(tmp_path / "out" / "compare.csv")
    near = records["Near"]
    assert near["paired_seeds"] == "0;1;2;3;4" and near["paired_n"] == "5" and near["paired_level"] == "0.95"
    assert [float(d) for d in near["paired_diffs"].split(";")] == pytest.approx(list(NEAR - BASE[:5]))
    assert float(near["paired_diff_sd"]) == pytest.approx(np.std(NEAR - BASE[:5], ddof=1))
    assert near["paired_verdict"] == NOISE and records["Few"]["paired_diff_low"] == ""
    # the console shows the same rows in a table of its own
    far_printed = next(line for line in printed.splitlines() if line.startswith("  Far "))
    assert f"[{low:+.4f}, {high:+.4f}]" in far_printed and "better" in far_printed


def _power_by_hand(delta: float, sd: float, n: int) -> float:
    """A two-sided paired t test's power at 95%, from the noncentral t written out (scipy's nct)."""
    crit, ncp = student_t.ppf(0.975, n - 1), delta * math.sqrt(n) / sd
    return nct.sf(crit, n - 1, ncp) + np.nan_to_num(nct.cdf(-crit, n - 1, ncp))  # the second: ~0, NaN at times


def test_power_line_is_the_paired_t_tests(study, tmp_path):
    printed = _print(study, tmp_path / "out")
    diffs = [FAR - BASE, NEAR - BASE[:5], WORSE_ - BASE]  # the cases with 2 or more paired seeds
    sd = math.sqrt(sum((len(d) - 1) * d.var(ddof=1) for d in diffs) / sum(len(d) - 1 for d in diffs))
    needs = [next(n for n in range(2, 10_000) if _power_by_hand(delta, sd, n) >= 0.8) for delta in (0.01, 0.02)]
    line = next(line for line in printed.splitlines() if line.startswith("Power:"))
    resolvable = float(re.search(r"resolves differences of ([0-9.e-]+) nats", line).group(1))
    assert _power_by_hand(resolvable, sd, 6) == pytest.approx(0.8, abs=0.01)  # 3 significant digits
    assert line == (f"Power: with 6 seeds this study resolves differences of {resolvable:.3g} nats or more in "
                    f"val/loss; a difference of 0.01 nats needs {needs[0]} seeds, 0.02 nats needs {needs[1]} seeds.")
    assert needs[0] > 2  # the numbers say something here
    assert f"sd {sd:.3g} of the paired differences, pooled over 3 cases" in printed
    assert "noncentral t with n − 1 df" in printed


def test_the_power_agrees_with_the_t_interval_at_few_seeds_and_with_the_normal_formula_at_many():
    sd, z = 0.1, norm.ppf(0.975) + norm.ppf(0.8)
    power = Power(sd, cases=5, seeds=2, level=0.95)
    half_width = student_t.ppf(0.975, 1) * sd / math.sqrt(2)  # the 2-seed interval beside it: +-0.9 sd
    assert power.resolvable() > half_width  # never claims to resolve less than the interval can exclude
    assert _power_by_hand(power.resolvable(), sd, 2) == pytest.approx(0.8, abs=1e-6)
    assert not power.priced and Power(sd, 5, MIN_PRICED_SEEDS, 0.95).priced
    many = Power(sd, cases=5, seeds=5000, level=0.95)
    assert many.resolvable() == pytest.approx(z * sd / math.sqrt(5000), rel=2e-3)
    assert many.seeds_for(0.002) == pytest.approx((z * sd / 0.002) ** 2, rel=0.01)
    for delta in (0.05, 0.1, 0.3):  # the fewest seeds whose exact power reaches 80%
        n = power.seeds_for(delta)
        assert _power_by_hand(delta, sd, n) >= 0.8 and (n == 2 or _power_by_hand(delta, sd, n - 1) < 0.8)


def test_two_seeds_are_said_to_be_too_few_to_price(tmp_path):
    """The README's old 2-seed line said "resolves 0.048 nats" beside an interval of [-0.125, +0.312]."""
    study = tmp_path / "two"
    write_sweep(study, [("Transformer", "baseline"), ("DIFF", "diff_v1")], [0, 1])
    for seed in (0, 1):
        write_trial(study, "Transformer", "baseline", seed, {"val/loss": 3.40})
        write_trial(study, "DIFF", "diff_v1", seed, {"val/loss": 3.30 + 0.1 * seed})
    printed = " ".join(_print(study, tmp_path / "out").split())
    diff = np.array([-0.1, 0.0])
    half_width = student_t.ppf(0.975, 1) * diff.std(ddof=1) / math.sqrt(2)
    assert ("Power: 2 seeds are too few to price a difference: a paired t test on them has 1 degree of freedom"
            in printed)
    resolvable = float(re.search(r"only a difference of ([0-9.e-]+) nats", printed).group(1))
    assert resolvable > half_width


def test_paired_plot_is_written(study, tmp_path):
    out = tmp_path / "out"
    assert compare.main([str(study), "--out", str(out)]) == 0
    data = (out / "paired_diffs.png").read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000
    from matplotlib.image import imread

    image = imread(out / "paired_diffs.png")
    assert image.shape[0] > 200 and image.shape[1] > 500


def test_default_reference_without_the_reference_variant_is_the_first_case(tmp_path):
    printed = _print(make_study(tmp_path), tmp_path / "out")
    assert "Reference: Transformer, the first case, as none runs the reference variant" in printed
    assert "the reference variant baseline (--reference CASE picks another)." in " ".join(printed.split())


def test_the_reference_variant_read_from_source_is_the_registrys():
    """compare names the registry's reference variant without importing the registry (torch)."""
    from diffexp.compare.paired import reference_variant_name
    from diffexp.model.attention.registry import reference_variant

    assert reference_variant_name() == reference_variant().name


def test_a_maximized_objective_reads_above_zero_as_better(tmp_path):
    acc = np.array([0.50, 0.55, 0.45])
    study = write_loss_table(tmp_path / "acc", {("A", "a"): dict(enumerate(acc)),
                                                ("B", "b"): dict(enumerate(acc + 0.1 + np.array([0, 0.001, -0.001])))},
                             [0, 1, 2], metric="val/acc", direction="maximize")
    runs = compare.load_study_runs(study, curves=False)
    rows = compare.summarize(runs)
    assert paired_report(runs, rows, reference="A").of(rows[1]).verdict == BETTER
    assert paired_report(runs, rows, reference="B").of(rows[0]).verdict == WORSE


def test_search_draws_pair_each_seeds_best_draw(tmp_path):
    study = tmp_path / "search"
    write_sweep(study, [("A", "a"), ("B", "b")], [0, 1], n_trials=2)
    for seed, (first, second) in enumerate(((3.0, 2.9), (3.1, 3.2))):
        write_trial(study, "A", "a", seed, {"val/loss": first})
        write_trial(study, "A", "a", seed, {"val/loss": second}, draw=1)
    runs = compare.load_study_runs(study, curves=False)
    assert seed_values(runs, compare.summarize(runs)[0], "val/loss") == {0: 2.9, 1: 3.1}


def test_paper_direction_from_the_verdict(runs):
    """What the paper check would use: the paper's sign against the paired interval's."""
    rows = compare.summarize(runs)
    far = paired_difference(runs, _row(rows, "Far"), _row(rows, "Baseline"))
    near = paired_difference(runs, _row(rows, "Near"), _row(rows, "Baseline"))
    few = paired_difference(runs, _row(rows, "Few"), _row(rows, "Baseline"))
    assert paper_agreement(-0.04, far) == AGREES and paper_agreement(+0.04, far) == DISAGREES
    assert paper_agreement(-0.04, near) == INCONCLUSIVE and paper_agreement(-0.04, few) == INCONCLUSIVE
    assert paper_agreement(0.0, far) == INCONCLUSIVE  # the paper's rows are equal: no direction


@pytest.mark.parametrize("args, named", [
    (["--reference", "Nope"], ["--reference 'Nope'", "'Baseline'", "'Far'", "'Few'"]),
    (["--level", "1.5"], ["--level '1.5'", "between 0 and 1"]),
    (["--level", "0"], ["--level '0'", "between 0 and 1"]),
    (["--level", "95"], ["--level '95'", "0.95 for a 95% interval"]),
    (["--level", "high"], ["--level 'high'", "between 0 and 1"]),
])
def test_bad_flags_exit_2_naming_the_flag_and_what_is_allowed(study, tmp_path, capsys, args, named):
    assert exit_code(["compare", str(study), "--out", str(tmp_path / "out"), "--no-plots", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    for text in named:
        assert text in err, text
    assert not (tmp_path / "out" / "compare.md").exists()  # nothing written


def test_bad_level_from_the_command_line_has_no_traceback(study, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "diffexp", "compare", str(study), "--level", "-0.1"],
                          env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert re.match(r"error: --level '-0\.1' is invalid: .*between 0 and 1", proc.stderr)

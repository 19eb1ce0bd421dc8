"""compare's statistics: the 95% confidence interval of a case's mean over seeds."""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest

from diffexp import compare
from diffexp.compare.stats import Stat, t_quantile_975
from tests.fixtures_compare import make_study


def _t_cdf(x: float, df: int) -> float:
    """Student's t CDF at x > 0 by integrating its density: a check that shares no code with scipy."""
    grid = np.linspace(0.0, x, 400_001)
    scale = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    density = scale * (1 + grid**2 / df) ** (-(df + 1) / 2)
    return 0.5 + float(np.sum((density[1:] + density[:-1]) / 2 * np.diff(grid)))


@pytest.mark.parametrize("df", [1, 2, 3, 4, 9, 29, 30, 31, 45, 60, 1000])
def test_t_quantile(df):
    assert _t_cdf(t_quantile_975(df), df) == pytest.approx(0.975, abs=2e-6)


def test_ci95_half_width():
    stat = Stat([1.90, 1.92, 1.94])
    assert stat.ci95 == pytest.approx(4.3027 * 0.02 / math.sqrt(3), rel=1e-4)  # t(0.975, 2) = 4.3027
    assert Stat([1.5]).ci95 is None and Stat([]).ci95 is None
    assert stat.format() == "1.920 ± 0.020"  # the table keeps mean ± std


@pytest.mark.parametrize("values, text", [
    ([1.90, 1.92, 1.94], "1.920 ± 0.020"),  # a loss: three decimals, its std too, however small
    ([6.35, 6.3504], "6.350 ± 0.000"),
    ([0.041, 0.045], "0.043 ± 0.003"),  # from 0.01 up, as before
    ([1234.5, 1300.0], "1,267.2 ± 46.315"),
    ([0.0, 0.0], "0.000 ± 0.000"),
    ([0.0001, 0.5], "0.250 ± 0.353"),  # the std sets the digits when it is the larger
    ([0.00209, 0.00213, 0.00217], "0.00213 ± 0.00004"),  # small: three significant digits, the std alike
    ([0.009, 0.0095], "0.00925 ± 0.00035"),
    ([-2e-6, -3e-6, -4e-6], "-3.00e-06 ± 1.00e-06"),  # below 0.001 an exponent, as the paired differences
    ([0.002], "0.00200 ± n/a"),
])
def test_format_gives_small_values_significant_digits(values, text):
    assert Stat(values).format() == text


def test_csv_holds_the_ci(tmp_path):
    study = make_study(tmp_path)
    compare.compare(study, out=tmp_path / "out", plots=False, console=_quiet())
    with open(tmp_path / "out" / "compare.csv", newline="") as f:
        records = list(csv.DictReader(f))
    assert float(records[0]["val/loss_ci95"]) == pytest.approx(t_quantile_975(2) * 0.02 / math.sqrt(3), rel=1e-4)
    assert records[2]["val/loss_ci95"] == "" and records[2]["val/loss_n"] == "1"  # one seed: no interval


def _quiet():
    import io

    from rich.console import Console

    return Console(file=io.StringIO(), width=200)

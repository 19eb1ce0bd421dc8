"""`diffexp bench trainer`: diffexp fit against a plain loop of the same model, both actually timed."""

from __future__ import annotations

import json

import pytest

from diffexp.bench.cli import main
from tests.helpers import exit_code

TINY = ["--model.arch.d_model", "32", "--model.arch.n_layers", "1", "--model.arch.n_heads", "2",
        "--data.seq_len", "32", "--data.batch_size", "2", "--data.max_chars", "40000"]


@pytest.mark.heavy
def test_both_sides_train_and_the_overhead_is_their_ratio(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "r.json"
    assert main(["trainer", "--steps", "4", "--warmup", "1", "--rounds", "2", "--json", str(out), "--profile",
                 "--", *TINY, "--data.cache_dir", str(tmp_path / "cache")]) == 0
    results = json.loads(out.read_text())["results"]
    assert len(results["plain_step_s"]) == len(results["fit_step_s"]) == 2
    assert all(s > 0 for s in results["plain_step_s"] + results["fit_step_s"])
    for plain, fit, overhead in zip(results["plain_step_s"], results["fit_step_s"], results["overhead_per_round"]):
        assert overhead == pytest.approx(fit / plain - 1)
    assert any("optimizer_step" in row["hook"] for row in results["profile"])
    assert "diffexp fit vs a plain loop" in capsys.readouterr().out
    assert not (tmp_path / "runs").exists()  # the fits' runs went to a temporary folder


@pytest.mark.parametrize("args, message", [(["--steps", "0"], "--steps"), (["--warmup", "0"], "--warmup"),
                                           (["--threads", "0"], "--threads")])
def test_bad_flags_stop_before_any_work(args, message, capsys):
    assert exit_code(["bench", "trainer", *args]) == 2
    assert message in capsys.readouterr().err


def test_a_bad_fit_argument_stops_before_any_round(tmp_path, monkeypatch, capsys):
    from diffexp.bench import trainer

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(trainer, "time_side", lambda *a, **k: pytest.fail("a round ran"))
    assert exit_code(["bench", "trainer", "--steps", "2", "--", "--model.arch.d_model", "abc"]) == 2
    assert "model.arch.d_model" in capsys.readouterr().err


def test_the_interval_of_the_median_is_the_binomial_order_statistics():
    from diffexp.bench.timing import median_interval

    values = [float(v) for v in range(20, 0, -1)]  # any order
    assert median_interval(values) == [6.0, 15.0]  # P(Bin(20, 1/2) <= 5) = 0.021, <= 6: 0.058
    assert median_interval(values[:6]) == [15.0, 20.0]  # 6 rounds: the extremes (coverage 96.9%)
    assert median_interval(values[:5]) is None  # 5: even the extremes cover only 93.8%
    # at 95% the interval covers the true median in at least 95% of samples (checked by counting)
    import random

    rng = random.Random(0)
    covered = sum(lo <= 0 <= hi for lo, hi in (median_interval([rng.gauss(0, 1) for _ in range(20)])
                                              for _ in range(2000)))
    assert covered / 2000 >= 0.94

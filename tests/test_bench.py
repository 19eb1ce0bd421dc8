"""bench/bench_variants.py runs on CPU: every variant against the baseline, a JSON a later run compares with."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_variants", REPO / "bench" / "bench_variants.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TINY = ["--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--vocab-size", "64", "--seq-lens", "32",
        "--batch-size", "2", "--steps", "1", "--warmup", "0", "--rounds", "2", "--threads", "1"]


def test_bench_writes_ratios_flops_and_mfu_and_compares(tmp_path, capsys):
    bench = _bench()
    first = tmp_path / "first.json"
    assert bench.main([*TINY, "--json", str(first), "--peak-tflops", "1.0"]) == 0
    data = json.loads(first.read_text())
    caption = " ".join(capsys.readouterr().out.split())  # the table may wrap it
    assert f"the peak (1 TFLOP/s). Wall time {data['env']['wall_s']:.0f} s" in caption and "{" not in caption
    results = data["results"]
    assert set(results) == {f"{v}@32" for v in ("baseline", "diff_v1", "diff_v2", "shared_diff", "dint")}
    base = results["baseline@32"]
    assert base["speed_ratio"] == pytest.approx(1.0) and base["mem_ratio"] == pytest.approx(1.0)
    for entry in results.values():
        assert entry["speed_ratio"] > 0 and entry["peak_bytes"] > 0
        assert entry["mfu"] == pytest.approx(entry["tflops_per_s"] / 1.0)
    # the two-map variants do more attention work per token than the baseline
    assert results["diff_v1@32"]["flops_per_step"] > base["flops_per_step"]

    second = tmp_path / "second.json"
    assert bench.main([*TINY, "--variants", "dint", "--no-memory", "--json", str(second),
                       "--compare", str(first)]) == 0
    out = capsys.readouterr().out
    assert "MFU" in out and "old tok/s ratio" in out


@pytest.mark.parametrize("args, message", [
    (["--variants", "diff_v9"], "unknown variant 'diff_v9'"),
    (["--peak-tflops", "0"], "--peak-tflops: expected a positive number"),
    (["--seq-lens", "0"], "--seq-lens: expected a positive integer, got 0"),
])
def test_bench_rejects_bad_flags_before_any_work(args, message, capsys):
    with pytest.raises(SystemExit):
        _bench().main([*TINY, *args])
    assert message in capsys.readouterr().err

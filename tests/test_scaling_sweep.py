"""sweeps/scaling.yaml end to end, cut to seconds: two variants at the spec's smallest sizes, a few steps each,
then `diffexp compare` with its scaling section (table, scaling.csv, scaling.png)."""

from __future__ import annotations

import csv

import pytest
import yaml

from diffexp.compare import main as compare_main
from diffexp.sweep.runner import main as sweep_main
from tests.helpers import REPO

FAST = {"trainer.max_steps": 4, "trainer.val_check_interval": 4, "trainer.limit_val_batches": 1,
        "data.seq_len": 32, "data.batch_size": 4, "data.max_chars": 20000}
#: the reference at the spec's three smallest sizes (the least that makes a scaling study) and DIFF at two of
#: them (the least any fit needs): five trials
KEEP = {"Transformer": ("d64", "d96", "d128"), "DIFF": ("d64", "d128")}


@pytest.mark.heavy  # python -m pytest -m heavy
def test_scaling_sweep_then_compare_reports_the_fit(tmp_path):
    raw = yaml.safe_load((REPO / "sweeps/scaling.yaml").read_text())
    raw["cases"] = {name: case for name, case in raw["cases"].items()
                    if name.rsplit(" ", 1)[1] in KEEP.get(name.rsplit(" ", 1)[0], ())}
    assert len(raw["cases"]) == 5
    raw.update(seeds=[0], runs_dir=str(tmp_path / "runs"),
               overrides={**raw["overrides"], **FAST, "data.cache_dir": str(tmp_path / "cache")})
    spec = tmp_path / "scaling.yaml"
    spec.write_text(yaml.safe_dump(raw))
    assert sweep_main(["--config", str(spec)]) == 0

    out = tmp_path / "cmp"
    assert compare_main([str(tmp_path / "runs/scaling"), "--out", str(out)]) == 0
    rows = {r["variant"]: r for r in csv.DictReader((out / "scaling.csv").open())}
    assert set(rows) == {"baseline", "diff_v1"}  # each case ran its own recipe's variant
    assert [len(rows[v]["sizes"].split(";")) for v in ("baseline", "diff_v1")] == [3, 2]
    for row in rows.values():
        assert row["method"] == "log-linear" and "< 4" in row["fit_note"]  # fewer than 4 sizes: the fallback
        assert row["reference"] == "baseline" and float(row["n_ref"]) > 800_000  # d128: 0.85M
        assert float(row["ratio"]) > 0  # loss falls with size even after 4 steps: each fit reaches L*
    md = (out / "compare.md").read_text()
    assert "## Scaling: parameters needed to reach the reference's loss" in md
    assert "| baseline (reference) | 3 |" in md
    assert (out / "scaling.png").stat().st_size > 10_000

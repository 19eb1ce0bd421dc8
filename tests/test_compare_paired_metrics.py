"""`compare --paired-metric`: the seed-by-seed difference to the reference case in a metric besides the objective
(the softmax-constraint study's context RMS and sink score), checked against a hand computation."""

from __future__ import annotations

import io
import math

import numpy as np
from rich.console import Console
from scipy.stats import t as student_t

from diffexp import compare
from diffexp.compare.paired_metrics import HIGHER, LOWER
from diffexp.model.attention.registry import reference_variant
from tests.fixtures_compare import write_sweep, write_trial
from tests.helpers import exit_code, markdown_tables

RMS = {"Transformer": [0.28, 0.27, 0.29], "Gated": [0.18, 0.19, 0.17], "Sink": [0.27, 0.29, 0.28],
       "Louder": [0.40, 0.41, 0.39]}


def _study(root):
    study = root / "rms"
    cases = [("Transformer", reference_variant().name), ("Gated", "gated"), ("Sink", "sink"), ("Louder", "louder")]
    write_sweep(study, cases, [0, 1, 2])
    for name, slug in cases:
        for seed, rms in enumerate(RMS[name]):
            write_trial(study, name, slug, seed, {"val/loss": 1.85 + seed / 100, "vitals/context_rms": rms})
    return study


def test_each_case_against_the_reference_in_another_metric(tmp_path):
    study = _study(tmp_path)
    buffer = io.StringIO()
    compare.compare(study, out=tmp_path / "out", plots=False, paired_metrics=["vitals/context_rms"],
                    console=Console(file=buffer, width=220, color_system=None))
    assert "Paired differences in vitals/context_rms" in buffer.getvalue()
    tables = markdown_tables((tmp_path / "out" / "compare.md").read_text())
    table = next(t for t in tables if t[0][1] == "Context RMS")
    rows = {r[0]: r for r in table[1:]}
    diffs = np.array(RMS["Gated"]) - np.array(RMS["Transformer"])
    half = student_t.ppf(0.975, 2) * diffs.std(ddof=1) / math.sqrt(3)
    gated = rows["Gated"]
    assert float(gated[2]) == round(diffs.mean(), 4)
    assert gated[3] == f"[{diffs.mean() - half:+.4f}, {diffs.mean() + half:+.4f}]"
    assert float(gated[4]) == round(np.mean(RMS["Gated"]) / np.mean(RMS["Transformer"]), 2)
    assert (gated[5], gated[6]) == ("3", LOWER)
    assert rows["Sink"][6] == "within seed noise" and rows["Louder"][6] == HIGHER
    assert rows["Transformer"][6] == "reference"


def test_an_unknown_paired_metric_is_refused_naming_the_flag_and_the_metrics_there(tmp_path, capsys):
    study = _study(tmp_path)
    assert exit_code(["compare", str(study), "--no-plots", "--paired-metric", "vitals/nope"]) == 2
    err = capsys.readouterr().err
    assert "--paired-metric 'vitals/nope'" in err and "vitals/context_rms" in err and "Traceback" not in err
    assert not (study / "compare").exists()

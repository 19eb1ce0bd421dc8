"""A sweep's `paper:` block: checked when the spec is read, printed by compare beside the measured numbers,
with the direction of every difference between rows checked against the paper's."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from rich.console import Console

from diffexp.compare import compare
from diffexp.compare.paired import AGREES, DISAGREES, INCONCLUSIVE
from diffexp.compare.paper import PaperCheck, paper_checks
from diffexp.sweep.layout import SWEEP_FILE
from diffexp.sweep.runs import load_study_runs
from diffexp.sweep.spec import SpecError, parse_spec
from tests.fixtures_compare import make_study, write_loss_table
from tests.helpers import REPO, markdown_tables

PAPER = {"source": "A paper, Table 9",
         "values": {"Transformer": {"val/loss": 3.10}, "DIFF": {"val/loss": 3.06},
                    "DIFF -GroupNorm": {"val/loss": 3.12}, "DIFF lambda 0.8": {"val/loss": 3.065}}}


def _study_with_paper(tmp_path: Path, paper=PAPER) -> Path:
    """make_study's measured means: Transformer 1.92, DIFF 1.86, DIFF -GroupNorm 1.88, DIFF lambda 0.8 none."""
    study = make_study(tmp_path)
    sweep = json.loads((study / SWEEP_FILE).read_text())
    (study / SWEEP_FILE).write_text(json.dumps({**sweep, "paper": paper}))
    return study


def test_each_pair_of_rows_is_checked_against_the_papers_direction(tmp_path):
    runs = load_study_runs(_study_with_paper(tmp_path), curves=False)
    from diffexp.compare.stats import summarize

    (check,) = paper_checks(runs, summarize(runs, ["val/loss"]))
    assert [(c, round(m, 3), p) for c, m, p in check.rows] == [
        ("Transformer", 1.92, 3.10), ("DIFF", 1.86, 3.06), ("DIFF -GroupNorm", 1.88, 3.12)]
    assert check.missing == ["DIFF lambda 0.8"]
    # T-D: paper +, 2 paired seeds both +0.05 (agrees); T-DG and D-DG: one paired seed (inconclusive), their means
    # have the paper's direction for D-DG only
    assert [(p.first, p.second, p.verdict, p.means_agree) for p in check.pairs] == [
        ("Transformer", "DIFF", AGREES, True), ("Transformer", "DIFF -GroupNorm", INCONCLUSIVE, False),
        ("DIFF", "DIFF -GroupNorm", INCONCLUSIVE, True)]
    assert check.pairs[0].paired.seeds == (0, 1) and check.pairs[1].paired.seeds == (0,)
    counts = (check.count(AGREES), check.count(DISAGREES), check.count(INCONCLUSIVE), check.means_agreeing)
    assert counts == (1, 0, 2, 2)
    assert check.rank_correlation == pytest.approx(1 / 3)  # 2 concordant, 1 discordant pair


def test_compare_prints_and_writes_the_paper_columns(tmp_path):
    study = _study_with_paper(tmp_path)
    buffer = io.StringIO()
    compare(study, out=tmp_path / "out", plots=False, console=Console(file=buffer, width=160, color_system=None))
    printed = buffer.getvalue()
    assert "Paper: A paper, Table 9" in printed
    paper_table = printed[printed.index("Paper: A paper, Table 9"):]
    row = next(line for line in paper_table.splitlines() if line.startswith("│ DIFF -GroupNorm"))
    assert [cell.strip() for cell in row.split("│")[2:4]] == ["1.880", "3.120"]
    assert ("val/loss, 3 pairs of rows, paired by seed at 95%: 1 agree with the paper's direction, 0 disagree, "
            "2 inconclusive") in printed
    assert "the means alone have its direction in 2 of 3; rank correlation (Kendall's tau) +0.33" in printed
    assert ("inconclusive: Transformer < DIFF -GroupNorm in the paper; measured Transformer − DIFF -GroupNorm "
            "+0.0200 (1 paired seeds)") in printed
    assert "not measured yet: DIFF lambda 0.8" in printed
    md = (tmp_path / "out" / "compare.md").read_text()
    assert "## Paper: A paper, Table 9" in md and "| DIFF | 1.860 | 3.060 |" in md
    assert ["DIFF", "1.860", "3.060"] in markdown_tables(md)[-1]  # the paper's table is drawn


def test_the_direction_check_reads_the_paired_verdict(tmp_path):
    """B is 0.05 below A on every seed (the paper has it above: disagrees); C is A plus noise (the paper has it
    below: inconclusive, though C's mean is below A's); the seed effect is large, so only pairing resolves B."""
    seed_effect = np.array([0.0, 0.08, -0.06])
    a = 2.0 + seed_effect
    b, c = a - 0.05 + np.array([0.002, -0.001, 0.0]), a + np.array([-0.012, 0.010, -0.004])
    study = write_loss_table(tmp_path / "abc", {(n, n.lower()): dict(enumerate(v)) for n, v in
                                                (("A", a), ("B", b), ("C", c))}, [0, 1, 2])
    sweep = json.loads((study / SWEEP_FILE).read_text())
    paper = {"source": "P", "values": {"A": {"val/loss": 3.10}, "B": {"val/loss": 3.12}, "C": {"val/loss": 3.05}}}
    (study / SWEEP_FILE).write_text(json.dumps({**sweep, "paper": paper}))
    runs = load_study_runs(study, curves=False)
    from diffexp.compare.stats import summarize

    (check,) = paper_checks(runs, summarize(runs, ["val/loss"]))
    verdicts = {(p.first, p.second): p.verdict for p in check.pairs}
    assert verdicts == {("A", "B"): DISAGREES, ("A", "C"): INCONCLUSIVE, ("B", "C"): DISAGREES}
    assert [p.means_agree for p in check.pairs] == [False, True, False]
    assert paper_checks(runs, summarize(runs, ["val/loss"]), level=0.2)[0].pairs[1].paired.level == 0.2
    buffer = io.StringIO()
    compare(study, out=tmp_path / "out", plots=False, console=Console(file=buffer, width=160, color_system=None))
    assert "0 agree with the paper's direction, 2 disagree, 1 inconclusive" in buffer.getvalue()
    md = (tmp_path / "out" / "compare.md").read_text()
    assert "- disagrees: A < B in the paper; measured A − B +0.0497 [" in md


def test_a_study_without_a_paper_block_prints_no_paper_section(tmp_path):
    buffer = io.StringIO()
    compare(make_study(tmp_path), out=tmp_path / "out", plots=False,
            console=Console(file=buffer, width=160, color_system=None))
    assert "Paper:" not in buffer.getvalue()


def test_equal_values_have_no_direction():
    check = PaperCheck("val/loss", [("a", 1.0, 3.0), ("b", 1.0, 3.1), ("c", 1.2, 3.1)], [], [])
    assert check.rank_correlation is not None  # three rows with both values
    runs_like = type("Runs", (), {"paper": {"source": "s", "values": {
        "a": {"val/loss": 3.0}, "b": {"val/loss": 3.0}}}})()
    rows = [type("Row", (), {"case": type("Case", (), {"name": n})(), "stats": {
        "val/loss": type("Stat", (), {"mean": m})()}})() for n, m in (("a", 1.0), ("b", 2.0))]
    (only,) = paper_checks(runs_like, rows)
    assert only.pairs == []  # the paper shows no difference between a and b


BASE_SPEC = {"study": "s", "base": str(REPO / "recipes/tiny/diff_v1.yaml"),
             "cases": {"DIFF": {}, "DIFF -GroupNorm": {"model.arch.head_norm": False}}}


@pytest.mark.parametrize("paper, message", [
    ({"values": {"DIFF": {"val/loss": 3.0}}}, "paper.source=None"),
    ({"source": "T6", "values": {"DINT": {"val/loss": 3.0}}}, "paper.values['DINT']: not a row of this sweep"),
    ({"source": "T6", "values": {"DIFF": {"val/lost": 3.0}}}, "'val/lost' is not a metric trials record"),
    ({"source": "T6", "values": {"DIFF": {"val/loss": "low"}}}, "expected a finite number"),
    ({"source": "T6", "values": {"DIFF": {"val/loss": 3.0}}, "table": 6}, "unknown key(s) 'table'"),
    ("Table 6", "expected a mapping with `source`"),
])
def test_a_bad_paper_block_is_refused_naming_the_key(paper, message):
    with pytest.raises(SpecError) as err:
        parse_spec({**BASE_SPEC, "paper": paper})
    assert message in str(err.value)


def test_the_paper_block_does_not_change_the_study(tmp_path):
    plain = parse_spec(dict(BASE_SPEC))
    with_paper = parse_spec({**BASE_SPEC, "paper": {"source": "T6", "values": {"DIFF": {"val/loss": 3.062}}}})
    assert with_paper.paper == {"source": "T6", "values": {"DIFF": {"val/loss": 3.062}}}
    assert with_paper.fingerprint() == plain.fingerprint()


@pytest.mark.parametrize("name", ["table6", "needle"])
def test_shipped_paper_blocks_parse(name):
    from diffexp.sweep.spec import load_spec

    spec = load_spec(REPO / "sweeps" / f"{name}.yaml", repo_root=REPO)
    raw = yaml.safe_load((REPO / "sweeps" / f"{name}.yaml").read_text())
    assert spec.paper["values"] == {row: {m: float(v) for m, v in vals.items()}
                                    for row, vals in raw["paper"]["values"].items()}

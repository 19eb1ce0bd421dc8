"""The DIFF V2 comparison sweep (sweeps/v2_comparison.yaml): each row differs from DIFF V2 in what its
comment says, and the whole sweep runs and compares end to end at tiny size with a few steps."""

from __future__ import annotations

import csv
import re

import pytest
import yaml

from diffexp import Decoder, ModelConfig
from diffexp.compare import main as compare_main
from diffexp.compare.render import format_params
from diffexp.model.attention import variant
from diffexp.sweep.command import cli_value
from diffexp.sweep.runner import main as sweep_main
from diffexp.sweep.spec import load_spec
from diffexp.training.cli import parse_config
from tests.helpers import REPO

SPEC = REPO / "sweeps/v2_comparison.yaml"
CASES = ["Transformer", "Transformer kv=2", "Transformer 2x heads", "Transformer 1.5x heads", "DIFF V2",
         "DIFF V2 +FFN"]
BYTE_VOCAB = 257  # the byte tokenizer's vocabulary, which the runs (and compare) count


def row_archs() -> dict[str, ModelConfig]:
    """Each row's model config, as its trials' `diffexp fit` parses it."""
    spec = load_spec(SPEC)
    archs = {}
    for label, overrides in spec.rows():
        args = ["--config", str(spec.base)] + [f"--{k}={cli_value(v)}" for k, v in overrides.items()]
        archs[label] = ModelConfig(**{**parse_config(args).model.arch.as_dict(), "vocab_size": BYTE_VOCAB})
    return archs


def header_counts() -> dict[str, tuple[int, int, int]]:
    """The spec's comment: 'NAME total / non-embedding / attention' for every row."""
    text = "\n".join(line for line in SPEC.read_text().splitlines() if line.startswith("#"))
    found = re.findall(r"((?:Transformer|DIFF V2)[\w .=+]*?) ([\d,]+) / ([\d,]+) / ([\d,]+)", text)
    return {name.strip(): tuple(int(n.replace(",", "")) for n in numbers) for name, *numbers in found}


def test_rows_differ_from_diff_v2_in_what_the_comment_says():
    archs = row_archs()
    assert list(archs) == CASES
    reports = {name: Decoder(arch).parameter_report() for name, arch in archs.items()}
    v2, base = archs["DIFF V2"], archs["Transformer"]
    d, layers, lam = v2.resolved_head_dim, v2.n_layers, v2.n_layers * v2.d_model * v2.n_heads  # lam: W_lam
    assert (v2.attention, base.attention) == ("diff_v2", "baseline") and v2.kv_heads < base.kv_heads
    for name, arch in archs.items():
        assert arch.resolved_head_dim == d, name
        if name != "Transformer":
            assert arch.kv_heads == v2.kv_heads, name  # every comparison keeps V2's KV heads
    assert archs["Transformer kv=2"].n_heads == base.n_heads
    wide = archs["Transformer 2x heads"]
    assert wide.n_heads == 2 * v2.n_heads
    assert variant(wide.attention).attention_flops(wide, 64) == variant(v2.attention).attention_flops(v2, 64)
    assert reports["Transformer 2x heads"]["attention"] - reports["DIFF V2"]["attention"] == \
        layers * v2.n_heads * d * v2.d_model - lam
    assert reports["DIFF V2"]["total"] - reports["Transformer 1.5x heads"]["total"] == lam
    # +FFN: V2's attention, and the nearest total to "2x heads" that a whole SwiGLU width gives
    assert reports["DIFF V2 +FFN"]["attention"] == reports["DIFF V2"]["attention"]
    gap = reports["DIFF V2 +FFN"]["total"] - reports["Transformer 2x heads"]["total"]
    assert abs(gap) <= 3 * v2.d_model * layers / 2
    # the spec's comment states each row's counts
    assert header_counts() == {name: (r["total"], r["non_embedding"], r["attention"]) for name, r in reports.items()}


@pytest.mark.slow
@pytest.mark.heavy  # python -m pytest -m heavy
def test_sweep_runs_and_compares_one_row_per_case_with_parameter_counts(tmp_path):
    spec = yaml.safe_load(SPEC.read_text())
    spec.update(base=str(REPO / spec["base"]), runs_dir=str(tmp_path / "runs"), seeds=[0])
    spec["overrides"] = {"trainer.max_steps": 2, "trainer.val_check_interval": 2, "trainer.limit_val_batches": 1,
                         "data.seq_len": 32, "data.batch_size": 2, "data.max_chars": 20000,
                         "data.cache_dir": str(tmp_path / "cache")}
    path = tmp_path / "v2_comparison.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    assert sweep_main(["--config", str(path)]) == 0
    out = tmp_path / "cmp"
    assert compare_main([str(tmp_path / "runs/v2_comparison"), "--out", str(out), "--no-plots"]) == 0
    rows = list(csv.DictReader((out / "compare.csv").open()))
    assert [r["case"] for r in rows] == CASES
    assert all(r["n_complete"] == "1" and float(r["val/loss_mean"]) > 0 for r in rows)
    counts = header_counts()
    for row in rows:  # the trials' own parameter reports, as the comment states them
        assert (int(row["params_total"]), int(row["params_non_embedding"])) == counts[row["case"]][:2], row["case"]
    table = (out / "compare.md").read_text().splitlines()
    for case in CASES:  # compare.md: Case | Params | Non-emb. params | ...
        cells = [c.strip() for c in next(line for line in table if line.startswith(f"| {case} |")).split("|")]
        assert cells[2:4] == [format_params(n) for n in counts[case][:2]], cells

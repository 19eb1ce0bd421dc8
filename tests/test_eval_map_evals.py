"""outliers, quantize and rounding on every registered variant: a tiny random checkpoint of each, every map of every
head seen (the logits' count), 16 bits reproducing the loss, and bf16 / fp16 errors of their precision's size."""

from __future__ import annotations

import csv
import json
import math

import pytest

from diffexp.model.attention import variant_names
from diffexp.model.attention.registry import variant
from tests.helpers import run_eval, save_checkpoint, small_model, write_texts

CONTEXT, ROWS = 6, 2


@pytest.mark.parametrize("attention", variant_names())
def test_map_evaluations_on_every_variant(tmp_path, capsys, attention):
    run = tmp_path / "run"
    checkpoint = save_checkpoint(small_model(attention, max_seq_len=16), run / "checkpoints" / "last.ckpt")
    common = ["--text-file", *write_texts(tmp_path), "--rows", str(ROWS), "--context-len", str(CONTEXT),
              "--device", "cpu"]
    for name, extra in (("outliers", []), ("quantize", ["--bits", "16", "4"]), ("rounding", [])):
        code, out = run_eval([name, str(checkpoint), *common, *extra], capsys)
        assert code == 0, (name, out)
    with open(run / "eval" / "outliers.csv") as f:
        pooled = {row["kind"]: row for row in csv.DictReader(f) if row["layer"] == "all"}
    maps = 2 if variant(attention).differential else 1  # both maps of a differential head
    visible = CONTEXT * (CONTEXT + 1) // 2
    assert int(pooled["logits"]["count"]) == 2 * 2 * maps * ROWS * visible  # layers x heads x maps x rows x keys
    assert int(pooled["hidden"]["count"]) == 2 * ROWS * CONTEXT * 32
    quantize = json.loads((run / "eval" / "quantize.json").read_text())["scalars"]
    assert quantize["quantize/loss_b16"] == pytest.approx(quantize["quantize/loss_unquantized"], rel=1e-5)
    assert math.isfinite(quantize["quantize/loss_b4"])
    rounding = json.loads((run / "eval" / "rounding.json").read_text())["scalars"]
    assert 1e-5 < rounding["rounding/bf16_rel_error"] < 2e-2
    assert rounding["rounding/fp16_rel_error"] < rounding["rounding/bf16_rel_error"]


@pytest.mark.parametrize("name", ["outliers", "quantize", "rounding"])
def test_map_evaluations_score_during_a_fit(tmp_path, name):
    """Through diffexp.evals.Evaluate, on the validation documents of the fit's own data module."""
    import lightning as L

    from diffexp.data import TextDataModule
    from diffexp.evals import Evaluate
    from diffexp.model.config import ModelConfig
    from diffexp.training import DiffexpLM

    data = TextDataModule(tokenizer="byte", seq_len=8, batch_size=2, max_chars=20_000, val_fraction=0.4,
                          cache_dir=str(tmp_path / "cache"))
    model = DiffexpLM(ModelConfig(attention="diff_v1", vocab_size=257, d_model=32, n_layers=1, n_heads=2,
                                  max_seq_len=16))
    callback = Evaluate(name, {"rows": 2, "context_len": 8, **({"bits": [8]} if name == "quantize" else {})})
    trainer = L.Trainer(max_steps=2, limit_val_batches=1, val_check_interval=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[callback], default_root_dir=tmp_path, num_sanity_val_steps=0)
    trainer.fit(model, datamodule=data)
    tag = {"outliers": "outliers/logits_top1", "quantize": "quantize/loss_b8", "rounding": "rounding/bf16_rel_error"}
    assert math.isfinite(float(trainer.callback_metrics[tag[name]]))

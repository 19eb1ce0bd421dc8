"""`diffexp eval rounding`: FlashAttention's low-precision P V against a hand rounding, the error statistics by
hand, and the command on a checkpoint (that the taps' terms are the head's output: tests/test_taps.py)."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from diffexp.evals.rounding import Sums, flash_product, low_precision_output
from diffexp.model.heads.taps import Term
from tests.helpers import run_eval, save_checkpoint, small_model, write_texts

# one head, two keys, one channel: row 0 reads key 0 only, row 1 weighs 1/4 and 3/4
P = torch.tensor([[[[1.0, 0.0], [0.25, 0.75]]]], dtype=torch.float64)
V = torch.tensor([[[[1 + 2 ** -9], [3.0]]]], dtype=torch.float64)


def f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def test_flash_product_rounds_as_by_hand():
    exact = P @ V  # [1 + 2^-9, 0.25 (1 + 2^-9) + 2.25]
    # bf16 (8 significant bits): 1 + 2^-9 -> 1; row 1's unnormalised weights [1/3, 1], 1/3 -> 0.333984375 (up)
    bf16 = flash_product(P, V, torch.bfloat16)
    assert bf16.dtype == torch.float32
    assert bf16[0, 0, :, 0].tolist() == [1.0, (0.333984375 * 1.0 + 1.0 * 3.0) * 0.75]
    # fp16 (11 significant bits): 1 + 2^-9 is exact; 1/3 -> 0.333251953125 (down)
    fp16 = flash_product(P, V, torch.float16)
    # the products exact in fp32, their sum rounded to fp32 (24 bits), then times the row's max weight
    assert fp16[0, 0, :, 0].tolist() == [1 + 2 ** -9, f32(f32(0.333251953125 * (1 + 2 ** -9) + 3.0) * 0.75)]
    assert float(exact[0, 0, 1, 0]) - float(fp16[0, 0, 1, 0]) == pytest.approx(0.75 * (1 / 3 - 0.333251953125)
                                                                               * (1 + 2 ** -9), rel=5e-3)
    # a differential head: each map's product rounded, then combined in fp32
    lam = torch.tensor(0.5, dtype=torch.float64)
    flipped = torch.tensor([[[[1.0, 0.0], [0.75, 0.25]]]], dtype=torch.float64)
    terms = (Term(1.0, P, V, "map1"), Term(-lam, flipped, V, "map2"))
    torch.testing.assert_close(low_precision_output(terms, torch.bfloat16),
                               bf16 - 0.5 * flash_product(flipped, V, torch.bfloat16), rtol=0, atol=0)


def test_error_statistics_per_head():
    sums = Sums(2)
    exact = torch.tensor([[[[1.0], [3.0]], [[2.0], [2.0]]]], dtype=torch.float64)  # (B=1, h=2, T=2, dv=1)
    low = exact + torch.tensor([[[[0.5], [-0.1]], [[0.0], [0.0]]]], dtype=torch.float64)
    sums.add(low, exact)
    head0, head1 = sums.per_head()
    rms0 = (5.0 ** 0.5)  # sqrt((1 + 9) / 2)
    assert head0["rel_error"] == pytest.approx(((0.25 + 0.01) / 2) ** 0.5 / rms0)
    assert head0["bias"] == pytest.approx(0.2 / rms0)
    assert head1["rel_error"] == 0 and head1["bias"] == 0


@pytest.mark.parametrize("attention", ["baseline", "diff_v1"])
def test_rounding_command(tmp_path, capsys, attention):
    module = small_model(attention, max_seq_len=32)
    run = tmp_path / "run"
    checkpoint = save_checkpoint(module, run / "checkpoints" / "last.ckpt")
    code, out = run_eval(["rounding", str(checkpoint), "--text-file", *write_texts(tmp_path), "--rows", "2",
                          "--context-len", "12", "--device", "cpu"], capsys)
    assert code == 0, out
    scalars = json.loads((run / "eval" / "rounding.json").read_text())["scalars"]
    # bf16 keeps 8 significant bits, fp16 11: errors of order 2^-9 and 2^-12 of the output
    assert 1e-4 < scalars["rounding/bf16_rel_error"] < 1e-2
    assert 1e-5 < scalars["rounding/fp16_rel_error"] < scalars["rounding/bf16_rel_error"] / 4
    assert abs(scalars["rounding/bf16_bias"]) < scalars["rounding/bf16_rel_error"]
    with open(run / "eval" / "rounding.csv") as f:
        rows = list(csv.DictReader(f))
    assert {(r["layer"], r["head"], r["precision"]) for r in rows} == {
        (str(layer), str(head), p) for layer in range(2) for head in range(2) for p in ("bf16", "fp16")}
    assert "| bf16 |" in out and "| fp16 |" in out

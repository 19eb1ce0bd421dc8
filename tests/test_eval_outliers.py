"""`diffexp eval outliers`: top-1..3 and median |attention logit| and |hidden state| against a hand computation in
float64 from the weights (the logits q.k / sqrt(d) of every map, future keys left out)."""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch

from tests.helpers import EVAL_TEXTS, run_eval, save_checkpoint, small_model, write_texts
from tests.reference import heads

CONTEXT = 8


def hand_logits(attn, x: torch.Tensor) -> list[float]:
    """|q.k / sqrt(d)| of every map, head, row and visible key, one at a time in float64."""
    cfg, x = attn.cfg, x.detach().double()
    maps = 2 if cfg.attention == "diff_v1" else 1
    q = attn.rope.rotate(heads(x @ attn.q_proj.weight.detach().double().T, maps * cfg.n_heads))
    k = attn.rope.rotate(heads(x @ attn.k_proj.weight.detach().double().T, maps * cfg.kv_heads))
    d, group = q.shape[-1], q.shape[1] // k.shape[1]
    values = []
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            for i in range(q.shape[2]):
                for j in range(i + 1):
                    values.append(abs(float(q[b, h, i] @ k[b, h // group, j]) / math.sqrt(d)))
    return values


def stats(values: list[float]) -> dict[str, float]:
    ordered = sorted(values, reverse=True)
    low = sorted(values)
    return {"top1": ordered[0], "top2": ordered[1], "top3": ordered[2], "median": low[(len(low) - 1) // 2]}


@pytest.mark.parametrize("attention", ["baseline", "diff_v1"])
def test_outliers_match_a_hand_computation(tmp_path, capsys, attention):
    module = small_model(attention, max_seq_len=32)
    run = tmp_path / "run"
    checkpoint = save_checkpoint(module, run / "checkpoints" / "last.ckpt")
    code, out = run_eval(["outliers", str(checkpoint), "--text-file", *write_texts(tmp_path), "--rows", "3",
                          "--context-len", str(CONTEXT), "--batch-size", "2", "--device", "cpu"], capsys)
    assert code == 0, out
    tokens = torch.tensor([list(text.encode())[:CONTEXT] for text in EVAL_TEXTS.values()])
    decoder = module.model.eval()
    inputs, outputs = [], []
    x = decoder.embed(tokens)
    with torch.no_grad():
        for block in decoder.blocks:  # block by block, the hidden state after each
            inputs.append(block.attn_norm(x))
            x = block(x)[0]
            outputs.append(x)
    with open(run / "eval" / "outliers.csv") as f:
        written = {(row["kind"], row["layer"]): row for row in csv.DictReader(f)}
    pooled = {"logits": [], "hidden": []}
    for layer, (block, x_in, x_out) in enumerate(zip(decoder.blocks, inputs, outputs, strict=True)):
        for kind, values in (("logits", hand_logits(block.attn, x_in)),
                             ("hidden", x_out.double().abs().reshape(-1).tolist())):
            pooled[kind] += values
            row = written[kind, str(layer)]
            for stat, value in stats(values).items():
                assert float(row[stat]) == pytest.approx(value, rel=1e-4, abs=1e-6), (kind, layer, stat)
            assert int(row["count"]) == len(values)
    scalars = json.loads((run / "eval" / "outliers.json").read_text())["pooled"]
    for kind, values in pooled.items():
        for stat, value in stats(values).items():
            assert scalars[kind][stat] == pytest.approx(value, rel=1e-4, abs=1e-6)
    assert "| attention logits |" in out and "| hidden states |" in out
    check_printed_table(out, scalars)


def check_printed_table(out: str, pooled: dict[str, dict[str, float]]) -> None:
    """The printed table's cells are the pooled values, each column in one number of decimals that gives its
    smallest value 4 significant digits (zeros kept)."""
    rows = {"attention logits": "logits", "hidden states": "hidden"}
    cells = {rows[parts[2]]: parts[3:7] for line in out.splitlines()
             if len(parts := [p.strip() for p in line.split("|")]) > 7 and parts[2] in rows}
    assert set(cells) == {"logits", "hidden"}
    for i, stat in enumerate(("top1", "top2", "top3", "median")):
        column = [cells[kind][i] for kind in ("logits", "hidden")]
        decimals = {len(text.partition(".")[2]) for text in column}
        assert len(decimals) == 1, column
        (places,) = decimals
        smallest = min(pooled[kind][stat] for kind in ("logits", "hidden"))
        assert places == max(0, 3 - math.floor(math.log10(smallest))), column
        for kind, text in zip(("logits", "hidden"), column, strict=True):
            assert float(text) == pytest.approx(pooled[kind][stat], abs=0.51 * 10**-places), (kind, stat)


def test_a_column_of_the_printed_table_keeps_one_number_of_decimals():
    """'6.200' above '6.167', not '6.2' above '6.167'; the csv keeps its own precision."""
    from diffexp.evals.outliers import OutlierResults

    pooled = {"logits": {"top1": 21.3512, "top2": 6.2, "top3": 6.1, "median": 1.2, "count": 10},
              "hidden": {"top1": 4.78123, "top2": 6.167, "top3": 0.05, "median": 0.000346123, "count": 10}}
    results = OutlierResults([], pooled, "baseline", "text", documents=1, context_len=CONTEXT)
    table = results.table()
    assert "| baseline | attention logits | 21.351 | 6.200 | 6.10000 | 1.2000000 |" in table
    assert "| baseline | hidden states | 4.781 | 6.167 | 0.05000 | 0.0003461 |" in table
    check_printed_table(table, pooled)


def test_outliers_refuses_bad_options_before_loading(tmp_path, capsys):
    checkpoint = save_checkpoint(small_model("baseline", max_seq_len=32), tmp_path / "run" / "checkpoints" / "a.ckpt")
    files = write_texts(tmp_path)
    code, out = run_eval(["outliers", str(checkpoint), "--text-file", *files, "--context-len", "64",
                          "--out", str(tmp_path / "never")], capsys)
    assert code == 2 and "--context-len=64 is invalid" in out and "max_seq_len=32" in out
    code, out = run_eval(["outliers", str(checkpoint), "--text-file", *files, "--rows", "0"], capsys)
    assert code == 2 and "--rows=0 is invalid: expected a positive integer" in out
    assert not (tmp_path / "never").exists()


def test_past_its_sample_a_pool_keeps_the_exact_top_and_a_sampled_median():
    from diffexp.evals.outliers import Pool, summary_row

    pool = Pool(per_batch=2000, generator=torch.Generator().manual_seed(0))
    batches = [torch.rand(10_000, generator=torch.Generator().manual_seed(i)) ** 2 for i in range(4)]
    for values in batches:
        pool.add(values)
    everything = torch.cat(batches).double()
    row = summary_row(pool.top, pool.sample(), pool.count)
    assert [row["top1"], row["top2"], row["top3"]] == everything.topk(3).values.tolist()
    assert pool.sample().numel() == 8000 and row["count"] == 40_000
    assert row["median"] == pytest.approx(float(everything.median()), abs=0.02)  # 0.25 for uniform squared

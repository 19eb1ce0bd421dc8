"""MQAR (zoology's multi-query associative recall): labels, ranges, determinism, accuracy known answers."""

from __future__ import annotations

import lightning as L
import numpy as np
import pytest
import torch

from diffexp.data.mqar import MQARDataModule, power_law_gap_probs
from diffexp.evals import Evaluate
from diffexp.evals.mqar import evaluate_mqar, mqar_accuracy
from diffexp.model import Decoder
from diffexp.model.config import ModelConfig
from diffexp.training import DiffexpLM


def small_dm(**kwargs) -> MQARDataModule:
    args = dict(vocab_size=64, seq_len=48, num_kv_pairs=6, train_size=64, val_size=40, batch_size=8, seed=3)
    return MQARDataModule(**{**args, **kwargs})


def all_val(dm: MQARDataModule) -> dict[str, torch.Tensor]:
    batches = list(dm.val_dataloader())
    return {k: torch.cat([b[k] for b in batches]) for k in ("tokens", "loss_mask")}


def oracle_logits(tokens_in: torch.Tensor, num_kv_pairs: int, vocab_size: int) -> torch.Tensor:
    """Looks each position's token up among the keys of the context and predicts the paired value."""
    B, T = tokens_in.shape
    logits = torch.zeros(B, T, vocab_size)
    for b in range(B):
        pairs = {int(tokens_in[b, 2 * i]): int(tokens_in[b, 2 * i + 1]) for i in range(num_kv_pairs)}
        for t in range(2 * num_kv_pairs, T):
            value = pairs.get(int(tokens_in[b, t]))
            if value is not None:
                logits[b, t, value] = 1.0
    return logits


def test_shapes_ranges_and_labels():
    dm = small_dm()
    n, half = dm.num_kv_pairs, dm.vocab_size // 2
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"tokens", "loss_mask"}
    assert batch["tokens"].shape == (8, 49) and batch["tokens"].dtype == torch.long
    assert batch["loss_mask"].shape == (8, 48)
    for tokens, mask in zip(*all_val(dm).values()):
        keys, values = tokens[0 : 2 * n : 2], tokens[1 : 2 * n : 2]
        assert ((keys >= 1) & (keys < half)).all() and ((values >= half) & (values < dm.vocab_size)).all()
        assert len(set(keys.tolist())) == n  # no key repeats among the kv pairs
        assert int(mask.sum()) == n and not mask[: 2 * n].any()
        pairs = dict(zip(keys.tolist(), values.tolist()))
        positions = mask.nonzero().flatten().tolist()
        queried = [int(tokens[q]) for q in positions]
        assert sorted(queried) == sorted(pairs)  # every key queried exactly once
        for q in positions:  # the target of q is tokens[q + 1]: the value paired with the queried key
            assert int(tokens[q + 1]) == pairs[int(tokens[q])]
        assert ((tokens >= 0) & (tokens < dm.vocab_size)).all()


def test_deterministic_by_seed_and_splits_differ():
    a, b, c = small_dm(), small_dm(), small_dm(seed=4)
    va, vb, vc = all_val(a), all_val(b), all_val(c)
    assert torch.equal(va["tokens"], vb["tokens"]) and torch.equal(va["loss_mask"], vb["loss_mask"])
    assert not torch.equal(va["tokens"], vc["tokens"])
    train = a.dataset("train")[0]["tokens"]
    assert torch.equal(train, b.dataset("train")[0]["tokens"])
    assert not torch.equal(train, a.dataset("val")[0]["tokens"])
    # the resumable training order is seeded too
    assert torch.equal(next(iter(a.train_dataloader()))["tokens"], next(iter(b.train_dataloader()))["tokens"])


def test_power_law_gaps():
    p = power_law_gap_probs(50, 0.01)
    assert p.sum() == pytest.approx(1.0) and (np.diff(p) < 0).all()
    np.testing.assert_allclose(power_law_gap_probs(10, 1.0), 0.1)
    near = small_dm(seq_len=128, power_a=0.01)
    uniform = small_dm(seq_len=128, power_a=1.0)
    mean_pos = [float(all_val(dm)["loss_mask"].nonzero()[:, 1].float().mean()) for dm in (near, uniform)]
    assert mean_pos[0] < mean_pos[1] - 5  # power_a = 0.01 puts the queries closer to the context


def test_oracle_gets_one_random_gets_chance():
    dm = small_dm(vocab_size=16, num_kv_pairs=4, seq_len=32, val_size=400, batch_size=50)
    val = all_val(dm)
    logits = oracle_logits(val["tokens"][:, :-1], dm.num_kv_pairs, dm.vocab_size)
    assert mqar_accuracy(logits, val) == 1.0
    # random guesses among the 8 values: ~1/8
    g = torch.Generator().manual_seed(0)
    guesses = torch.randint(8, 16, val["loss_mask"].shape, generator=g)
    random_logits = torch.nn.functional.one_hot(guesses, 16).float()
    n_values = dm.vocab_size - dm.vocab_size // 2
    assert mqar_accuracy(random_logits, val) == pytest.approx(1 / n_values, abs=0.04)
    # evaluate_mqar on a data module: an oracle "model" and a random-weights Decoder
    class Oracle(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.dummy = torch.nn.Parameter(torch.zeros(1))

        def forward(self, idx):
            return oracle_logits(idx, dm.num_kv_pairs, dm.vocab_size)

    assert evaluate_mqar(Oracle(), dm) == {"mqar/accuracy": 1.0, "mqar/n": 1600}
    torch.manual_seed(0)
    decoder = Decoder(ModelConfig(vocab_size=16, d_model=32, n_layers=1, n_heads=2, max_seq_len=64))
    result = evaluate_mqar(decoder, dm)
    assert result["mqar/n"] == 1600 and result["mqar/accuracy"] < 0.3
    assert decoder.training  # mode restored


def test_bad_values_are_named():
    with pytest.raises(ValueError, match="seq_len=20"):
        small_dm(seq_len=20)  # 6 pairs need 24
    with pytest.raises(ValueError, match="vocab_size=10"):
        small_dm(vocab_size=10)
    with pytest.raises(ValueError, match="power_a=0"):
        small_dm(power_a=0)
    with pytest.raises(ValueError, match="num_kv_pairs=0"):
        small_dm(num_kv_pairs=0)
    with pytest.raises(ValueError, match="train_size=4"):
        small_dm(train_size=4)


def test_trains_with_diffexp_lm(tmp_path):
    """Dict batches with loss_mask go through DiffexpLM and the resumable loader; the callback scores the
    validation sequences."""
    dm = small_dm(train_size=32, val_size=16)
    model = DiffexpLM(arch=ModelConfig(attention="diff_v1", d_model=32, n_layers=1, n_heads=2, max_seq_len=64),
                      vocab_size=dm.vocab_size)
    callback = Evaluate("mqar", {"samples": 16})
    trainer = L.Trainer(max_steps=3, limit_val_batches=1, val_check_interval=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[callback], default_root_dir=tmp_path, num_sanity_val_steps=0)
    trainer.fit(model, datamodule=dm)
    acc = float(trainer.callback_metrics["mqar/accuracy"])
    assert 0.0 <= acc <= 1.0
    assert acc == pytest.approx(evaluate_mqar(model, dm)["mqar/accuracy"])  # the data module's own validation sequences
    assert float(trainer.callback_metrics[f"mqar/accuracy_seq{dm.seq_len}_kv{dm.num_kv_pairs}"]) == pytest.approx(acc)
    assert "val/loss" in trainer.callback_metrics

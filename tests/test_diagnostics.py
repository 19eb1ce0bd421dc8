"""Training diagnostics: known answers for kurtosis, spikes and the attention-logit maximum."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from diffexp import Decoder, ModelConfig
from diffexp.training.diagnostics import Diagnostics, kurtosis


def test_kurtosis_known_values():
    assert kurtosis(torch.tensor([1.0, -1.0] * 50)) == 1.0
    heavy = torch.zeros(1000)
    heavy[0] = 100.0
    assert kurtosis(heavy) > 900  # one outlier dominates


def test_gradient_spikes_are_counted_after_warmup():
    diag = Diagnostics(spike_factor=3.0, spike_warmup=5)
    module = SimpleNamespace(last_grad_norm=None)
    for norm in [1.0, 1.0, 20.0] + [1.0] * 30 + [10.0] + [1.0] * 5 + [2.5]:
        module.last_grad_norm = norm
        diag._count_spike(module)
    assert diag.spikes == 1  # the 20 comes before the warmup ends; 2.5 is under 3x the mean
    restored = Diagnostics()
    restored.load_state_dict(diag.state_dict())
    assert restored.spikes == 1


def test_measure_reports_layers_and_the_true_logit_max():
    cfg = ModelConfig(attention="diff_v2", d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=50)
    model = Decoder(cfg)
    idx = torch.randint(0, 50, (1, 12))
    stats = Diagnostics.measure(model, idx)
    for layer in ("00", "01"):
        for key in ("act_max_abs", "act_kurtosis", "attn_logit_max", "lambda_mean", "lambda_std"):
            assert f"diag/layer_{layer}/{key}" in stats
    # the first layer's logit max, recomputed by hand from its projections
    attn = model.blocks[0].attn
    x = model.blocks[0].attn_norm(model.embed(idx))
    q = attn.rope.rotate(attn.q_proj(x).view(1, 12, 4, 16).transpose(1, 2))
    k = attn.rope.rotate(attn.k_proj(x).view(1, 12, 1, 16).transpose(1, 2))
    logits = (q @ k.transpose(-1, -2)) / math.sqrt(16)
    causal = torch.ones(12, 12, dtype=torch.bool).tril()
    assert abs(stats["diag/layer_00/attn_logit_max"] - logits[..., causal].max().item()) < 1e-5
    assert not any(b.attn.record_stats for b in model.blocks)


def test_training_forward_is_observed_like_an_extra_forward():
    """The callback observes the training step's own forward (FSDP-safe): same numbers as `measure`,
    recorded once per block even when activation checkpointing reruns the blocks in backward."""
    import copy

    from torch.utils.checkpoint import checkpoint

    from diffexp.training.diagnostics import LayerStats

    cfg = ModelConfig(attention="diff_v2", d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=50)
    model = Decoder(cfg)
    idx = torch.randint(0, 50, (3, 12))
    expected = Diagnostics.measure(copy.deepcopy(model), idx[:1])

    recorder = LayerStats(model, rows=1).start()
    x = model.embed(idx)
    for block in model.blocks:  # checkpointed: each block's forward runs twice
        x = checkpoint(lambda h, b=block: b(h)[0], x, use_reentrant=False)
    model.lm_head(model.final_norm(x)).sum().backward()
    observed = recorder.stop()
    assert observed.keys() == expected.keys()
    for key, value in expected.items():
        assert abs(observed[key] - value) < 1e-4 * max(1.0, abs(value)), key
    assert not any(b.attn.record_stats for b in model.blocks)
    assert not model.blocks[0]._forward_hooks


def test_sharded_gradient_norm_counts_each_shard_once():
    """Under FSDP each rank's grad norm covers its shard; the squares are summed over ranks, once per copy."""
    from unittest import mock

    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

    from diffexp.training.module import _shard_replicas

    cases = [(dict(sharding_strategy="FULL_SHARD"), 8, 1, 1), (dict(sharding_strategy="SHARD_GRAD_OP"), 8, 1, 1),
             (dict(sharding_strategy="HYBRID_SHARD", auto_wrap_policy={torch.nn.Linear}), 16, 2, 2),
             (dict(sharding_strategy="NO_SHARD"), 8, 1, 0), (dict(sharding_strategy="FULL_SHARD"), 1, 1, 0)]
    for kwargs, world, nodes, copies in cases:
        strategy = FSDPStrategy(**kwargs)
        with mock.patch.object(FSDPStrategy, "world_size", world), \
                mock.patch.object(strategy, "num_nodes", nodes):
            assert _shard_replicas(strategy) == copies, kwargs
    assert _shard_replicas(DDPStrategy()) == 0  # DDP grads are already all-reduced: every rank has all of it

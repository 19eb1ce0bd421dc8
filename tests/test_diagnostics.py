"""Training diagnostics: known answers for kurtosis, spikes, the attention-logit maximum, context RMS, the
attention-sink score, loss spikes and divergence."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from diffexp import Decoder, ModelConfig
from diffexp.model.attention.registry import variant_names
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
    assert diag.grad_norm_max == 20.0
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
            assert f"vitals/layer_{layer}/{key}" in stats
    # the first layer's logit max, recomputed by hand from its projections
    attn = model.blocks[0].attn
    x = model.blocks[0].attn_norm(model.embed(idx))
    q = attn.rope.rotate(attn.q_proj(x).view(1, 12, 4, 16).transpose(1, 2))
    k = attn.rope.rotate(attn.k_proj(x).view(1, 12, 1, 16).transpose(1, 2))
    logits = (q @ k.transpose(-1, -2)) / math.sqrt(16)
    causal = torch.ones(12, 12, dtype=torch.bool).tril()
    assert abs(stats["vitals/layer_00/attn_logit_max"] - logits[..., causal].max().item()) < 1e-5
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


# -- the DIFF V2 blog's stability quantities (diffexp.training.stability) ---------------------------------
SMALL = dict(vocab_size=61, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)


def test_context_rms_of_a_known_input():
    from diffexp.training.stability import context_rms

    # 2 tokens, 2 heads of 4 features: head 0 tokens RMS 1 and 2, head 1 tokens RMS 0 and 1
    x = torch.tensor([[[1.0, 1, 1, 1, 0, 0, 0, 0],
                       [2.0, -2, 2, -2, 1, -1, 1, -1]]])
    assert context_rms(x, n_heads=2).tolist() == [1.5, 0.5]
    # the blog's example: a unit-RMS value vector kept whole (RMS 1) or averaged over n orthogonal ones
    n = 16
    values = torch.eye(n) * math.sqrt(n)  # each row has RMS 1
    assert context_rms(values[:1], 1).item() == pytest.approx(1.0)
    assert context_rms(values.mean(0, keepdim=True), 1).item() == pytest.approx(1 / math.sqrt(n))


@pytest.mark.parametrize("name", variant_names())
def test_context_rms_reads_each_variants_o_proj_input_by_head(name):
    """The hook's numbers against the o_proj input captured separately and reduced with plain loops."""
    from diffexp.training.diagnostics import LayerStats

    torch.manual_seed(0)
    model = Decoder(ModelConfig(attention=name, **SMALL))
    idx = torch.randint(0, 61, (3, 10))
    seen = []
    handle = model.blocks[1].attn.o_proj.register_forward_pre_hook(lambda m, inputs: seen.append(inputs[0].detach()))
    recorder = LayerStats(model, rows=2).start()
    model(idx)
    stats = recorder.stop()
    handle.remove()
    x = seen[0][:2]  # the recorded rows
    heads = model.blocks[1].attn.n_heads
    width = x.shape[-1] // heads
    expected = []
    for h in range(heads):
        per_token = [math.sqrt(sum(float(v) ** 2 for v in x[b, t, h * width:(h + 1) * width]) / width)
                     for b in range(2) for t in range(10)]
        expected.append(sum(per_token) / len(per_token))
    for h, value in enumerate(expected):
        assert stats[f"vitals/layer_01/context_rms/head_{h:02d}"] == pytest.approx(value, rel=1e-5)
    assert stats["vitals/layer_01/context_rms"] == pytest.approx(sum(expected) / heads, rel=1e-5)
    layers = [stats[f"vitals/layer_{i:02d}/context_rms"] for i in range(2)]
    assert stats["vitals/context_rms"] == pytest.approx(sum(layers) / 2)
    assert not any(m._forward_pre_hooks for m in model.modules())


def test_sink_score_of_a_hand_built_map():
    from diffexp.training.stability import sink_score

    weights = torch.tensor([[[[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.2, 0.3, 0.5]],
                             [[1.0, 0.0, 0.0], [0.9, 0.1, 0.0], [-0.1, 0.6, 0.5]]]])  # (1, 2, 3, 3)
    # row 0 (which can only attend to token 0) left out: mean of 0.5, 0.2, 0.9, -0.1
    assert sink_score(weights) == pytest.approx(0.375)
    uniform = torch.ones(8, 8).tril() / torch.arange(1, 9).unsqueeze(1)
    assert sink_score(uniform.view(1, 1, 8, 8)) == pytest.approx(sum(1 / i for i in range(2, 9)) / 7)


@pytest.mark.parametrize("name", variant_names())
def test_attention_sinks_score_each_variants_effective_map(name):
    from diffexp.training.stability import attention_sinks, sink_score

    torch.manual_seed(0)
    model = Decoder(ModelConfig(attention=name, **SMALL)).train()
    idx = torch.randint(0, 61, (2, 12))
    scores = attention_sinks(model, idx)
    with torch.no_grad():
        _, maps = model(idx, need_weights=True)
    for i, effective in enumerate(maps):
        assert scores[f"vitals/layer_{i:02d}/attn_sink"] == pytest.approx(sink_score(effective), abs=1e-6)
    assert scores["vitals/attn_sink"] == pytest.approx(sum(sink_score(m) for m in maps) / len(maps), abs=1e-6)
    assert model.training and not any(m._forward_hooks for m in model.modules())


def test_loss_spikes_against_hand_computed_running_medians():
    from diffexp.training.stability import LossSpikes

    spikes = LossSpikes(factor=1.5, window=3, warmup=2)
    series = [2.0, 2.0, 4.0, 2.0, 1.0, 1.0, 1.0, 1.6, 2.0, float("nan"), 3.1]
    # previous <= 3 finite losses and their median; a spike is a loss above 1.5 x that median
    # step 0, 1: warmup | 2: median(2, 2) = 2 -> 4.0 > 3 spike | 3: median(2, 2, 4) = 2 -> 2.0 no
    # 4: median(2, 4, 2) = 2 | 5: median(4, 2, 1) = 2 | 6: median(2, 1, 1) = 1 -> 1.0 no
    # 7: median(1, 1, 1) = 1 -> 1.6 > 1.5 spike | 8: median(1, 1, 1.6) = 1 -> 2.0 spike | nan skipped
    # 10: median(1, 1.6, 2) = 1.6 -> 3.1 > 2.4 spike
    flags = [spikes.update(loss) for loss in series]
    assert [i for i, flag in enumerate(flags) if flag] == [2, 7, 8, 10]
    assert spikes.count == 4
    restored = LossSpikes(factor=1.5, window=3, warmup=2)
    restored.load_state_dict(spikes.state_dict())
    assert restored.update(4.0) and restored.count == 5  # median(1.6, 2, 3.1) = 2 -> 4.0 > 3


def test_loss_spikes_and_divergence_per_optimizer_step():
    """Micro-batches of an accumulated step count as one loss (their mean); a loss above divergence_factor x
    ln(vocab_size) records the divergence at that step and stops the run."""
    from diffexp.training.diagnostics import diverged_at

    diag = Diagnostics(every_n_steps=0, spike_warmup=1, loss_spike_factor=1.5, loss_spike_window=4)
    logged = {}
    module = SimpleNamespace(arch=SimpleNamespace(vocab_size=257), last_grad_norm=1.0, step_losses=[],
                             log=lambda name, value: logged.__setitem__(name, value))
    trainer = SimpleNamespace(global_step=0, should_stop=False, callbacks=[diag],
                              _logger_connector=SimpleNamespace(should_update_logs=True))  # logs every step
    diag.on_train_start(trainer, module)

    def micro_batch(loss: float, steps: bool) -> None:
        if steps:  # DiffexpLM brings the step's micro-batch losses to the host before the optimizer step
            module.step_losses, pending[:] = [*pending, loss], []
        else:
            pending.append(loss)
        trainer.global_step += steps
        diag.on_train_batch_end(trainer, module, None, None, 0)

    pending = []

    for first, second in [(2.0, 2.0), (1.0, 6.0), (2.0, 2.0)]:  # step means 2, 3.5, 2
        micro_batch(first, steps=False)
        micro_batch(second, steps=True)
    assert diag.loss_spikes.count == 1 and logged["vitals/loss_spikes"] == 1.0  # 3.5 > 1.5 x median(2)
    assert diag.grad_norm_max == 1.0 and logged["vitals/grad_norm_max"] == 1.0
    assert diverged_at(trainer) is None and not trainer.should_stop

    threshold = 1.5 * math.log(257)
    micro_batch(threshold - 0.01, steps=False)
    micro_batch(threshold - 0.01, steps=True)
    assert diverged_at(trainer) is None
    micro_batch(threshold + 0.02, steps=False)
    with pytest.warns(UserWarning, match="diverged at step 4"):
        micro_batch(threshold, steps=True)  # step 4's mean is above the threshold
    assert trainer.should_stop and logged["vitals/diverged_step"] == 4.0
    assert diverged_at(trainer) == {"step": 4, "reason": f"train/loss {threshold + 0.01:.4g} > {threshold:.4g} "
                                                          "(1.5 x ln 257)"}


@pytest.mark.slow
def test_a_compiled_fit_keeps_one_graph_while_the_diagnostics_observe_it(tmp_path, monkeypatch):
    """model.compile with every diagnostic on, observing every second step (and the sink forward, eval mode without
    gradients): the block compiles once, to one graph without breaks, and the observed steps log their values.
    Traced, the diagnostics broke the graph at each host read and recompiled on grad mode, hooks and flags."""
    from pathlib import Path

    import diffexp.model.compile as model_compile
    from diffexp.training.cli import build_fit
    from tests.helpers import scalars, tiny_fit_args

    torch.compiler.reset()
    torch._dynamo.utils.counters.clear()
    frames = []

    def counter(graph, example_inputs):  # a torch.compile backend that counts the frames it is given
        frames.append(graph)
        return graph.forward

    compile_blocks = model_compile.compile_blocks
    monkeypatch.setattr(model_compile, "compile_blocks", lambda blocks, device: compile_blocks(blocks, device, counter))
    monkeypatch.chdir(tmp_path)
    module, data, trainer = build_fit([
        *tiny_fit_args(tmp_path), "--model.compile", "true", "--data.batch_size", "2", "--trainer.max_steps", "6",
        "--diagnostics.every_n_steps", "2", "--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar",
        "false"])
    trainer.fit(module, data)
    assert len(frames) == 2, [frame.code for frame in frames]  # compile_blocks' probe, then the block's one graph
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    logged = scalars(Path(trainer.log_dir))
    for key in ("vitals/layer_00/attn_logit_max", "vitals/layer_00/attn_sink", "vitals/layer_00/context_rms"):
        assert [step for step, _ in logged[key]] == [1, 3, 5], key  # written at the steps done after them
    torch.compile(lambda x: x + 1, backend=counter)(torch.ones(1))  # the eager observation ended with its step
    assert len(frames) == 3

"""Each variant's FLOP count (its registry entry's `attention_flops`, summed by `Decoder.flops_per_token`)
against the FLOPs PyTorch actually executes, counted by `torch.utils.flop_counter.FlopCounterMode`.

Why the eager backend, and keys = T: the count is *logical* (causal attention reads T/2 keys per query on
average; no padding, no split or duplicated work), while FlopCounterMode counts what runs. On the SDPA
path it credits each fused call with a full, non-causal T x T map and counts every call, so DIFF V1's two
calls per map over V's halves (or Q/K zero-padded to 2d) would show up as extra work that the logical
count rightly leaves out. The eager path runs exactly the logical matmuls, only over the full T x T map
(the causal mask is applied by -inf, not by skipping work): X W for every nn.Linear, Q K^T and A V per
map (over the 2d-wide V in the two-map variants), Shared DIFF's low-rank up-projections, DINT's A3 V.
Softmax, norms, cumsums and masks are not matmuls; neither side counts them. So the executed count must
equal the logical count evaluated at keys = T (`Decoder._forward_flops`); the causal count at T/2 keys
halves the part of each entry that grows with the keys (Shared DIFF's up-projections do not).
Training: the backward of every matmul is two matmuls of the same size (input and weight gradients),
so forward + backward executes 3 x forward, as `flops_per_token(training=True)` counts.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from diffexp import Decoder, ModelConfig
from diffexp.model.attention import variants

T, BATCH = 32, 2
CASES = [(v.name, case, {**v.bench_arch, **overrides}) for v in variants() for case, overrides in v.cases.items()]


def executed_flops(model: Decoder, tokens: torch.Tensor, training: bool) -> int:
    with FlopCounterMode(display=False) as counter:
        logits = model(tokens)
        if training:
            logits.float().pow(2).mean().backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("name, case, overrides", CASES, ids=[f"{n}-{c}" if c else n for n, c, _ in CASES])
def test_counted_flops_match_executed_flops(name, case, overrides):
    torch.manual_seed(0)
    cfg = ModelConfig(attention=name, d_model=64, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=T,
                      backend="eager", **overrides)
    model = Decoder(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, T))
    full_map = BATCH * T * model._forward_flops(keys=T)  # the logical count, every query reading all T keys
    assert executed_flops(model, tokens, training=False) == pytest.approx(full_map, rel=0.05)
    if case == "":  # fwd + bwd once per variant: the same matmuls, so the default case is enough
        assert executed_flops(model, tokens, training=True) == pytest.approx(3 * full_map, rel=0.05)
    # the logical (causal) count: the part of the entry that grows with the keys, halved; 3 x forward to train
    flops = next(v for v in variants() if v.name == name).attention_flops
    assert flops(cfg, T / 2) == pytest.approx(flops(cfg, 0) + (flops(cfg, T) - flops(cfg, 0)) / 2)
    causal = model._forward_flops(keys=T) - cfg.n_layers * (flops(cfg, T) - flops(cfg, T / 2))
    assert model.flops_per_token(T, training=False) == pytest.approx(causal)
    assert model.flops_per_token(T) == pytest.approx(3 * causal)

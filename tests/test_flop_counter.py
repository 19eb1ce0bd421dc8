"""Each variant's FLOP count (its registry entry's `attention_flops`, summed by `Decoder.flops_per_token`)
against the FLOPs PyTorch executes, counted by `torch.utils.flop_counter.FlopCounterMode`.

The count is logical (causal: T/2 keys per query on average); the eager backend runs exactly its matmuls over the
full T x T map (SDPA's fused calls would be credited with a non-causal map and every split call), so what runs
must equal the count at keys = T (`Decoder._forward_flops`). Training executes 3 x forward (a matmul's backward
is two of the same size), as `flops_per_token(training=True)` counts.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from diffexp import Decoder, ModelConfig
from diffexp.model.attention import variants
from tests.reference import CASES as FLAG_CASES

T, BATCH = 32, 2
CASES = [(v.name, case, {**v.bench_arch, **overrides}) for v in variants()
         for case, overrides in FLAG_CASES[v.name].items()]


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
    # PaLM's convention counts every query over all T keys: what the eager backend executes
    assert model.flops_per_token(T, training=False, convention="palm") == pytest.approx(model._forward_flops(keys=T))


def test_palm_convention_is_6n_plus_12_l_h_q_t_for_the_baseline():
    """PaLM's MFU rule (appendix B): 6 N + 12 L H Q T per trained token, N the matmul parameters. At the 125m recipe's
    shape (d 768, 12 layers, 32K vocabulary, T 2048) that is 887M FLOPs per token, where the causal count is 774M."""
    cfg = ModelConfig(attention="baseline", d_model=768, n_layers=12, n_heads=12, vocab_size=32768, max_seq_len=2048)
    with torch.device("meta"):
        model = Decoder(cfg)
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    palm = model.flops_per_token(2048, convention="palm")
    assert palm == pytest.approx(6 * matmul + 12 * 12 * 768 * 2048)
    assert round(palm / 1e6) == 887 and round(model.flops_per_token(2048) / 1e6) == 774
    with pytest.raises(ValueError, match="expected one of causal, palm"):
        model.flops_per_token(2048, convention="full")

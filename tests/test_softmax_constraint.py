"""The designs that free softmax attention from its magnitude constraint, beside DIFF V2: softmax with a sink
(off by one, gpt-oss) and gated attention (Qiu et al.). Forward and every gradient against the float64 references
with the learned sinks moved off their init, the SDPA path without a T x T tensor, the effective map the
diagnostics read, and the parameters the gate adds."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from diffexp import Decoder, ModelConfig
from diffexp.model.attention import build_attention
from diffexp.training.stability import attention_sinks
from tests.helpers import SMALL, make_config
from tests.reference import reference_attention

CASES = ["softmax_sink", "softmax_sink-mha", "softmax_sink-learned", "softmax_sink-learned-mha", "gated",
         "gated-mha", "gated-headwise", "gated-headwise-mha"]


def module_off_init(case: str, backend: str):
    """The case's attention layer in float64, learned sinks drawn from N(0, 2^2) (they start at 0)."""
    torch.manual_seed(0)
    attn = build_attention(make_config(case, backend=backend), layer_idx=1).double()
    with torch.no_grad():
        for name, param in attn.named_parameters():
            if name == "sinks":
                param.copy_(2 * torch.randn_like(param))
    return attn


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("case", CASES)
def test_forward_and_every_gradient_match_the_float64_reference(case, backend):
    attn = module_off_init(case, backend)
    reference = module_off_init(case, backend)
    x = torch.randn(2, 13, attn.d_model, dtype=torch.float64)
    grad = torch.randn(2, 13, attn.d_model, dtype=torch.float64)
    x_in, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, maps = attn(x_in, need_weights=backend == "eager")
    out.backward(grad)
    want, want_maps = reference_attention(reference, x_ref)
    want.backward(grad)
    torch.testing.assert_close(out, want, rtol=1e-9, atol=1e-9)
    if maps is not None:
        torch.testing.assert_close(maps, want_maps, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(x_in.grad, x_ref.grad, rtol=1e-9, atol=1e-9)
    for (name, got), (_, wanted) in zip(attn.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(got.grad, wanted.grad, rtol=1e-9, atol=1e-9, msg=lambda m, n=name: f"d{n}: {m}")


@pytest.mark.parametrize("align", [1, 8])
@pytest.mark.parametrize("t_q", [13, 4])
def test_sink_on_sdpa_is_one_causal_call_without_a_mask_over_whole_sequences(monkeypatch, t_q, align):
    """Over whole sequences SDPA gets its own causal flag (no (T, T) mask); a chunk after a cache gets its mask.
    align 8: the channels padded as on CUDA."""
    calls, sdpa = [], F.scaled_dot_product_attention

    def recording(q, k, v, **kwargs):
        calls.append(kwargs)
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    from diffexp.model.heads.sink import eager_sink, sdpa_sink, sink_attention

    q, k, v = torch.randn(2, 4, t_q, 8), torch.randn(2, 2, 13, 8), torch.randn(2, 2, 13, 8)
    sink = torch.randn(4)
    if align == 1:
        out, weights = sink_attention(q, k, v, sink)
    else:
        out, weights = sdpa_sink(q, k, v, sink, align), None
    assert weights is None and len(calls) == 1
    assert (calls[0].get("is_causal"), "attn_mask" in calls[0]) == ((True, False) if t_q == 13 else (None, True))
    torch.testing.assert_close(out, eager_sink(q, k, v, sink)[0], rtol=1e-5, atol=1e-6)


def test_learned_sink_changes_the_model_and_the_maps_leave_its_mass_out():
    """Sinks pulling every row's mass (s = 20) leave the effective map near 0: the attention-sink score (mass on
    token 0) and the context RMS go to 0, where the sink column read as token 0 would give a score near 1."""
    zero = Decoder(ModelConfig(**SMALL, attention="softmax_sink"))
    learned = Decoder(ModelConfig(**SMALL, attention="softmax_sink", sink="learned"))
    missing, unexpected = learned.load_state_dict(zero.state_dict(), strict=False)
    assert sorted(missing) == [f"blocks.{i}.attn.sinks" for i in range(SMALL["n_layers"])] and not unexpected
    idx = torch.randint(0, 61, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(learned(idx), zero(idx))  # learned sinks start at 0: off by one
        for block in learned.blocks:
            block.attn.sinks.fill_(20.0)
        _, maps = learned(idx, need_weights=True)
    assert all(m.sum(-1).max() < 1e-6 for m in maps)
    assert attention_sinks(learned, idx)["vitals/attn_sink"] < 1e-6
    _, zero_maps = zero(idx, need_weights=True)
    row_sums = torch.stack([m.sum(-1) for m in zero_maps])
    assert row_sums.max() < 1 and row_sums.min() > 0  # off by one: every row gives some mass to the sink


@pytest.mark.parametrize("gate, extra", [("elementwise", lambda d_model, h, d: d_model * h * d),
                                         ("headwise", lambda d_model, h, d: d_model * h)])
def test_gate_adds_one_projection_and_its_parameters(gate, extra):
    cfg = ModelConfig(**SMALL, attention="gated", gate=gate)
    baseline = sum(p.numel() for p in build_attention(ModelConfig(**SMALL, attention="baseline"), 0).parameters())
    attn = build_attention(cfg, 0)
    assert sum(p.numel() for p in attn.parameters()) == baseline + extra(cfg.d_model, cfg.n_heads, attn.head_dim)
    model = Decoder(cfg)  # the decoder's normal init, as the paper's code (the gate is part of its q_proj)
    weight = model.blocks[0].attn.gate_proj.weight
    assert weight.std().item() == pytest.approx(cfg.init_std, rel=0.2)
    idx = torch.randint(0, 61, (2, 20))
    _, maps = model(idx, need_weights=True)
    row_sums = maps[0].sum(-1)  # the softmax map times the gate, which starts near 1/2
    assert 0.3 < row_sums.min() and row_sums.max() < 0.7


def test_sink_and_gate_count_the_baselines_flops():
    base = Decoder(ModelConfig(**SMALL, attention="baseline"))
    for overrides in ({"attention": "softmax_sink", "sink": "learned"}, {"attention": "gated"}):
        model = Decoder(ModelConfig(**{**SMALL, **overrides}))
        extra_linear = sum(p.numel() for n, p in model.named_parameters() if "attn.gate_proj" in n)
        assert model.flops_per_token(256) == base.flops_per_token(256) + 3 * 2 * extra_linear

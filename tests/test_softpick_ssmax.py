"""Softpick (Zuhri et al.) and Scalable-Softmax (Nakanishi). The shared suites run both against their float64
references (forward and every gradient), decode them with the cache, export them: here is what each adds. Softpick:
a head can attend to nothing, the weights are exactly 0 where a logit is not positive, a decoding step reads only
each row's own keys. SSMax: the factor s log n of each query position, learned s moved off its init included, on
SDPA without a map; its init and its refusals."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from diffexp import Decoder, ModelConfig
from diffexp.model.attention import build_attention
from diffexp.model.attention.softpick import EPS, softpick, softpick_attention
from diffexp.model.attention.ssmax import length_factor
from tests.helpers import SMALL, make_config
from tests.reference import reference_attention

SSMAX_CASES = ["ssmax", "ssmax-mha", "ssmax-init0.43"]


def ssmax_off_init(case: str, backend: str):
    """The case's attention layer in float64, each head's s drawn apart (they all start equal)."""
    torch.manual_seed(0)
    attn = build_attention(make_config(case, backend=backend), layer_idx=1).double()
    with torch.no_grad():
        attn.s.copy_(0.2 + torch.rand_like(attn.s))
    return attn


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("case", SSMAX_CASES)
def test_ssmax_with_heads_apart_matches_the_reference_forward_and_gradients(case, backend):
    attn, reference = ssmax_off_init(case, backend), ssmax_off_init(case, backend)
    x = torch.randn(2, 13, attn.d_model, dtype=torch.float64)
    upstream = torch.randn_like(x)
    x_in, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, maps = attn(x_in, need_weights=backend == "eager")
    out.backward(upstream)
    want, want_maps = reference_attention(reference, x_ref)
    want.backward(upstream)
    torch.testing.assert_close(out, want, rtol=1e-9, atol=1e-9)
    if maps is not None:
        torch.testing.assert_close(maps, want_maps, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(x_in.grad, x_ref.grad, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(attn.s.grad, reference.s.grad, rtol=1e-9, atol=1e-9)
    assert attn.s.grad.abs().min() > 0


def test_ssmax_factor_is_s_log_n_per_position_and_row():
    s = torch.tensor([0.5, 2.0], dtype=torch.float64)
    like = torch.zeros(1, dtype=torch.float64)
    whole = length_factor(0, 4, s, like)[0, :, :, 0]
    expected = torch.stack([s[h] * torch.log(torch.arange(1, 5, dtype=torch.float64)) for h in range(2)])
    assert torch.equal(whole, expected) and torch.all(whole[:, 0] == 0)  # position 1: log 1 = 0
    chunk = length_factor(3, 2, s, like)[0, :, :, 0]  # 3 cached positions: the queries are positions 4 and 5
    assert torch.equal(chunk, expected.new_tensor([[0.5 * math.log(4), 0.5 * math.log(5)],
                                                   [2.0 * math.log(4), 2.0 * math.log(5)]]))
    step = length_factor(torch.tensor([0, 6]), 1, s, like)[:, :, 0, 0]  # a step: each row at its own position
    assert torch.equal(step, expected.new_tensor([[0.0, 0.0], [0.5 * math.log(7), 2.0 * math.log(7)]]))
    assert length_factor(0, 3, s.float(), torch.zeros(1, dtype=torch.bfloat16)).dtype == torch.float32


def test_ssmax_runs_on_sdpa_without_a_map(monkeypatch):
    """Over whole sequences the scaled queries go to SDPA with its causal flag: no (T, T) tensor is written."""
    calls, sdpa = [], F.scaled_dot_product_attention

    def recording(q, k, v, **kwargs):
        calls.append(kwargs)
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    attn = build_attention(make_config("ssmax"), layer_idx=0)
    out, weights = attn(torch.randn(2, 9, attn.d_model))
    assert weights is None and len(calls) == 1 and calls[0].get("is_causal") is True and "attn_mask" not in calls[0]


@pytest.mark.parametrize("init, expected", [("length", 1 / math.log(64)), (0.43, 0.43), (2, 2.0)])
def test_ssmax_init_sets_every_heads_s(init, expected):
    model = Decoder(ModelConfig(**SMALL, attention="ssmax", ssmax_init=init))
    for block in model.blocks:
        assert block.attn.s.dtype == torch.float32 and block.attn.s.shape == (SMALL["n_heads"],)
        assert torch.all(block.attn.s == torch.tensor(expected, dtype=torch.float32))


def test_ssmax_s_changes_the_model_and_its_flops_are_the_baselines():
    model = Decoder(ModelConfig(**SMALL, attention="ssmax"))
    idx = torch.randint(0, 61, (2, 20))
    with torch.no_grad():
        before = model(idx)
        for block in model.blocks:
            block.attn.s.mul_(3.0)
        assert not torch.allclose(model(idx), before)
    baseline = Decoder(ModelConfig(**SMALL, attention="baseline"))
    assert model.flops_per_token(256) == baseline.flops_per_token(256)
    assert model.num_parameters() == baseline.num_parameters() + SMALL["n_layers"] * SMALL["n_heads"]


@pytest.mark.parametrize("overrides, needle", [
    (dict(ssmax_init=0.0), "model.arch.ssmax_init=0.0"),
    (dict(ssmax_init=-0.5), "model.arch.ssmax_init=-0.5"),
    (dict(ssmax_init=float("inf")), "model.arch.ssmax_init=inf"),
    (dict(ssmax_init="long"), "model.arch.ssmax_init='long'"),
    (dict(max_seq_len=1), "model.arch.ssmax_init='length'"),
])
def test_ssmax_refuses_a_bad_init(overrides, needle):
    with pytest.raises(ValueError) as err:
        ModelConfig(**{**SMALL, "attention": "ssmax", **overrides})
    assert needle in str(err.value) and ("positive number" in str(err.value))


def test_softpick_rows_are_zero_where_the_logit_is_not_positive():
    """relu(e^z - 1): exactly 0 for z <= 0; a row of non-positive logits attends to nothing; a row never sums past
    1; masked keys count in neither sum; all-zero logits give zeros, not 0/0."""
    logits = torch.tensor([[0.5, -1.0, 2.0, float("-inf")],
                           [-0.5, -2.0, 0.0, float("-inf")],
                           [0.0, 0.0, float("-inf"), float("-inf")],
                           [3.0, float("-inf"), float("-inf"), float("-inf")]], dtype=torch.float64)
    weights = softpick(logits)
    e = torch.exp(logits[0, :3]) - 1
    m = logits[0, :3].max()
    expected_first = torch.relu(e) * torch.exp(-m) / (e.abs().sum() * torch.exp(-m) + EPS)
    torch.testing.assert_close(weights[0, :3], expected_first, rtol=1e-12, atol=0)
    assert weights[0, 1] == 0 and torch.all(weights[1] == 0) and torch.all(weights[2] == 0)
    assert weights[0].sum() < 1
    assert weights[3, 0] == pytest.approx((math.e ** 3 - 1) / (math.e ** 3 - 1 + EPS * math.e ** 3))
    assert torch.all(weights[:, 3] == 0) and torch.isfinite(weights).all()


def test_softpick_heads_can_attend_to_nothing():
    """Queries of zero give every logit 0: each row's weights are 0 and the head outputs 0 (softmax would average V)."""
    attn = build_attention(make_config("softpick", backend="eager"), layer_idx=0)
    with torch.no_grad():
        attn.q_proj.weight.zero_()
        out, weights = attn(torch.randn(2, 9, attn.d_model), need_weights=True)
    assert torch.all(weights == 0) and torch.all(out == 0)


def test_softpick_step_reads_only_each_rows_keys():
    """A decoding step with rows of different lengths: keys past a row's length hold values (another row's, or
    stale ones) and must count in neither sum."""
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    lengths = torch.tensor([3, 7])
    cache = SimpleNamespace(stepping=True, key_lengths=lambda: lengths)
    out, weights = softpick_attention(q, k, v, cache)
    for b, n in enumerate(lengths.tolist()):
        alone, alone_weights = softpick_attention(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n])
        torch.testing.assert_close(out[b:b + 1], alone, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(weights[b:b + 1, ..., :n], alone_weights)
        assert torch.all(weights[b, ..., n:] == 0)


def test_softpick_has_the_baselines_parameters_and_flops():
    model = Decoder(ModelConfig(**SMALL, attention="softpick"))
    baseline = Decoder(ModelConfig(**SMALL, attention="baseline"))
    assert model.num_parameters() == baseline.num_parameters()
    assert model.flops_per_token(256) == baseline.flops_per_token(256)

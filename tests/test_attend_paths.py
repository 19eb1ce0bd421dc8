"""The CPU speed levers are exact: each alternative path gives the same values and gradients in fp32.

* `attend` over a V wider than Q/K: zero-padded Q and K in one SDPA call ("pad") against d-wide slices of V
  ("split"), causal, GQA, decoding (fewer queries than keys) and a single query.
* Each registered CPU kernel in a whole decoder against the plain path (one SDPA call per map), every gradient;
  the kernels' own tests: test_kernels.py, test_cpu_kernel.py.
"""

from __future__ import annotations

import pytest
import torch

from diffexp.model.heads.single_map import WIDE_V_MODES, attend, wide_v_mode

TOL = dict(rtol=1e-5, atol=1e-5)


def grads_of(fn, inputs, grad_out):
    inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*inputs)
    out.backward(grad_out)
    return out.detach(), [t.grad for t in inputs]


@pytest.mark.parametrize("heads, kv_heads, t_q, t_k", [(4, 4, 37, 37), (4, 2, 37, 37), (4, 2, 5, 37), (2, 1, 1, 9)])
def test_wide_v_pad_equals_split(heads, kv_heads, t_q, t_k):
    torch.manual_seed(t_q + heads)
    d = 8
    q = torch.randn(2, heads, t_q, d)
    k = torch.randn(2, kv_heads, t_k, d)
    v = torch.randn(2, kv_heads, t_k, 2 * d)
    grad = torch.randn(2, heads, t_q, 2 * d)
    (pad, pad_grads), (split, split_grads) = (
        grads_of(lambda q, k, v, mode=mode: attend(q, k, v, wide_v=mode)[0], (q, k, v), grad) for mode in WIDE_V_MODES)
    eager, eager_grads = grads_of(lambda q, k, v: attend(q, k, v, backend="eager")[0], (q, k, v), grad)
    for out, grads in ((pad, pad_grads), (split, split_grads)):
        torch.testing.assert_close(out, eager, **TOL)
        for got, want in zip(grads, eager_grads, strict=True):
            torch.testing.assert_close(got, want, **TOL)
    assert wide_v_mode(q) in WIDE_V_MODES


@pytest.mark.parametrize("t_q, t_k, dv", [(37, 37, 8), (5, 37, 8), (37, 37, 16)])
def test_gqa_with_repeated_kv_heads_equals_sdpa_gqa(monkeypatch, t_q, t_k, dv):
    """Where SDPA would run GQA in its math kernel (CUDA in fp32, or with a mask), attend repeats the K/V heads."""
    from diffexp.model.heads import single_map

    torch.manual_seed(t_q + dv)
    q, k, v = torch.randn(2, 4, t_q, 8), torch.randn(2, 2, t_k, 8), torch.randn(2, 2, t_k, dv)
    grad = torch.randn(2, 4, t_q, dv)
    fused, fused_grads = grads_of(lambda q, k, v: attend(q, k, v)[0], (q, k, v), grad)
    monkeypatch.setattr(single_map, "sdpa_fuses_gqa", lambda q, masked: False)
    calls, expand = [], single_map.expand_kv
    monkeypatch.setattr(single_map, "expand_kv", lambda t, h: calls.append(h) or expand(t, h))
    repeated, repeated_grads = grads_of(lambda q, k, v: attend(q, k, v)[0], (q, k, v), grad)
    assert calls == [4, 4]
    torch.testing.assert_close(repeated, fused, **TOL)
    for got, want in zip(repeated_grads, fused_grads, strict=True):
        torch.testing.assert_close(got, want, **TOL)


# -- every registered kernel that runs on CPU, in a whole decoder, against one SDPA call per map --------------------
from diffexp import Decoder, ModelConfig  # noqa: E402
from diffexp.kernels import PLAIN, kernels, use  # noqa: E402
from tests.helpers import require_cpu_kernel  # noqa: E402

SINGLE_PASSES = tuple(kernel.name for kernel in kernels() if "cpu" in kernel.devices)


@pytest.mark.parametrize("name, overrides", [
    ("diff_v1", {}), ("diff_v1", {"n_kv_heads": 2}), ("shared_diff", {"rank": 4}), ("dint", {}),
    ("dint", {"n_kv_heads": 2, "gamma": "learned", "gamma_init": 0.9}), ("diff_v2", {"n_kv_heads": 2}),
    ("diff_v2", {"lambda_mode": "none", "pair_norm": True})])
def test_decoder_single_pass_equals_one_call_per_map(name, overrides):
    """A whole decoder, logits and every parameter's gradient, with each CPU kernel against the plain path (one
    SDPA call per map; DINT: map 1 and its integral streamed, map 2 by SDPA). The yardstick is float64: each fp32
    kernel must be as close to the float64 model as the fp32 plain path is (lambda's gradient in a deep layer sums
    terms that cancel, so two fp32 paths can differ by 1e-4 of its largest entry while both are right)."""
    import copy

    require_cpu_kernel()
    torch.manual_seed(0)
    cfg = ModelConfig(attention=name, d_model=64, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=160, **overrides)
    model = Decoder(cfg)
    tokens = torch.randint(0, 64, (2, 150))

    def run(net, mode):
        net.zero_grad()
        with use(mode):
            logits = net(tokens)
        logits.double().pow(2).sum().backward()  # a sum: gradients of order 1, so atol does not hide lambda's
        return [logits.detach().double()] + [p.grad.double() for p in net.parameters()]

    reference = run(copy.deepcopy(model).double(), PLAIN)
    errors = {mode: [(got - want).abs().max().item() for got, want in zip(run(model, mode), reference, strict=True)]
              for mode in SINGLE_PASSES + (PLAIN,)}
    names = ["logits"] + [param for param, _ in model.named_parameters()]
    for mode in SINGLE_PASSES:
        for what, err, per_map_err, want in zip(names, errors[mode], errors[PLAIN], reference, strict=True):
            # fp32 sums in another order: within 4x the per-map path's own error, or 1e-5 of the largest entry;
            # lambda's and DINT gamma's gradients sum terms that cancel over every token (see above): 1e-4
            floor = 1e-4 if "lambda" in what or "gamma" in what else 1e-5
            allowed = max(4 * per_map_err, floor * want.abs().max().item())
            assert err <= allowed, f"{mode}, {what}: off float64 by {err:.3g}, one SDPA call per map by " \
                                   f"{per_map_err:.3g} (allowed {allowed:.3g})"

"""The CPU speed levers are exact: each alternative path gives the same values and gradients in fp32.

* `attend` over a V wider than Q/K: zero-padded Q and K in one SDPA call ("pad") against d-wide slices of V
  ("split"), causal, GQA, decoding (fewer queries than keys) and a single query.
"""

from __future__ import annotations

import pytest
import torch

from diffexp.model.attention.base import WIDE_V_MODES, attend, wide_v_mode

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

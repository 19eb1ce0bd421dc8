"""DINT's streaming integral: exact against the naive T x T computation, and no T x T tensor kept."""

from __future__ import annotations

import pytest
import torch

from diffexp import ModelConfig
from diffexp.model.attention import build_attention
from diffexp.model.heads.dint_integral import fused_first_map_integral, streaming_integral
from diffexp.model.heads.per_map import integral_map
from diffexp.model.heads.single_map import causal_softmax


@pytest.mark.parametrize("t, block", [(13, 4), (16, 16), (9, 1), (21, 8), (5, 64)])
def test_streaming_integral_matches_naive_forward_and_backward(t, block):
    torch.manual_seed(t)
    q, k = (torch.randn(2, 3, t, 4, dtype=torch.float64, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 3, t, 6, dtype=torch.float64, requires_grad=True)
    naive = integral_map(causal_softmax(q, k), "softmax") @ v
    streamed = streaming_integral(q, k, v, block)
    torch.testing.assert_close(streamed, naive, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(naive)
    for g_naive, g_streamed in zip(torch.autograd.grad(naive, (q, k, v), grad),
                                   torch.autograd.grad(streamed, (q, k, v), grad)):
        torch.testing.assert_close(g_streamed, g_naive, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("t, block", [(13, 4), (21, 8), (9, 32), (16, 16)])
def test_fused_first_map_and_integral_match_naive(t, block):
    """(A1 + gamma A3) V from one blocked pass, and the gradients of q, k, v and gamma, against the T x T maps."""
    torch.manual_seed(t)
    q, k = (torch.randn(2, 3, t, 4, dtype=torch.float64, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 3, t, 8, dtype=torch.float64, requires_grad=True)
    gamma = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    a1 = causal_softmax(q, k)
    naive = (a1 + gamma * integral_map(a1, "softmax")) @ v
    fused = fused_first_map_integral(q, k, v, gamma, block)
    torch.testing.assert_close(fused, naive, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(naive)
    for g_naive, g_fused in zip(torch.autograd.grad(naive, (q, k, v, gamma), grad),
                                torch.autograd.grad(fused, (q, k, v, gamma), grad), strict=True):
        torch.testing.assert_close(g_fused, g_naive, rtol=1e-10, atol=1e-12)


def test_gradcheck():
    q, k, v = (torch.randn(1, 2, 7, 3, dtype=torch.float64, requires_grad=True) for _ in range(3))
    assert torch.autograd.gradcheck(lambda q, k, v: streaming_integral(q, k, v, 3), (q, k, v))


def _saved_elements(cfg: ModelConfig, t: int) -> int:
    attn = build_attention(cfg, 0)
    attn.integral_block_size = 32
    saved: list[int] = []

    def count(tensor):
        saved.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(count, lambda x: x):
        out, _ = attn(torch.randn(2, t, 64, requires_grad=True))
    out.sum().backward()
    return sum(saved)


@pytest.mark.parametrize("integral", ["softmax", "mean"])
def test_dint_memory_for_backward_grows_linearly_with_length(integral):
    """What autograd keeps for backward doubles (not quadruples) when T doubles: no T x T tensor."""
    cfg = ModelConfig(attention="dint", d_model=64, n_heads=2, n_kv_heads=1, integral=integral, backend="sdpa")
    ratio = _saved_elements(cfg, 512) / _saved_elements(cfg, 256)
    assert ratio < 2.2, f"saved tensors grow {ratio:.2f}x when T doubles"
    eager = ModelConfig(attention="dint", d_model=64, n_heads=2, n_kv_heads=1, integral=integral, backend="eager")
    assert _saved_elements(eager, 512) / _saved_elements(eager, 256) > 3  # the naive path is quadratic

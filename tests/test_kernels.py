"""The kernel door's contract: every registered kernel, and the plain path, computes each two-map case of
tests/reference.py (and DIFF V2's, whose pairs a kernel with a lambda per token computes) as the naive float64
reference does: the attention module's output and the gradient of its
input and of every parameter (lambda's, gamma's, the low-rank factors').

A kernel is run through `use(name)` on the CPU, where it can compute (Triton kernels under Triton's interpreter,
set by tests/conftest.py); in float64 where it takes float64, else in float32 at float32's tolerance. A kernel
that cannot compute a case at all (DINT's integral for a two-maps-only kernel) is not collected; one that could but
cannot run on this machine (no C++ compiler, no Triton) is skipped with its own reason.
"""

from __future__ import annotations

import copy
import dataclasses
from unittest import mock

import pytest
import torch

from diffexp.kernels import PLAIN, cpu_native, gpu_dint, kernels, registry, use
from diffexp.model.attention import build_attention, variant
from tests.helpers import make_config, small_blocks, variant_cases
from tests.reference import reference_attention

TWO_MAP_CASES = [case for case in variant_cases() if variant(make_config(case).attention).maps_per_head == 2
                 or make_config(case).attention == "diff_v2"]
TOLERANCE = {torch.float64: dict(rtol=1e-9, atol=1e-9), torch.float32: dict(rtol=2e-4, atol=2e-5)}


def refusal(name: str, attn, x: torch.Tensor) -> str | None:
    """Why kernel `name` cannot compute this module's head on x's dtype (None: it can)."""
    if name == PLAIN:
        return None
    kernel = registry._KERNELS[name]
    d, h, h_kv = attn.head_dim, attn.n_heads, attn.n_kv_heads
    q1, k1 = x.new_zeros(1, h, x.shape[1], d), x.new_zeros(1, h_kv, x.shape[1], d)
    if attn.cfg.attention == "diff_v2":
        if attn.cfg.pairing != "same":
            return "pairs across K/V groups run the plain path"
        if attn.cfg.lambda_mode != "none" and not kernel.token_lambda:
            return "takes one lambda per layer, not DIFF V2's per token"
        return kernel.refuses(q1, k1, x.new_zeros(1, h_kv, x.shape[1], d), None)
    integral = attn.cfg.integral if attn.cfg.attention == "dint" else None
    return kernel.refuses(q1, k1, x.new_zeros(1, h_kv, x.shape[1], 2 * d), integral)


def computes_anywhere(name: str, case: str) -> bool:
    """Whether kernel `name` computes this case on a machine where it can run (a C++ compiler, Triton): in fp64,
    or else in fp32."""
    attn = build_attention(make_config(case), layer_idx=2)
    x = torch.zeros(1, 4, attn.d_model)
    with mock.patch.object(cpu_native, "available", lambda: True), \
            mock.patch.object(gpu_dint, "unavailable_reason", lambda device: None):
        return any(refusal(name, attn, x.to(dtype)) is None for dtype in (torch.float64, torch.float32))


PAIRS = [(PLAIN, case) for case in TWO_MAP_CASES] + [
    (kernel.name, case) for kernel in kernels() for case in TWO_MAP_CASES if computes_anywhere(kernel.name, case)]


@pytest.mark.parametrize("implementation, case", PAIRS)
def test_every_implementation_matches_the_naive_reference(implementation, case, monkeypatch):
    torch.manual_seed(0)
    cfg = make_config(case)
    reference_module = build_attention(cfg, layer_idx=2).double()  # layer 2: lambda_init 0.471 under "depth"
    small_blocks(reference_module)
    x = torch.randn(2, 13, cfg.d_model, dtype=torch.float64)
    dtype = torch.float64
    if refusal(implementation, reference_module, x) is not None:
        dtype = torch.float32
        reason = refusal(implementation, reference_module, x.float())
        if reason is not None:
            pytest.skip(f"{implementation} cannot compute {case} here: {reason}")
    ran = []
    if implementation != PLAIN:  # count the kernel's calls: a refused call would pass silently on the plain path
        kernel = registry._KERNELS[implementation]
        monkeypatch.setitem(registry._KERNELS, implementation, dataclasses.replace(
            kernel, head=lambda *a: ran.append(1) or kernel.head(*a)))
    module = copy.deepcopy(reference_module).to(dtype)
    x_in, x_ref = x.to(dtype).clone().requires_grad_(), x.clone().requires_grad_()
    grad = torch.randn(2, 13, cfg.d_model, dtype=torch.float64)
    with use(implementation):
        out, _ = module(x_in)
    out.backward(grad.to(dtype))
    want, _ = reference_attention(reference_module, x_ref)
    want.backward(grad)
    assert ran == ([] if implementation == PLAIN else [1])
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), want, **tolerance)
    torch.testing.assert_close(x_in.grad.double(), x_ref.grad, **tolerance)
    for (name, got), (_, wanted) in zip(module.named_parameters(), reference_module.named_parameters(), strict=True):
        scale = max(wanted.grad.abs().max().item(), 1.0)
        torch.testing.assert_close(got.grad.double(), wanted.grad, rtol=tolerance["rtol"],
                                   atol=tolerance["atol"] * scale, msg=lambda m, name=name: f"d{name}: {m}")

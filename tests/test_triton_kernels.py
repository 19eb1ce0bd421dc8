"""The Triton kernels (diffexp/model/kernels) against the sdpa and eager paths: outputs and every gradient.

Without CUDA they run through Triton's CPU interpreter. TRITON_INTERPRET=1 has to be in the environment
before triton is first imported (triton decorates its own helpers, tl.cumsum among them, at import, and
lightning imports triton), so tests/conftest.py sets it when there is no CUDA device. Shapes are tiny:
the interpreter runs each program in Python. Sequence lengths 13, 20 and 37 end inside a 16-row tile.
"""

from __future__ import annotations

import pytest
import torch

from diffexp.model.kernels.triton_support import interpreter_requested, unavailable_reason

DEVICE = "cuda" if torch.cuda.is_available() and not interpreter_requested() else "cpu"
REASON = unavailable_reason(DEVICE)
if REASON is not None:
    pytest.skip(f"the Triton kernels cannot run here: {REASON}", allow_module_level=True)

from diffexp.kernels.triton_dint import dint_integral  # noqa: E402
from diffexp.model.kernels.per_map import integral_map  # noqa: E402
from diffexp.model.kernels.single_map import attend, causal_logits, causal_softmax, expand_kv  # noqa: E402
from diffexp.model.kernels.triton_diff_attention import differential_attention  # noqa: E402

F64, F32 = torch.float64, torch.float32
TOLERANCE = {F64: dict(rtol=1e-10, atol=1e-10), F32: dict(rtol=2e-5, atol=2e-5)}
# batch, query heads, kv heads, T, d, V width, query block, key block, dtype; then whether A1 V gets a gradient
CASES = [
    pytest.param(1, 2, 1, 37, 8, 16, 16, 16, F64, False, id="gqa-T37-dv2d"),
    pytest.param(2, 2, 2, 13, 8, 8, 16, 32, F64, True, id="mha-T13-dv=d-keyblock32-out1grad"),
    pytest.param(1, 4, 2, 20, 16, 32, 32, 16, F32, False, id="fp32-gqa-T20-queryblock32"),
]
SIZES = "b, h, hk, t, d, dv, block_m, block_n, dtype, out1_grad"


def tensors(b, h, hk, t, d, dv, dtype, seed=0):
    """q1, q2: (b, h, t, d); k1, k2: (b, hk, t, d); v: (b, hk, t, dv), all requiring grad."""
    gen = torch.Generator().manual_seed(seed)

    def make(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype).to(DEVICE).requires_grad_()

    return make(b, h, t, d), make(b, h, t, d), make(b, hk, t, d), make(b, hk, t, d), make(b, hk, t, dv)


def sdpa_maps(q1, q2, k1, k2, v, lam):
    """The model's own path: one SDPA call per map (a 2d-wide V in d-wide halves)."""
    out1, _ = attend(q1, k1, v, "sdpa")
    out2, _ = attend(q2, k2, v, "sdpa")
    return out1 - lam.view(-1, 1, 1) * out2, out1


def check_grads(outputs, references, inputs, cotangents, tolerance):
    got = torch.autograd.grad(outputs, inputs, cotangents, retain_graph=True)
    want = torch.autograd.grad(references, inputs, cotangents, retain_graph=True)
    for i, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, **tolerance, msg=lambda m, i=i: f"input {i}: {m}")


@pytest.mark.parametrize(SIZES, CASES)
def test_differential_attention_matches_sdpa(b, h, hk, t, d, dv, block_m, block_n, dtype, out1_grad):
    q1, q2, k1, k2, v = tensors(b, h, hk, t, d, dv, dtype)
    lam = torch.linspace(0.2, 0.9, h, dtype=dtype, device=DEVICE).requires_grad_()  # one lambda per head
    out, out1, lse1 = differential_attention(q1, q2, k1, k2, v, lam, want_out1=True, block_m=block_m,
                                             block_n=block_n)
    want, want1 = sdpa_maps(q1, q2, k1, k2, v, lam)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, want, **tol)
    torch.testing.assert_close(out1, want1, **tol)
    torch.testing.assert_close(lse1, causal_logits(q1, k1).logsumexp(-1), **tol)
    outputs, references = ([out, out1], [want, want1]) if out1_grad else ([out], [want])  # DINT "mean" reads A1 V
    check_grads(outputs, references, (q1, q2, k1, k2, v, lam), [torch.randn_like(out) for _ in outputs], tol)


def test_one_lambda_per_layer_broadcasts_and_gets_its_gradient():
    q1, q2, k1, k2, v = tensors(1, 2, 1, 13, 8, 16, F64, seed=1)
    lam = torch.tensor(0.37, dtype=F64, requires_grad=True)
    out, _, _ = differential_attention(q1, q2, k1, k2, v, lam, block_m=16, block_n=16)
    eager = (causal_softmax(q1, k1) - lam * causal_softmax(q2, k2)) @ expand_kv(v, 2)
    grad = torch.randn_like(out)
    check_grads([out], [eager], (q1, q2, k1, k2, v, lam), [grad], TOLERANCE[F64])


@pytest.mark.parametrize(SIZES, CASES)
def test_dint_integral_matches_eager(b, h, hk, t, d, dv, block_m, block_n, dtype, out1_grad):
    q, _, k, _, v = tensors(b, h, hk, t, d, dv, dtype, seed=2)
    lse = causal_logits(q, k).logsumexp(-1)
    out = dint_integral(q, k, v, lse, block_m=block_m, block_n=block_n)
    eager = integral_map(causal_softmax(q, k), "softmax").to(dtype) @ expand_kv(v, h)
    torch.testing.assert_close(out, eager, **TOLERANCE[dtype])
    check_grads([out], [eager], (q, k, v), [torch.randn_like(out)], TOLERANCE[dtype])


def test_dint_head_from_both_kernels_matches_eager():
    """DINT's head before its norm, (A1 - lambda A2 + lambda A3) V, with the integral reading A1's
    log-sum-exp from the differential kernel: gradients reach q1 and k1 through both terms."""
    h = 2
    q1, q2, k1, k2, v = tensors(1, h, 1, 21, 8, 16, F64, seed=3)
    lam = torch.tensor(0.3, dtype=F64, requires_grad=True)
    out, _, lse1 = differential_attention(q1, q2, k1, k2, v, lam, block_m=16, block_n=16)
    out = out + lam * dint_integral(q1, k1, v, lse1, block_m=16, block_n=16)
    a1 = causal_softmax(q1, k1)
    eager = (a1 - lam * causal_softmax(q2, k2) + lam * integral_map(a1, "softmax")) @ expand_kv(v, h)
    torch.testing.assert_close(out, eager, **TOLERANCE[F64])
    check_grads([out], [eager], (q1, q2, k1, k2, v, lam), [torch.randn_like(out)], TOLERANCE[F64])


def test_kernels_are_causal():
    """Changing the keys and values from position 9 on leaves every earlier output row as it was."""
    q1, q2, k1, k2, v = (x.detach() for x in tensors(1, 2, 1, 19, 8, 16, F32, seed=4))
    later = torch.arange(19, device=DEVICE) >= 9

    def outputs(k1, k2, v):
        out, _, lse1 = differential_attention(q1, q2, k1, k2, v, 0.5, block_m=16, block_n=16)
        return out, dint_integral(q1, k1, v, lse1, block_m=16, block_n=16)

    changed = [x + 5.0 * later.view(-1, 1) * torch.randn_like(x) for x in (k1, k2, v)]
    for before, after in zip(outputs(k1, k2, v), outputs(*changed)):
        torch.testing.assert_close(after[..., :9, :], before[..., :9, :], rtol=1e-6, atol=1e-6)
        assert not torch.allclose(after[..., 9:, :], before[..., 9:, :])


def test_without_cuda_or_interpreter_the_kernels_say_why(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "TRITON_INTERPRET=1" in unavailable_reason("cpu")
    assert unavailable_reason("cuda") is None


@pytest.mark.parametrize("arch", [
    pytest.param(dict(attention="diff_v1"), id="diff_v1"),
    pytest.param(dict(attention="shared_diff", rank=4), id="shared_diff"),
    pytest.param(dict(attention="dint"), id="dint"),
    pytest.param(dict(attention="dint", integral="mean", gamma="learned", gamma_init=0.9), id="dint-mean-learned"),
])
def test_decoder_on_the_triton_backend_matches_sdpa(arch):
    """A whole decoder (GQA, T=13): the same logits and parameter gradients with backend triton as with sdpa."""
    from diffexp import ModelConfig
    from diffexp.model.decoder import Decoder

    sizes = dict(vocab_size=31, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, max_seq_len=16, **arch)
    torch.manual_seed(0)
    sdpa = Decoder(ModelConfig(**sizes, backend="sdpa")).double().to(DEVICE)
    kernels = Decoder(ModelConfig(**sizes, backend="triton")).double().to(DEVICE)
    kernels.load_state_dict(sdpa.state_dict())
    idx = torch.randint(0, 31, (2, 13), device=DEVICE)
    logits = [model(idx) for model in (sdpa, kernels)]
    torch.testing.assert_close(logits[1], logits[0], **TOLERANCE[F64])
    grad = torch.randn_like(logits[0])
    for out in logits:
        out.backward(grad)
    for (name, want), got in zip(sdpa.named_parameters(), kernels.parameters()):
        torch.testing.assert_close(got.grad, want.grad, **TOLERANCE[F64], msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA runs the kernels without the interpreter")
def test_triton_backend_without_cuda_or_interpreter_is_refused(monkeypatch):
    from diffexp import ModelConfig
    from diffexp.errors import UserError
    from diffexp.model.decoder import Decoder

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(UserError, match=r"model.arch.backend='triton' is invalid: cannot run here.*CUDA"):
        Decoder(ModelConfig(attention="diff_v1", d_model=32, n_layers=1, n_heads=2, backend="triton"))


def test_fp64_results_do_not_rest_on_float_arguments_which_a_gpu_passes_as_fp32(monkeypatch):
    """Compiled Triton passes a Python float argument as an fp32 scalar, the interpreter as a Python float: with
    the interpreter made to round floats as a GPU does, fp64 stays exact (the softmax scale is read from a tensor).
    On a GPU the interpreter is not used and the same call checks the compiled kernels themselves."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    convert = interpreter._implicit_cvt

    def as_on_a_gpu(arg):
        if isinstance(arg, float):
            return tl.tensor(interpreter.TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
        return convert(arg)

    monkeypatch.setattr(interpreter, "_implicit_cvt", as_on_a_gpu)
    test_dint_head_from_both_kernels_matches_eager()

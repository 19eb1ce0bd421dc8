"""The compiled CPU attention kernel (diffexp/kernels/cpu_native.py) against naive float64 references built
from whole T x T maps: values and the gradient of every input (lambda per row or one lambda, DINT's gamma), GQA,
lengths that are not a multiple of the block, one token, causality, other dtypes, and its fallback."""

from __future__ import annotations

import pytest
import torch

from diffexp.kernels import cpu_native, resolve
from tests.helpers import require_cpu_kernel


@pytest.fixture(autouse=True)
def kernel():
    require_cpu_kernel()


def causal_maps(q, k):
    """softmax(q k^T / sqrt(d)) with the causal mask, GQA by repeating kv heads: (B, h, T, T)."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    logits = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    t = q.shape[-2]
    future = torch.ones(t, t, dtype=torch.bool).triu(1)
    return logits.masked_fill(future, float("-inf")).softmax(-1)


def naive_integral(a1):
    """A3: row n is the softmax over j <= n of the mean of A1's rows 0..n."""
    t = a1.shape[-1]
    g = a1.cumsum(-2) / torch.arange(1, t + 1, dtype=a1.dtype).unsqueeze(-1)
    return g.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)


def naive_head(q1, q2, k1, k2, v, lam, gamma=None):
    """(A1 - lambda A2 [+ gamma A3]) V; lam 0-d or (B, h, T)."""
    a1, a2 = causal_maps(q1, k1), causal_maps(q2, k2)
    lam = lam.unsqueeze(-1) if lam.dim() else lam
    final = a1 - lam * a2
    if gamma is not None:
        final = final + gamma * naive_integral(a1)
    return final @ v.repeat_interleave(q1.shape[1] // v.shape[1], dim=1)


def inputs_for(heads, kv_heads, t, d=8, dv=16, per_row=False, seed=0):
    torch.manual_seed(seed)
    lam = torch.rand(2, heads, t) if per_row else torch.tensor(0.37)
    return [torch.randn(2, heads, t, d), torch.randn(2, heads, t, d), torch.randn(2, kv_heads, t, d),
            torch.randn(2, kv_heads, t, d), torch.randn(2, kv_heads, t, dv), lam]


def compare(fn, reference, inputs, names, rtol=2e-5, atol=2e-5):
    """fn in fp32 against reference in fp64: the output and every input's gradient."""
    got_in = [t.clone().requires_grad_(True) for t in inputs]
    want_in = [t.double().requires_grad_(True) for t in inputs]
    got, want = fn(*got_in), reference(*want_in)
    grad = torch.randn_like(got)
    got.backward(grad)
    want.backward(grad.double())
    torch.testing.assert_close(got, want.float(), rtol=rtol, atol=atol)
    for name, g, w in zip(names, got_in, want_in, strict=True):
        scale = w.grad.abs().max().item()
        torch.testing.assert_close(g.grad, w.grad.float(), rtol=rtol, atol=atol * max(scale, 1.0),
                                   msg=lambda m, name=name: f"d{name}: {m}")


@pytest.mark.parametrize("heads, kv_heads, t, block, per_row", [
    (4, 4, 37, 16, False), (4, 2, 130, 64, True), (2, 1, 64, 64, False), (2, 2, 1, 8, True), (6, 3, 70, 32, True)])
def test_two_map_equals_naive(heads, kv_heads, t, block, per_row):
    inputs = inputs_for(heads, kv_heads, t, per_row=per_row, seed=t + heads)
    compare(lambda *a: cpu_native.two_map(*a, block_rows=block), naive_head, inputs,
            ("q1", "q2", "k1", "k2", "v", "lambda"))


@pytest.mark.parametrize("heads, kv_heads, t, block", [(4, 4, 37, 16), (4, 2, 100, 32), (2, 2, 1, 8)])
def test_dint_equals_naive(heads, kv_heads, t, block):
    """DINT's head with a gamma of its own (learned) and with gamma = lambda (the paper)."""
    *inputs, lam = inputs_for(heads, kv_heads, t, seed=t)
    compare(lambda *a: cpu_native.dint_head(*a, block_rows=block), naive_head, [*inputs, lam, torch.tensor(0.6)],
            ("q1", "q2", "k1", "k2", "v", "lambda", "gamma"))
    compare(lambda *a: cpu_native.dint_head(*a, a[-1], block_rows=block), lambda *a: naive_head(*a, a[-1]),
            [*inputs, lam], ("q1", "q2", "k1", "k2", "v", "lambda"))


@pytest.mark.parametrize("head", ["two_map", "dint"])
def test_causal(head):
    """Changing the last token's keys and values changes no earlier output, across block boundaries."""
    q1, q2, k1, k2, v, lam = inputs_for(2, 2, 40)
    run = (lambda *a: cpu_native.two_map(*a, block_rows=16)) if head == "two_map" else (
        lambda *a: cpu_native.dint_head(*a, a[-1], block_rows=16))
    out = run(q1, q2, k1, k2, v, lam)
    k1b, k2b, vb = k1.clone(), k2.clone(), v.clone()
    for tensor in (k1b, k2b, vb):
        tensor[..., -1, :] += 3.0
    changed = run(q1, q2, k1b, k2b, vb, lam)
    torch.testing.assert_close(changed[..., :-1, :], out[..., :-1, :], rtol=0, atol=0)
    assert not torch.allclose(changed[..., -1, :], out[..., -1, :])


def test_other_dtypes_are_cast_in_and_out():
    inputs = [t.bfloat16() for t in inputs_for(2, 2, 20)]
    leaves = [t.requires_grad_(True) for t in inputs]
    out = cpu_native.two_map(*leaves)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and all(t.grad.dtype == torch.bfloat16 for t in leaves)
    want = naive_head(*(t.detach().double() for t in inputs))
    torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=2e-2)


def head_call(dtype=torch.float32):
    return torch.zeros(1, 2, 4, 8, dtype=dtype), torch.zeros(1, 2, 4, 8, dtype=dtype), torch.zeros(1, 2, 4, 16,
                                                                                                 dtype=dtype)


def test_cpu_fp32_takes_the_kernel_and_fp64_the_plain_path():
    assert resolve(*head_call()).name == "cpu_native"
    assert resolve(*head_call(torch.float64)) is None


def test_unavailable_kernel_leaves_the_plain_path_with_one_warning(monkeypatch):
    monkeypatch.setattr(cpu_native, "unavailable_reason", lambda: "no compiler (test)")
    monkeypatch.setattr(cpu_native, "_warned", [])
    with pytest.warns(UserWarning, match="no compiler \\(test\\).*plain path"):
        assert resolve(*head_call()) is None
    assert resolve(*head_call()) is None  # warned once


def test_switch_and_broken_build_give_reasons_not_errors(monkeypatch, tmp_path):
    monkeypatch.setenv(cpu_native.SWITCH, "0")
    assert cpu_native.unavailable_reason.__wrapped__() == f"{cpu_native.SWITCH}=0"
    monkeypatch.delenv(cpu_native.SWITCH)
    broken = tmp_path / "broken.cpp"
    broken.write_text("#error this kernel does not compile\n")
    monkeypatch.setattr(cpu_native, "SOURCE", broken)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "build"))  # never the real kernel's build directory
    reason = cpu_native.unavailable_reason.__wrapped__()
    assert reason is not None and reason.startswith("building broken.cpp failed")


def test_the_build_is_keyed_by_its_source_and_its_path(monkeypatch, tmp_path):
    """Two checkouts on one machine build under different names, never each other's: with different kernel sources,
    and with the same source at another path (ninja rebuilds when the path in its build file changes, so two
    checkouts of one commit took turns rebuilding one library)."""
    capability = torch.backends.cpu.get_cpu_capability()
    name, flags, directory = cpu_native._build_settings(capability)
    assert cpu_native._build_settings(capability)[0] == name  # the same source and path: the same build
    copy = tmp_path / "two_map_attention.cpp"
    copy.write_bytes(cpu_native.SOURCE.read_bytes())
    monkeypatch.setattr(cpu_native, "SOURCE", copy)
    moved, _, moved_directory = cpu_native._build_settings(capability)
    assert moved != name and moved_directory != directory
    copy.write_bytes(copy.read_bytes() + b"\n// changed\n")
    other, _, other_directory = cpu_native._build_settings(capability)
    assert other not in (name, moved) and other_directory not in (directory, moved_directory)


def test_the_build_says_compiled_only_when_it_compiled_and_only_on_stderr(monkeypatch, tmp_path, capfd):
    source = tmp_path / "tiny.cpp"
    source.write_text("int diffexp_tiny() { return 1; }\n")
    monkeypatch.setattr(cpu_native, "SOURCE", source)
    monkeypatch.setattr(cpu_native, "_register_fakes", lambda: None)  # the tiny library defines no ops
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "build"))
    assert cpu_native.unavailable_reason.__wrapped__() is None
    out, err = capfd.readouterr()
    assert "compiled the CPU attention kernel" in err and "compiled" not in out
    assert cpu_native.unavailable_reason.__wrapped__() is None  # built before: loaded, not compiled
    out, err = capfd.readouterr()
    assert "compiled" not in err and "compiled" not in out

"""The one resolver that picks the kernel of a two-map head: every backend and mode, and what each variant runs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from diffexp import Decoder, ModelConfig
from diffexp.model import kernels
from diffexp.model.kernels import KERNELS, forced_kernel, resolve_kernel

CPU32, CPU64 = torch.zeros(1), torch.zeros(1, dtype=torch.float64)
GPU = torch.zeros(1, device="meta")  # any tensor off the CPU


@pytest.fixture
def kernel_builds(monkeypatch):
    monkeypatch.setattr(kernels.cpu_native, "available", lambda: True)
    monkeypatch.setattr(kernels.cpu_native, "unavailable_reason", lambda: None)


@pytest.mark.parametrize("backend, q, call, want", [
    # maps requested, or the eager backend: the maps themselves
    ("sdpa", CPU32, dict(need_weights=True), "eager"),
    ("triton", GPU, dict(need_weights=True), "eager"),
    ("eager", CPU32, {}, "eager"),
    ("eager", GPU, dict(decoding="chunk"), "eager"),
    # a chunk after a cache: new queries over the cached keys, one call per map
    ("sdpa", CPU32, dict(decoding="chunk"), "per_map"),
    ("triton", GPU, dict(decoding="chunk"), "per_map"),
    ("flash_attn", GPU, dict(decoding="chunk", integral="softmax"), "per_map"),
    # a decoding step, one token per row: both maps against the cache, V read once, on every backend
    ("sdpa", CPU32, dict(decoding="step"), "cached_step"),
    ("eager", CPU32, dict(decoding="step"), "cached_step"),
    ("triton", GPU, dict(decoding="step", integral="mean"), "cached_step"),
    ("sdpa", CPU64, dict(decoding="step", layer_lambda=False), "cached_step"),
    # whole sequences
    ("sdpa", CPU32, {}, "cpu_native"),
    ("sdpa", CPU64, {}, "blocked"),  # the compiled kernel computes in fp32
    ("flash_attn", CPU32, {}, "cpu_native"),
    ("sdpa", GPU, {}, "per_map"),
    ("flash_attn", GPU, {}, "per_map"),
    ("triton", GPU, {}, "triton"),
    ("triton", GPU, dict(integral="mean"), "triton"),
    # heads a kernel cannot compute go to per_map: a lambda per token (or a number), DINT's mean integral
    ("sdpa", CPU32, dict(layer_lambda=False), "cpu_native"),
    ("sdpa", CPU64, dict(layer_lambda=False), "per_map"),
    ("triton", GPU, dict(layer_lambda=False), "per_map"),
    ("sdpa", CPU32, dict(integral="mean"), "per_map"),
    ("sdpa", CPU64, dict(integral="mean"), "per_map"),
    ("sdpa", CPU32, dict(integral="softmax"), "cpu_native"),
    ("sdpa", CPU64, dict(integral="softmax"), "blocked"),
])
def test_every_backend_and_mode(kernel_builds, backend, q, call, want):
    assert resolve_kernel(backend, q, **call) == want


@pytest.mark.parametrize("backend", ["sdpa", "flash_attn"])
def test_on_a_gpu_dints_softmax_integral_runs_the_triton_kernels_where_triton_runs(monkeypatch, backend):
    """SDPA and flash-attn have no integral; without Triton it streams through PyTorch ops (per_map)."""
    cuda = SimpleNamespace(device=torch.device("cuda"), dtype=torch.float32)  # what the resolver reads of q
    monkeypatch.setattr(kernels, "unavailable_reason", lambda device: None)
    assert resolve_kernel(backend, cuda, integral="softmax") == "triton"
    assert resolve_kernel(backend, cuda, integral="mean") == "per_map"  # cumsum(A1 V) / n after the map's own call
    assert resolve_kernel(backend, cuda) == "per_map"
    assert resolve_kernel(backend, GPU, integral="softmax") == "per_map"  # meta (the memory estimate): no kernel runs
    monkeypatch.setattr(kernels, "unavailable_reason", lambda device: "no triton")
    assert resolve_kernel(backend, cuda, integral="softmax") == "per_map"


@pytest.mark.parametrize("forced", ["blocked", "per_map", "cpu_native"])
def test_a_forced_kernel_applies_to_sdpa_where_it_computes_the_head(kernel_builds, forced):
    with forced_kernel(forced):
        assert resolve_kernel("sdpa", CPU32) == forced
        assert resolve_kernel("sdpa", GPU) == forced
        assert resolve_kernel("sdpa", CPU32, need_weights=True) == "eager"
        assert resolve_kernel("sdpa", CPU32, decoding="chunk") == "per_map"
        assert resolve_kernel("sdpa", CPU32, decoding="step") == "cached_step"
        assert resolve_kernel("triton", GPU) == "triton"
        assert resolve_kernel("sdpa", CPU32, layer_lambda=False) == ("per_map" if forced == "blocked" else forced)
    assert resolve_kernel("sdpa", CPU32) == "cpu_native"
    with pytest.raises(ValueError, match="kernel 'native'"):
        with forced_kernel("native"):
            pass


@pytest.mark.parametrize("arch, dtype, want", [
    (dict(attention="diff_v1"), torch.float32, "cpu_native"),
    (dict(attention="diff_v1"), torch.float64, "blocked"),
    (dict(attention="shared_diff", rank=4), torch.float32, "cpu_native"),
    (dict(attention="dint"), torch.float32, "cpu_native"),
    (dict(attention="dint"), torch.float64, "blocked"),
    (dict(attention="dint", integral="mean"), torch.float32, "per_map"),
    (dict(attention="diff_v2", n_kv_heads=2), torch.float32, "cpu_native"),
    (dict(attention="diff_v2", n_kv_heads=2), torch.float64, "per_map"),
    (dict(attention="diff_v2", n_kv_heads=2, pairing="cross"), torch.float32, None),  # no two-map head
    (dict(attention="baseline"), torch.float32, None),
])
def test_each_variant_runs_the_resolved_kernel(monkeypatch, arch, dtype, want):
    """A full forward, then maps requested, then a prefill and a decoding step: the kernels the layers asked for."""
    if want == "cpu_native" and kernels.cpu_native.unavailable_reason() is not None:
        want = "blocked" if arch["attention"] != "diff_v2" else "per_map"  # the fallbacks, without a compiler
    seen = []
    resolve = kernels.resolve_kernel
    monkeypatch.setattr(kernels, "resolve_kernel", lambda *a, **k: seen.append(resolve(*a, **k)) or seen[-1])
    model = Decoder(ModelConfig(d_model=32, n_layers=2, n_heads=2, vocab_size=31, **arch)).to(dtype)
    idx = torch.randint(0, 31, (1, 9))
    with torch.no_grad():
        model(idx)
        full, seen[:] = list(seen), []
        model(idx, need_weights=True)
        maps, seen[:] = list(seen), []
        cache = model.new_cache()
        model(idx[:, :5], cache=cache)
        model(idx[:, 5:6], cache=cache)
    layers = [] if want is None else [want] * 2
    assert full == layers
    assert maps == ([] if want is None else ["eager"] * 2)
    assert seen == ([] if want is None else ["per_map"] * 2 + ["cached_step"] * 2)
    assert set(full + maps + seen) <= set(KERNELS)

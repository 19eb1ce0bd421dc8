"""The one door to fast attention (diffexp.kernels): which kernel each call gets, `use`, and which calls never reach
a kernel (maps requested, the eager backend, decoding)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from diffexp import Decoder, ModelConfig
from diffexp.kernels import PLAIN, Integral, kernels, registry, resolve, use

GAMMA = torch.tensor(0.5)


def call(device="cpu", dtype=torch.float32, kv_heads=2):
    """q1, k1, v of a two-map head (meta tensors stand for a device this machine lacks)."""
    device = "meta" if device == "cuda" and not torch.cuda.is_available() else device
    return (torch.zeros(1, 4, 8, 8, device=device, dtype=dtype), torch.zeros(1, kv_heads, 8, 8, device=device,
            dtype=dtype), torch.zeros(1, kv_heads, 8, 16, device=device, dtype=dtype))


@pytest.fixture
def cpu_kernel_builds(monkeypatch):
    from diffexp.kernels import cpu_native

    monkeypatch.setattr(cpu_native, "available", lambda: True)


def test_every_kernel_declares_its_devices_and_a_summary():
    names = [kernel.name for kernel in kernels()]
    assert len(set(names)) == len(names) and PLAIN not in names
    for kernel in kernels():
        assert kernel.devices and kernel.summary and callable(kernel.head) and callable(kernel.refuses)


@pytest.mark.parametrize("dtype, integral, want", [
    (torch.float32, None, "cpu_native"),
    (torch.bfloat16, None, "cpu_native"),
    (torch.float64, None, None),  # the kernel computes in fp32: fp64 runs the plain path, exactly
    (torch.float32, "softmax", "cpu_native"),
    (torch.float32, "mean", None),  # cumsum(A1 V) / n on the plain path
])
def test_cpu_calls(cpu_kernel_builds, dtype, integral, want):
    integral = None if integral is None else Integral(integral, GAMMA)
    got = resolve(*call("cpu", dtype), integral)
    assert (got and got.name) == want


def test_a_cpu_kernel_that_cannot_build_leaves_the_plain_path(monkeypatch):
    from diffexp.kernels import cpu_native

    monkeypatch.setattr(cpu_native, "available", lambda: False)
    assert resolve(*call("cpu")) is None


def test_kernels_are_picked_unasked_only_on_their_devices(cpu_kernel_builds):
    """A Triton kernel can compute under Triton's CPU interpreter (the tests), but is never picked there unasked."""
    integral = Integral("softmax", GAMMA)
    assert resolve(*call("cpu"), integral).name == "cpu_native"
    meta = call("meta")
    assert resolve(*meta) is None and resolve(*meta, integral) is None  # the memory estimate's meta tensors


def test_use_chooses_a_kernel_where_it_computes_and_the_plain_path_elsewhere(cpu_kernel_builds):
    with use("sdpa_joined"):
        assert resolve(*call("cpu")).name == "sdpa_joined"  # asked for: it computes on CPU too (its tests)
        assert resolve(*call("cpu"), Integral("softmax", GAMMA)) is None  # it has no integral: the plain path
    with use(PLAIN):
        assert resolve(*call("cpu")) is None
    with pytest.raises(ValueError, match="expected 'plain' or one of"):
        with use("no_such_kernel"):
            pass


def test_sdpa_joined_is_picked_on_cuda_in_half_precision_only(monkeypatch):
    from diffexp.kernels import sdpa_joined

    cuda = torch.zeros(1, 4, 8, 8, device="meta", dtype=torch.bfloat16)
    k, v = torch.zeros(1, 2, 8, 8, device="meta"), torch.zeros(1, 2, 8, 16, device="meta")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: t.device.type == "meta"))
    monkeypatch.setattr(sdpa_joined, "fused_backend_takes", lambda *a: True)
    assert sdpa_joined.refuses(cuda, k, v, None) is None
    assert "half precision" in sdpa_joined.refuses(cuda.float(), k, v, None)
    assert "two maps only" in sdpa_joined.refuses(cuda, k, v, "softmax")
    monkeypatch.setattr(sdpa_joined, "fused_backend_takes", lambda *a: False)
    assert "no fused SDPA backend" in sdpa_joined.refuses(cuda, k, v, None)


@pytest.mark.parametrize("arch, dtype, want", [
    (dict(attention="diff_v1"), torch.float32, "cpu_native"),
    (dict(attention="diff_v1"), torch.float64, PLAIN),
    (dict(attention="shared_diff", rank=4), torch.float32, "cpu_native"),
    (dict(attention="dint"), torch.float32, "cpu_native"),
    (dict(attention="dint", integral="mean"), torch.float32, PLAIN),
    (dict(attention="diff_v2", n_kv_heads=2), torch.float32, "cpu_native"),  # a pair shares K/V: a two-map head
    (dict(attention="diff_v2", n_kv_heads=2), torch.float64, PLAIN),
    (dict(attention="diff_v2", n_kv_heads=2, pairing="cross"), torch.float32, None),  # one call, no pair kernel
    (dict(attention="baseline"), torch.float32, None),
])
def test_each_variant_reaches_the_door_only_over_whole_sequences(cpu_kernel_builds, monkeypatch, arch, dtype, want):
    """A full forward asks the door once per layer; maps requested, a prefill and a decoding step never do."""
    from diffexp.kernels import cpu_native

    if want == "cpu_native" and cpu_native.unavailable_reason() is not None:
        pytest.skip(f"the CPU kernel cannot build here: {cpu_native.unavailable_reason()}")
    seen = []
    monkeypatch.setattr(registry, "_KERNELS", {name: dataclasses.replace(
        kernel, head=lambda *a, kernel=kernel: seen.append(kernel.name) or kernel.head(*a))
        for name, kernel in registry._KERNELS.items()})
    asked = []
    original = registry.resolve
    from diffexp.model import heads
    monkeypatch.setattr(heads, "resolve", lambda *a, **k: asked.append(1) or original(*a, **k))
    model = Decoder(ModelConfig(d_model=32, n_layers=2, n_heads=2, vocab_size=31, **arch)).to(dtype)
    idx = torch.randint(0, 31, (1, 9))
    with torch.no_grad():
        model(idx)
        full, seen[:] = list(seen), []
        assert len(asked) == (0 if want is None else 2)
        model(idx, need_weights=True)
        cache = model.new_cache()
        model(idx[:, :5], cache=cache)
        model(idx[:, 5:6], cache=cache)
    assert full == ([] if want in (None, PLAIN) else [want] * 2)
    assert seen == [] and len(asked) == (0 if want is None else 2)


def test_a_lambda_per_token_takes_the_plain_path(cpu_kernel_builds, monkeypatch):
    """The kernels take one lambda per layer (a 0-d tensor); a head with another lambda (a new variant's, one per
    token) never reaches them and is computed on the plain path."""
    from diffexp.model import heads
    from diffexp.model.heads import per_map, two_map_head

    monkeypatch.setattr(heads, "resolve", lambda *a, **k: pytest.fail("the door was asked"))
    torch.manual_seed(0)
    q1, q2, k1, k2 = (torch.randn(1, 4, 9, 8) for _ in range(4))
    v, lam = torch.randn(1, 4, 9, 16), torch.rand(1, 4, 9, 1)
    out, _ = two_map_head(q1, q2, k1, k2, v, lam)
    want, _ = per_map.per_map_head(q1, q2, k1, k2, v, lam, None, None, False)
    torch.testing.assert_close(out, want)


def test_gpu_dint_is_picked_on_cuda_in_half_precision_only(monkeypatch):
    """In fp32 on CUDA its tiles get no tensor cores and need large fp32 buffers: the plain path's streaming integral
    runs instead."""
    from diffexp.kernels import gpu_dint

    cuda = torch.zeros(1, 4, 8, 8, device="meta", dtype=torch.bfloat16)
    k, v = torch.zeros(1, 2, 8, 8, device="meta"), torch.zeros(1, 2, 8, 16, device="meta")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: t.device.type == "meta"))
    monkeypatch.setattr(gpu_dint, "unavailable_reason", lambda device: None)
    assert gpu_dint.refuses(cuda, k, v, "softmax") is None
    assert gpu_dint.refuses(cuda.half(), k, v, "softmax") is None
    assert "half precision" in gpu_dint.refuses(cuda.float(), k, v, "softmax")
    assert "softmax integral only" in gpu_dint.refuses(cuda, k, v, "mean")


def test_constant_result_marks_as_torch_does():
    """registry.constant_result sets what torch.compiler.assume_constant_result sets, without importing torch's
    compiler: if a torch release marks such functions another way, this fails and the decorator must follow."""
    def mine():
        return True

    def torchs():
        return True

    assert registry.constant_result(mine) is mine
    assert torch.compiler.assume_constant_result(torchs) is torchs, "assume_constant_result no longer returns fn"
    assert vars(torchs) == vars(mine) == {registry._CONSTANT_MARK: True}, (
        f"torch {torch.__version__}'s assume_constant_result sets {vars(torchs)}; diffexp.kernels.registry."
        "constant_result sets {_CONSTANT_MARK: True} and needs updating")
    from diffexp.kernels import cpu_native, sdpa_joined

    for fn in (registry._picked, cpu_native.available, sdpa_joined.fused_backend_takes):
        assert getattr(fn, registry._CONSTANT_MARK, False), fn.__qualname__


def test_importing_the_model_leaves_torch_compiler_stack_unloaded():
    import subprocess
    import sys

    code = "import sys, diffexp.model, diffexp.kernels; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr[-2000:]

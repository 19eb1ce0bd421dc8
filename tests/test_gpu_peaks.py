"""The peak rates behind MFU and the decode benchmark's memory bound, for GPUs named as torch names them."""

from __future__ import annotations

import pytest
import torch

from diffexp.gpu_peaks import peak_bandwidth, peak_flops

CUDA = torch.device("cuda")


@pytest.fixture
def gpu_named(monkeypatch):
    def name(device_name: str) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: device_name)
    return name


def test_a_plain_h200_gets_the_sxm_parts_peaks(gpu_named):
    """Lightning's table parses "H200" only with "SXM1" or "NVL1" in the name; torch says "NVIDIA H200"."""
    gpu_named("NVIDIA H200")
    assert peak_flops(CUDA, torch.bfloat16) == pytest.approx(989.4e12)
    assert peak_bandwidth(CUDA) == pytest.approx(4.8e12)


def test_fp32_counts_as_tf32_only_where_matmuls_may_use_it(gpu_named, monkeypatch):
    gpu_named("NVIDIA H200")
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "highest")
    assert peak_flops(CUDA, torch.float32) == pytest.approx(66.9e12)
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert peak_flops(CUDA, torch.float32) == pytest.approx(494.7e12)


def test_other_gpus_come_from_lightnings_table(gpu_named):
    gpu_named("NVIDIA H100 80GB HBM3")
    assert peak_flops(CUDA, torch.bfloat16) == pytest.approx(989.4e12)
    assert peak_bandwidth(CUDA) == pytest.approx(3.35e12)
    gpu_named("NVIDIA H100 PCIe")
    assert peak_bandwidth(CUDA) == pytest.approx(2.0e12)


def test_no_peak_on_the_cpu_or_for_an_unknown_gpu(gpu_named):
    assert peak_flops(torch.device("cpu"), torch.float32) is None and peak_bandwidth(torch.device("cpu")) is None
    gpu_named("Some Future GPU")
    with pytest.warns(UserWarning, match="FLOPs not found"):
        assert peak_flops(CUDA, torch.bfloat16) is None
    assert peak_bandwidth(CUDA) is None

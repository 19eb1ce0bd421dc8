"""Peak rates of the GPU in use: dense FLOP/s for MFU, memory bandwidth for the decode benchmark's bound.

FLOP/s come from Lightning's table, except for names it does not parse: a plain "NVIDIA H200" (the SXM part,
as torch names it) is the H100 SXM's compute with more memory.
"""

from __future__ import annotations

import torch

_H200_SXM = {torch.float64: 33.5e12, torch.float32: 66.9e12, "tfloat32": 494.7e12, torch.bfloat16: 989.4e12,
             torch.float16: 989.4e12}
#: dense FLOP/s by lower-case device name, for the names Lightning's get_available_flops misses
FLOPS = {"nvidia h200": _H200_SXM}
#: HBM bandwidth in bytes/s by a part of the device name (the first match wins: "H100 PCIe" before "H100")
BANDWIDTH = {"H200": 4.8e12, "H100 PCIe": 2.0e12, "H100": 3.35e12, "A100-SXM4-80GB": 2.039e12,
             "A100-SXM4-40GB": 1.555e12, "A100 80GB PCIe": 1.935e12, "L40S": 0.864e12, "L4": 0.3e12}


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """Dense FLOP/s of `device` at `dtype` (fp32 counts as TF32 where matmuls may use it); None off CUDA or for a
    GPU no table knows."""
    if device.type != "cuda":
        return None
    table = FLOPS.get(torch.cuda.get_device_name(device).lower())
    if table is None:
        from lightning.fabric.utilities.throughput import get_available_flops

        return get_available_flops(device, dtype)
    if dtype is torch.float32 and torch.get_float32_matmul_precision() != "highest":
        dtype = "tfloat32"
    return table.get(dtype)


def peak_bandwidth(device: torch.device) -> float | None:
    """Memory bandwidth of `device` in bytes/s; None off CUDA or for a GPU the table lacks."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((bw for key, bw in BANDWIDTH.items() if key in name), None)

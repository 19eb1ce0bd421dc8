"""Triton kernels of the GPU path (`model.arch.backend: triton`), exact under Triton's CPU interpreter.

triton_diff_attention: the two maps of a differential head, A1 V - lambda A2 V, in one pass.
triton_dint_integral: DINT's integral term A3 V with running column sums (O(T) memory).
Importing either needs the `triton` package; `unavailable_reason` says why they cannot run, before import.
"""

from __future__ import annotations

import importlib.util
import os

import torch


def interpreter_on() -> bool:
    """TRITON_INTERPRET=1: kernels run on CPU tensors (set it before triton is first imported)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def unavailable_reason(device: torch.device | str) -> str | None:
    """None when the kernels can run on tensors of `device`, else why not."""
    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed (it comes with CUDA builds of torch; or pip install triton)"
    if interpreter_on() or torch.device(device).type == "cuda":
        return None
    return (f"Triton kernels need CUDA tensors, got {torch.device(device).type} ones; set TRITON_INTERPRET=1 "
            "(before triton is imported) to run them on the CPU through Triton's interpreter, for testing")

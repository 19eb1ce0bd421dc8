"""Whether the Triton kernels can run here, asked without importing triton."""

from __future__ import annotations

import importlib.util
import os
import sys

import torch


def interpreter_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _imported_compiled() -> bool:
    """triton decides at import whether its own helpers (tl.cumsum, ...) are interpreted: too late to ask then."""
    standard = sys.modules.get("triton.language.standard")
    return standard is not None and type(standard.cumsum).__name__ != "InterpretedFunction"


def unavailable_reason(device: torch.device | str) -> str | None:
    """None when the kernels can run on tensors of `device`, else why not."""
    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed (CUDA builds of torch bring it; or pip install triton)"
    if interpreter_requested():
        if _imported_compiled():
            return "TRITON_INTERPRET=1 was set after triton was imported; set it before (in the environment)"
        return None
    if torch.device(device).type == "cuda":
        return None
    return (f"the Triton kernels need CUDA tensors, got {torch.device(device).type} ones; TRITON_INTERPRET=1 (set "
            "before triton is imported) runs them on the CPU through Triton's interpreter, for testing")

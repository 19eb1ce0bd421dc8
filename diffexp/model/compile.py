"""`model.compile`: torch.compile each decoder block (as torchtitan does), or train without it where it cannot run.

Compiling per block keeps the graphs small (one per distinct block, reused by every layer) and composes with
FSDP2, which wraps the compiled blocks. Inductor needs a C++ compiler on CPU and Triton on CUDA; where a tiny
probe does not compile, the model runs eagerly and the reason is returned for the log. `eagerly()` runs the compiled
blocks as plain Python for a while: the training diagnostics observe their steps so (diffexp.training.diagnostics).
"""

from __future__ import annotations

import torch
from torch import nn


def compile_unavailable(device: torch.device, backend: str = "inductor", options: dict | None = None) -> str | None:
    """Why torch.compile cannot run here (None: it can), from compiling and running a one-line probe with the
    inductor `options` the real graph will use."""
    try:
        probe = torch.compile(lambda x: torch.nn.functional.silu(x) * 2, backend=backend, dynamic=False,
                              options=options)
        probe(torch.ones(4, device=device))
    except Exception as err:  # noqa: BLE001 - any failure means: train without it
        return (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
    return None


def compile_blocks(blocks: nn.ModuleList, device: torch.device, backend: str = "inductor") -> str | None:
    """Compile every block in place (its parameter names unchanged); the reason when it cannot, else None."""
    reason = compile_unavailable(device, backend)
    if reason is not None:
        return reason
    for block in blocks:
        block.compile(backend=backend)
    return None


def eagerly():
    """A context (enter and leave it, or close an ExitStack holding it) in which every compiled block runs eagerly:
    its hooks, flags and host reads never reach dynamo, so they neither break the compiled graphs nor add a guard
    that would recompile them, and the graphs keep no trace of them. Process-wide, as torch.compile's stance is."""
    return torch.compiler.set_stance("force_eager")

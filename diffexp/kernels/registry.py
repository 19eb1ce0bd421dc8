"""The one door to fast attention: implementations of the two-map head register here; one resolver picks.

A registered kernel computes, over whole causal sequences, exactly what the model's plain path computes
(diffexp.model.heads.per_map_head):

    head(q1, q2, k1, k2, v, lam, integral) = (A1 - lambda A2 [+ gamma A3]) V,   A_m = softmax(Q_m K_m^T / sqrt(d))

q1, q2: (B, h, T, d); k1, k2: (B, h_kv, T, d); v: (B, h_kv, T, dv), query head p reading kv head p // (h / h_kv);
lam: a 0-d tensor, or (B, h, T, 1), one per token and head, for a kernel with `token_lambda`; integral: None or an
`Integral`. It returns (B, h, T, dv) in v's dtype, with gradients for
every tensor input. Kernels see plain tensors only: no cache, no module, no config. Every registered kernel passes
the reference tests (tests/test_kernels.py); where none applies, the plain path runs.

The decoding step has a door of its own: a device type's step replay (a CUDA graph on "cuda") replays the compiled
step, given its inputs and the tensors it reads in place (`register_step_replay`, `step_replay`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Integral:
    """DINT's third map, + gamma A3: kind "softmax" (the paper) or "mean"; gamma a 0-d tensor."""

    kind: str
    gamma: torch.Tensor
    block_size: int = 32  # query rows per step of the streaming passes


@dataclass(frozen=True)
class Kernel:
    """name: how benchmarks and tests choose it; head: the two-map head; devices: the device types it is picked for
    unasked (`use` runs it on any device it can compute on, e.g. a Triton kernel under Triton's CPU interpreter in
    tests); refuses(q1, k1, v, integral kind or None): why it cannot compute such a call, or None when it can;
    summary: one line for docs and benchmark tables; token_lambda: it takes a lambda per token and head (DIFF V2's
    pairs)."""

    name: str
    head: Callable[..., torch.Tensor]
    devices: tuple[str, ...]
    refuses: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, str | None], str | None]
    summary: str
    token_lambda: bool = False


#: the plain path's name, where a benchmark or test asks for no kernel
PLAIN = "plain"
PROFILER_PREFIX = "diffexp.kernels."
_KERNELS: dict[str, Kernel] = {}
_CHOSEN: list[str] = []


def register(kernel: Kernel) -> Kernel:
    """Add a kernel; earlier registrations are preferred where several can compute a call. Its eager calls show in
    torch.profiler as `diffexp.kernels.NAME` (torch.compile traces through the label, so compiled code records
    which kernel it runs through `recording`)."""
    head = kernel.head

    def labelled(*args, **kwargs):
        if torch.compiler.is_compiling():
            return head(*args, **kwargs)
        with torch.profiler.record_function(PROFILER_PREFIX + kernel.name):
            return head(*args, **kwargs)

    kernel = dataclasses.replace(kernel, head=labelled)
    _KERNELS[kernel.name] = kernel
    return kernel


def kernels() -> tuple[Kernel, ...]:
    return tuple(_KERNELS.values())


def resolve(q1: torch.Tensor, k1: torch.Tensor, v: torch.Tensor, integral: Integral | None = None,
            token_lambda: bool = False) -> Kernel | None:
    """The kernel for this call (the one `use` chose, else the first registered that can compute it), or None for
    the plain path. token_lambda: lambda is one per token and head."""
    kind = None if integral is None else integral.kind

    def computes(kernel: Kernel | None) -> bool:
        return (kernel is not None and (kernel.token_lambda or not token_lambda)
                and kernel.refuses(q1, k1, v, kind) is None)

    if _CHOSEN:
        kernel = _KERNELS.get(_CHOSEN[-1])
        kernel = kernel if computes(kernel) else None
    else:
        kernel = next((kernel for kernel in _KERNELS.values()
                       if q1.device.type in kernel.devices and computes(kernel)), None)
    _picked(PLAIN if kernel is None else kernel.name)
    return kernel


_RECORDS: list[collections.Counter] = []


@contextlib.contextmanager
def recording():
    """Within the block, what the door picks, by name (PLAIN for the plain path): a Counter of one per call in eager
    code, and one per trace in code torch.compile traces (its graph calls the kernel without asking the door
    again). Benchmarks record a model's first step, where a compiled model is traced."""
    picks: collections.Counter = collections.Counter()
    _RECORDS.append(picks)
    try:
        yield picks
    finally:
        _RECORDS.remove(picks)


#: what torch.compiler.assume_constant_result sets on a function (checked against the installed torch by
#: tests/test_kernel_registry.py::test_constant_result_marks_as_torch_does)
_CONSTANT_MARK = "_dynamo_marked_constant"


def constant_result(fn: Callable) -> Callable:
    """torch.compiler.assume_constant_result without importing torch's compiler stack: a compiled region calls `fn`
    once while tracing and keeps its result as a constant (no guard, no graph break). The public decorator imports
    torch._dynamo (and sympy, Triton) only to set one attribute, which costs every light subcommand its start-up."""
    setattr(fn, _CONSTANT_MARK, True)
    return fn


@constant_result  # run while tracing, outside the graph: no guard, no graph break
def _picked(name: str) -> bool:
    for picks in _RECORDS:
        picks[name] += 1
    return True


@contextlib.contextmanager
def use(name: str):
    """Within the block, two-map heads run on kernel `name` where it computes them, else on the plain path
    (name PLAIN: always the plain path). For benchmarks and tests."""
    if name != PLAIN and name not in _KERNELS:
        raise ValueError(f"kernel {name!r}: expected {PLAIN!r} or one of {', '.join(_KERNELS)}")
    _CHOSEN.append(name)
    try:
        yield
    finally:
        _CHOSEN.pop()


_STEP_REPLAYS: dict[str, Callable[[], Callable[..., torch.Tensor]]] = {}


def register_step_replay(device_type: str, factory: Callable[[], Callable[..., torch.Tensor]]) -> None:
    """factory() gives a replay(step, inputs, fixed, restored) -> step(*inputs) for decoding on `device_type`
    (the contract: diffexp.kernels.cuda_graph.GraphReplay)."""
    _STEP_REPLAYS[device_type] = factory


def step_replay(device_type: str) -> Callable[[], Callable[..., torch.Tensor]] | None:
    """The step replay registered for a device type, or None."""
    return _STEP_REPLAYS.get(device_type)

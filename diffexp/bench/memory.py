"""Peak memory of one run of a measured function: live tensor bytes, persistent state included.

CUDA: the allocator's max_memory_allocated; CPU: the running sum of torch.profiler's allocator events, the same
quantity and exact (why not a process's RSS: bench/README.md).
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from collections.abc import Callable, Iterable

MIB = 2**20


def memory_method(device: str, enabled: bool = True) -> str | None:
    """How `peak_bytes` measures on this device (recorded in the results JSON)."""
    if not enabled:
        return None
    return "cuda max_memory_allocated" if device == "cuda" else "torch.profiler CPU allocator events"


def tensor_bytes(tensors: Iterable) -> int:
    """Bytes of the distinct tensors given (a tied weight counts once)."""
    distinct = {id(t): t for t in tensors}
    return sum(t.numel() * t.element_size() for t in distinct.values())


def peak_bytes(fn: Callable[[], object], device, state_bytes: int) -> int | None:
    """Peak live tensor bytes while fn runs once (untimed), plus state_bytes; None if it cannot be measured."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        gc.collect()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        extra = torch.cuda.max_memory_allocated(device) - before
        return state_bytes + max(0, extra)
    extra = cpu_peak_extra(fn)
    return None if extra is None else state_bytes + extra


def cpu_peak_extra(fn: Callable[[], object]) -> int | None:
    """Max of the running sum of CPU allocator events (+alloc / -free) while fn runs."""
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    with _drop_kineto_log_lines(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    try:
        events = prof.profiler.kineto_results.events()
    except AttributeError:  # internal API moved: report n/a rather than a wrong number
        return None
    mem = sorted((e.start_ns(), e.nbytes()) for e in events
                 if e.name() == "[memory]" and str(e.device_type()).endswith("CPU"))
    live = peak = 0
    for _, nbytes in mem:
        live += nbytes
        peak = max(peak, live)
    return peak


@contextlib.contextmanager
def _drop_kineto_log_lines():
    """Kineto writes "USDT: ... profiler_start/stop" to fd 2 on every profile; pass the rest through."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    import tempfile

    with tempfile.TemporaryFile(mode="w+b") as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            for line in capture.read().decode(errors="replace").splitlines():
                if not line.startswith("USDT:"):
                    print(line, file=sys.stderr)


def measure_peaks(runners: dict, enabled: bool, progress, label: str) -> dict[str, int | None]:
    """Each runner's `peak_bytes()` (None for all when disabled), logged as it goes."""
    peaks: dict[str, int | None] = {}
    for name, runner in runners.items():
        if not enabled:
            peaks[name] = None
            continue
        peaks[name] = runner.peak_bytes()
        progress.advance(f"{label} memory {name}")
        shown = "n/a" if peaks[name] is None else f"{peaks[name] / MIB:.1f} MiB"
        progress.log(f"{label} peak memory {name}: {shown}")
    return peaks


def release(device) -> None:
    """Free what the previous measurement's models left behind before the next one."""
    gc.collect()
    if device.type == "cuda":
        import torch

        torch.cuda.empty_cache()

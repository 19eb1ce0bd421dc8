"""Peak memory of one run of a measured function: live tensor bytes, persistent state included.

The peak is what the run allocates at its highest point plus the state that lives across runs
(parameters, buffers, optimizer moments: the caller counts them with `tensor_bytes`):

* CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, minus what was
  allocated before the run (the other variants' models live on the device too).
* CPU: there is no allocator statistics API, so the run happens under ``torch.profiler`` with
  ``profile_memory=True``; every allocation and free of the CPU allocator is an event with a
  signed byte count, and the running sum's maximum is the run's peak. This is chosen over the
  peak RSS of a fresh subprocess because (1) it measures the same quantity as the CUDA number
  (live tensor bytes), so CPU and GPU memory ratios mean the same thing; (2) it is exact and
  deterministic: it does not depend on glibc's arenas and trim thresholds, on the OpenMP/oneDNN
  thread pools or on the ~300 MiB that importing torch maps, which would swamp a tiny model's
  activations in RSS; (3) it needs no extra process per measurement (importing torch again costs
  seconds on a loaded 2-core machine). What it does not see: memory that libraries allocate
  outside PyTorch's allocator (e.g. oneDNN scratchpads), which is small and the same for all
  variants.
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

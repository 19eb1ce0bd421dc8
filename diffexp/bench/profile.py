"""`--profile N`: where each variant's time goes, after the timed rounds.

One more run of every runner under torch.profiler; its N most expensive operations and kernels by self time (the
GPU's kernel time on CUDA, the host's on CPU), per token for decoding and per run otherwise; `report.print_profiles`
prints them. The CPU kernels that inductor writes are named only when they were compiled to record themselves, so
`prepared` turns that on while the models are built and run (a check of one flag per kernel call while no
profiler runs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

from diffexp.bench.progress import ProgressReporter


def prepared(args) -> contextlib.AbstractContextManager:
    """Within it, with --profile, the CPU kernels inductor compiles record themselves (the setting is restored
    after)."""
    if not args.profile:
        return contextlib.nullcontext()
    import torch._inductor.config as inductor_config

    return inductor_config.patch({"cpp.enable_kernel_profile": True})


def profile_runs(runners: Mapping, top: int, device, progress: ProgressReporter, label: str) -> dict[str, dict]:
    """runner name -> {"unit", "clock", "total_us", "top": [{"name", "calls", "self_us"}]}, per unit of work."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    field = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    profiles = {}
    for name, runner in runners.items():
        with profile(activities=activities) as prof:
            runner.run()
        if on_gpu:
            torch.cuda.synchronize(device)
        unit, per_run = getattr(runner, "profile_unit", ("run", 1))
        events = [e for e in prof.key_averages() if getattr(e, field) > 0]
        events.sort(key=lambda e: getattr(e, field), reverse=True)
        profiles[name] = {
            "unit": unit, "clock": "gpu" if on_gpu else "cpu",
            "total_us": sum(getattr(e, field) for e in events) / per_run,
            "top": [{"name": e.key, "calls": e.count / per_run, "self_us": getattr(e, field) / per_run}
                    for e in events[:top]],
        }
        progress.advance(f"{label} profile {name}")
    return profiles

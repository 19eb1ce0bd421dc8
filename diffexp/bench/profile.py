"""`--profile N`: where each variant's time goes, after the timed rounds.

One more run of every runner under torch.profiler; its N most expensive operations and kernels by self time (the
GPU's kernel time on CUDA, the host's on CPU), per token for decoding and per run otherwise; `report.print_profiles`
prints them. On CPU a compiled graph shows as one compiled region (inductor's CPU kernels do not record themselves
unless built to).
"""

from __future__ import annotations

from collections.abc import Mapping

from diffexp.bench.progress import ProgressReporter


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


#: aten's fused attention operators -> the SDPA backend that ran them (forward and backward)
SDPA_BACKENDS = {
    "_scaled_dot_product_flash_attention_for_cpu": "cpu_flash",
    "_scaled_dot_product_flash_attention": "flash",
    "_flash_attention_forward": "flash",
    "_flash_attention_backward": "flash",
    "_scaled_dot_product_efficient_attention": "efficient",
    "_efficient_attention_forward": "efficient",
    "_efficient_attention_backward": "efficient",
    "_scaled_dot_product_cudnn_attention": "cudnn",
    "_scaled_dot_product_attention_math": "math",
    "_scaled_dot_product_fused_attention_overrideable": "overrideable",
}


def sdpa_backend(op: str) -> tuple[str, str] | None:
    """(backend, "fwd" or "bwd") of an aten operator's profiler name, or None for any other operator. The
    forward operators' names are prefixes of their backward's (`..._backward`); the longest match decides."""
    name = op.removeprefix("aten::")
    backward = name.endswith("_backward")
    base = name.removesuffix("_backward")
    if base not in SDPA_BACKENDS:
        return None
    return SDPA_BACKENDS[base], "bwd" if backward else "fwd"


def attention_ops(runner, device) -> dict[str, dict]:
    """Which SDPA backend the runner's attention calls took in one run, and which of diffexp's registered kernels
    (or the plain path, "plain") the kernel door picked for its two-map heads.

    SDPA backends: {name: {"fwd": calls, "bwd": calls}} per run, from the host-side events torch.profiler records
    (eager or compiled alike: inductor calls the same aten operators). The door's picks come from the runner's
    `kernel_picks`, recorded over its first run (diffexp.kernels.recording): {name: {"fwd": calls, "bwd": None}}
    per run for an eager model (a kernel's backward runs inside it), {name: {"fwd": None, "bwd": None, "traced":
    traces}} for a compiled one, whose graph calls the kernel without asking the door again. An empty dict: none
    of these (the attention ran in other operators)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        runner.run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    per_run = getattr(runner, "profile_unit", ("run", 1))[1]
    found: dict[str, dict] = {}
    for event in prof.key_averages():
        kind = sdpa_backend(event.key)
        if kind is not None:
            backend, direction = kind
            calls = found.setdefault(backend, {"fwd": 0.0, "bwd": 0.0})
            calls[direction] += event.count / per_run
    return {**found, **door_picks(runner)}


def door_picks(runner) -> dict[str, dict]:
    """What the kernel door picked in the runner's first run (its `kernel_picks`, from diffexp.kernels.recording),
    as attention_ops reports it."""
    compiled = getattr(runner, "compiled", False)
    per_run = getattr(runner, "profile_unit", ("run", 1))[1]
    return {name: {"fwd": None, "bwd": None, "traced": count} if compiled else {"fwd": count / per_run, "bwd": None}
            for name, count in (getattr(runner, "kernel_picks", None) or {}).items()}


def attention_text(ops: dict[str, dict] | None) -> str:
    """`flash 12/12` (an SDPA backend's forward/backward calls per run), `cpu_native 4` (the door's picks per run),
    `sdpa_joined (compiled in)` (a pick traced into a compiled graph), several joined by commas; `none` without
    any."""
    if ops is None:
        return "n/a"
    if not ops:
        return "none"

    def cell(name: str, calls: dict) -> str:
        if calls.get("traced"):
            return f"{name} (compiled in)"
        return f"{name} {calls['fwd']:g}" + ("" if calls["bwd"] is None else f"/{calls['bwd']:g}")

    return ", ".join(cell(name, calls) for name, calls in sorted(ops.items()))

"""`diffexp sweep --gpus auto|N|LIST`: fill a node with one sweep worker per GPU, each pinned to its own device.

Each worker is an ordinary `diffexp sweep` process on the study's storage with CUDA_VISIBLE_DEVICES set to its
one device, so its trials (`diffexp fit` with trainer.devices -1) see that GPU alone; the workers split the
trials as workers on several machines do.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from diffexp.errors import UserError

DEVICES_ENV = "CUDA_VISIBLE_DEVICES"
FLAG = "--gpus"


def visible_devices(environ: dict[str, str] | None = None, count: Callable[[], int] | None = None) -> list[str]:
    """The GPUs this process may use: CUDA_VISIBLE_DEVICES's entries when it is set (ids or UUIDs), else
    0 .. torch.cuda.device_count() - 1."""
    environ = os.environ if environ is None else environ
    if DEVICES_ENV in environ:
        entries = [d.strip() for d in environ[DEVICES_ENV].split(",") if d.strip()]
        return [] if entries[:1] == ["-1"] else entries  # -1 hides every device
    if count is None:
        import torch

        count = torch.cuda.device_count
    return [str(i) for i in range(count())]


def chosen_devices(value: str, visible: Sequence[str]) -> list[str]:
    """The devices --gpus names: `auto` every visible one, `N` the first N, `LIST` (0,2,3: two or more) those."""
    shown = ", ".join(visible) if visible else f"none ({DEVICES_ENV} and torch see no GPU)"
    allowed = f"auto (every visible GPU), a count up to {len(visible)}, or a comma-separated list of device ids"
    if value == "auto":
        if not visible:
            raise UserError(f"{FLAG} auto: no GPU is visible here ({DEVICES_ENV}="
                            f"{os.environ.get(DEVICES_ENV, 'unset')!r}, torch sees none); run without {FLAG} "
                            "for one worker on this machine's devices")
        return list(visible)
    if value.isdigit():
        count = int(value)
        if not 1 <= count <= len(visible):
            raise UserError(f"{FLAG} {value}: {count} worker(s) asked for, {len(visible)} GPU(s) visible "
                            f"({shown}); expected {allowed}")
        return list(visible[:count])
    ids = [part.strip() for part in value.split(",")]
    if len(ids) < 2:
        raise UserError(f"{FLAG} {value!r}: not a GPU count or list; expected {allowed}")
    if not all(ids) or len(set(ids)) != len(ids):
        raise UserError(f"{FLAG} {value!r}: a device list names each device once, with no empty entry; "
                        f"expected {allowed}")
    missing = [d for d in ids if d not in visible]
    if missing:
        raise UserError(f"{FLAG} {value!r}: device(s) {', '.join(missing)} not visible ({shown}); expected {allowed}")
    return ids


def worker_env(device: str, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of the worker pinned to `device`."""
    return {**(os.environ if environ is None else environ), DEVICES_ENV: device}


def run_workers(sweep_args: Sequence[str], devices: Sequence[str], log_dir: Path,
                popen: Callable[..., subprocess.Popen] = subprocess.Popen) -> int:
    """One `diffexp sweep SWEEP_ARGS` per device, each pinned to it, its output in log_dir/gpu<device>-<time>.log;
    wait for all. 0 when every worker returned 0, else the largest exit code."""
    log_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    workers = []
    for device in devices:
        log_path = _new_log(log_dir, f"gpu{device}-{stamp}")
        with open(log_path, "w") as log:
            proc = popen([sys.executable, "-m", "diffexp", "sweep", *sweep_args], stdout=log,
                         stderr=subprocess.STDOUT, env=worker_env(device))
        workers.append((device, proc, log_path))
        print(f"worker on GPU {device} ({DEVICES_ENV}={device}): pid {proc.pid}, log {log_path}", file=sys.stderr)
    forward = lambda signum, _frame: [proc.send_signal(signum) for _, proc, _ in workers]  # noqa: E731
    # each worker passes the signal on to its trial, which saves its checkpoint (diffexp.sweep.interruptions)
    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    try:
        codes = [proc.wait() for _, proc, _ in workers]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    for (device, _, log_path), code in zip(workers, codes):
        print(f"worker on GPU {device}: exit {code}; {_last_line(log_path)}", file=sys.stderr)
    return max(codes, default=0)


def _new_log(log_dir: Path, stem: str) -> Path:
    """log_dir/<stem>.log, or <stem>-<k>.log when that exists: a later launch never overwrites a log."""
    path, k = log_dir / f"{stem}.log", 1
    while path.exists():
        path, k = log_dir / f"{stem}-{k}.log", k + 1
    return path


def _last_line(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(no output)"

"""Checks of a multi-process launch that need no process: the strategy, its precision, the world size."""

from __future__ import annotations

import os
from typing import Any

from diffexp.errors import UserError

FSDP2 = "diffexp.parallel.FSDP2Strategy"
FULL_PRECISION = (None, "32-true", "32", 32)


def requested_world_size(trainer: dict[str, Any]) -> int | None:
    """The processes a trainer config launches, where the config alone says (None: devices auto or -1 on an
    accelerator whose count only the machine knows)."""
    devices, nodes = trainer.get("devices", "auto"), int(trainer.get("num_nodes") or 1)
    if isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        devices = int(devices)
    if isinstance(devices, (list, tuple)):
        return len(devices) * nodes
    if isinstance(devices, int) and devices > 0:
        return devices * nodes
    if trainer.get("accelerator") == "cpu" and devices in ("auto", -1):  # Lightning: one CPU process
        return nodes
    return None


def strategy_class(trainer: dict[str, Any]) -> str | None:
    strategy = trainer.get("strategy")
    if isinstance(strategy, dict):
        return str(strategy.get("class_path", ""))
    return strategy if isinstance(strategy, str) else None


def check_launch(trainer: dict[str, Any]) -> None:
    """Refuse, before any process starts, a strategy diffexp cannot shard with, a precision that would fight
    FSDP2's own, and a torchrun / SLURM launch whose process count differs from the config's."""
    strategy = strategy_class(trainer) or ""
    if strategy.rsplit(".", 1)[-1] in ("ModelParallelStrategy", "model_parallel"):
        raise UserError(f"trainer.strategy={strategy!r}: diffexp shards with its subclass {FSDP2} (FSDP2 per "
                        "decoder block, mixed precision and activation checkpointing as its init_args); use that "
                        "class_path")
    if strategy == FSDP2 and trainer.get("precision") not in FULL_PRECISION:
        raise UserError(f"trainer.precision={trainer.get('precision')!r} with {FSDP2}: mixed precision is the "
                        "strategy's own (trainer.strategy.init_args.mixed_precision: bf16 parameters and compute, "
                        "fp32 gradient reduction and master weights; auto picks bf16 on GPUs); set "
                        "trainer.precision 32-true")
    launched = os.environ.get("WORLD_SIZE") if "LOCAL_RANK" in os.environ else None  # torchrun sets both
    requested = requested_world_size(trainer)
    if launched is not None and requested is not None and int(launched) != requested:
        raise UserError(f"trainer.num_nodes x trainer.devices = {requested}, but the launcher started "
                        f"{launched} processes (WORLD_SIZE={launched}): set them to match, e.g. torchrun --nnodes N "
                        "--nproc_per_node D with --trainer.num_nodes N --trainer.devices D")

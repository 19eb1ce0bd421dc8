"""What this machine cannot build from a config (the accelerator, the strategy, the precision, the attention
backend), refused as one `UserError` before any data, model or run directory exists.

LightningCLI makes the Trainer (where Lightning checks these) only after the data module and the model, which
can take minutes: `check_buildable` builds a throw-away Trainer from trainer.* alone first. `build_error` turns
what Lightning raises for a trainer.* value into a UserError naming the key; anything else keeps its traceback.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException

from diffexp.errors import UserError, invalid

#: the Trainer arguments Lightning checks while building, with their defaults (a key differing from its default
#: was set by the user)
BUILD_KEYS: dict[str, Any] = {"accelerator": "auto", "strategy": "auto", "devices": "auto", "num_nodes": 1,
                              "precision": None, "plugins": None, "profiler": None, "max_time": None,
                              "sync_batchnorm": False}
#: what Lightning raises for a value it cannot build (ImportError: a package the value needs is missing)
BUILD_FAULTS = (MisconfigurationException, ValueError, TypeError, RuntimeError, ImportError)
PACKAGE = Path(__file__).resolve().parents[1]  # diffexp/: an error raised in here is diffexp's own


def check_build_config(trainer: dict[str, Any], arch) -> None:
    """What the config alone says cannot be built, on any machine (preflight). arch: the ModelConfig."""
    strategy = trainer.get("strategy")
    if isinstance(strategy, str) and "." in strategy:  # jsonargparse keeps a class path given as a value a str
        raise invalid("trainer.strategy", strategy, "a class given as a plain value is read as the name of one of "
                      f"Lightning's strategies (ddp, fsdp, ...); give it as --trainer.strategy.class_path {strategy} "
                      f"(in YAML: strategy: {{class_path: {strategy}}})")
    every = trainer.get("check_val_every_n_epoch")
    if every is not None and every < 1:  # Lightning takes it, then divides by it at the first epoch's end
        raise invalid("trainer.check_val_every_n_epoch", every, "expected a positive number of epochs, or null "
                      "(validate by trainer.val_check_interval steps only)")


def check_buildable(trainer: dict[str, Any], model: dict[str, Any]) -> None:
    """Refuse a trainer.* config this machine cannot build, and a model.arch.backend it cannot run."""
    check_accelerator(trainer.get("accelerator"))
    check_process_group_backend(trainer.get("strategy"))
    try:
        build_trainer_alone(trainer)
    except UserError:
        raise
    except Exception as err:  # noqa: BLE001
        converted = build_error(err, trainer)
        if converted is not None:
            raise converted from err  # DIFFEXP_DEBUG=1 shows Lightning's traceback
        # anything else is left to the real build, which raises it again


def check_accelerator(name: Any) -> None:
    """trainer.accelerator names a device this machine has (Lightning's own message says less)."""
    from lightning.pytorch.accelerators import CUDAAccelerator, MPSAccelerator, XLAAccelerator

    if not isinstance(name, str):
        return
    why_not = {
        "cuda": None if CUDAAccelerator.is_available() else
        f"torch {torch.__version__} is built without CUDA" if torch.version.cuda is None else
        f"no CUDA device is visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})",
        "mps": None if MPSAccelerator.is_available() else "MPS needs an Apple silicon machine",
        "tpu": "torch_xla is not installed" if importlib.util.find_spec("torch_xla") is None else
        None if XLAAccelerator.is_available() else "no TPU device is visible",
    }
    wanted = ("cuda", "mps") if name.lower() == "gpu" else (name.lower(),)
    if any(kind not in why_not or why_not[kind] is None for kind in wanted):
        return
    here = ", ".join([kind for kind, reason in why_not.items() if reason is None] + ["cpu"])
    reasons = "; ".join(why_not[kind] for kind in wanted)
    raise invalid("trainer.accelerator", name, f"this machine has no such device ({reasons}); expected one it "
                  f"has: {here}, or auto (the best of them)")


def check_process_group_backend(strategy: Any) -> None:
    """A strategy's process_group_backend is one this torch has (else its first collective fails mid-fit)."""
    init_args = strategy.get("init_args") if isinstance(strategy, dict) else None
    backend = (init_args or {}).get("process_group_backend")
    if not backend:
        return
    import torch.distributed as dist

    # "nccl", or per device type: "cpu:gloo,cuda:nccl"
    names = [part.split(":")[-1].strip() for part in str(backend).split(",")]
    missing = [name for name in names if not (dist.is_available() and dist.is_backend_available(name))]
    if missing:
        have = [name for name in ("gloo", "nccl", "mpi", "ucc", "xccl")
                if dist.is_available() and dist.is_backend_available(name)]
        raise invalid("trainer.strategy.init_args.process_group_backend", backend,
                      f"this torch has no {', '.join(missing)} backend; it has: {', '.join(have) or 'none'} "
                      "(unset, the strategy picks nccl on GPUs and gloo on CPU)")


def build_trainer_alone(trainer: dict[str, Any]) -> None:
    """Build a Trainer from the trainer.* values alone (no logger, callbacks or model) and throw it away: Lightning
    checks the accelerator, devices, strategy, precision, profiler, max_time, ... there. Quietly: the real Trainer
    says it all again."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.cli import instantiate_class

    args = {key: value for key, value in trainer.items() if key not in ("logger", "callbacks", "enable_checkpointing")}
    for key in ("plugins", "profiler"):
        value = args.get(key)
        names = isinstance(value, str) or isinstance(value, list) and all(isinstance(item, str) for item in value)
        if value is not None and not names:  # classes (class_path) need jsonargparse: the real build checks them
            args.pop(key)
    previous = logging.root.manager.disable
    logging.disable(logging.INFO)  # "GPU available: ...", "Using bfloat16 Automatic Mixed Precision", ...
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if isinstance(args.get("strategy"), dict):  # a class_path: a fresh instance, the Trainer gets its own
                args["strategy"] = instantiate_class((), args["strategy"])
            Trainer(**args, logger=False, callbacks=[], enable_checkpointing=False)
    finally:
        logging.disable(previous)


def _raised_by_diffexp(err: BaseException) -> bool:
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and Path(tb.tb_frame.f_code.co_filename).resolve().is_relative_to(PACKAGE)


def _as_written(value: Any) -> Any:
    return value.get("class_path", value) if isinstance(value, dict) else value


def build_error(err: BaseException, trainer: dict[str, Any]) -> UserError | None:
    """What Lightning (or a package it needs) raised building the Trainer from these trainer.* values, as one
    paragraph naming the keys it is about (those its message mentions, else those the user set); None for an
    error of another kind or raised in diffexp's own code."""
    if not isinstance(err, BUILD_FAULTS) or isinstance(err, UserError) or _raised_by_diffexp(err):
        return None
    reason = " ".join(str(err).split()) or type(err).__name__
    text = reason.lower().replace("_", "")  # `num_nodes`, and NumNodes in a class name
    mentioned = [key for key in {**BUILD_KEYS, **trainer} if key.replace("_", "") in text]
    user_set = [key for key in BUILD_KEYS if trainer.get(key, BUILD_KEYS[key]) != BUILD_KEYS[key]]
    keys = [key for key in mentioned if key in user_set] or mentioned or user_set
    if not keys:
        return UserError(f"the trainer cannot be built from this config: {reason}")
    settings = " with ".join(f"trainer.{key}={_as_written(trainer.get(key, BUILD_KEYS.get(key)))!r}" for key in keys)
    return UserError(f"{settings} is invalid: {reason}")


@contextlib.contextmanager
def trainer_build_errors(trainer: dict[str, Any]):
    """Around the Trainer's construction: build_error's UserError instead of Lightning's traceback."""
    try:
        yield
    except BUILD_FAULTS as err:
        converted = build_error(err, trainer)
        if converted is None:
            raise
        raise converted from err  # DIFFEXP_DEBUG=1 shows Lightning's traceback

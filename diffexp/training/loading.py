"""A trained checkpoint back as a model: what `diffexp eval` and `diffexp generate` share.

A checkpoint is a .ckpt file, a sharded (FSDP) checkpoint directory (diffexp.checkpoint_io reads both), or a
directory `diffexp export --format hf` wrote (Llama, DiffLlama or remote code; its tokenizer.json comes along).
Every problem is a UserError naming CKPT, raised before any output exists.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

from diffexp.checkpoint_io import model_hparams, read_checkpoint
from diffexp.errors import UserError

CKPT_KEY = "CKPT"  # how the usage lines name the checkpoint argument
MODEL_PREFIX = "model."  # DiffexpLM's name of its Decoder, before each weight's name in a checkpoint


def load_checkpoint(path: str) -> tuple[dict, dict]:
    """(the checkpoint, its model_hparams); a UserError names CKPT and the problem. An HF export reads as the
    checkpoint it was exported from, with the tokenizer its tokenizer.json holds."""
    from diffexp.hf.reading import hf_model_type, read_hf_model
    from diffexp.hf.tokenizer import read_tokenizer

    directory = Path(path).expanduser()
    if hf_model_type(directory) is None:
        checkpoint = read_checkpoint(path, CKPT_KEY)
        return checkpoint, model_hparams(checkpoint)
    checkpoint = read_hf_model(directory, CKPT_KEY)
    tokenizer = read_tokenizer(directory, CKPT_KEY)
    if tokenizer is not None:
        checkpoint["diffexp_tokenizer"] = tokenizer
    return checkpoint, model_hparams(checkpoint)


def check_device(device: str) -> str:
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise UserError(f"--device={device!r} is invalid: expected cpu, cuda or cuda:<index>") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device={device!r} is invalid: no CUDA GPU is available here; use --device cpu")
    return device


def check_compile(device: str) -> None:
    """--compile: torch.compile must run on the device (a C++ compiler on CPU, Triton on CUDA)."""
    from diffexp.model.compile import compile_unavailable

    reason = compile_unavailable(torch.device(device))
    if reason is not None:
        raise UserError(f"--compile is invalid here: torch.compile cannot run on {device} ({reason}); "
                        "leave out --compile to decode eagerly")


def load_decoder(checkpoint: dict, path: str, device: str):
    """The checkpoint's Decoder alone, in eval mode on `device`: what `load_model(...).model` holds, built without
    the LightningModule around it, so that `diffexp generate` never imports Lightning. The same checks, the same
    UserErrors: its ModelConfig is DiffexpLM's (arch, with vocab_size over it), its weights DiffexpLM's `model.*`."""
    from diffexp.model import Decoder
    from diffexp.model.config import ModelConfig

    hparams = checkpoint["hyper_parameters"]
    arch = dict(hparams.get("arch") or {})
    if hparams.get("vocab_size") is not None:
        arch["vocab_size"] = hparams["vocab_size"]
    try:
        model = Decoder(ModelConfig(**arch))
    except (TypeError, ValueError) as err:
        raise UserError(f"{CKPT_KEY}={path!r}: its hyper_parameters do not describe a model this version of "
                        f"diffexp can build ({err})") from None
    # DiffexpLM holds the Decoder as `model`; a key outside it stays as it is, and is refused as unexpected
    weights = {name.removeprefix(MODEL_PREFIX): value for name, value in checkpoint["state_dict"].items()}
    try:
        model.load_state_dict(weights)
    except RuntimeError as err:
        reason = str(err).strip().splitlines()[0]
        raise UserError(f"{CKPT_KEY}={path!r}: its weights do not fit the model its hyper_parameters describe "
                        f"({reason})") from None
    return model.to(device).eval()


def load_model(checkpoint: dict, path: str, device: str):
    """The DiffexpLM of a checkpoint, in eval mode on `device` (what `load_from_checkpoint` does, from the
    dict read_checkpoint already holds: the file is read once)."""
    from diffexp.training.module import DiffexpLM

    accepted = inspect.signature(DiffexpLM.__init__).parameters
    hparams = {k: v for k, v in checkpoint["hyper_parameters"].items() if k in accepted}
    try:
        model = DiffexpLM(**hparams)
    except (TypeError, ValueError) as err:
        raise UserError(f"{CKPT_KEY}={path!r}: its hyper_parameters do not describe a model this version of "
                        f"diffexp can build ({err})") from None
    model.on_load_checkpoint(checkpoint)
    try:
        model.load_state_dict(checkpoint["state_dict"])
    except RuntimeError as err:
        reason = str(err).strip().splitlines()[0]
        raise UserError(f"{CKPT_KEY}={path!r}: its weights do not fit the model its hyper_parameters describe "
                        f"({reason})") from None
    return model.to(device).eval()

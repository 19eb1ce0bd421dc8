"""What every `diffexp eval TASK CKPT` does around its evaluation: read the checkpoint, check the flags,
rebuild the model, and open the outputs (files under <run>/eval/, scalars in the run's TensorBoard).

The order matters: the checkpoint and every flag are checked before the model is built and before any
output directory or TensorBoard writer exists, so a bad command changes no file of the run.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterable
from pathlib import Path

import torch

from diffexp.checkpoint_io import model_hparams, read_checkpoint
from diffexp.errors import UserError

CKPT_KEY = "CKPT"  # how the usage line names the checkpoint argument


def load_checkpoint(path: str) -> tuple[dict, dict]:
    """(the checkpoint, its model_hparams); a UserError names CKPT and the problem."""
    checkpoint = read_checkpoint(path, CKPT_KEY)
    return checkpoint, model_hparams(checkpoint)


def positive(flag: str, values: int | Iterable[int]) -> None:
    for value in [values] if isinstance(values, int) else values:
        if value < 1:
            raise UserError(f"{flag}={value} is invalid: expected a positive integer")


def at_most_max_seq_len(flag: str, values: int | Iterable[int], arch: dict) -> None:
    """Sequences longer than the model's RoPE table cannot be scored."""
    for value in [values] if isinstance(values, int) else values:
        if value > arch["max_seq_len"]:
            raise UserError(f"{flag}={value} is invalid: the checkpoint's model was built for sequences of at "
                            f"most model.arch.max_seq_len={arch['max_seq_len']} tokens; expected <= "
                            f"{arch['max_seq_len']}")


def byte_vocab(task: str, arch: dict, needed: int) -> None:
    if arch["vocab_size"] < needed:
        raise UserError(f"{CKPT_KEY}: diffexp eval {task} feeds byte tokens (ids below {needed}), but the "
                        f"checkpoint's model has vocab_size={arch['vocab_size']}; expected a model trained with "
                        f"data.tokenizer=byte (vocab_size >= {needed})")


def check_device(device: str) -> str:
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise UserError(f"--device={device!r} is invalid: expected cpu, cuda or cuda:<index>") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device={device!r} is invalid: no CUDA GPU is available here; use --device cpu")
    return device


def check_out(out: str | None) -> None:
    if out and Path(out).exists() and not Path(out).is_dir():
        raise UserError(f"--out={out!r} is invalid: it is a file; expected a directory (created if missing)")


def as_flags(message: str, names: dict[str, str]) -> str:
    """A library's ValueError message with its argument names (`k_classes`, `data.seq_len`) written as the
    command's flags (`--k-classes`, `--seq-len`)."""
    for name, flag in names.items():
        message = re.sub(rf"(?<![\w-])(?:data\.)?{re.escape(name)}\b", flag, message)
    return message


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


def eval_output(checkpoint: str, out: str | None, step: int):
    """(output dir, SummaryWriter on the run dir or None, step): call only once the evaluation has results.

    Default output: <run>/eval/ for <run>/checkpoints/<name>, else <name>-eval/ beside the checkpoint.
    """
    ckpt = Path(checkpoint)
    run_dir = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else None
    if out:
        directory = Path(out)
    else:
        directory = run_dir / "eval" if run_dir else ckpt.with_name(ckpt.stem + "-eval")
    directory.mkdir(parents=True, exist_ok=True)
    writer = None
    if run_dir is not None:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(log_dir=str(run_dir))
    return directory, writer, step

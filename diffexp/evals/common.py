"""What every `diffexp eval TASK CKPT` does around its evaluation: read the checkpoint, check the flags,
rebuild the model, and open the outputs (files under <run>/eval/, scalars in the run's TensorBoard).

The order matters: the checkpoint and every flag are checked before the model is built and before any
output directory or TensorBoard writer exists, so a bad command changes no file of the run.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from diffexp.errors import UserError
from diffexp.evals.layout import EVAL_DIR
from diffexp.training.loading import CKPT_KEY, check_compile, check_device, load_checkpoint, load_model

# loading lives in diffexp.training.loading (generate uses it too); the tasks import it from here
__all__ = [
    "CKPT_KEY",
    "check_compile",
    "check_device",
    "load_checkpoint",
    "load_model",
    "positive",
    "at_most_max_seq_len",
    "byte_vocab",
    "check_out",
    "as_flags",
    "eval_output",
    "checkpoint_tokenizer",
]


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


def check_out(out: str | None) -> None:
    if out and Path(out).exists() and not Path(out).is_dir():
        raise UserError(f"--out={out!r} is invalid: it is a file; expected a directory (created if missing)")


def as_flags(message: str, names: dict[str, str]) -> str:
    """A library's ValueError message with its argument names (`k_classes`, `data.seq_len`) written as the
    command's flags (`--k-classes`, `--seq-len`)."""
    for name, flag in names.items():
        message = re.sub(rf"(?<![\w-])(?:data\.)?{re.escape(name)}\b", flag, message)
    return message


def eval_output(checkpoint: str, out: str | None, step: int):
    """(output dir, SummaryWriter on the run dir or None, step): call only once the evaluation has results.

    Default output: <run>/eval/ for <run>/checkpoints/<name>, else <name>-eval/ beside the checkpoint.
    """
    ckpt = Path(checkpoint)
    run_dir = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else None
    if out:
        directory = Path(out)
    else:
        directory = run_dir / EVAL_DIR if run_dir else ckpt.with_name(ckpt.stem + "-eval")
    directory.mkdir(parents=True, exist_ok=True)
    writer = None
    if run_dir is not None:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(log_dir=str(run_dir))
    return directory, writer, step


def checkpoint_tokenizer(checkpoint: dict, hparams: dict, flag: str | None):
    """The tokenizer the checkpoint's model reads (--tokenizer, else the one saved with it, else what its data
    settings name), refused if its ids do not fit the model's vocabulary."""
    from diffexp.generate.cli import check_vocab, resolve_tokenizer

    tokenizer = resolve_tokenizer(checkpoint, hparams, flag)
    check_vocab(tokenizer, hparams["arch"])
    return tokenizer


def save_results(results, checkpoint: str, out: str | None, step: int) -> Path:
    """Write an evaluation's results (``results.save(dir)``) and log them into the run's TensorBoard
    (``results.log_to_tensorboard(writer, step)``); returns the output directory."""
    directory, writer, step = eval_output(checkpoint, out, step)
    results.save(directory)
    if writer is not None:
        results.log_to_tensorboard(writer, step)
        writer.close()
    return directory

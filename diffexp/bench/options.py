"""The flags every bench kind shares, and their checks: all run before any model is built.

A bad value is a `diffexp.errors.UserError` naming the flag as typed, the value and what is
allowed; `diffexp bench` prints it as one paragraph and exits 2 (no traceback, no usage page).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import sys
from pathlib import Path

from diffexp.errors import UserError
from diffexp.model.attention import variant_names
from diffexp.model.attention.registry import reference_variant
from diffexp.model.config import SHARED_FLAGS

DEFAULT_SHAPE = {"d_model": 128, "n_layers": 4, "n_heads": 4, "vocab_size": 256}
DEFAULT_CPU_TOKENS_PER_BATCH = 2048
#: the attention backends: the choices of model.arch.backend, as diffexp.model.config declares it
BACKENDS = next(flag for flag in SHARED_FLAGS if flag.name == "backend").choices
RESULTS_DIR = Path("bench") / "results"


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where there is none to show (None: the help says what happens)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None:
            return action.help or ""
        return super()._get_help_string(action)


class BenchArgumentParser(argparse.ArgumentParser):
    """argparse's errors (unknown flag, bad choice, not a number) as a UserError, without the usage page."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)  # a shortened flag is an unknown flag, never another one
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        raise UserError(f"{message.removeprefix('argument ')} (`{self.prog} --help` lists the options)")


def build_parser(kind: str, description: str, *, batch_size: int | list[int], seq_lens: list[int],
                 seq_lens_help: str | None = None, dtype_help: str | None = None) -> BenchArgumentParser:
    """The shared flags: variants, model shape, sizes, timing scheme, device, output and --compare."""
    p = BenchArgumentParser(prog=f"diffexp bench {kind}", description=description,
                            formatter_class=_DefaultsFormatter)
    p.add_argument("--variants", nargs="+", default=None, metavar="NAME",
                   help="variants to measure (default: every registered one; `diffexp variants` lists them); "
                        f"the reference variant ({reference_variant().name}) is always added")
    p.add_argument("--seq-lens", nargs="+", type=int, default=seq_lens, metavar="T",
                   help=seq_lens_help or "sequence lengths")
    if isinstance(batch_size, list):  # a kind measured at several batch sizes (decode)
        p.add_argument("--batch-size", nargs="+", type=int, default=batch_size, metavar="B",
                       help="sequences per batch; each size is measured")
    else:
        p.add_argument("--batch-size", type=int, default=batch_size, help="sequences per batch")
    p.add_argument("--d-model", type=int, default=DEFAULT_SHAPE["d_model"], help="residual width")
    p.add_argument("--n-layers", type=int, default=DEFAULT_SHAPE["n_layers"], help="decoder blocks")
    p.add_argument("--n-heads", type=int, default=DEFAULT_SHAPE["n_heads"], help="attention heads")
    p.add_argument("--vocab-size", type=int, default=DEFAULT_SHAPE["vocab_size"], help="token ids")
    p.add_argument("--steps", type=int, default=3, help="timed runs per variant per round")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per variant per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each in a rotated variant order")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to run")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help=dtype_help or "bf16 = autocast mixed precision (fp32 weights and optimizer state)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's default)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory run")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after the timed rounds, one more run of each variant under torch.profiler: a table of its "
                        "N most expensive operations and kernels by self time (GPU time on CUDA); 0 = none")
    p.add_argument("--json", type=Path, default=None, metavar="PATH",
                   help=f"where to write the results (default: {RESULTS_DIR}/{kind}-<timestamp>.json under the "
                        "current directory)")
    p.add_argument("--compare", type=Path, default=None, metavar="PATH",
                   help=f"JSON of an earlier `diffexp bench {kind}` run: print how the ratios changed")
    return p


def add_backend(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=BACKENDS, default="sdpa", help="attention backend of every layer")


def add_batch_cap(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens-per-batch", type=int, default=None,
                   help="cap batch so batch*seq <= this (at least 1 sequence); 0 = no cap. "
                        f"Default: {DEFAULT_CPU_TOKENS_PER_BATCH} on cpu, no cap on cuda")


def add_peak_tflops(p: argparse.ArgumentParser) -> None:
    p.add_argument("--peak-tflops", type=float, default=None, metavar="TF",
                   help="the device's peak TFLOP/s at --dtype for MFU (default: Lightning's table for known GPUs)")


def positive(flag: str, values) -> None:
    for value in values if isinstance(values, list) else [values]:
        if value <= 0:
            raise UserError(f"{flag}: expected a positive integer, got {value}")


def validate(args: argparse.Namespace) -> None:
    """The shared checks, in the order a user reads the flags; kinds check their own flags afterwards."""
    reference = reference_variant().name
    known = variant_names()
    requested = known if args.variants is None else args.variants
    for name in requested:
        if name not in known:
            raise UserError(f"--variants: unknown variant {name!r}; allowed: {', '.join(known)}")
    if args.variants is not None and reference not in args.variants:
        print(f"note: adding {reference!r} to --variants (ratios are relative to it)", file=sys.stderr)
    args.variants = [reference] + [v for v in dict.fromkeys(requested) if v != reference]

    if args.seq_lens is not None:  # None: the kind fills it in (bench train --recipe: the recipe's)
        positive("--seq-lens", args.seq_lens)
    for flag in ("batch_size", "d_model", "n_layers", "n_heads", "vocab_size", "steps", "rounds"):
        if getattr(args, flag) is not None:
            positive(f"--{flag.replace('_', '-')}", getattr(args, flag))
    if args.threads is not None:
        positive("--threads", args.threads)
    if args.warmup < 0:
        raise UserError(f"--warmup: expected 0 or more, got {args.warmup}")
    if args.profile < 0:
        raise UserError(f"--profile: expected 0 (no profile) or a number of entries per variant, got {args.profile}")
    if getattr(args, "tokens_per_batch", None) is not None and args.tokens_per_batch < 0:
        raise UserError(f"--tokens-per-batch: expected 0 (no cap) or more, got {args.tokens_per_batch}")
    if args.seq_lens is not None:
        args.seq_lens = sorted(dict.fromkeys(args.seq_lens))

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device cuda: CUDA is not available to this torch ({torch.__version__}, "
                        f"built with CUDA {torch.version.cuda}); use --device cpu")
    if args.device == "cuda" and args.dtype == "bf16" and not torch.cuda.is_bf16_supported():
        raise UserError("--dtype bf16: this GPU does not support bfloat16")
    if getattr(args, "peak_tflops", None) is not None and args.peak_tflops <= 0:
        raise UserError(f"--peak-tflops: expected a positive number, got {args.peak_tflops}")
    if getattr(args, "tokens_per_batch", 0) is None:
        args.tokens_per_batch = DEFAULT_CPU_TOKENS_PER_BATCH if args.device == "cpu" else 0


def output_path(args: argparse.Namespace, kind: str) -> None:
    """Default --json, and its folder created (an error names --json if that fails)."""
    if args.json is None:
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        args.json = RESULTS_DIR / f"{kind}-{stamp}.json"
    try:
        args.json.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"--json {args.json}: cannot create its folder: {err}") from None

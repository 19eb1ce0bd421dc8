"""What the shared flags build: each variant's model config, the batch, the random input, the precision
context, and the settings every results JSON records."""

from __future__ import annotations

import argparse
import contextlib

from diffexp.bench.memory import memory_method
from diffexp.bench.timing import RATIO_ESTIMATOR
from diffexp.errors import UserError
from diffexp.model.attention import variant

SEED = 1234


def model_config(args: argparse.Namespace, name: str, max_seq_len: int, backend: str):
    """The shared shape plus the variant's registry `bench_arch` (its matched benchmark settings)."""
    from diffexp.model.config import ModelConfig

    fields = {"d_model": args.d_model, "n_layers": args.n_layers, "n_heads": args.n_heads,
              "vocab_size": args.vocab_size, "max_seq_len": max_seq_len, "backend": backend}
    fields.update(variant(name).bench_arch)
    if getattr(args, "kv_heads", None) is not None:  # one KV-head count for every variant (decode)
        fields["n_kv_heads"] = args.kv_heads
    return ModelConfig(attention=name, **fields)


def check_configs(args: argparse.Namespace, max_seq_len: int, backends: list[str]) -> None:
    """Every variant's config must be valid for the chosen shape, before any model is built."""
    for name in args.variants:
        for backend in backends:
            try:
                model_config(args, name, max_seq_len, backend)
            except (ValueError, TypeError) as err:
                raise UserError(f"variant {name!r} with --d-model {args.d_model} --n-heads {args.n_heads}: "
                                f"{err}") from None


def overrides(args: argparse.Namespace) -> dict[str, dict]:
    """Each measured variant's bench_arch (and --kv-heads), as recorded in the results JSON."""
    kv = {} if getattr(args, "kv_heads", None) is None else {"n_kv_heads": args.kv_heads}
    return {name: {**variant(name).bench_arch, **kv} for name in args.variants}


def batch_for(seq_len: int, args: argparse.Namespace) -> int:
    """--batch-size, capped at --tokens-per-batch tokens (kinds without the cap use --batch-size)."""
    cap = getattr(args, "tokens_per_batch", 0)
    if not cap:
        return args.batch_size
    return max(1, min(args.batch_size, cap // seq_len))


def random_tokens(args: argparse.Namespace, batch: int, length: int, seq_len: int, device):
    """The same random token ids for every variant at one sequence length (seeded by it)."""
    import torch

    gen = torch.Generator().manual_seed(SEED + seq_len)
    return torch.empty(batch, length, dtype=torch.int64).random_(0, args.vocab_size, generator=gen).to(device)


def autocast(args: argparse.Namespace, device):
    """bf16 autocast (fp32 weights) for --dtype bf16, else nothing."""
    import torch

    if args.dtype == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def common_config(args: argparse.Namespace) -> dict:
    """The settings every kind records in its results JSON (--compare warns when they differ)."""
    keys = ("variants", "seq_lens", "batch_size", "d_model", "n_layers", "n_heads", "vocab_size", "steps",
            "warmup", "rounds", "dtype")
    return {**{key: getattr(args, key) for key in keys}, "variant_overrides": overrides(args),
            "memory_method": memory_method(args.device, not args.no_memory), "ratio_estimator": RATIO_ESTIMATOR}

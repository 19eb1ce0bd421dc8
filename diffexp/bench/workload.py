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


def model_config(args: argparse.Namespace, name: str, max_seq_len: int, backend: str,
                 ffn_hidden: int | None = None):
    """The shared shape plus the variant's registry `bench_arch` (its matched benchmark settings), --kv-heads, and
    its SwiGLU width under --match-params (or `ffn_hidden`)."""
    from dataclasses import replace

    from diffexp.model.config import ModelConfig

    recipe_archs = getattr(args, "recipe_archs", None)
    if recipe_archs:  # --recipe: the recipe's own model (diffexp.bench.recipe_shape)
        return replace(recipe_archs[name], max_seq_len=max_seq_len, backend=backend)
    fields = {"d_model": args.d_model, "n_layers": args.n_layers, "n_heads": args.n_heads,
              "vocab_size": args.vocab_size, "max_seq_len": max_seq_len, "backend": backend}
    fields.update(variant(name).bench_arch)
    if getattr(args, "kv_heads", None) is not None:  # one KV-head count for every variant (decode)
        fields["n_kv_heads"] = args.kv_heads
    width = ffn_hidden or getattr(args, "matched_ffn_hidden", {}).get(name)
    if width is not None:
        fields["ffn_hidden"] = width
    return ModelConfig(attention=name, **fields)


def parameter_count(cfg) -> int:
    """The parameters of a model built from cfg, counted on the meta device (nothing allocated)."""
    import torch

    from diffexp.model import Decoder

    with torch.device("meta"):
        return Decoder(cfg).num_parameters()


FFN_STEP = 8  # hidden units: a vector's width, so a matched SwiGLU keeps whole vectors


def matched_ffn_widths(args: argparse.Namespace, max_seq_len: int, backend: str) -> dict[str, int]:
    """--match-params: per variant, the SwiGLU width (a multiple of FFN_STEP) that brings its parameter count nearest
    the reference's. A variant's extra attention parameters are taken from its FFN and its savings given to it, as
    the DIFF V2 blog's 'additional parameters (borrowed from other parts of the model)'. Variants already nearest
    keep their width and are left out."""
    from diffexp.model.attention.registry import reference_variant

    target = parameter_count(model_config(args, reference_variant().name, max_seq_len, backend))
    widths = {}
    for name in args.variants:
        cfg = model_config(args, name, max_seq_len, backend)
        width, have = cfg.resolved_ffn_hidden, parameter_count(cfg)
        per_step = parameter_count(model_config(args, name, max_seq_len, backend, width + FFN_STEP)) - have
        matched = width + FFN_STEP * round((target - have) / per_step)
        if matched < FFN_STEP:
            raise UserError(f"--match-params: variant {name!r} has {have - target:,} parameters more than "
                            f"{reference_variant().name} at this shape, more than its SwiGLU holds ({width} hidden "
                            "units); use a larger --d-model or leave out --match-params")
        if matched != width:
            widths[name] = matched
    return widths


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
    """Each measured variant's bench_arch (and --kv-heads, and its width under --match-params), as recorded in the
    results JSON."""
    from diffexp.bench.recipe_shape import shapes

    recipe = shapes(args)
    if recipe is not None:
        return recipe
    kv = {} if getattr(args, "kv_heads", None) is None else {"n_kv_heads": args.kv_heads}
    widths = getattr(args, "matched_ffn_hidden", {})
    return {name: {**variant(name).bench_arch, **kv, **({"ffn_hidden": widths[name]} if name in widths else {})}
            for name in args.variants}


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
            "warmup", "rounds", "dtype", "profile")
    return {**{key: getattr(args, key) for key in keys}, "variant_overrides": overrides(args),
            "memory_method": memory_method(args.device, not args.no_memory), "ratio_estimator": RATIO_ESTIMATOR}

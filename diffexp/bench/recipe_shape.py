"""`--recipe SIZE`: measure the GPU recipes' own models, not the bench's default shape.

Each variant's model is exactly what `diffexp fit --config base.yaml --config size/<SIZE>.yaml --config
variant/<variant>.yaml [--config variant/<variant>/<SIZE>.yaml]` builds: the size's width and depth, the variant's
heads, KV heads and rank, and the vocabulary the recipe's data module links (32,768 for the GPU recipes). The
recipe's sequence length and micro-batch are the defaults of --seq-lens and --batch-size.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path

from diffexp.errors import UserError

#: the ModelConfig fields that tell one variant's recipe model from another's (recorded in the results JSON)
SHAPE_FIELDS = ("d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "rank", "ffn_hidden", "vocab_size")


def default_dir() -> Path:
    from diffexp.compare.params import recipes_root

    return recipes_root() / "gpu"


def sizes(recipe_dir: Path) -> list[str]:
    return sorted(p.stem for p in (recipe_dir / "size").glob("*.yaml"))


def load(args: argparse.Namespace) -> None:
    """Fill args from the recipe: each variant's ModelConfig (args.recipe_archs), and the recipe's seq_len and
    micro-batch where --seq-lens / --batch-size were not given. Refuses an unknown size or a variant the recipe
    directory has no file for, before any model is built."""
    from diffexp.compare.params import Recipe, gpu_files, is_gpu_dir, model_config, parsed
    from diffexp.training.values import data_init_args

    recipe_dir = Path(args.recipe_dir) if args.recipe_dir is not None else default_dir()
    if not is_gpu_dir(recipe_dir):
        raise UserError(f"--recipe-dir {str(recipe_dir)!r}: not a GPU recipe directory; expected base.yaml, size/ "
                        "and variant/ in it (the repository's recipes/gpu)")
    known = sizes(recipe_dir)
    if args.recipe not in known:
        raise UserError(f"--recipe {args.recipe!r}: no such size in {recipe_dir}/size; allowed: {', '.join(known)}")
    from dataclasses import replace

    archs, data = {}, None
    for name in args.variants:
        files = gpu_files(recipe_dir, args.recipe, name)
        if not files[2].is_file():
            raise UserError(f"--variants {name}: the recipe directory {recipe_dir} has no variant/{name}.yaml")
        recipe = Recipe(f"{recipe_dir.name}/{args.recipe} + {name}", files, args.recipe)
        config = parsed(recipe)
        archs[name] = model_config(recipe, config)
        if args.vocab_size is not None:  # --vocab-size: another tokenizer's vocabulary
            archs[name] = replace(archs[name], vocab_size=args.vocab_size)
        data = data or data_init_args(config)[1]
    args.recipe_archs = archs
    reference = archs[args.variants[0]]
    # the title's shape is the reference's; each variant's own heads are in the table
    args.d_model, args.n_layers, args.n_heads, args.vocab_size = (reference.d_model, reference.n_layers,
                                                                   reference.n_heads, reference.vocab_size)
    if args.seq_lens is None:
        args.seq_lens = [int(data.get("seq_len") or reference.max_seq_len)]
    if args.batch_size is None:
        args.batch_size = int(data.get("batch_size") or 1)


def shapes(args: argparse.Namespace) -> dict[str, dict] | None:
    """Per variant, the recipe model's distinguishing fields (None without --recipe)."""
    archs = getattr(args, "recipe_archs", None)
    if not archs:
        return None
    from diffexp.model.attention import variant

    def reads(name: str, key: str) -> bool:  # a variant-specific flag (rank) only for the variants that read it
        return key != "rank" or any(flag.name == key for flag in variant(name).flags)

    return {name: {key: value for key, value in asdict(cfg).items() if key in SHAPE_FIELDS and reads(name, key)}
            for name, cfg in archs.items()}

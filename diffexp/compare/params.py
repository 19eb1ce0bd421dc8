"""`diffexp params [RECIPE ...]`: the parameter counts of recipes, as a table.

Models are built on the meta device (no memory, any size) with the vocabulary the data module links into the
model at fit time (`linked_vocab_size`), so the counts are those of the trained model; each recipe states them
in its header (`header_line`), checked by tests/test_recipe_params.py. Recipes are read as `diffexp fit` reads
them, without Lightning (diffexp.training.recipe; one that only fit's parser can judge is read by it). A second
table gives each run's tokens, FLOPs and wall time on 1 and 8 GPUs at the FLOP rate of the measured fit in
bench/fits.json (diffexp.compare.budget), which the GPU size files state as `# run[<variant>]:` lines under
`run_header`'s line naming that fit.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from diffexp.compare.budget import GPU_COUNTS, MeasuredFit, RunBudget, measured_fit, run_budget
from diffexp.errors import UserError
from diffexp.training.recipe import DEFAULT_DATA_CLASS, NeedsFitParser, read_recipe

#: the recipes of a source checkout (diffexp/compare/params.py -> the repository's recipes/)
PACKAGE_RECIPES = Path(__file__).resolve().parents[2] / "recipes"
#: the counts each recipe states in its header, in this order
HEADER_KEYS = ("total", "non_embedding", "attention")
COLUMNS = {"total": "total", "non_embedding": "non-embedding", "attention": "attention",
           "qk_projections": "Q/K projections"}
PIPED_WIDTH = 160


@dataclass(frozen=True)
class Recipe:
    """One model a recipe trains: its name in the table and its --config flags."""

    name: str
    configs: tuple[Path, ...]
    size: str | None = None  # GPU combinations: the size file's stem ("830m")

    def args(self) -> list[str]:
        return [arg for path in self.configs for arg in ("--config", str(path))]

    @property
    def header_file(self) -> Path:
        """The file whose header states the counts: the recipe, or a GPU combination's variant file."""
        return self.configs[2] if self.size is not None else self.configs[0]

    @property
    def variant(self) -> str | None:
        """A GPU combination's variant file stem (a variant, or a variant and a comparison); None for a single file."""
        return self.configs[2].stem if self.size is not None else None


def recipes_root() -> Path:
    """recipes/ under the current directory if there is one, else the checkout's."""
    here = Path("recipes")
    return here if here.is_dir() else PACKAGE_RECIPES


def is_gpu_dir(path: Path) -> bool:
    """A base + size + variant recipe directory."""
    return (path / "base.yaml").is_file() and (path / "size").is_dir() and (path / "variant").is_dir()


def gpu_files(gpu: Path, size: str, variant: str) -> tuple[Path, ...]:
    """The --config files of a GPU combination, in order: base, size, variant, and the variant's size part
    (variant/<variant>/<size>.yaml) when it has one."""
    files = (gpu / "base.yaml", gpu / "size" / f"{size}.yaml", gpu / "variant" / f"{variant}.yaml")
    size_part = gpu / "variant" / variant / f"{size}.yaml"
    return files + (size_part,) if size_part.is_file() else files


def gpu_recipes(gpu: Path, sizes: Sequence[str] | None = None, variants: Sequence[str] | None = None) -> list[Recipe]:
    sizes = sizes or sorted(p.stem for p in (gpu / "size").glob("*.yaml"))
    variants = variants or sorted(p.stem for p in (gpu / "variant").glob("*.yaml"))
    return [Recipe(f"{gpu.name}/{size} + {variant}", gpu_files(gpu, size, variant), size)
            for size, variant in itertools.product(sizes, variants)]


def _name(path: Path, root: Path) -> str:
    try:
        return str(path.resolve().relative_to(root.resolve()))
    except ValueError:
        return str(path)


def expand(target: Path, root: Path) -> list[Recipe]:
    """The models a RECIPE argument stands for. A GPU recipe is base.yaml + size/<size>.yaml + variant/<variant>.yaml
    (+ variant/<variant>/<size>.yaml): a size file stands for that size with every variant, a variant file or folder
    for that variant at every size, a size part for its one combination, gpu/ or its base.yaml for all of them."""
    if not target.exists():
        raise UserError(f"RECIPE {str(target)!r}: no such file or directory; expected a recipe such as "
                        "recipes/tiny/<variant>.yaml, a GPU size or variant file, or a directory of recipes")
    if target.is_dir():
        if is_gpu_dir(target):
            return gpu_recipes(target)
        if target.name in ("size", "variant") and is_gpu_dir(target.parent):
            return gpu_recipes(target.parent)
        if target.parent.name == "variant" and is_gpu_dir(target.parent.parent):  # a variant's size parts
            return gpu_recipes(target.parent.parent, variants=[target.name])
        found = []
        for path in sorted(target.iterdir()):
            if path.is_dir() or path.suffix in (".yaml", ".yml"):
                found += expand(path, root)
        return found
    if target.suffix not in (".yaml", ".yml"):
        raise UserError(f"RECIPE {str(target)!r}: not a YAML file; expected a recipe (.yaml) or a directory")
    parent = target.parent
    if parent.name == "size" and is_gpu_dir(parent.parent):
        return gpu_recipes(parent.parent, sizes=[target.stem])
    if parent.name == "variant" and is_gpu_dir(parent.parent):
        return gpu_recipes(parent.parent, variants=[target.stem])
    if target.name == "base.yaml" and is_gpu_dir(parent):
        return gpu_recipes(parent)
    if parent.parent.name == "variant" and is_gpu_dir(parent.parent.parent):  # variant/<variant>/<size>.yaml
        return gpu_recipes(parent.parent.parent, sizes=[target.stem], variants=[parent.name])
    return [Recipe(_name(target, root), (target,))]


def all_recipes(root: Path | None = None) -> list[Recipe]:
    """Every single-file recipe under root (recipes/), then every GPU combination."""
    return expand(root or recipes_root(), root or recipes_root())


#: the vocabulary of diffexp's synthetic data modules that name no vocab_size, from their settings, without
#: building them (which imports Lightning): their tokenizer's (tests/test_recipe_reader.py checks each against
#: the built module)
SYNTHETIC_VOCAB = {
    "diffexp.data.needle.NeedleDataModule": lambda args: _tokenizer_vocab(args.get("tokenizer", "byte")),
    "diffexp.data.icl.ICLDataModule": lambda args: _tokenizer_vocab("byte"),
}
#: the class paths of the text data module
TEXT_DATA_CLASSES = (DEFAULT_DATA_CLASS, "diffexp.data.datamodule.TextDataModule")


def _tokenizer_vocab(tokenizer: str) -> int:
    """The vocabulary size of data.tokenizer: 'byte', or a tokenizer.json."""
    from diffexp.data.tokenizer import ByteTokenizer, load_tokenizer_file

    if tokenizer == "byte":
        return ByteTokenizer.vocab_size
    return load_tokenizer_file(Path(tokenizer), tokenizer).vocab_size


def linked_vocab_size(config) -> int:
    """The vocabulary size the data module links into model.arch.vocab_size at fit time, without reading
    data: an explicit data.vocab_size (MQAR); for text, 257 with the byte tokenizer, data.bpe_vocab_size with
    a BPE trained by diffexp, the file's size for a tokenizer file; the tokenizer's for diffexp's other synthetic
    tasks (SYNTHETIC_VOCAB); otherwise the data module's own vocab_size (another class is built for it)."""
    import importlib

    from diffexp.training.values import data_init_args, to_builtin

    class_path, args = data_init_args(config)
    class_path = class_path or DEFAULT_DATA_CLASS
    if args.get("vocab_size") is not None:
        return int(args["vocab_size"])
    if class_path in SYNTHETIC_VOCAB:
        return SYNTHETIC_VOCAB[class_path](args)
    data_class = None
    if class_path not in TEXT_DATA_CLASSES:  # another class: built below, unless it is a TextDataModule
        from diffexp.data import TextDataModule

        module, _, name = class_path.rpartition(".")
        data_class = getattr(importlib.import_module(module), name)
        data_class = None if issubclass(data_class, TextDataModule) else data_class
    if data_class is None:
        source = Path(str(args.get("source", "stdlib"))).expanduser()
        if (source / "manifest.json").is_file():  # a prepared directory: its tokenizer
            return int(json.loads((source / "manifest.json").read_text())["tokenizer"]["vocab_size"])
        if source.suffix == "" and not source.exists() and not str(source).startswith(("hf:", "stdlib")):
            # a directory to prepare before training (the GPU recipes): the size the recipe states
            return int(to_builtin(config.get("model") or {}).get("arch", {}).get("vocab_size") or 32768)
        tokenizer = args.get("tokenizer", "byte")
        if tokenizer == "bpe":
            return int(args.get("bpe_vocab_size") or 4096)
        return _tokenizer_vocab(tokenizer)
    return int(data_class(**args).vocab_size)


@contextlib.contextmanager
def _quiet_parse():
    """parse_config runs LightningCLI: keep its seed message and its note about sys.argv off the table."""
    argv, seed_log = sys.argv, logging.getLogger("lightning.fabric.utilities.seed")
    level = seed_log.level
    sys.argv = argv[:1]
    seed_log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        sys.argv = argv
        seed_log.setLevel(level)


@functools.cache  # within one `params` call, the two tables read each recipe once
def parsed(recipe: Recipe):
    """The recipe's config: read without Lightning (diffexp.training.recipe), or, where it holds what only fit's
    parser can judge, by that parser (diffexp.training.cli.parse_config), which imports Lightning."""
    try:
        return read_recipe(recipe.configs)
    except NeedsFitParser:
        return fit_parsed(recipe)


def fit_parsed(recipe: Recipe):
    """The recipe's config as `diffexp fit` parses it, its trainer values checked as fit checks them."""
    from diffexp.training.cli import parse_config
    from diffexp.training.trainer_checks import check_trainer
    from diffexp.training.values import to_builtin

    with _quiet_parse():
        config = parse_config(recipe.args())
    check_trainer(to_builtin(config.get("trainer") or {}), "fit")
    return config


def model_config(recipe: Recipe, config=None):
    """The recipe's ModelConfig, with the vocabulary its data module links."""
    from diffexp.model.config import ModelConfig
    from diffexp.training.values import to_builtin

    config = config or parsed(recipe)
    arch = to_builtin(config.get("model"))["arch"]
    return ModelConfig(**{**arch, "vocab_size": linked_vocab_size(config)})


def memory_settings(config, arch) -> tuple[int, int, bool]:
    """(micro-batch, sequence length, activation checkpointing) of a parsed config's run whose model is `arch`."""
    from diffexp.training.values import data_init_args, to_builtin

    data = data_init_args(config)[1]
    strategy = to_builtin(config.get("trainer") or {}).get("strategy")
    init_args = (strategy.get("init_args") or {}) if isinstance(strategy, dict) else {}
    return (int(data.get("batch_size") or 1), int(data.get("seq_len") or arch.max_seq_len),
            bool(init_args.get("activation_checkpointing")))


def memory(recipe: Recipe, gpus: int):
    """diffexp.parallel.memory's estimate per rank of the recipe's run on `gpus` GPUs (bf16 compute; the
    recipe's micro-batch, sequence length and activation checkpointing)."""
    import torch

    from diffexp.parallel.memory import estimate_memory
    from diffexp.training.loss import token_losses

    config = parsed(recipe)
    arch = model_config(recipe, config)
    batch_size, seq_len, checkpointing = memory_settings(config, arch)
    return estimate_memory(arch, batch_size, seq_len, gpus, torch.bfloat16, checkpointing, loss=token_losses)


def budget(recipe: Recipe, config=None) -> RunBudget | None:
    """The tokens and FLOPs of the recipe's whole run (None for a run not bounded by steps)."""
    config = config or parsed(recipe)
    return run_budget(config, replace(model_config(recipe, config), backend="sdpa"))


def run_header(fit: MeasuredFit | None) -> str:
    """The line above a GPU size file's `# run[<variant>]:` lines: what their times rest on, said plainly: one
    measured rate prices every variant."""
    if fit is None:
        return "# Whole run of each variant:"
    return (f"# Whole run of each variant, every one {fit.basis()}; no other variant's fit is measured, so the "
            "variants that run slower than it (bench/README.md, GPU) take longer than stated:")


def report(recipe: Recipe, config=None) -> dict[str, int]:
    """Decoder.parameter_report() of the model a recipe trains, built on the meta device."""

    from diffexp.model import Decoder
    from diffexp.model.meta import building_on_meta

    arch = replace(model_config(recipe, config), backend="sdpa")  # the backend changes no count (and warns off-GPU)
    with building_on_meta():
        return {"attention_variant": arch.attention, **Decoder(arch).parameter_report()}


def header_line(counts: dict[str, int], size: str | None = None) -> str:
    """`# parameters: total=N non_embedding=N attention=N` (GPU variant files: `# parameters[830m]: ...`)."""
    label = "parameters" if size is None else f"parameters[{size}]"
    return f"# {label}: " + " ".join(f"{key}={counts[key]}" for key in HEADER_KEYS)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(allow_abbrev=False,
        prog="diffexp params", description=__doc__.split("\n\n")[0].split(": ", 1)[1],
        epilog="With no RECIPE: every recipe under recipes/ and every GPU size x variant combination.")
    parser.add_argument("recipes", nargs="*", metavar="RECIPE",
                        help="a recipe file, a GPU size or variant file, or a directory of recipes")
    parser.add_argument("--headers", action="store_true",
                        help="also print each recipe's header line (# parameters: total=N ...), for its comment")
    parser.add_argument("--memory", type=int, metavar="GPUS",
                        help="also the memory per rank of an FSDP2 run on GPUS GPUs (bf16; the recipe's micro-batch, "
                             "sequence length and activation checkpointing; diffexp.parallel.memory)")
    return parser


def params(targets: Sequence[str], headers: bool = False, console=None,
           memory_gpus: int | None = None) -> list[tuple[Recipe, dict[str, int]]]:
    """Count, print the table (and the header lines), return the rows."""
    from rich.console import Console
    from rich.table import Table

    root = recipes_root()
    recipes = [r for target in targets for r in expand(Path(target), root)] if targets else all_recipes(root)
    if not recipes:
        raise UserError(f"RECIPE {' '.join(targets)}: no recipe (.yaml) found there")
    parsed.cache_clear()  # recipe paths are relative to the working directory: read them afresh
    rows = [(recipe, report(recipe)) for recipe in recipes]
    budgets = [budget(recipe) for recipe in recipes]
    fit = measured_fit()
    console = console or Console(width=None if sys.stdout.isatty() else PIPED_WIDTH)
    table = Table(title="parameters of the model each recipe trains (vocabulary as linked from its data)")
    table.add_column("recipe")
    table.add_column("variant")
    for label in COLUMNS.values():
        table.add_column(label, justify="right")
    if memory_gpus:
        table.add_column(f"per rank on {memory_gpus} GPUs (params, grads, optimizer, activations)", justify="right")
    for recipe, counts in rows:
        cells = [f"{counts[key]:,}" for key in COLUMNS]
        if memory_gpus:
            cells.append(memory(recipe, memory_gpus).describe().replace(" per rank", ""))
        table.add_row(recipe.name, str(counts["attention_variant"]), *cells)
    console.print(table)
    console.print(compute_table(recipes, budgets, fit))
    if headers:
        for recipe, counts in rows:
            console.print(f"{recipe.header_file}: {header_line(counts, recipe.size)}", soft_wrap=True,
                          markup=False, highlight=False)
        if any(recipe.size is not None and run is not None for recipe, run in zip(recipes, budgets)):
            console.print(f"recipes/gpu/size/*.yaml: {run_header(fit)}", soft_wrap=True, markup=False,
                          highlight=False)
        for recipe, run in zip(recipes, budgets):
            if recipe.size is not None and run is not None:
                console.print(f"{recipe.configs[1]}: {run_header_line(recipe.variant, run, fit)}", soft_wrap=True,
                              markup=False, highlight=False)
    return rows


def run_header_line(variant: str, run: RunBudget, fit: MeasuredFit | None) -> str:
    """`# run[<variant>]: ...`: a GPU size file's statement of one variant's whole run."""
    return f"# run[{variant}]: {run.describe(fit)}"


def compute_table(recipes: Sequence[Recipe], budgets: Sequence[RunBudget | None], fit: MeasuredFit | None):
    from rich.table import Table

    basis = fit.basis() if fit is not None else "no time: no measured fit (bench/fits.json of a source checkout)"
    table = Table(title=f"compute of each recipe's whole run, {basis}")
    table.add_column("recipe")
    for label in ("tokens", "steps x rows x seq_len", "training FLOPs"):
        table.add_column(label, justify="right")
    for gpus in GPU_COUNTS:
        table.add_column(f"{gpus} {fit.gpu if fit else 'GPU'}", justify="right")
    for recipe, run in zip(recipes, budgets):
        if run is None:
            table.add_row(recipe.name, "not bounded by steps", "", "", *("" for _ in GPU_COUNTS))
            continue
        table.add_row(recipe.name, f"{run.tokens / 1e9:.3g}B", f"{run.steps} x {run.rows} x {run.seq_len}",
                      f"{run.flops:.3g}", *(run.wall_time(gpus, fit) for gpus in GPU_COUNTS))
    return table


def main(argv: Sequence[str] | None = None) -> int:
    """`diffexp params [RECIPE ...]`: 0 on success; a bad RECIPE raises a UserError for the caller's guard."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.memory is not None and args.memory < 1:
        raise SystemExit(f"error: --memory={args.memory}: expected a positive number of GPUs")
    params(args.recipes, args.headers, None, args.memory)
    return 0

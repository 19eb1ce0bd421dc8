"""`diffexp SUBCOMMAND ...`: the one entry point; each subcommand lives in its own package.

fit, validate and test are LightningCLI over DiffexpLM (diffexp.training.cli); every other subcommand is the
main(argv) that SUBCOMMAND_MAINS names. All run under `diffexp.errors.guarded`: a user error is one paragraph
and exit code 2, no traceback; a subcommand's main leaves that to this guard.
"""

from __future__ import annotations

import importlib
import sys

from diffexp.errors import UserError, guarded

__all__ = ["SUBCOMMANDS", "main"]  # and, loaded on first use: DiffexpCLI, parse_config


def __getattr__(name: str):
    # lazy: `diffexp data` and the other light subcommands start without Lightning
    if name in ("DiffexpCLI", "parse_config", "run_lightning_cli"):
        from diffexp.training import cli

        return getattr(cli, name)
    raise AttributeError(f"module 'diffexp.cli' has no attribute {name!r}")


SUBCOMMANDS = {
    "fit": "train a model (a recipe: --config recipes/tiny/<variant>.yaml; resume: --ckpt_path last)",
    "validate": "validation loss of a checkpoint (--config <run>/config.yaml --ckpt_path CKPT)",
    "test": "loss on the held-out test split of a checkpoint",
    "data": "prepare a corpus as token shards once, on every core (diffexp data prepare SOURCE OUT); inspect it",
    "sweep": "run an ablation table of fits through an Optuna study (--config sweeps/<name>.yaml)",
    "compare": "tabulate and plot a sweep's runs, the papers' way (diffexp compare runs/<study>)",
    "eval": "the papers' evaluations on a checkpoint (needle, icl, mqar, nll)",
    "generate": "continue a prompt with a trained checkpoint, with the KV cache: diffexp generate CKPT --prompt TEXT",
    "export": "one self-contained model directory (safetensors, config, tokenizer) from any checkpoint",
    "variants": "the attention variants: name, paper and the model.arch flags each one reads",
    "bench": "cost of each variant vs the reference, side by side: diffexp bench train|decode|kernel",
    "params": "parameter counts of recipes (total, non-embedding, attention, Q/K): diffexp params [RECIPE ...]",
}

#: the subcommands besides fit, validate, test and variants: "module:function" of each one's main(argv) -> exit
#: code, imported when it runs (the light subcommands start without Lightning)
SUBCOMMAND_MAINS = {
    "data": "diffexp.data.cli:main",
    "sweep": "diffexp.sweep.runner:main",
    "eval": "diffexp.evals.cli:main",
    "generate": "diffexp.generate.cli:main",
    "export": "diffexp.export:main",
    "compare": "diffexp.compare:main",
    "bench": "diffexp.bench.cli:main",
    "params": "diffexp.compare.params:main",
}


def overview() -> str:
    width = max(map(len, SUBCOMMANDS))
    lines = [f"  {name:<{width}}  {about}" for name, about in SUBCOMMANDS.items()]
    return ("usage: diffexp SUBCOMMAND [options]\n\n"
            "diffexp trains, ablates and compares differential-attention transformers (DIFF V1, DIFF V2,\n"
            "Shared DIFF, DINT and a LLaMA-style baseline).\n\nsubcommands:\n" + "\n".join(lines) +
            "\n\n`diffexp SUBCOMMAND --help` lists a subcommand's options. DIFFEXP_DEBUG=1 shows tracebacks.\n")


def describe_variants() -> str:
    """`diffexp variants`: one paragraph per registry entry."""
    import textwrap

    from diffexp.model.attention import variants
    from diffexp.model.config import SHARED_FIELDS

    shared = f"model.arch.attention: one of the variants below. Every variant reads {', '.join(SHARED_FIELDS[1:])}."
    lines = [textwrap.fill(shared, 100), ""]
    for entry in variants():
        own = ", ".join(entry.fields) or "(none beyond the shared ones)"
        lines += [f"{entry.name}: {entry.summary}", f"  paper: {entry.paper}", f"  flags: {own}", ""]
    return "\n".join(lines)


def check_config_files(argv: list[str]) -> None:
    """Each --config file exists and is a YAML mapping; jsonargparse's own messages do not name the file."""
    from diffexp.training.recipe import load_config_file

    example = "a sweep spec such as sweeps/table6.yaml" if argv[:1] == ["sweep"] else \
        "a YAML recipe such as recipes/tiny/<variant>.yaml"
    for i, arg in enumerate(argv):
        if arg in ("--config", "-c") and i + 1 < len(argv):
            load_config_file(argv[i + 1], "--config", example)
        elif arg.startswith("--config="):
            load_config_file(arg.split("=", 1)[1], "--config", example)


def main(args: list[str] | None = None) -> None:
    """`diffexp ...`: every subcommand under `guarded`, so user errors print one paragraph and exit 2."""
    guarded(_main, args)


def _main(args: list[str] | None = None) -> None:
    argv = sys.argv[1:] if args is None else args
    if not argv or argv[0] in ("-h", "--help", "help"):
        sys.stdout.write(overview())
        if not argv:
            raise UserError("no subcommand given; expected one of " + ", ".join(SUBCOMMANDS))
        return
    if argv[0] not in SUBCOMMANDS and not argv[0].startswith("-"):
        raise UserError(f"unknown subcommand {argv[0]!r}; expected one of {', '.join(SUBCOMMANDS)} "
                        "(`diffexp --help` describes them)")
    check_config_files(argv)
    if argv[0] == "variants":
        sys.stdout.write(describe_variants())
        return
    if argv[0] in SUBCOMMAND_MAINS:
        module, _, function = SUBCOMMAND_MAINS[argv[0]].partition(":")
        sys.exit(getattr(importlib.import_module(module), function)(argv[1:]))
    from diffexp.training.cli import run_lightning_cli

    run_lightning_cli(args)


if __name__ == "__main__":
    main()



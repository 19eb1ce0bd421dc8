"""`diffexp fit | validate | test --config recipe.yaml`: LightningCLI over DiffexpLM and TextDataModule.

`diffexp sweep --config sweeps/<name>.yaml` and `diffexp compare runs/<study>` run ablation grids and
tabulate them (diffexp.sweep, diffexp.compare); `diffexp eval TASK CKPT` runs the papers' evaluations;
`diffexp bench train|decode|kernel` measures each variant's cost against the reference (diffexp.bench).

With no --config, `diffexp fit` trains the tiny default (the defaults of every class) on the
embedded corpus. Every run logs to TensorBoard under runs/<name>/<version>/.
Every subcommand runs under `diffexp.errors.guarded`: a user error is one paragraph, no traceback.
"""

from __future__ import annotations

import logging
import re
import sys
import time
from pathlib import Path

import lightning as L
from jsonargparse import Namespace
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from diffexp.checkpoint_io import read_checkpoint
from diffexp.errors import UserError, debug_enabled, guarded
from diffexp.preflight import check_resume, validate_fit_config
from diffexp.training.checkpointing import RunCheckpoint
from diffexp.training.diagnostics import Diagnostics
from diffexp.training.module import DiffexpLM
from diffexp.training.progress import use_step_progress_bar
from diffexp.training.report import RunReport, print_summary
from diffexp.training.runs import AtomicCheckpointIO, resolve_resume, run_logger
from diffexp.training.throughput import Throughput

TRAINER_DEFAULTS = {
    "max_steps": 300,
    "val_check_interval": 100,
    "check_val_every_n_epoch": None,
    "limit_val_batches": 20,
    "log_every_n_steps": 10,
    "gradient_clip_val": 1.0,
    "num_sanity_val_steps": 0,
    "enable_model_summary": False,  # DiffexpLM prints its own parameter report (Lightning's shows "FLOPs 0")
    "logger": {
        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
        "init_args": {"save_dir": "runs", "name": "default", "default_hp_metric": False},
    },
}


SUBCOMMANDS = {
    "fit": "train a model (a recipe: --config recipes/tiny/<variant>.yaml; resume: --ckpt_path last)",
    "validate": "validation loss of a checkpoint (--config <run>/config.yaml --ckpt_path CKPT)",
    "test": "loss on the held-out test split of a checkpoint",
    "sweep": "run an ablation table of fits through an Optuna study (--config sweeps/<name>.yaml)",
    "compare": "tabulate and plot a sweep's runs, the papers' way (diffexp compare runs/<study>)",
    "eval": "the papers' evaluations on a checkpoint (needle, icl, mqar)",
    "variants": "the attention variants: name, paper and the model.arch flags each one reads",
    "bench": "cost of each variant vs the reference, side by side: diffexp bench train|decode|kernel",
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
    from diffexp.model.attention import variants
    from diffexp.model.config import SHARED_FIELDS

    import textwrap

    shared = f"model.arch.attention: one of the variants below. Every variant reads {', '.join(SHARED_FIELDS[1:])}."
    lines = [textwrap.fill(shared, 100), ""]
    for entry in variants():
        own = ", ".join(entry.fields) or "(none beyond the shared ones)"
        lines += [f"{entry.name}: {entry.summary}", f"  paper: {entry.paper}", f"  flags: {own}", ""]
    return "\n".join(lines)


def _clean_parser_message(message: str) -> str:
    """jsonargparse's message as one paragraph with the key as the user writes it."""
    message = re.sub(r"<class '([\w.]+)'>", r"\1", message)
    message = re.sub(r'Parser key "([^"]+)":\s*', r"\1: ", message)
    message = re.sub(r"\s*\n\s*", " ", message).strip().replace("Expected a ", "expected ")
    unknown = re.match(r"unrecognized arguments: (.*)", message)
    if unknown:
        keys = [arg.split("=", 1)[0] for arg in unknown.group(1).split() if arg.startswith("--")]
        message = f"unknown key(s) {', '.join(k.lstrip('-') for k in keys) or unknown.group(1)}"
    return message


class DiffexpArgumentParser(LightningArgumentParser):
    """Parse errors become UserErrors: one paragraph naming the key, without the pages of usage."""

    appended_help = ""  # set on the fit/validate/test parsers: the default data module's options

    def format_help(self) -> str:
        return super().format_help() + self.appended_help

    def error(self, message: str, ex: Exception | None = None):
        if debug_enabled():
            return super().error(message, ex)
        prog = self.prog.replace(" [options]", "")
        raise UserError(f"{_clean_parser_message(message)} (`{prog} --help` lists the accepted keys)") from None


class DiffexpCLI(LightningCLI):
    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """fit, validate and test (predict has no meaning for a language-model run here)."""
        return {name: keys for name, keys in LightningCLI.subcommands().items() if name != "predict"}

    def _parse_ckpt_path(self) -> None:
        """Lightning would silently replace the config's model with the checkpoint's; diffexp compares them
        instead (before_instantiate_classes) and refuses a mismatch."""

    def add_arguments_to_parser(self, parser) -> None:
        if self.subclass_mode_data:
            parser.set_defaults({"data": {"class_path": "diffexp.data.TextDataModule"}})
            if isinstance(parser, DiffexpArgumentParser):
                parser.appended_help = data_options_help()
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")
        # always on, configurable as checkpoint.*: last.ckpt for --ckpt_path last, plus the best by val/loss
        parser.add_lightning_class_args(RunCheckpoint, "checkpoint")
        # always on, configurable as diagnostics.*: outliers, attention logits, lambda, gradient spikes
        parser.add_lightning_class_args(Diagnostics, "diagnostics")
        # always on, configurable as throughput.*: tokens/s, FLOPs/s and MFU (ThroughputMonitor)
        parser.add_lightning_class_args(Throughput, "throughput")
        parser.set_defaults({
            "checkpoint.save_last": True,
            "checkpoint.every_n_train_steps": 100,
            "checkpoint.monitor": "val/loss",
            "checkpoint.mode": "min",
            "checkpoint.save_top_k": 1,
            "checkpoint.filename": "step{step:06d}-val{val/loss:.3f}",
            "checkpoint.auto_insert_metric_name": False,
        })

    def instantiate_classes(self) -> None:
        """jsonargparse wraps a class's own UserError in a union error with a Namespace dump: unwrap it."""
        try:
            super().instantiate_classes()
        except Exception as err:
            cause = err
            while cause is not None and not isinstance(cause, UserError):
                cause = cause.__cause__ or cause.__context__
            if cause is None:
                raise
            raise cause from None

    def instantiate_trainer(self, **kwargs):
        # a new run's own version_<k>, reserved now; validate/test log into the evaluated run's eval/
        trainer_config = self._get(self.config, "trainer", default={})
        logger = run_logger(self.subcommand, self._get(self.config_init, "trainer", default={}).get("logger"),
                            trainer_config.get("logger"), self._get(self.config, "ckpt_path"))
        if logger is not None:
            kwargs["logger"] = logger
        trainer = super().instantiate_trainer(**kwargs)
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # FSDP's sharded IO is left alone
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        use_step_progress_bar(trainer)
        trainer.callbacks.append(RunReport())
        return trainer

    def after_fit(self) -> None:
        """Every run ends validated at its last step, so its final val/loss belongs to its final weights."""
        needs = getattr(self.model, "needs_final_validation", None)
        if needs is not None and needs():
            print(f"validating the final weights (step {self.model.global_step})", file=sys.stderr)
            # logged one step back, like Lightning's validations inside fit (after 6 steps: step 5)
            epoch_loop = self.trainer.fit_loop.epoch_loop
            epoch_loop._batches_that_stepped -= 1
            try:
                self.trainer.validate(self.model, datamodule=self.datamodule, verbose=False)
            finally:
                epoch_loop._batches_that_stepped += 1
        if not self.trainer.interrupted:
            print_summary(self.trainer)

    def before_instantiate_classes(self) -> None:
        """Every check that needs no work runs here, before data, model or run directory exist."""
        subcommand = self.config.get("subcommand")
        if subcommand is None:
            return
        config = self.config[subcommand]
        validate_fit_config(config, subcommand)
        ckpt_path = config.get("ckpt_path")
        if not ckpt_path:
            return
        logger = config.trainer.get("logger")
        if subcommand == "fit" and _is_tensorboard(logger):
            init_args = logger.init_args
            path, version = resolve_resume(ckpt_path, init_args.save_dir, init_args.name)
        else:
            path, version = Path(ckpt_path), None
        check_resume(config, read_checkpoint(path, weights=False), path, subcommand)
        config.ckpt_path = str(path)
        if subcommand != "fit":
            return
        if version is not None:  # append to the run being resumed, keep its first config.yaml
            init_args.version = version
            self.save_config_kwargs["config_filename"] = time.strftime("config.resumed-%Y%m%d-%H%M%S.yaml")
        print(f"resuming from {path}", file=sys.stderr)


def check_config_files(argv: list[str]) -> None:
    """Each --config file exists and is a YAML mapping; jsonargparse's own messages do not name the file."""
    import yaml

    example = "a sweep spec such as sweeps/table6.yaml" if argv[:1] == ["sweep"] else \
        "a YAML recipe such as recipes/tiny/<variant>.yaml"
    for i, arg in enumerate(argv):
        if arg in ("--config", "-c") and i + 1 < len(argv):
            path = argv[i + 1]
        elif arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        else:
            continue
        file = Path(path)
        if not file.is_file():
            raise UserError(f"--config {path}: no such file" + (" (a directory)" if file.is_dir() else "") +
                            f"; expected {example}")
        try:
            loaded = yaml.safe_load(file.read_text())
        except (yaml.YAMLError, UnicodeDecodeError) as err:
            where = getattr(err, "problem_mark", None)
            line = f" at line {where.line + 1}" if where is not None else ""
            raise UserError(f"--config {path}: not valid YAML{line} ({getattr(err, 'problem', None) or err}); "
                            "expected a mapping of keys such as model:, data:, trainer:") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise UserError(f"--config {path}: holds a {type(loaded).__name__}, expected a mapping of keys such as "
                            "model:, data:, trainer:")


def data_options_help() -> str:
    """The data.* options of the default data module, which jsonargparse's subclass help would hide."""
    from jsonargparse import ArgumentParser

    from diffexp.data import TextDataModule

    parser = ArgumentParser(prog="diffexp fit")
    parser.add_class_arguments(TextDataModule, "data", sub_configs=True)
    text = parser.format_help()
    options = text[text.find("  --data.source"):] if "  --data.source" in text else text
    return ("\ndata.* options of the default data module (diffexp.data.TextDataModule); other data modules "
            "(NeedleDataModule, MQARDataModule, ICLDataModule) list theirs with --data.help CLASS:\n" + options)


def _is_tensorboard(logger) -> bool:
    return isinstance(logger, Namespace) and str(logger.get("class_path", "")).endswith("TensorBoardLogger")


class _DropMessages(logging.Filter):
    def __init__(self, *fragments: str) -> None:
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(fragment in record.getMessage() for fragment in self.fragments)


def quiet_third_party_noise() -> None:
    """Drop messages that tell a diffexp user nothing (real warnings stay): Lightning's litlogger
    advertisement and its own deprecated pytree call."""
    import warnings

    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
    for name in ("lightning.pytorch", "lightning.fabric"):
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, _DropMessages) for f in handler.filters):
                handler.addFilter(_DropMessages("litlogger"))


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
    if argv and argv[0] == "sweep":
        from diffexp.sweep.runner import main as sweep_main

        sys.exit(sweep_main(argv[1:]))
    if argv and argv[0] == "eval":
        from diffexp.evals.cli import main as eval_main

        sys.exit(eval_main(argv[1:]))
    if argv and argv[0] == "compare":
        from diffexp.compare import main as compare_main

        sys.exit(compare_main(argv[1:]))
    if argv and argv[0] == "bench":
        from diffexp.bench.cli import main as bench_main

        sys.exit(bench_main(argv[1:]))
    quiet_third_party_noise()
    log = logging.getLogger("diffexp")
    if not log.handlers:  # data preparation messages ("tokenizing ...", "reusing cached ...")
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    DiffexpCLI(
        DiffexpLM,
        L.LightningDataModule,
        parser_class=DiffexpArgumentParser,
        parser_kwargs={"prog": "diffexp"},
        subclass_mode_data=True,  # TextDataModule by default; NeedleDataModule, MQARDataModule, ... by class_path
        seed_everything_default=1234,
        trainer_defaults=TRAINER_DEFAULTS,
        save_config_kwargs={"overwrite": False},
        auto_configure_optimizers=False,  # DiffexpLM.configure_optimizers follows the papers
        args=args,
    )


if __name__ == "__main__":
    main()


class _ParseOnlyCLI(DiffexpCLI):
    def before_instantiate_classes(self) -> None:
        pass

    def instantiate_classes(self) -> None:
        pass

    def _run_subcommand(self, subcommand: str) -> None:
        pass


def parse_config(args: list[str], subcommand: str = "fit") -> Namespace:
    """Parse and type-check a full config (recipe + overrides) of a subcommand without building anything."""
    cli = _ParseOnlyCLI(DiffexpLM, L.LightningDataModule, parser_class=DiffexpArgumentParser,
                        parser_kwargs={"prog": "diffexp"}, subclass_mode_data=True, seed_everything_default=1234,
                        trainer_defaults=TRAINER_DEFAULTS, auto_configure_optimizers=False, args=[subcommand, *args])
    return cli.config[subcommand]

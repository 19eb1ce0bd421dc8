"""The training command line: LightningCLI over DiffexpLM and any LightningDataModule (`fit`, `validate`,
`test`), with diffexp's checks before any work, its run directories, checkpoints and run report.

With no --config, `fit` trains the tiny default (the defaults of every class) on the embedded corpus.
Every run logs to TensorBoard under runs/<name>/<version>/; a fit is also a row of the HParams tab (hparams.py).
"""

from __future__ import annotations

import logging
import re
import sys
import time
from dataclasses import asdict
from pathlib import Path

import lightning as L
from jsonargparse import Namespace
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only

from diffexp.checkpoint_io import read_checkpoint
from diffexp.errors import UserError, dash_value_hint, debug_enabled
from diffexp.lightning_internals import CLIInternals
from diffexp.training.auto_batch import is_auto, resolve_auto_batch
from diffexp.training.checkpointing import RunCheckpoint
from diffexp.training.construction import check_buildable, trainer_build_errors
from diffexp.training.diagnostics import Diagnostics
from diffexp.training.global_batch import GlobalBatch
from diffexp.training.hparams import RunHParams
from diffexp.training.module import DiffexpLM
from diffexp.training.parser_messages import clean_parser_message
from diffexp.training.preemption import Preemption, handling_signals
from diffexp.training.preflight import (
    check_cpu_memory,
    check_resume,
    check_same_data,
    model_sections,
    validate_fit_config,
)
from diffexp.training.progress import use_step_progress_bar
from diffexp.training.recipe import DEFAULT_DATA_CLASS, TRAINER_DEFAULTS
from diffexp.training.report import RunReport, print_summary, progress_interval
from diffexp.training.runs import AtomicCheckpointIO, RemoveRefusedRun, resolve_resume, run_logger
from diffexp.training.slurm_jobs import current_job, record_job
from diffexp.training.throughput import Throughput
from diffexp.training.values import data_init_args, to_builtin
from diffexp.training.warm_start import check_init_from


class DiffexpArgumentParser(LightningArgumentParser):
    """Parse errors become UserErrors: one paragraph naming the key, without the pages of usage."""

    appended_help = ""  # set on the fit/validate/test parsers: the default data module's options
    parsed_words: list[str] = []  # the words parsed last, read by error()
    #: the last error of a class's own parser (jsonargparse parses data.* with the data module's): (its message,
    #: the keys it accepts), which the error of the section that holds the class reads (_section_error)
    class_error: tuple[str, list[str]] | None = None

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)  # --trainer.max_step is an unknown key, not max_steps
        super().__init__(*args, **kwargs)

    @property
    def parses_a_class(self) -> bool:
        """Whether this is the parser jsonargparse makes for a class's arguments (data.*, trainer.logger.*): it
        makes each with exit_on_error=False; fit's own parsers exit on error."""
        return self.exit_on_error is False

    def format_help(self) -> str:
        return super().format_help() + self.appended_help

    def parse_args(self, args=None, *rest, **kwargs):
        if self.parses_a_class:  # `--data.bogus 3` parsed as `--bogus=3` by the data module's parser
            return super().parse_args(args, *rest, **kwargs)
        if args is not None or not DiffexpArgumentParser.parsed_words:  # a subcommand's parser keeps the root's words
            DiffexpArgumentParser.parsed_words = [str(a) for a in (sys.argv[1:] if args is None else args)]
        DiffexpArgumentParser.class_error = None
        return super().parse_args(args, *rest, **kwargs)

    def error(self, message: str, ex: Exception | None = None):
        if debug_enabled():
            return super().error(message, ex)
        if self.parses_a_class:  # jsonargparse folds this into the section's error, which names it (_section_error)
            DiffexpArgumentParser.class_error = (message, self._long_options())
            raise UserError(message)
        prog = self.prog.replace(" [options]", "")
        words = DiffexpArgumentParser.parsed_words
        text = self._section_error(message, words)
        if text is None:
            text, prog = self._unknown_in_file(message, words) or (None, prog)
        if text is None:
            text = clean_parser_message(message, words) + dash_value_hint(message, words) + self._nearest_keys(message)
        raise UserError(f"{text} (`{prog} --help` lists the accepted keys)") from None

    def _long_options(self) -> list[str]:
        """The keys this parser accepts (not --help, nor a list's append form `--key+`)."""
        return [option.lstrip("-") for action in self._actions for option in action.option_strings
                if option.startswith("--") and not option.endswith(("+", "help"))]

    def _section_error(self, message: str, words: list[str]) -> str | None:
        """A class section's error (`--data.bogus 3`, a recipe's `data: {batch_sise: 16}`) as the class's parser
        found it, with the key as the user writes it: jsonargparse reports it as the section's value matching no
        type ("data: NestedArg(key='bogus', val='3') is not allowed; allowed: LightningDataModule or null")."""
        found = re.match(r'Parser key "([\w.]+)":\s*Does not validate against any of the Union subtypes', message)
        recorded, DiffexpArgumentParser.class_error = DiffexpArgumentParser.class_error, None
        if not found or recorded is None or recorded[0].splitlines()[0] not in message:
            return None
        section, (inner, known) = found.group(1), recorded
        unknown = re.match(r"Option '([\w.]+)' is not accepted", inner)
        if unknown is None:  # a bad value of one of the class's keys: the key under its section
            inner = re.sub(r'Parser key "([\w.]+)"', rf'Parser key "{section}.\1"', inner)
            return clean_parser_message(inner, words) + dash_value_hint(inner, words)
        key, owner = f"{section}.{unknown.group(1)}", configured_class(section, words)
        return (f"{key_files(key, words, section)}unknown key(s) {key}" + _nearest(key, known, f"{section}.")
                + (f"; {section} holds the arguments of {owner}: " if owner else f"; {section} accepts: ")
                + ", ".join(known))

    def _unknown_in_file(self, message: str, words: list[str]) -> tuple[str, str] | None:
        """A --config file's unknown key (`trainer: {max_stepz: 10}`), which jsonargparse reports as "Subcommand
        'fit' does not accept option 'trainer.max_stepz'": the file, the key and the nearest accepted key, with
        the subcommand's prog (`diffexp fit`, whose --help lists its keys)."""
        found = re.match(r"Subcommand '(\w+)' does not accept option '([\w.]+)'", message)
        if not found:
            return None
        subcommand, key = found.groups()
        parser = next((choice for action in self._actions if isinstance(getattr(action, "choices", None), dict)
                       for name, choice in action.choices.items() if name == subcommand), None)
        if not isinstance(parser, DiffexpArgumentParser):
            return None
        text = f"{key_files(key, words)}unknown key(s) {key}" + _nearest(key, parser._long_options())
        return text, parser.prog.replace(" [options]", "")

    def _nearest_keys(self, message: str) -> str:
        """For each unknown --key, the accepted keys it is nearest to (a misspelt or shortened key)."""
        unknown = re.match(r"unrecognized arguments: (.*)", " ".join(message.split()))
        if not unknown:
            return ""
        known = self._long_options()
        return "".join(_nearest(arg.split("=", 1)[0].lstrip("-"), known) for arg in unknown.group(1).split()
                       if arg.startswith("--"))


def _nearest(key: str, known: list[str], prefix: str = "") -> str:
    """`; KEY: did you mean NEAREST?` for the accepted key nearest to a misspelt or shortened one, else "";
    `known` are the keys under `prefix` (a class section's, compared without the section: `data.` would make
    any two keys alike)."""
    import difflib

    close = difflib.get_close_matches(key.removeprefix(prefix), known, n=1, cutoff=0.75)
    return f"; {key}: did you mean {prefix}{close[0]}?" if close else ""


def key_files(key: str, words: list[str], section: str = "") -> str:
    """`--config FILE: ` for the --config files of `words` that set the dotted `key` (a class section's key under
    the section's init_args too), else "" (a key given on the command line)."""
    from diffexp.training.command_line import config_files, file_setting

    spellings = [key] + ([f"{section}.init_args.{key.removeprefix(section + '.')}"] if section else [])
    files = [path for path in config_files(words) if any(file_setting(path, k)[0] for k in spellings)]
    return f"--config {', '.join(files)}: " if files else ""


def configured_class(section: str, words: list[str]) -> str | None:
    """The class a class section (data) is configured with, as written: the last of the --config files'
    `section.class_path` and the command line's `--section CLASS` / `--section.class_path CLASS`; fit's default
    data module when none sets it (None for another section)."""
    from diffexp.training.command_line import CONFIG_FLAG, file_setting

    chosen = DEFAULT_DATA_CLASS if section == "data" else None
    for i, word in enumerate(words):
        name, sep, value = word.partition("=")
        value = value if sep else (words[i + 1] if i + 1 < len(words) else "")
        if name == CONFIG_FLAG:
            held, spec = file_setting(value, section)
            spec = spec.get("class_path") if held and isinstance(spec, dict) else spec if held else None
            chosen = spec if isinstance(spec, str) else chosen
        elif name in (f"--{section}", f"--{section}.class_path") and value and not value.startswith("{"):
            chosen = value
    return chosen


class DiffexpCLI(CLIInternals):
    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """fit, validate and test (predict has no meaning for a language-model run here)."""
        return {name: keys for name, keys in LightningCLI.subcommands().items() if name != "predict"}

    def load_checkpoint_hparams(self) -> None:
        """Lightning would silently replace the config's model with the checkpoint's; diffexp compares them
        instead (before_instantiate_classes) and refuses a mismatch."""

    def parse_arguments(self, parser, args) -> None:
        """Also keeps the words parsed (`self.words`): they say which keys the user gave (validate_fit_config)."""
        words = [] if isinstance(args, (dict, Namespace)) else sys.argv[1:] if args is None else args
        self.words = [str(word) for word in words]
        super().parse_arguments(parser, args)

    def setting(self, config: Namespace, key: str, default=None):
        """A top-level key of the subcommand's config (`trainer`, `model`, `ckpt_path`)."""
        return config.get(str(self.subcommand), config).get(key, default)

    def add_arguments_to_parser(self, parser) -> None:
        if self.subclass_mode_data:
            parser.set_defaults({"data": {"class_path": DEFAULT_DATA_CLASS}})
            if isinstance(parser, DiffexpArgumentParser):
                parser.appended_help = data_options_help()
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")
        # always on, configurable as checkpoint.*: last.ckpt for --ckpt_path last, plus the best by val/loss
        parser.add_lightning_class_args(RunCheckpoint, "checkpoint")
        # always on, configurable as diagnostics.*: outliers, attention logits, lambda, gradient spikes
        parser.add_lightning_class_args(Diagnostics, "diagnostics")
        # always on, configurable as throughput.*: tokens/s, FLOPs/s and MFU (ThroughputMonitor)
        parser.add_lightning_class_args(Throughput, "throughput")
        # off unless set: global_batch.rows keeps the tokens per step whatever the number of processes
        parser.add_lightning_class_args(GlobalBatch, "global_batch")
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
        """What this machine cannot build is refused first, before data and model exist (check_buildable).
        jsonargparse wraps a class's own UserError in a union error with a Namespace dump: unwrap it."""
        trainer = to_builtin(self.setting(self.config, "trainer", default={}))
        check_buildable(trainer, to_builtin(self.setting(self.config, "model", default={})))
        if self.subcommand == "fit":
            config = self.config[self.subcommand]
            check_cpu_memory(model_sections(config)[0], trainer, data_init_args(config)[1])
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
        trainer_config = self.setting(self.config, "trainer", default={})
        with trainer_build_errors(to_builtin(trainer_config)):
            trainer = super().instantiate_trainer(**kwargs)
        # a new run's own version_<k>, reserved once the trainer is built, so a refused build leaves no directory;
        # validate/test log into the evaluated run's eval/ (fast_dev_run logs nowhere)
        logger = None if trainer.fast_dev_run else run_logger(
            self.subcommand, self.setting(self.config_init, "trainer", default={}).get("logger"),
            trainer_config.get("logger"), self.setting(self.config, "ckpt_path"))
        if logger is not None:
            trainer.logger = logger
            if self.subcommand == "fit":  # a new run's directory, reserved here: gone again if setup refuses
                trainer.callbacks.append(RemoveRefusedRun(Path(logger.log_dir)))
        job = current_job()
        if self.subcommand == "fit" and job and isinstance(trainer.logger, TensorBoardLogger) \
                and rank_zero_only.rank == 0:  # the run this SLURM job trains, for its requeue's --ckpt_path last
            record_job(Path(trainer.logger.log_dir), job)
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # FSDP's sharded IO is left alone
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        configured = self.setting(self.config_init, "trainer", default={}).get("callbacks") or []
        use_step_progress_bar(trainer, configured if isinstance(configured, list) else [configured])
        # before the checkpoint callback, which Lightning runs last and which stops a signalled run at a
        # validation's end: this validation's report line is printed first
        checkpoints = [i for i, c in enumerate(trainer.callbacks) if isinstance(c, ModelCheckpoint)]
        at = checkpoints[0] if checkpoints else len(trainer.callbacks)
        # RunReport states the seed in the summary (Lightning's "Seed set to" line is dropped: quiet_third_party_noise)
        seed = self.setting(self.config, "seed_everything")
        trainer.callbacks[at:at] = [RunReport(seed=seed), Preemption()]  # Preemption: SIGTERM, SIGINT, SIGUSR1
        if self.subcommand == "fit":  # its row in TensorBoard's HParams tab; first, so the checkpoints saved at a
            trainer.callbacks.insert(0, RunHParams())  # validation's end hold the val/loss it has just recorded
        return trainer

    def build_trainer(self, config: dict, callbacks: list) -> L.Trainer:
        if config.get("enable_checkpointing") is False:  # checkpoint.* is always configured: switched off, it goes
            callbacks = [callback for callback in callbacks if not isinstance(callback, RunCheckpoint)]
        return super().build_trainer(config, callbacks)

    def after_fit(self) -> None:
        """Every run ends validated at its last step, so its final val/loss belongs to its final weights."""
        needs = getattr(self.model, "needs_final_validation", None)
        if needs is not None and needs():
            print(f"validating the final weights (step {self.model.global_step})", file=sys.stderr)
            # logged at the steps done, like the validations inside fit (DiffexpLM.on_validation_epoch_end)
            self.trainer.validate(self.model, datamodule=self.datamodule, verbose=False)
        if not self.trainer.interrupted:
            print_summary(self.trainer)

    def before_instantiate_classes(self) -> None:
        """Every check that needs no work runs here, before data, model or run directory exist."""
        subcommand = self.config.get("subcommand")
        if subcommand is None:
            return
        progress_interval()  # a bad DIFFEXP_PROGRESS_EVERY_S is refused before any file is written
        config = self.config[subcommand]
        ckpt_path, resumed = config.get("ckpt_path"), None
        logger = config.trainer.get("logger")
        if subcommand == "fit" and ckpt_path and _is_tensorboard(logger):
            resumed = resolve_resume(ckpt_path, logger.init_args.save_dir, logger.init_args.name)
            if resumed[0] is None:  # --ckpt_path last of a requeued SLURM job whose run saved nothing: a new run
                config.ckpt_path = ckpt_path = None
        if not ckpt_path:  # data.batch_size auto: a number from the GPU's free memory (a resume: the checkpoint's)
            resolve_auto_batch(config)
        arch = validate_fit_config(config, subcommand, self.words)
        init_from = (to_builtin(config.get("model") or {})).get("init_from")
        if subcommand == "fit" and init_from and not ckpt_path:  # a resume takes its weights from ckpt_path
            data_class, data_args = data_init_args(config)
            check_init_from(init_from, asdict(arch), data_args, data_class)
        if not ckpt_path:
            return
        path, version = resumed or (Path(ckpt_path), None)
        checkpoint = read_checkpoint(path, weights=False)
        if is_auto(config):
            resolve_auto_batch(config, checkpoint)
        check_resume(config, checkpoint, path, subcommand)
        check_same_data(config, checkpoint, path, subcommand)  # a data.source prepared again since
        config.ckpt_path = str(path)
        if subcommand != "fit":
            return
        if version is not None:  # append to the run being resumed, keep its first config.yaml
            logger.init_args.version = version
            self.save_config_kwargs["config_filename"] = time.strftime("config.resumed-%Y%m%d-%H%M%S.yaml")
        print(f"resuming from {path}", file=sys.stderr)


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


#: fragments of the Lightning messages quiet_third_party_noise drops
NOISE = ("litlogger", "available: False", "`Trainer.fit` stopped:",
         "SLURM auto-requeueing enabled",  # diffexp requeues on SIGUSR1 itself (training.preemption)
         "Seed set to")  # logged before diffexp's checks, so it came before a refusal; fit's summary states the seed


class _DropMessages(logging.Filter):
    def __init__(self, *fragments: str) -> None:
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(fragment in record.getMessage() for fragment in self.fragments)


def quiet_third_party_noise() -> None:
    """Drop messages that tell a diffexp user nothing (real warnings stay): Lightning's litlogger
    advertisement, its own deprecated pytree call, the accelerators a machine lacks ("TPU available: False", while
    "GPU available: True (cuda), used: True" stays), "`Trainer.fit` stopped: `max_steps=400` reached.", which
    lands on the validation bar's line (the run summary says how the run ended), and "Seed set to 1234", which
    seed_everything logs before any of diffexp's checks, so that a refused command printed it above its error (the
    seed is set as before; fit's summary states it)."""
    import warnings

    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
    for name in ("lightning.pytorch", "lightning.fabric"):
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, _DropMessages) for f in handler.filters):
                handler.addFilter(_DropMessages(*NOISE))


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a message comes (a run inside a test, a redirected stream)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def make_cli(args: list[str], cli_class: type[DiffexpCLI] = DiffexpCLI, run: bool = True) -> DiffexpCLI:
    """The LightningCLI of `diffexp fit | validate | test` over ARGS (they start with the subcommand unless run
    is False), with diffexp's parser, defaults and run directories."""
    return cli_class(
        DiffexpLM,
        L.LightningDataModule,
        parser_class=DiffexpArgumentParser,
        parser_kwargs={"prog": "diffexp"},
        subclass_mode_data=True,  # TextDataModule by default; NeedleDataModule, MQARDataModule, ... by class_path
        seed_everything_default=1234,
        trainer_defaults=TRAINER_DEFAULTS,
        save_config_kwargs={"overwrite": False},
        auto_configure_optimizers=False,  # DiffexpLM.configure_optimizers follows the papers
        run=run,
        args=args,
    )


def run_lightning_cli(args: list[str]) -> None:
    """`diffexp fit | validate | test ...` (args start with the subcommand)."""
    quiet_third_party_noise()
    log = logging.getLogger("diffexp")
    if not log.handlers:  # data preparation messages ("preparing ...", "reusing prepared ...")
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    with handling_signals():
        make_cli(args)


def build_fit(args: list[str]):
    """(module, data module, trainer) exactly as `diffexp fit ARGS` builds them, without training (benchmarks)."""
    quiet_third_party_noise()
    argv, sys.argv = sys.argv, sys.argv[:1]  # ARGS is the command line (LightningCLI warns when both are given)
    try:
        cli = make_cli(args, run=False)
    finally:
        sys.argv = argv
    return cli.model, cli.datamodule, cli.trainer


class _ParseOnlyCLI(DiffexpCLI):
    def before_instantiate_classes(self) -> None:
        pass

    def instantiate_classes(self) -> None:
        pass

    def run_subcommand(self, subcommand: str) -> None:
        pass


#: the parser LightningCLI builds, kept per process: building it costs 3x a parse, and a sweep check or the
#: recipe tests parse hundreds of configs
_PARSER: list[LightningArgumentParser] = []


def parse_config(args: list[str], subcommand: str = "fit") -> Namespace:
    """Parse and type-check a full config (recipe + overrides) of a subcommand without building anything."""
    args = [str(arg) for arg in args]
    reads_checkpoint = any(arg.startswith("--ckpt_path") for arg in args)  # LightningCLI re-parses with its hparams
    if _PARSER and not reads_checkpoint:
        return _PARSER[0].parse_args([subcommand, *args])[subcommand]
    cli = make_cli([subcommand, *args], cli_class=_ParseOnlyCLI)
    if not _PARSER:
        _PARSER.append(cli.parser)
    return cli.config[subcommand]

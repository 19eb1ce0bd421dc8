"""`diffexp fit | validate | test --config recipe.yaml`: LightningCLI over DiffexpLM and TextDataModule.

`diffexp sweep --config sweeps/<name>.yaml` and `diffexp compare runs/<study>` run ablation grids and
tabulate them (diffexp.sweep, diffexp.compare).

With no --config, `diffexp fit` trains the tiny default (the defaults of every class) on the
embedded corpus. Every run logs to TensorBoard under runs/<name>/<version>/.
"""

from __future__ import annotations

import logging
import sys
import time

import lightning as L
from jsonargparse import Namespace
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.cli import LightningCLI

from diffexp.training.checkpointing import RunCheckpoint
from diffexp.training.diagnostics import Diagnostics
from diffexp.training.module import DiffexpLM
from diffexp.training.progress import use_step_progress_bar
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
    "logger": {
        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
        "init_args": {"save_dir": "runs", "name": "default", "default_hp_metric": False},
    },
}


class DiffexpCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        if self.subclass_mode_data:
            parser.set_defaults({"data": {"class_path": "diffexp.data.TextDataModule"}})
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
        return trainer

    def _parse_ckpt_path(self) -> None:
        """Lightning lets a checkpoint's hyperparameters override the command line's model.*; a resumed fit
        trains as configured (e.g. with the lower model.optim.lr a non-finite stop advises), as it does with
        --ckpt_path last. validate/test still build the model the checkpoint describes."""
        if self.config.get("subcommand") != "fit":
            super()._parse_ckpt_path()

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

    def before_instantiate_classes(self) -> None:
        subcommand = self.config.get("subcommand")
        if subcommand is None:
            return
        config = self.config[subcommand]
        ckpt_path = config.get("ckpt_path")
        logger = config.trainer.get("logger")
        if subcommand != "fit" or not ckpt_path or not _is_tensorboard(logger):
            return
        init_args = logger.init_args
        path, version = resolve_resume(ckpt_path, init_args.save_dir, init_args.name)
        config.ckpt_path = str(path)
        if version is not None:  # append to the run being resumed, keep its first config.yaml
            init_args.version = version
            self.save_config_kwargs["config_filename"] = time.strftime("config.resumed-%Y%m%d-%H%M%S.yaml")
        print(f"resuming from {path}", file=sys.stderr)


def _is_tensorboard(logger) -> bool:
    return isinstance(logger, Namespace) and str(logger.get("class_path", "")).endswith("TensorBoardLogger")


def main(args: list[str] | None = None) -> None:
    argv = sys.argv[1:] if args is None else args
    if argv and argv[0] == "sweep":
        from diffexp.sweep.runner import main as sweep_main

        sys.exit(sweep_main(argv[1:]))
    if argv and argv[0] == "eval":
        from diffexp.evals.cli import main as eval_main

        sys.exit(eval_main(argv[1:]))
    if argv and argv[0] == "compare":
        from diffexp.compare import main as compare_main

        sys.exit(compare_main(argv[1:]))
    log = logging.getLogger("diffexp")
    if not log.handlers:  # data preparation messages ("tokenizing ...", "reusing cached ...")
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    DiffexpCLI(
        DiffexpLM,
        L.LightningDataModule,
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
    cli = _ParseOnlyCLI(DiffexpLM, L.LightningDataModule, subclass_mode_data=True, seed_everything_default=1234,
                        trainer_defaults=TRAINER_DEFAULTS, auto_configure_optimizers=False, args=[subcommand, *args])
    return cli.config[subcommand]

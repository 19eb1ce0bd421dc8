"""diffexp.lightning_internals against the installed Lightning: every private member it reads, calls or overrides
is there, and means what diffexp takes it to mean, in a real (tiny) Lightning fit. A failure names the member and
the Lightning version, so that a release that moves one fails here, loudly, rather than shifting a step axis or a
checkpoint's timing without a word."""

from __future__ import annotations

import importlib

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import Logger

from diffexp import lightning_internals as internals

#: (object path, member) of every private member lightning_internals touches
MEMBERS = [
    ("lightning.pytorch.trainer.connectors.logger_connector.logger_connector._LoggerConnector", "should_update_logs"),
    ("lightning.pytorch.trainer.connectors.logger_connector.logger_connector._LoggerConnector", "metrics"),
    ("lightning.pytorch.trainer.trainer.Trainer", "_logger_connector"),
    ("lightning.pytorch.loops.training_epoch_loop._TrainingEpochLoop", "_batches_that_stepped"),
    ("lightning.pytorch.loops.training_epoch_loop._TrainingEpochLoop", "_skip_next_val"),
    ("lightning.pytorch.loops.training_epoch_loop._TrainingEpochLoop", "_should_check_val_fx"),
    ("lightning.pytorch.loops.fit_loop._FitLoop", "_data_fetcher"),
    ("lightning.pytorch.loops.fit_loop._FitLoop", "_should_accumulate"),
    ("lightning.pytorch.loops.progress._BatchProgress", "increment_processed"),
    ("lightning.pytorch.callbacks.ModelCheckpoint", "_every_n_train_steps"),
    ("lightning.pytorch.callbacks.ModelCheckpoint", "_every_n_epochs"),
    ("lightning.pytorch.callbacks.ModelCheckpoint", "_train_time_interval"),
    ("lightning.pytorch.callbacks.ModelCheckpoint", "_last_time_checked"),
    ("lightning.pytorch.callbacks.ModelCheckpoint", "_monitor_candidates"),
    ("lightning.pytorch.callbacks.ModelCheckpoint", "_save_topk_checkpoint"),
    ("lightning.pytorch.callbacks.ModelCheckpoint", "_save_last_checkpoint"),
    ("lightning.pytorch.callbacks.ModelCheckpoint", "_save_checkpoint"),
    ("lightning.pytorch.callbacks.ThroughputMonitor", "_update"),
    ("lightning.pytorch.callbacks.ThroughputMonitor", "_compute"),
    *[("lightning.pytorch.callbacks.ThroughputMonitor", name) for name in internals.THROUGHPUT_STATE],
    ("lightning.pytorch.callbacks.RichProgressBar", "_update_metrics"),
    ("lightning.pytorch.callbacks.RichProgressBar", "_get_train_description"),
    ("lightning.pytorch.callbacks.RichProgressBar", "_leave"),
    ("lightning.pytorch.callbacks.RichProgressBar", "_console_kwargs"),
    ("lightning.pytorch.cli.LightningCLI", "_parse_ckpt_path"),
    ("lightning.pytorch.cli.LightningCLI", "_instantiate_trainer"),
    ("lightning.pytorch.cli.LightningCLI", "_run_subcommand"),
    ("lightning.pytorch.strategies.ModelParallelStrategy", "_setup_distributed"),
    ("lightning.pytorch.strategies.ModelParallelStrategy", "_device_mesh"),
]


def _resolve(path: str):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _instance_attributes(cls: type) -> set[str]:
    """What a class's methods assign to self (instance attributes are not on the class)."""
    import inspect
    import re

    names = set()
    for base in cls.__mro__:
        if base.__module__.startswith("lightning"):
            names |= set(re.findall(r"self\.(\w+)\s*(?::[^=]*)?=", inspect.getsource(base)))
    return names


@pytest.mark.parametrize(("owner", "member"), MEMBERS, ids=[f"{o.rpartition('.')[2]}.{m}" for o, m in MEMBERS])
def test_each_private_member_is_still_there(owner, member):
    try:
        cls = _resolve(owner)
    except (ImportError, AttributeError) as err:
        pytest.fail(f"Lightning {L.__version__} has no {owner} ({err}): diffexp/lightning_internals.py needs "
                    "updating for it")
    assert hasattr(cls, member) or member in _instance_attributes(cls), (
        f"Lightning {L.__version__}: {owner} no longer has {member}; diffexp/lightning_internals.py uses it "
        "(see its docstring for why) and needs updating")


# ----------------------------------------------------------------------------- a tiny fit that watches them

class Written(Logger):
    """A logger that keeps what Lightning writes to it: {step: set of keys}."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: dict[int, set[str]] = {}

    @property
    def name(self) -> str:
        return "written"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.steps.setdefault(step, set()).update(metrics)


class Logging(BoringModel):
    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        self.log("watched", out["loss"])
        return out


class Probe(L.Callback):
    def __init__(self) -> None:
        self.ends, self.validated_at, self.processed = [], [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 1:
            before = trainer.fit_loop.epoch_loop.batch_progress.current.processed
            internals.count_batch_as_processed(trainer)
            self.processed.append(trainer.fit_loop.epoch_loop.batch_progress.current.processed - before)
            trainer.fit_loop.epoch_loop.batch_progress.current.processed = before

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.ends.append({
            "global_step": trainer.global_step, "accumulate": internals.should_accumulate(trainer),
            "stepped": internals.batches_that_stepped(trainer), "logs": internals.logs_this_step(trainer),
            "pending": set(internals.pending_step_metrics(trainer)),
            "validates": internals.validation_follows(trainer)})

    def on_validation_start(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self.validated_at.append(trainer.global_step)


@pytest.fixture(scope="module")
def watched(tmp_path_factory):
    probe, written = Probe(), Written()
    trainer = L.Trainer(default_root_dir=tmp_path_factory.mktemp("internals"), max_steps=6, accumulate_grad_batches=2,
                        log_every_n_steps=2, val_check_interval=6, limit_val_batches=1, num_sanity_val_steps=0,
                        logger=written, callbacks=[probe], enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu")
    trainer.fit(Logging())
    return probe, written


def test_the_loop_internals_mean_what_diffexp_reads(watched):
    probe, written = watched
    ends = probe.ends
    assert len(ends) == 12  # 6 optimizer steps of 2 micro-batches
    # should_accumulate: the first micro-batch of each step waits, the second steps
    assert [end["accumulate"] for end in ends] == [True, False] * 6
    # batches_that_stepped lags global_step by one at a stepping batch's end (Lightning counts it after)
    assert all(end["stepped"] == end["global_step"] - 1 for end in ends if not end["accumulate"])
    # logs_this_step and pending_step_metrics: what Lightning then writes, at every second step
    logged = {end["global_step"] for end in ends if not end["accumulate"] and end["logs"]}
    assert logged == {2, 4, 6}
    watched_at = {step for step, keys in written.steps.items() if "watched" in keys}
    assert watched_at == {step - 1 for step in logged}  # Lightning's own x: its count of stepped batches
    assert all("watched" in end["pending"] for end in ends if not end["accumulate"] and end["logs"])
    # validation_follows: true at the batch end right before each validation
    assert [end["global_step"] for end in ends if end["validates"]] == probe.validated_at == [3, 6]  # every 6 batches
    assert probe.processed == [1]


def test_checkpoint_internals_save_and_report_their_triggers(tmp_path):
    saved = []

    class Checkpoint(internals.CheckpointInternals):
        def before_save(self, trainer):
            saved.append(("before", trainer.global_step))

        def after_save_last(self, trainer):
            saved.append(("last", trainer.global_step))

        def on_train_end(self, trainer, pl_module):
            self.save_last_now(trainer, self.monitor_candidates(trainer))
            self.save_top_k_now(trainer, self.monitor_candidates(trainer))

    checkpoint = Checkpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=0, save_top_k=1, monitor=None)
    assert (checkpoint.every_n_train_steps, checkpoint.every_n_epochs, checkpoint.train_time_interval) == (0, 0, None)
    trainer = L.Trainer(default_root_dir=tmp_path, max_steps=3, logger=False, callbacks=[checkpoint],
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", max_epochs=-1,
                        limit_val_batches=0)
    trainer.fit(BoringModel())
    assert (tmp_path / "last.ckpt").is_file()
    assert ("before", 3) in saved and ("last", 3) in saved
    assert "step" in checkpoint.monitor_candidates(trainer)
    checkpoint.last_time_checked = 1.5
    assert checkpoint.last_time_checked == 1.5


def test_throughput_internals_read_and_write_through_their_hooks(tmp_path):
    calls = []

    class Monitor(internals.ThroughputInternals):
        def read(self, trainer, pl_module, batch, iter_num):
            calls.append("read")
            super().read(trainer, pl_module, batch, iter_num)

        def write(self, trainer, iter_num=None):
            calls.append("write")
            stage = trainer.state.stage
            samples, lengths, batches = self.counts(stage)
            assert batches >= 1 and samples == batches and lengths == 0  # BoringModel: 1 row a batch, no length_fn
            assert self.started_at(stage) > 0 and self.module_has_flops(trainer.lightning_module) is False

    monitor = Monitor(batch_size_fn=lambda batch: batch.shape[0], window_size=2)
    trainer = L.Trainer(default_root_dir=tmp_path, max_steps=4, logger=Written(), callbacks=[monitor],
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                        limit_val_batches=0, log_every_n_steps=1, enable_checkpointing=False)
    trainer.fit(BoringModel())
    assert calls.count("read") == 4 and "write" in calls
    throughput = next(iter(monitor.all_throughputs()))
    assert callable(throughput.update) and callable(throughput.compute)


def test_progress_bar_internals_gather_and_describe_through_their_hooks(tmp_path):
    calls = []

    class Bar(internals.ProgressBarInternals):
        def gather_metrics(self, trainer, pl_module):
            calls.append("gather")
            super().gather_metrics(trainer, pl_module)

        def train_description(self, current_epoch):
            calls.append("describe")
            return super().train_description(current_epoch)

    trainer = L.Trainer(default_root_dir=tmp_path, max_steps=2, logger=False, callbacks=[Bar()],
                        enable_model_summary=False, accelerator="cpu", limit_val_batches=0,
                        enable_checkpointing=False)
    trainer.fit(BoringModel())
    assert "gather" in calls and "describe" in calls
    assert internals.progress_bar_settings(RichProgressBar(leave=True, console_kwargs={"width": 90})) == {
        "leave": True, "console_kwargs": {"width": 90}}


def test_cli_internals_run_their_steps_through_their_hooks(tmp_path):
    calls = []

    class CLI(internals.CLIInternals):
        def load_checkpoint_hparams(self):
            calls.append("hparams")
            super().load_checkpoint_hparams()

        def build_trainer(self, config, callbacks):
            calls.append("trainer")
            return super().build_trainer(config, callbacks)

        def run_subcommand(self, subcommand):
            calls.append(subcommand)
            super().run_subcommand(subcommand)

    CLI(BoringModel, args=["fit", "--trainer.max_steps=1", "--trainer.logger=false", "--trainer.limit_val_batches=0",
                           "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
                           f"--trainer.default_root_dir={tmp_path}"], save_config_callback=None)
    assert calls == ["hparams", "trainer", "fit"]


def test_strategy_internals_set_the_mesh_for_strategy_and_module():
    strategy, module, mesh = internals.StrategyInternals(), BoringModel(), object()
    strategy.connect(module)
    strategy.use_device_mesh(mesh)
    assert strategy.device_mesh is mesh and module.device_mesh is mesh
    assert callable(strategy.setup_distributed)


def test_the_module_attached_trainer_is_read_through_the_public_property():
    from diffexp.training.module import attached_trainer

    module = BoringModel()
    assert attached_trainer(module) is None
    trainer = L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, accelerator="cpu")
    module.trainer = trainer
    assert attached_trainer(module) is trainer
    torch.manual_seed(0)

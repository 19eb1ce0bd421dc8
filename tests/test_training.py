"""End-to-end runs of the CLI: logs, run directories, resume after a kill, early errors."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch

from diffexp.cli import DiffexpCLI, main
from diffexp.data import TextDataModule
from diffexp.training import DiffexpLM
from tests.helpers import run_cli, scalars, tiny_fit_args, write_recipe


def records(path: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines())}


@pytest.mark.slow
def test_fit_logs_to_tensorboard_and_never_overwrites(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    recipe = write_recipe(tmp_path, attention="dint")
    main(["fit", "--config", str(recipe), "--throughput.peak_tflops=0.001", "--throughput.window_size=2"])
    # the summary's TensorBoard command is the README's: the logger's save_dir, this run among the others there
    assert "tensorboard --logdir runs   (this run: run/version_0, beside" in capsys.readouterr().out
    first = tmp_path / "runs/run/version_0"
    logged = scalars(first)
    flops, mfu = (logged[f"vitals/throughput/device/{name}"] for name in ("flops_per_sec", "mfu"))  # the peak given
    assert [s for s, _ in mfu] == [s for s, _ in flops] and len(mfu) >= 3
    assert all(m == pytest.approx(f / 1e9, rel=1e-5) for (_, f), (_, m) in zip(flops, mfu))
    for tag in ("train/loss", "val/loss", "val/ppl", "train/lr", "vitals/grad_norm", "vitals/throughput/tokens_per_s",
                "val/loss_best",
                "vitals/lambda/layer_00", "vitals/lambda/layer_01", "val/loss_ar_hit", "val/loss_others",
                "vitals/grad_spikes", "vitals/layer_01/act_kurtosis", "vitals/layer_00/attn_logit_max",
                "vitals/act_max_abs"):
        assert tag in logged, tag
    # one step axis, the optimizer steps done: the 2nd step's train/loss and the validation after 6 steps sit at 2
    # and 6, as the CLI prints them
    assert [step for step, _ in logged["val/loss"]] == [6, 12]
    # lambda: at the logging steps (log_every_n_steps 2), as train/loss; the diagnostics: at the steps they were
    # measured (diagnostics.every_n_steps 4: the 1st, 5th and 9th), once each
    lambdas, losses = logged["vitals/lambda/layer_00"], logged["train/loss"]
    assert [s for s, _ in lambdas] == [s for s, _ in losses] == [2, 4, 6, 8, 10, 12]
    for tag in ("vitals/layer_01/act_kurtosis", "vitals/act_max_abs", "vitals/attn_sink", "vitals/layer_00/attn_sink"):
        assert [s for s, _ in logged[tag]] == [1, 5, 9], tag
    # what TensorBoard lists first is train/ and val/: every other tag sorts after them, and none is noise (a
    # running count, an evaluation batch counter, a constant "epoch", one-point parameter counts)
    groups = sorted({tag.split("/")[0] for tag in logged})
    assert groups == ["train", "val", "vitals"], groups
    assert not [tag for tag in logged if tag.split("/")[-1] in ("time", "batches", "samples", "lengths", "epoch")]
    # AR-Hit / Others split the same tokens as val/loss
    share, hit, other = (logged[t][-1][1] for t in ("val/share_ar_hit", "val/loss_ar_hit", "val/loss_others"))
    assert 0 < share < 1
    assert share * hit + (1 - share) * other == pytest.approx(logged["val/loss"][-1][1], rel=1e-4)
    assert (first / "config.yaml").is_file() and (first / "checkpoints/last.ckpt").is_file()
    before = {p: p.stat().st_mtime_ns for p in first.rglob("*") if p.is_file()}

    main(["fit", "--config", str(recipe)])
    assert (tmp_path / "runs/run/version_1/checkpoints/last.ckpt").is_file()
    assert {p: p.stat().st_mtime_ns for p in first.rglob("*") if p.is_file()} == before

    ckpt = torch.load(first / "checkpoints/last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 12
    assert ckpt["hyper_parameters"]["arch"]["attention"] == "dint"

    metrics = {}
    for subcommand, metric in (("validate", "val/loss"), ("test", "test/loss")):
        ckpt = str(first / "checkpoints/last.ckpt")
        cli = DiffexpCLI(DiffexpLM, TextDataModule, auto_configure_optimizers=False,
                         args=[subcommand, "--config", str(recipe), "--ckpt_path", ckpt])
        metrics[metric] = cli.trainer.callback_metrics[metric].item()
    # the checkpoint's weights, not fresh ones: validate reproduces the last val/loss of the fit
    assert metrics["val/loss"] == pytest.approx(logged["val/loss"][-1][1], rel=1e-4)
    assert 0 < metrics["test/loss"] < logged["val/loss"][0][1]


@pytest.mark.slow
def test_resume_after_kill_continues_at_same_step_and_data(tmp_path):
    ref_dir, killed_dir = tmp_path / "ref", tmp_path / "killed"
    ref_dir.mkdir(), killed_dir.mkdir()
    record = '--trainer.callbacks+={{"class_path": "tests.helpers.RecordBatches", "init_args": {{"path": "{}"}}}}'
    run_cli(["fit", "--config", str(write_recipe(ref_dir)), record.format(ref_dir / "batches.jsonl")], ref_dir)

    recipe = write_recipe(killed_dir)
    kill = '--trainer.callbacks+={"class_path": "tests.helpers.KillAtStep", "init_args": {"step": 10}}'
    proc = run_cli(["fit", "--config", str(recipe), record.format(killed_dir / "before.jsonl"), kill], killed_dir,
                   check=False)
    assert proc.returncode == 137
    last = torch.load(killed_dir / "runs/run/version_0/checkpoints/last.ckpt", weights_only=True)
    assert last["global_step"] == 8  # checkpoints every 4 steps; killed after step 10

    proc = run_cli(["fit", "--config", str(recipe), "--ckpt_path", "last",
                    record.format(killed_dir / "after.jsonl")], killed_dir)
    assert not (killed_dir / "runs/run/version_1").exists(), "a resumed run appends to the run it resumes"
    reference, resumed = records(ref_dir / "batches.jsonl"), records(killed_dir / "after.jsonl")
    assert sorted(resumed) == [8, 9, 10, 11]
    for step in resumed:
        assert resumed[step]["checksum"] == reference[step]["checksum"], f"data order differs at step {step}"
        assert resumed[step]["loss"] == pytest.approx(reference[step]["loss"], rel=1e-5, abs=1e-6)
    final = torch.load(killed_dir / "runs/run/version_0/checkpoints/last.ckpt", weights_only=True)
    assert final["global_step"] == 12


@pytest.mark.parametrize(
    "override, message",
    [
        (["--model.arch.attention", "diff_v9"], "attention='diff_v9'"),
        (["--model.arch.rank", "0"], "rank=0"),
        (["--model.arch.lambda_init", "1.5"], "lambda_init=1.5"),
        (["--model.arch.n_heads", "3"], "n_heads=3"),
        (["--model.arch.attention", "diff_v2", "--model.arch.n_kv_heads", "1", "--model.arch.pairing", "cross"],
         "pairing='cross'"),
        (["--data.source", "/nonexistent/corpus.txt"], "/nonexistent/corpus.txt"),
    ],
)
def test_bad_values_fail_before_training(tmp_path, monkeypatch, override, message):
    monkeypatch.chdir(tmp_path)
    recipe = write_recipe(tmp_path)
    with pytest.raises((ValueError, SystemExit)) as err:
        main(["fit", "--config", str(recipe), *override])
    assert message in str(err.value) or message in str(err.value.__context__)
    assert not (tmp_path / "runs").exists()


def test_ckpt_path_last_without_runs_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as err:
        main(["fit", "--config", str(write_recipe(tmp_path)), "--ckpt_path", "last"])
    assert err.value.code == 2
    assert "no run under runs/run/ has checkpoints/last.ckpt" in capsys.readouterr().err


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    from diffexp.training.runs import AtomicCheckpointIO

    io_ = AtomicCheckpointIO()
    target = tmp_path / "checkpoints" / "last.ckpt"
    io_.save_checkpoint({"step": 1, "w": torch.ones(3)}, target)
    real_save = torch.save

    def dies_halfway(obj, f, *args, **kwargs):
        f.write(b"partial bytes")
        raise KeyboardInterrupt  # a kill while writing

    monkeypatch.setattr(torch, "save", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        io_.save_checkpoint({"step": 2, "w": torch.zeros(3)}, target)
    monkeypatch.setattr(torch, "save", real_save)
    assert torch.load(target, weights_only=True)["step"] == 1
    assert [p.name for p in target.parent.iterdir()] == ["last.ckpt"]


def test_cli_trainer_uses_atomic_checkpoints(tmp_path, monkeypatch):
    from diffexp.cli import DiffexpCLI
    from diffexp.data import TextDataModule
    from diffexp.training import DiffexpLM
    from diffexp.training.runs import AtomicCheckpointIO

    monkeypatch.chdir(tmp_path)
    cli = DiffexpCLI(DiffexpLM, TextDataModule, run=False, auto_configure_optimizers=False,
                     args=["--config", str(write_recipe(tmp_path))])
    assert isinstance(cli.trainer.strategy.checkpoint_io, AtomicCheckpointIO)


def test_run_ending_off_the_validation_grid_validates_its_final_weights(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    main(["fit", "--config", str(write_recipe(tmp_path, max_steps=8))])  # validates every 6 steps
    run_dir = tmp_path / "runs/run/version_0"
    val_steps = [step for step, _ in scalars(run_dir)["val/loss"]]
    assert val_steps == [6, 8]  # after 6 steps, then the final weights after 8: the steps done, as printed
    ckpt = torch.load(run_dir / "checkpoints/last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 8
    cli = DiffexpCLI(DiffexpLM, TextDataModule, auto_configure_optimizers=False,
                     args=["validate", "--config", str(tmp_path / "run.yaml"), "--ckpt_path",
                           str(run_dir / "checkpoints/last.ckpt")])
    assert cli.trainer.callback_metrics["val/loss"].item() == pytest.approx(scalars(run_dir)["val/loss"][-1][1],
                                                                           rel=1e-4)


def test_step_based_runs_show_no_negative_epoch_count():
    from lightning.pytorch.callbacks import RichProgressBar

    from diffexp.training.progress import StepProgressBar, use_step_progress_bar

    def description(trainer):
        use_step_progress_bar(trainer)
        bar = trainer.progress_bar_callback
        assert type(bar) is StepProgressBar
        bar._trainer = trainer
        return bar._get_train_description(0).strip()

    # Lightning's own bar shows "Epoch 0/-2" when a run is bounded by steps
    assert description(L.Trainer(max_steps=5, max_epochs=-1, logger=False, enable_checkpointing=False)) == "Epoch 0"
    assert description(L.Trainer(max_epochs=3, logger=False, enable_checkpointing=False)) == "Epoch 0/2"
    configured = RichProgressBar(refresh_rate=7, leave=True)
    trainer = L.Trainer(max_steps=5, callbacks=[configured], logger=False, enable_checkpointing=False)
    use_step_progress_bar(trainer, [configured])
    bar = trainer.progress_bar_callback
    assert type(bar) is StepProgressBar and (bar.refresh_rate, bar._leave) == (7, True)  # its settings kept


def test_the_default_bar_redraws_a_few_times_a_second_and_a_configured_one_as_configured(tmp_path, monkeypatch):
    """Lightning's default bar (refresh_rate 100) redraws after every step on a thread that competes with training;
    diffexp fit's redraws twice a second, unless trainer.callbacks configures a bar."""
    from diffexp.training.cli import build_fit
    from diffexp.training.progress import DEFAULT_REFRESH_RATE, StepProgressBar

    monkeypatch.chdir(tmp_path)
    tiny = tiny_fit_args(tmp_path)
    _, _, trainer = build_fit(tiny)
    assert type(trainer.progress_bar_callback) is StepProgressBar
    assert trainer.progress_bar_callback.refresh_rate == DEFAULT_REFRESH_RATE == 2
    _, _, trainer = build_fit([*tiny, "--trainer.callbacks+=RichProgressBar", "--trainer.callbacks.refresh_rate=20"])
    assert type(trainer.progress_bar_callback) is StepProgressBar and trainer.progress_bar_callback.refresh_rate == 20


def test_the_bar_gathers_its_metrics_after_a_batch_only_when_a_redraw_is_due(monkeypatch):
    """Lightning gathers the bar's metrics after every batch; StepProgressBar only every 1 / refresh_rate s (its
    refresh thread draws no more often), and always at the ends of epochs and validations."""
    from lightning.pytorch.callbacks import RichProgressBar

    from diffexp.training import progress

    clock, gathered = [0.0], []
    monkeypatch.setattr(progress, "monotonic", lambda: clock[0])
    monkeypatch.setattr(RichProgressBar, "_update_metrics", lambda self, trainer, module: gathered.append(clock[0]))
    monkeypatch.setattr(RichProgressBar, "on_train_batch_end",  # Lightning's: update the bar, gather, refresh
                        lambda self, trainer, module, *rest: self._update_metrics(trainer, module))
    bar = progress.StepProgressBar(refresh_rate=2)
    for t in (100.0, 100.1, 100.4, 100.5, 100.7, 101.2):
        clock[0] = t
        bar.on_train_batch_end(None, None, None, None, 0)
    assert gathered == [100.0, 100.5, 101.2]
    clock[0] = 101.3
    bar._update_metrics(None, None)  # an epoch's or a validation's end
    assert gathered[-1] == 101.3


def test_a_run_ending_off_the_logging_grid_ends_with_its_last_steps_values(tmp_path, monkeypatch):
    """Per-step metrics are logged every trainer.log_every_n_steps, and at the last step: callback_metrics, where
    sweeps read a run's results, ends with the last step's train loss and the diagnostics' final counts."""
    from diffexp.training.cli import build_fit

    monkeypatch.chdir(tmp_path)
    module, data, trainer = build_fit([
        *tiny_fit_args(tmp_path), "--data.batch_size", "2", "--trainer.max_steps", "5", "--trainer.log_every_n_steps",
        "3", "--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar", "false"])
    losses = []

    class LastLoss(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(pl_module.last_train_loss))

    trainer.callbacks.append(LastLoss())
    trainer.fit(module, data)
    assert len(losses) == 5
    assert float(trainer.callback_metrics["train/loss"]) == losses[-1] != losses[2]  # not step 2's (logged)
    for key in ("vitals/loss_spikes", "vitals/grad_spikes", "vitals/grad_norm"):
        assert key in trainer.callback_metrics, key
    logged = scalars(Path(trainer.log_dir))
    assert [s for s, _ in logged["train/loss"]] == [3]  # Lightning writes only its logging steps (the 3rd step's)


def test_the_bar_shows_the_steps_loss_without_reading_the_device(tmp_path, monkeypatch):
    """The bar's loss is the value DiffexpLM brought to the host with the step's finite check: gathering the bar's
    metrics reads no tensor (a read of a CUDA tensor would wait for the GPU at every redraw)."""
    import traceback

    from diffexp.training import progress
    from diffexp.training.cli import build_fit

    monkeypatch.chdir(tmp_path)
    module, data, trainer = build_fit([
        *tiny_fit_args(tmp_path), "--data.batch_size", "2", "--trainer.max_steps", "6", "--trainer.log_every_n_steps",
        "2", "--trainer.accumulate_grad_batches", "2", "--trainer.limit_val_batches", "0"])
    bar = trainer.progress_bar_callback
    assert type(bar) is progress.StepProgressBar
    reads, shown = [], []

    def counted(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            reads.append((name, "".join(traceback.format_stack(limit=6)[:-1])))
            return original(self, *args, **kwargs)
        return read

    class AfterEachBatch(L.Callback):  # gathers the bar's metrics as a redraw does, reads counted
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            with monkeypatch.context() as patched:
                for name in ("item", "tolist", "__float__", "cpu"):
                    patched.setattr(torch.Tensor, name, counted(name))
                metrics = bar.get_metrics(trainer, pl_module)
            shown.append((metrics.get("train/loss"), pl_module.shown_train_loss))

    trainer.callbacks.append(AfterEachBatch())
    trainer.fit(module, data)
    assert reads == [], "".join(f"{name} from\n{stack}" for name, stack in reads[:2])
    assert len(shown) == 12 and shown[0] == (None, None)  # before the first optimizer step: nothing read yet
    assert all(text == f"{value:.3f}" for text, value in shown[1:])
    # the last micro-batch's loss of each optimizer step, as train/loss logs it at the logging steps
    assert module.shown_train_loss == float(trainer.callback_metrics["train/loss"])


def test_lightnings_noise_is_dropped_and_its_real_messages_stay():
    """What tells a diffexp user nothing is dropped from Lightning's log: accelerators the machine lacks, the
    "`Trainer.fit` stopped" line that lands on the validation bar's line, and "Seed set to", logged before diffexp's
    checks (the summary states the seed); a GPU that is there, and warnings, stay."""
    import logging

    from diffexp.training.cli import quiet_third_party_noise

    quiet_third_party_noise()
    handlers = [h for name in ("lightning.pytorch", "lightning.fabric") for h in logging.getLogger(name).handlers]
    assert handlers

    def shown(message: str) -> bool:
        record = logging.LogRecord("lightning.pytorch.utilities.rank_zero", logging.INFO, __file__, 1, message, None,
                                   None)
        return all(h.filter(record) for h in handlers)

    for noise in ("GPU available: False, used: False", "TPU available: False, using: 0 TPU cores",
                  "`Trainer.fit` stopped: `max_steps=400` reached.", "Seed set to 1234"):
        assert not shown(noise), noise
    assert shown("GPU available: True (cuda), used: True") and shown("model: diff_v1, parameters total 919,296")


def test_the_summary_states_the_seed_the_run_was_seeded_with(tmp_path, monkeypatch, capsys):
    """Lightning's "Seed set to" line is dropped (it came before any refusal): the summary says the seed instead,
    the one seed_everything was given, which the run is seeded with as before."""
    import os
    from types import SimpleNamespace

    from diffexp.training.report import RunReport, print_summary

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    recipe = write_recipe(tmp_path, attention="baseline", max_steps=2)
    main(["fit", "--config", str(recipe), "--seed_everything", "11"])
    assert "\nseed            11\n" in capsys.readouterr().out
    assert os.environ["PL_GLOBAL_SEED"] == "11"  # seed_everything's record of the seed it set
    unseeded = SimpleNamespace(log_dir=None, is_global_zero=True, callbacks=[RunReport(seed=False)],
                               callback_metrics={}, global_step=0,
                               strategy=SimpleNamespace(root_device=torch.device("cpu")))
    print_summary(unseeded)
    assert "seed            none (seed_everything: false)" in capsys.readouterr().out

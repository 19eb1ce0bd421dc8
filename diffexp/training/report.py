"""What a run tells the person who started it, in plain lines that survive logs without a TTY (CI, SLURM).

`RunReport` prints `val/loss` at each validation when no live progress bar shows it, and collects what the
closing summary needs; `print_summary` writes that one block at the end of `fit`.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from diffexp.parallel.memory import peak_line


def _shows_live_bar(trainer: L.Trainer) -> bool:
    return trainer.progress_bar_callback is not None and sys.stdout.isatty()


class RunReport(L.Callback):
    """Per-validation lines without a TTY, and the numbers of the closing summary."""

    def __init__(self) -> None:
        self.started = time.time()
        self.tokens_per_s: list[float] = []
        self._train_loss: torch.Tensor | float | None = None

    @property
    def train_loss(self) -> float | None:
        """The last micro-batch's train loss (the mean over ranks)."""
        return None if self._train_loss is None else float(self._train_loss)

    def on_fit_start(self, trainer, pl_module) -> None:
        self.started = time.time()
        self.tokens_per_s = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer._logger_connector.should_update_logs:  # a fresh reading (callback_metrics rebuilds a dict)
            value = trainer.callback_metrics.get("vitals/throughput/tokens_per_s")
            if value is not None:
                self.tokens_per_s.append(float(value))
        # the module's loss (the mean over ranks), not `outputs`, which Lightning divides by accumulate_grad_batches;
        # kept here: the final validation replaces the trainer's callback_metrics
        loss = getattr(pl_module, "last_train_loss", None)
        if loss is None:
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if loss is not None:  # read as a float when the run ends (train_loss): no host sync per micro-batch
            self._train_loss = loss.detach() if isinstance(loss, torch.Tensor) else loss

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero or _shows_live_bar(trainer):
            return
        loss = trainer.callback_metrics.get("val/loss")
        if loss is not None:
            print(f"step {trainer.global_step}: val/loss {float(loss):.4f}", flush=True)

    def median_tokens_per_s(self) -> float | None:
        return statistics.median(self.tokens_per_s) if self.tokens_per_s else None


def _number_text(value) -> str:
    return "-" if value is None else f"{float(value):.4f}"


def print_summary(trainer: L.Trainer, ended: str = "done", notes: list[str] = ()) -> None:
    """One block at the end of fit: where the run is, its checkpoints, losses, speed and what to run next; `ended`
    says how it ended (a signal's stop: diffexp.training.preemption), `notes` add lines before the commands."""
    log_dir = trainer.log_dir  # a broadcast under multi-process strategies: every rank takes part
    if not trainer.is_global_zero:
        return
    report = next((c for c in trainer.callbacks if isinstance(c, RunReport)), None)
    run_dir = Path(log_dir) if log_dir else None
    checkpoints = [c for c in trainer.callbacks if isinstance(c, ModelCheckpoint)]
    best = next((c.best_model_path for c in checkpoints if c.best_model_path), "")
    best_score = next((c.best_model_score for c in checkpoints if c.best_model_path), None)
    last = next((c.last_model_path for c in checkpoints if c.last_model_path), "")
    tokens = report.median_tokens_per_s() if report else None
    wall = time.time() - report.started if report else None
    lines = [
        f"run directory   {run_dir or '-'}",
        f"best checkpoint {best or '-'}" + (f" (val/loss {float(best_score):.4f})" if best_score is not None else ""),
        f"last checkpoint {last or '-'}",
        f"final loss      train {_number_text(report.train_loss if report else None)}, "
        f"val {_number_text(trainer.callback_metrics.get('val/loss'))} "
        f"(step {trainer.global_step})",
        f"tokens/s        {tokens:,.0f} (median over steps)" if tokens else "tokens/s        -",
        f"wall time       {wall / 60:.1f} min" if wall is not None else "wall time       -",
    ]
    peak = peak_line(trainer.strategy.root_device, getattr(trainer.strategy, "estimated_memory", None))
    if peak is not None:
        lines.append(f"peak memory     {peak}")
    lines += [f"note            {note}" for note in notes]
    if run_dir is not None and last:
        config = run_dir / "config.yaml"
        lines.append(f"resume          diffexp fit --config {config} --ckpt_path {last}")
    if run_dir is not None:
        study_dir = run_dir.parent.parent
        if (study_dir / "sweep.json").is_file():
            lines.append(f"compare         diffexp compare {study_dir}")
        else:  # the logger's save_dir: this run beside every other run there (the README's command, the same way)
            lines.append(f"compare         tensorboard --logdir {study_dir}   "
                         f"(this run: {run_dir.parent.name}/{run_dir.name}, beside the other runs there)")
    headline = f"== diffexp fit: {ended} "
    print("\n".join(["", headline + "=" * max(3, 71 - len(headline)), *lines, "=" * 71]), flush=True)

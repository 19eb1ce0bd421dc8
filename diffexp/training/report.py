"""What a run tells the person who started it, in plain lines that survive logs without a TTY (CI, SLURM).

`RunReport` prints, when no live progress bar shows them (a log file, a SLURM job), a progress line every
PROGRESS_EVERY_S seconds of training (step, loss, tokens/s, ETA) and `val/loss` at each validation; it collects
what the closing summary needs; `print_summary` writes that one block at the end of `fit`.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from diffexp import lightning_internals as internals
from diffexp.errors import UserError
from diffexp.parallel.memory import peak_line

#: seconds of training between two progress lines without a live bar (the first comes as soon as one has passed);
#: the environment's DIFFEXP_PROGRESS_EVERY_S sets another (0: a line per step)
PROGRESS_EVERY_S = 30.0
PROGRESS_ENV = "DIFFEXP_PROGRESS_EVERY_S"


def progress_interval() -> float:
    text = os.environ.get(PROGRESS_ENV, "").strip()
    if not text:
        return PROGRESS_EVERY_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value < 0:
        raise UserError(f"{PROGRESS_ENV}={text!r} is invalid: expected a number of seconds, 0 or more")
    return value


def _shows_live_bar(trainer: L.Trainer) -> bool:
    return trainer.progress_bar_callback is not None and sys.stdout.isatty()


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def progress_line(step: int, max_steps: int, loss: float | None, tokens_per_s: float | None,
                  seconds_per_step: float | None) -> str:
    """`step 191/400  train/loss 2.345  4,210 tokens/s  ETA 3.2 min` (the parts that are known)."""
    parts = [f"step {step}/{max_steps}" if max_steps > 0 else f"step {step}"]
    if loss is not None:
        parts.append(f"train/loss {loss:.4f}")
    if tokens_per_s:
        parts.append(f"{tokens_per_s:,.0f} tokens/s")
    if seconds_per_step and max_steps > 0:
        parts.append(f"ETA {_duration(max(0, max_steps - step) * seconds_per_step)}")
    return "  ".join(parts)


class RunReport(L.Callback):
    """Per-validation lines without a TTY, and the numbers of the closing summary."""

    def __init__(self, progress_every_s: float | None = None, seed: int | bool | None = None) -> None:
        self.seed = seed  # the run's seed_everything (false: not seeded), for the summary
        self.started = time.time()
        self.tokens_per_s: list[float] = []
        self._train_loss: torch.Tensor | float | None = None
        self.progress_every_s = progress_every_s if progress_every_s is not None else progress_interval()
        self._window: tuple[float, int, int] | None = None  # (time, step, tokens) at the last progress line
        self._tokens = 0  # tokens trained on by every rank since fit started

    @property
    def train_loss(self) -> float | None:
        """The last micro-batch's train loss (the mean over ranks)."""
        return None if self._train_loss is None else float(self._train_loss)

    def on_fit_start(self, trainer, pl_module) -> None:
        self.started = time.time()
        self.tokens_per_s = []

    def on_train_start(self, trainer, pl_module) -> None:
        self._window, self._tokens = (time.monotonic(), trainer.global_step, 0), 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if internals.logs_this_step(trainer):  # a fresh reading (callback_metrics rebuilds a dict)
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
        self._progress(trainer, pl_module, batch)

    def _progress(self, trainer, pl_module, batch) -> None:
        """A progress line once progress_every_s has passed since the last (rank 0, no live bar). The loss is the one
        the step already read to the host (no device read here); the rate and the ETA are over the lines' window."""
        if self._window is None or not trainer.is_global_zero or _shows_live_bar(trainer):
            return
        tokens = batch["tokens"] if isinstance(batch, dict) else batch
        if isinstance(tokens, torch.Tensor) and tokens.dim() == 2:
            self._tokens += tokens[:, :-1].numel() * trainer.world_size
        now = time.monotonic()
        since, step_then, tokens_then = self._window
        if now - since < self.progress_every_s or trainer.global_step == step_then:
            return
        steps = trainer.global_step - step_then
        print(progress_line(trainer.global_step, trainer.max_steps, getattr(pl_module, "shown_train_loss", None),
                            (self._tokens - tokens_then) / (now - since), (now - since) / steps), flush=True)
        self._window = (now, trainer.global_step, self._tokens)

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero or _shows_live_bar(trainer):
            return
        loss = trainer.callback_metrics.get("val/loss")
        if loss is not None:
            print(f"step {trainer.global_step}: val/loss {float(loss):.4f}", flush=True)

    def median_tokens_per_s(self) -> float | None:
        return statistics.median(self.tokens_per_s) if self.tokens_per_s else None


def _seed_text(seed) -> str:
    """The seed_everything a run was seeded with (Lightning replaces true with the seed it drew)."""
    if seed is None or seed is False:
        return "none (seed_everything: false)"
    return str(int(seed))


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
    if report is not None:
        lines.append(f"seed            {_seed_text(report.seed)}")
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

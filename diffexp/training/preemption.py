"""A fit stopped by a signal: SIGTERM (a scheduler's preemption, `kill`), SIGINT (Ctrl-C), SIGUSR1 (what SLURM's
`--signal` sends before a job's time limit).

While training, a signal is noted and nothing else happens until the optimizer step under way has finished: then
every rank agrees to stop (the flag travels in the step's one all-reduce, DiffexpLM.on_before_optimizer_step, or in
one reduction at a validation's end), last.ckpt is saved (RunCheckpoint.stop_for_signal: after the validation that
follows the step, if one does), the summary is printed with the resume command, and the process exits with 128 + the
signal's number (143 for SIGTERM, 130 for SIGINT, 138 for SIGUSR1): the shell's code for "ended by this signal", which
a scheduler reads as interrupted, not done. A save under way, or a validation, runs to its end first.

Before training starts (parsing, data preparation, building) and after it ends (the final validation), a signal
stops the process at once with the same exit code: nothing is trained then, and what was saved stays as it was.
A second Ctrl-C stops at once as well, without saving.

On SIGUSR1 inside a SLURM batch job (Lightning's SLURMEnvironment with auto_requeue, its default), rank 0 asks the
scheduler to requeue the job after the checkpoint is saved, as Lightning does; the requeued job resumes with
`--ckpt_path last` (docs/gpu.md).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

import lightning as L

#: the signals a fit stops on
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def exit_code(signum: int) -> int:
    """128 + the signal's number: what a shell reports for a process ended by that signal."""
    return 128 + int(signum)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class Preempted(SystemExit):
    """Raised on every rank once a signalled fit has saved (or could not save) its checkpoint: exits 128 + signum."""

    def __init__(self, signum: int, step: int | None = None) -> None:
        super().__init__(exit_code(signum))
        self.signum, self.step = signum, step

    def __str__(self) -> str:
        where = f" at step {self.step}" if self.step is not None else ""
        return f"stopped by {signal_name(self.signum)}{where}"


@dataclass
class _State:
    signum: int | None = None  # the first signal received
    deferred: bool = False  # training: note the signal, stop at the step's end
    agreed: bool = False  # every rank knows that some rank was signalled
    announce: bool = True  # this process prints (rank 0)
    previous: dict = field(default_factory=dict)


#: while a `diffexp fit` runs (handling_signals); None otherwise, so a fit built another way (a test, a benchmark)
#: leaves the process's handlers alone
_STATE: _State | None = None


def stop_requested_locally() -> bool:
    """Whether this process received one of SIGNALS during the fit."""
    return _STATE is not None and _STATE.signum is not None


def agreed() -> bool:
    """Whether the ranks agreed to stop at this step (set by note_agreement)."""
    return _STATE is not None and _STATE.agreed


def note_agreement(signalled_ranks: float) -> None:
    """The number of signalled ranks, as the step's all-reduce counted them (the same on every rank)."""
    if _STATE is not None and signalled_ranks > 0:
        _STATE.agreed = True
        if _STATE.signum is None:  # another rank's signal: stop the same way
            _STATE.signum = int(signal.SIGTERM)


def _write(text: str) -> None:
    if _STATE is not None and _STATE.announce:
        try:
            os.write(sys.stderr.fileno(), text.encode())
        except (OSError, ValueError):  # no usable stderr (a closed stream in a test)
            pass


def _handle(signum: int, frame) -> None:
    if _STATE is None:  # after the fit: as if no handler were installed
        raise KeyboardInterrupt if signum == signal.SIGINT else Preempted(signum)
    first = _STATE.signum is None
    if first:
        _STATE.signum = signum
    if not _STATE.deferred:
        if first:
            _write(f"\nreceived {signal_name(signum)}: stopping now, outside training (what was saved stays as it "
                   f"was); exit code {exit_code(signum)}\n")
        raise Preempted(signum)
    if first:
        again = " (Ctrl-C again stops at once, without saving)" if signum == signal.SIGINT else ""
        _write(f"\nreceived {signal_name(signum)}: stopping after this optimizer step and saving a checkpoint"
               f"{again}\n")
    elif signum == signal.SIGINT:
        raise KeyboardInterrupt


def _install() -> None:
    for sig in SIGNALS:
        current = signal.getsignal(sig)
        if current is not _handle:
            _STATE.previous.setdefault(sig, current)
            signal.signal(sig, _handle)


@contextmanager
def handling_signals():
    """Around a whole `diffexp fit`: the handlers installed (stop at once until training starts), then restored."""
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield
        return
    global _STATE
    saved, _STATE = _STATE, _State()
    _install()
    try:
        yield
    finally:
        for sig, handler in _STATE.previous.items():
            signal.signal(sig, handler)
        _STATE = saved


def requeue_if_asked(trainer: L.Trainer) -> str | None:
    """After the checkpoint of a SIGUSR1: requeue the SLURM job (rank 0), as Lightning's SLURMEnvironment does with
    auto_requeue. Returns a line saying what happened, or None when nothing was asked."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    environment = getattr(trainer.strategy, "cluster_environment", None)
    if not isinstance(environment, SLURMEnvironment) or not environment.auto_requeue:
        return None
    if _STATE is None or _STATE.signum != environment.requeue_signal or not trainer.is_global_zero:
        return None
    array_job, array_task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    job = f"{array_job}_{array_task}" if array_job and array_task else os.environ.get("SLURM_JOB_ID")
    if not job:
        return None
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"requeueing SLURM job {job} failed ({err}); resubmit it to resume"
    if done.returncode != 0:
        return f"requeueing SLURM job {job} failed ({done.stderr.strip() or done.returncode}); resubmit it to resume"
    return f"requeued SLURM job {job}: it resumes from the checkpoint above when it starts again"


class Preemption(L.Callback):
    """Switches the handlers to "stop at the step's end" while training, and back after it. Saving and stopping is
    RunCheckpoint's (stop_for_signal); without it (trainer.enable_checkpointing false) this stops without saving."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if _STATE is None or threading.current_thread() is not threading.main_thread():
            return
        _STATE.announce = trainer.is_global_zero
        _install()  # again: Lightning installs its own SIGTERM and SIGUSR1 handlers when fit starts
        _STATE.deferred = True
        if _STATE.signum is not None and not _STATE.agreed:  # received during start-up, after Lightning's handlers
            raise Preempted(_STATE.signum, trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if agreed() and trainer.checkpoint_callback is None:
            stop(trainer, saved=False)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if training_under_way() and trainer.checkpoint_callback is None and agree_now(trainer):
            stop(trainer, saved=False)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if _STATE is not None:  # the final validation and the summary: a signal stops them at once
            _STATE.deferred = False

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if _STATE is not None:
            _STATE.deferred = False


def training_under_way() -> bool:
    """Between on_train_start and on_train_end of a `diffexp fit` (a signal waits for the step's end)."""
    return _STATE is not None and _STATE.deferred


def agree_now(trainer: L.Trainer) -> bool:
    """Outside a training step (a validation's end): whether any rank was signalled, the same answer on every rank
    (one reduction)."""
    if trainer.world_size > 1:
        note_agreement(float(trainer.strategy.reduce_boolean_decision(stop_requested_locally(), all=False)))
    elif stop_requested_locally():
        note_agreement(1.0)
    return agreed()


def stop(trainer: L.Trainer, saved: bool, why: str | None = "trainer.enable_checkpointing is false") -> None:
    """Print the summary (with the resume command when a checkpoint was saved; else `why` none was) and raise
    Preempted on every rank."""
    from diffexp.training.report import print_summary

    signum = _STATE.signum if _STATE is not None and _STATE.signum is not None else int(signal.SIGTERM)
    if _STATE is not None:
        _STATE.deferred = False
    notes = []
    if saved:
        requeued = requeue_if_asked(trainer)
        if requeued:
            notes.append(requeued)
    else:
        notes.append(f"no checkpoint was saved at this step ({why})")
    print_summary(trainer, ended=f"stopped by {signal_name(signum)} at step {trainer.global_step}, "
                                 f"exit code {exit_code(signum)}", notes=notes)
    raise Preempted(signum, trainer.global_step)

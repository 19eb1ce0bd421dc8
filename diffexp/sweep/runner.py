"""`diffexp sweep --config sweeps/<name>.yaml`: run a spec's trials through an Optuna study.

Each trial is one `diffexp fit` process. Workers claim waiting trials under a lock, so none runs a point twice;
a trial whose heartbeat is older than stale_after_s is failed and its point enqueued again, up to max_attempts.

A trial stopped by the machine rather than by itself (a signal, a full disk, a storage outage:
diffexp.sweep.interruptions) uses no attempt and resumes from its checkpoint on the next run; the worker's
storage calls ride out an outage of up to storage_retry_s (diffexp.sweep.outages).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from diffexp.errors import UserError, print_error
from diffexp.secrets import mask_secrets, mask_url
from diffexp.sweep import layout
from diffexp.sweep.check import load_checked_spec
from diffexp.sweep.command import cli_value, fit_args
from diffexp.sweep.gpus import DEVICES_ENV, chosen_devices, run_workers, visible_devices
from diffexp.sweep.interruptions import (
    INFRA_OUTCOMES,
    INTERRUPTED,
    NO_SPACE,
    STORAGE,
    SignalWatch,
    WorkerSignalled,
    is_no_space,
    read_marker,
    signal_name,
    stopped_by_signal,
    write_marker,
)
from diffexp.sweep.outages import RetryingStorage, StorageFull, StorageGaveUp
from diffexp.sweep.records import STORAGE_ENV, NoSpaceError, no_space_message, write_json_atomic
from diffexp.sweep.spec import Point, SpecError, SweepSpec, recipe_record, slugify
from diffexp.sweep.storage import STORAGE_URL_ENV, local_lock, open_storage, resolve_url, translated_errors
from diffexp.sweep.storage import describe as describe_storage
from diffexp.sweep.tune import best_lrs, describe, final_spec, tuning_spec, views_of

HEARTBEAT = "diffexp_heartbeat"
POINT_PARAM = "point"
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)
RESUME_ENV = "DIFFEXP_SWEEP_RESUME"  # the command a `--gpus` worker's messages give for resuming
DUPLICATE = "duplicate of a claimed point"  # a copy enqueued by racing workers, dropped unrun: not an attempt
console = Console(stderr=True)


def print_line(text: str, style: str | None = None) -> None:
    """One plain line on stderr (above the progress bars): never wrapped inside a path, URL or case name."""
    console.print(text, style=style, soft_wrap=True, markup=False, highlight=False)


class SweepRunner:
    def __init__(self, spec: SweepSpec, worker_name: str | None = None, storage_origin: str = "storage",
                 resume: str | None = None) -> None:
        self.spec = spec
        self.url = spec.storage_url
        self.storage_origin = storage_origin  # --storage, DIFFEXP_STORAGE or the spec's storage: for messages
        pinned = f":gpu{os.environ[DEVICES_ENV]}" if DEVICES_ENV in os.environ else ""
        self.worker = worker_name or f"{os.uname().nodename}:{os.getpid()}{pinned}"
        self.points = {p.key: p for p in spec.points()}
        #: the command that resumes this sweep, for every message that stops a worker
        self.resume = resume or f"diffexp sweep --config {shlex.quote(str(spec.source or '<spec>'))}"
        self.watch = SignalWatch()  # its handlers are installed while run() runs
        self.current: tuple[int, Path] | None = None  # the trial claimed and not yet recorded, with its run dir
        with local_lock(self.url):  # the first open creates the schema: one worker at a time
            opened = open_storage(self.url, storage_origin)
        self.storage = RetryingStorage(opened, self.url, describe_storage(self.url, storage_origin),
                                       spec.storage_retry_s, self.resume, wait=self._wait,
                                       say=lambda line: print_line(line, "yellow"))
        with translated_errors(self.url, storage_origin):
            self.study = self._create_or_load()
        self.heartbeat_every = min(10.0, spec.stale_after_s / 3)

    def _wait(self, seconds: float) -> None:
        """Sleep between storage retries; a signal to a worker with no trial running ends the wait (and the
        worker) at once."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if self.watch.signum is not None and self.watch.child is None:
                raise WorkerSignalled(self.watch.signum, self._signalled(None))
            time.sleep(min(0.2, max(0.0, end - time.monotonic())))

    # -- study set-up -------------------------------------------------------------------------------
    def _create_or_load(self) -> optuna.Study:
        spec = self.spec
        with local_lock(self.url):
            study = optuna.create_study(
                study_name=spec.study, storage=self.storage, direction=spec.direction, load_if_exists=True,
                sampler=optuna.samplers.TPESampler(seed=0, multivariate=True))
            fingerprint = study.user_attrs.get("fingerprint")
            if fingerprint is None:
                study.set_user_attr("fingerprint", spec.fingerprint())
                study.set_user_attr("runs_dir", str(spec.study_dir.resolve()))
                study.set_user_attr("objective", spec.objective_metric)
            elif fingerprint != spec.fingerprint():
                raise SpecError(f"study {spec.study!r} in {mask_url(self.url)} was made from a different spec; "
                                "use a new study name (or another storage) for a changed table")
            self._write_sweep_json()
            self._enqueue_missing(study)
        return study

    def _write_sweep_json(self) -> None:
        spec = self.spec
        spec.study_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(spec.study_dir / layout.SWEEP_FILE, {
            "study": spec.study, "spec": str(spec.source) if spec.source else None,
            "cases": [{"name": label, "slug": slugify(label), "overrides": overrides,
                       **({"base": recipe_record(spec.case_bases[case])} if case in spec.case_bases else {})}
                      for label, case, _, overrides in spec.table()],
            "seeds": spec.seeds, "n_trials": spec.n_trials,
            "objective": {"metric": spec.objective_metric, "direction": spec.direction},
            "storage": mask_url(self.url),
            **({"paper": spec.paper} if spec.paper else {}),
            **views_of(spec),
        })

    def _trials_by_point(self, study: optuna.Study) -> dict[str, list[optuna.trial.FrozenTrial]]:
        by_point: dict[str, list[optuna.trial.FrozenTrial]] = {}
        for trial in study.get_trials(deepcopy=False):
            key = trial.user_attrs.get("point")
            if key is not None:
                by_point.setdefault(key, []).append(trial)
        return by_point

    def _enqueue_missing(self, study: optuna.Study) -> None:
        """Enqueue each point that has no finished, waiting or running trial and attempts left."""
        by_point = self._trials_by_point(study)
        for key, point in self.points.items():
            trials = by_point.get(key, [])
            if any(t.state in (*FINISHED, TrialState.WAITING, TrialState.RUNNING) for t in trials):
                continue
            if _attempts_failed(trials) >= self.spec.max_attempts:
                continue
            study.enqueue_trial({POINT_PARAM: key}, user_attrs={"point": key, "case": point.case, "seed": point.seed},
                                skip_if_exists=False)

    def results(self) -> dict[str, float]:
        """Point key -> the objective of its complete trial."""
        return {key: t.value for key, trials in self._trials_by_point(self.study).items() for t in trials
                if key in self.points and t.state == TrialState.COMPLETE and t.value is not None}

    # -- claiming work ----------------------------------------------------------------------------
    def _fail_stale(self) -> int:
        """Record the running trials whose worker is gone: stopped by the machine (its marker says so, at once;
        no attempt used), else stale (no heartbeat for stale_after_s: an attempt, the worker died unannounced)."""
        now, failed = time.time(), 0
        for trial in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            marker = read_marker(trial.user_attrs.get("run_dir"), trial._trial_id)
            beat = trial.system_attrs.get(HEARTBEAT, trial.datetime_start.timestamp() if trial.datetime_start else now)
            if marker is None and now - beat <= self.spec.stale_after_s:
                continue
            try:
                if marker is not None:
                    self.storage.set_trial_user_attr(trial._trial_id, "outcome", marker["outcome"])
                    self.storage.set_trial_user_attr(trial._trial_id, "failure", marker.get("failure", ""))
                else:
                    self.storage.set_trial_user_attr(trial._trial_id, "failure", "stale heartbeat (worker died)")
                self.storage.set_trial_state_values(trial._trial_id, state=TrialState.FAIL)
                failed += 1
            except (RuntimeError, optuna.exceptions.UpdateFinishedTrialError):
                pass  # another worker got there first
        return failed

    def claim(self) -> optuna.Trial | None:
        """A waiting trial this worker now owns, or None when no trial waits."""
        with local_lock(self.url):
            return self._claim()

    def _claim(self) -> optuna.Trial | None:
        study_id = self.study._study_id
        waiting = self.storage.get_all_trials(study_id, deepcopy=False, states=(TrialState.WAITING,))
        # a point with a checkpoint first (an interrupted trial, say): it resumes before new points start
        for frozen in sorted(waiting, key=lambda t: not self._has_checkpoint(t.user_attrs.get("point"))):
            try:
                if not self.storage.set_trial_state_values(frozen._trial_id, state=TrialState.RUNNING):
                    continue  # claimed by another worker between our read and our write
            except optuna.exceptions.UpdateFinishedTrialError:
                continue  # claimed and already finished (e.g. dropped as a duplicate) by another worker
            point = self.points.get(frozen.user_attrs.get("point"))
            if point is not None:  # from here a stop of this worker marks the trial (run()), found by its run_dir
                run_dir = layout.trial_dir(self.spec.study_dir, point.slug, point.seed, point.draw)
                self.current = (frozen._trial_id, run_dir)
                self.storage.set_trial_user_attr(frozen._trial_id, "run_dir", str(run_dir))
            self.storage.set_trial_system_attr(frozen._trial_id, HEARTBEAT, time.time())
            self.storage.set_trial_user_attr(frozen._trial_id, "worker", self.worker)
            trial = optuna.Trial(self.study, frozen._trial_id)
            key = trial.suggest_categorical(POINT_PARAM, sorted(self.points))
            others = [t for t in self._trials_by_point(self.study).get(key, [])
                      if t._trial_id != frozen._trial_id and t.state in (*FINISHED, TrialState.RUNNING)]
            if others:  # enqueued twice by racing workers on a server storage: drop the copy
                self.storage.set_trial_user_attr(frozen._trial_id, "failure", DUPLICATE)
                self.study.tell(trial, state=TrialState.FAIL)
                self.current = None
                continue
            return trial
        return None

    def _stopped(self, trial: optuna.Trial, run_dir: Path, outcome: str, failure: str) -> None:
        """Record a trial stopped by the machine: in its run directory first (the storage may be what is away),
        then in the storage; it uses no attempt and its point is enqueued again at once."""
        write_marker(run_dir, trial._trial_id, outcome, failure)
        self.storage.set_trial_user_attr(trial._trial_id, "outcome", outcome)
        self.storage.set_trial_user_attr(trial._trial_id, "failure", failure)
        self.study.tell(trial, state=TrialState.FAIL)
        self.current = None

    def _signalled(self, trial_line: str | None) -> str:
        signum = self.watch.signum
        what = f"worker stopped by {signal_name(signum)}" if signum is not None else "worker stopped"
        return (f"{what}: " + (trial_line or "no trial was running") + f". Resume with: {self.resume}")

    def _has_checkpoint(self, key: str | None) -> bool:
        point = self.points.get(key) if key else None
        return point is not None and (layout.trial_dir(self.spec.study_dir, point.slug, point.seed, point.draw)
                                      / "checkpoints" / "last.ckpt").exists()

    def _counts(self) -> tuple[int, int, int, int]:
        """(finished points, failed-for-good points, running, total)."""
        by_point = self._trials_by_point(self.study)
        finished = failed = running = 0
        for key in self.points:
            trials = by_point.get(key, [])
            if any(t.state in FINISHED for t in trials):
                finished += 1
            elif any(t.state == TrialState.RUNNING for t in trials):
                running += 1
            elif not any(t.state == TrialState.WAITING for t in trials) and \
                    _attempts_failed(trials) >= self.spec.max_attempts:
                failed += 1
        return finished, failed, running, len(self.points)

    # -- running one trial ------------------------------------------------------------------------
    def _command(self, trial: optuna.Trial, point: Point, run_dir: Path, resume: Path | None) -> list[str]:
        spec = self.spec
        sampled = {key: _suggest(trial, key, space) for key, space in spec.search.items()}
        overrides = spec.trial_overrides(point.base, point.overrides, sampled)
        trial.set_user_attr("overrides", {k: cli_value(v) for k, v in overrides.items()})
        trial.set_user_attr("run_dir", str(run_dir))
        return [sys.executable, "-m", "diffexp", "fit", *fit_args(spec, point, overrides, trial._trial_id, resume)]

    def _prepare_run_dir(self, point: Point) -> tuple[Path, Path | None]:
        """A retried point resumes from its checkpoint; a crashed run with none is moved aside, not overwritten."""
        run_dir = layout.trial_dir(self.spec.study_dir, point.slug, point.seed, point.draw)
        last = run_dir / "checkpoints" / "last.ckpt"
        if last.is_file():
            return run_dir, last
        if run_dir.exists():
            shutil.move(str(run_dir), str(run_dir.with_name(f"{run_dir.name}.crashed-{int(time.time())}")))
        return run_dir, None

    def _run_trial(self, trial: optuna.Trial, progress: Progress, bar) -> str:
        point = self.points[trial.params[POINT_PARAM]]
        run_dir = layout.trial_dir(self.spec.study_dir, point.slug, point.seed, point.draw)
        self.current = (trial._trial_id, run_dir)
        try:
            run_dir, resume = self._prepare_run_dir(point)
            command = self._command(trial, point, run_dir, resume)
            run_dir.mkdir(parents=True, exist_ok=True)
            attempt = len([p for p in run_dir.glob("trial-*.log")]) + 1
            log_path = run_dir / f"trial-{attempt}.log"
            env = {**os.environ, STORAGE_ENV: self.url, "PYTHONUNBUFFERED": "1"}
            if DEVICES_ENV in env:  # the devices this trial's process sees (`--gpus`: its worker's one GPU)
                trial.set_user_attr("devices", env[DEVICES_ENV])
            if self.watch.signum is not None:  # signalled between the claim and the start: never started
                self._stopped(trial, run_dir, INTERRUPTED, f"interrupted by {signal_name(self.watch.signum)}")
                raise WorkerSignalled(self.watch.signum, self._signalled(f"trial {point.key} was claimed, not "
                                                                         "started, and is waiting again"))
            progress.update(bar, description=f"{point.case} seed {point.seed}", completed=0, total=None)
            with open(log_path, "w") as log:
                # its own session: a Ctrl-C in the terminal reaches the worker, which passes it on once
                proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                        preexec_fn=_die_with_parent, start_new_session=True)
        except (NoSpaceError, OSError) as exc:
            if not isinstance(exc, NoSpaceError) and not is_no_space(exc):
                raise
            self._stopped(trial, run_dir, NO_SPACE, "no space left on the device")
            raise NoSpaceError(no_space_message(run_dir) + f" (trial {point.key} was about to start; it has not "
                               "used an attempt)") from None
        self.watch.attach(proc)
        try:
            self._watch_trial(trial, proc, progress, bar, run_dir)
        except (StorageGaveUp, StorageFull) as exc:
            stopped = self._stop_fit(proc)
            outcome = NO_SPACE if isinstance(exc, StorageFull) else STORAGE
            write_marker(run_dir, trial._trial_id, outcome, f"{outcome}: {type(exc).__name__}")
            self.current = None  # the marker stands in for the storage record
            kept = run_dir / "checkpoints" / "last.ckpt"
            where = f"it resumes from {kept}" if kept.exists() else "it had saved no checkpoint and starts again"
            raise type(exc)(f"{exc} Trial {point.key} {stopped}; {where}, and it uses no attempt.") from None
        finally:
            self.watch.attach(None)
        record = _read_record(run_dir / layout.TRIAL_FILE)
        done = (proc.returncode == 0 and record is not None and record.get("trial_id") == trial._trial_id
                and record.get("state") in ("complete", "pruned"))
        signum = self.watch.signum if self.watch.signum is not None else stopped_by_signal(proc.returncode)
        if signum is not None and not done:
            kept = run_dir / "checkpoints" / "last.ckpt"
            where = (f"it resumes from {kept}" if kept.exists() else "it had saved no checkpoint and starts again")
            self._stopped(trial, run_dir, INTERRUPTED, f"interrupted by {signal_name(signum)}")
            line = (f"trial {point.key} stopped (exit {proc.returncode}) and is recorded as interrupted, using no "
                    f"attempt; {where}; log: {log_path}")
            if self.watch.signum is not None:
                raise WorkerSignalled(signum, self._signalled(line))
            print_line(f"{line} (its process was signalled: a scheduler's preemption?)", style="yellow")
            return "interrupted"
        if proc.returncode != 0 and _no_space_hit(run_dir, log_path):
            self._stopped(trial, run_dir, NO_SPACE, "no space left on the device")
            kept = run_dir / "checkpoints" / "last.ckpt"
            raise NoSpaceError(
                f"no space left on the device that holds {run_dir} ({_free(run_dir)} free there): trial "
                f"{point.key} stopped (exit {proc.returncode}, log: {log_path}). "
                + (f"Its checkpoint {kept} is intact. " if kept.exists() else "It had saved no checkpoint yet. ")
                + "It is recorded as stopped by the full disk, not as a failure of the trial, so it uses none of "
                f"max_attempts. Free space on that file system, then resume with: {self.resume}")
        # a diverged run is a result (its trial.json says so, written by this attempt), even when it stopped
        # with an error (a non-finite loss): recorded, never retried
        diverged = (record is not None and record.get("state") == "diverged"
                    and record.get("trial_id") == trial._trial_id)
        if (proc.returncode != 0 and not diverged) or record is None:
            tail = log_path.read_text()[-1500:]
            self.storage.set_trial_user_attr(trial._trial_id, "failure", f"exit code {proc.returncode}")
            self.study.tell(trial, state=TrialState.FAIL)
            self.current = None
            print_line(f"trial {point.key} failed (exit {proc.returncode}); log: {log_path}", style="red")
            print_line(tail)
            return "failed"
        for key, value in record.get("metrics", {}).items():
            trial.set_user_attr(f"metric:{key}", value)
        if diverged:  # finished (Optuna's PRUNED: no objective value), so the point is not enqueued again
            trial.set_user_attr("outcome", "diverged")
            trial.set_user_attr("diverged_step", record.get("diverged_step"))
            self.study.tell(trial, state=TrialState.PRUNED)
            print_line(f"trial {point.key} diverged at step {record.get('diverged_step')} "
                       f"({record.get('divergence')}); recorded as diverged, not retried", style="yellow")
            return "diverged"
        if record["state"] == "pruned":
            self.study.tell(trial, state=TrialState.PRUNED)
            return "pruned"
        value = record["metrics"].get(self.spec.objective_metric)
        if value is None:
            self.study.tell(trial, state=TrialState.FAIL)
            print_line(f"trial {point.key} recorded no {self.spec.objective_metric}", style="red")
            return "failed"
        self.study.tell(trial, value)
        return "complete"

    def _watch_trial(self, trial: optuna.Trial, proc: subprocess.Popen, progress: Progress, bar,
                     run_dir: Path) -> None:
        """Wait for the trial's process: heartbeats (one try each: during an outage the fit trains on and the next
        beat tries again, up to storage_retry_s), progress, and the grace time of a signal passed on to it."""
        last_beat = 0.0
        while proc.poll() is None:
            time.sleep(0.5)
            forwarded = self.watch.forwarded_at
            if forwarded is not None and time.monotonic() - forwarded > self.spec.grace_s and proc.poll() is None:
                print_line(f"the trial did not stop within grace_s={self.spec.grace_s:g} s of the signal: killed; "
                           "it resumes from its last checkpoint", style="yellow")
                _kill_group(proc)
                proc.wait()
                break
            if time.time() - last_beat > self.heartbeat_every:
                self.storage.try_once("set_trial_system_attr", trial._trial_id, HEARTBEAT, time.time())
                last_beat = time.time()
            _show_trial_progress(progress, bar, run_dir)

    def _stop_fit(self, proc: subprocess.Popen) -> str:
        """Stop a running trial the way a scheduler does (SIGTERM: it saves its checkpoint), waiting up to grace_s;
        what became of it, for the message."""
        if proc.poll() is not None:
            return f"had ended (exit {proc.returncode})"
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=self.spec.grace_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            proc.wait()
            return f"did not stop within grace_s={self.spec.grace_s:g} s and was killed"
        return f"was stopped (exit {proc.returncode})"

    # -- the worker loop ----------------------------------------------------------------------------
    def run(self) -> int:
        """The worker loop, with the signal handlers installed; a trial left claimed by a stop (a signal, the
        storage given up, a full disk) is marked in its run directory, so the next worker resumes it at once."""
        with self.watch:
            try:
                return self._loop()
            except (WorkerSignalled, UserError) as stop:
                if self.current is not None:
                    trial_id, run_dir = self.current
                    outcome = INTERRUPTED if isinstance(stop, WorkerSignalled) else \
                        NO_SPACE if isinstance(stop, (StorageFull, NoSpaceError)) else STORAGE
                    write_marker(run_dir, trial_id, outcome, f"{outcome} (worker {self.worker} stopped)")
                raise

    def _loop(self) -> int:
        spec = self.spec
        print_line(f"sweep {spec.study}: {len(self.points)} trials "
                   f"({len(spec.rows())} rows x {len(spec.seeds)} seeds"
                   + (f" x {spec.n_trials} draws" if spec.n_trials > 1 else "")
                   + f"), storage {mask_url(self.url)}, runs in {spec.study_dir}/, worker {self.worker}")
        columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
        with Progress(*columns, console=console, transient=False) as progress:
            overall = progress.add_task("trials done", total=len(self.points))
            current = progress.add_task("waiting", total=None)
            while True:
                if self.watch.signum is not None:
                    raise WorkerSignalled(self.watch.signum, self._signalled(None))
                self._fail_stale()
                with local_lock(self.url):
                    self._enqueue_missing(self.study)
                finished, failed, running, total = self._counts()
                progress.update(overall, completed=finished)
                if finished + failed == total:
                    break
                trial = self.claim()
                if trial is None:  # everything left is running elsewhere: wait for it, or for it to go stale
                    progress.update(current, description=f"waiting for {running} trial(s) of other workers")
                    time.sleep(min(5.0, self.heartbeat_every))
                    continue
                started = time.time()
                outcome = self._run_trial(trial, progress, current)
                self.current = None
                point = self.points[trial.params[POINT_PARAM]]
                value = self.study._storage.get_trial(trial._trial_id).values
                shown = f"{spec.objective_metric}={value[0]:.4f}" if value else ""
                # a line per trial as well, for logs and terminals without live bars
                print_line(f"{outcome}: {point.case}, seed {point.seed} {shown} ({time.time() - started:.0f} s)")
        finished, failed, _, total = self._counts()
        diverged = sum(t.user_attrs.get("outcome") == "diverged" for t in self.study.get_trials(deepcopy=False))
        print_line(f"sweep {spec.study}: {finished}/{total} trials finished"
                   + (f" ({diverged} diverged, recorded as such)" if diverged else "")
                   + f", {failed} failed for good. Compare with: diffexp compare {spec.study_dir}")
        if failed:
            print_line(f"{failed} trial(s) failed by themselves max_attempts={spec.max_attempts} time(s) each (their "
                       f"logs: {spec.study_dir}/<case>/seed<k>/trial-<n>.log). Fix the cause, then raise "
                       "max_attempts in the spec (every failed run counts, so one more than now gives each one "
                       f"more try) and run again: {self.resume}", style="red")
        return 0 if failed == 0 else 1


def _read_record(path: Path) -> dict[str, Any] | None:
    """trial.json, or None when the run wrote none (or an unreadable one)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _attempts_failed(trials: list[optuna.trial.FrozenTrial]) -> int:
    """Failed runs of a point by itself; copies dropped as duplicates never ran, and trials stopped by the machine
    (a signal, a full disk, a storage outage) did not fail: neither uses up its attempts."""
    return sum(t.state == TrialState.FAIL and t.user_attrs.get("failure") != DUPLICATE
               and t.user_attrs.get("outcome") not in INFRA_OUTCOMES for t in trials)


def _suggest(trial: optuna.Trial, key: str, space: dict[str, Any]) -> Any:
    if space["type"] == "float":
        return trial.suggest_float(key, space["low"], space["high"], log=bool(space.get("log")))
    if space["type"] == "int":
        return trial.suggest_int(key, space["low"], space["high"], log=bool(space.get("log")))
    return trial.suggest_categorical(key, space["choices"])


def _show_trial_progress(progress: Progress, bar, run_dir: Path) -> None:
    try:
        state = json.loads((run_dir / "progress.json").read_text())
    except (OSError, ValueError):
        return
    progress.update(bar, completed=state["step"], total=state["max_steps"] if state["max_steps"] > 0 else None)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to a trial's whole process group (its own session), so no data loader worker outlives it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


def _no_space_hit(run_dir: Path, log_path: Path) -> bool:
    """Whether a failed trial ran out of disk: its log says so (diffexp's own no-space errors, or a raw ENOSPC),
    or a write of 1 MiB next to its run directory fails for want of space now."""
    try:
        with open(log_path, "rb") as log:
            log.seek(max(0, log.seek(0, os.SEEK_END) - 8000))
            tail = log.read().decode(errors="replace").lower()
    except OSError:
        tail = ""
    if "no space left on" in tail or "errno 28" in tail:
        return True
    probe = run_dir.parent / f".diffexp-space-probe-{os.getpid()}"
    try:
        with open(probe, "wb") as handle:
            handle.write(b"\0" * 2**20)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as exc:
        return is_no_space(exc)
    finally:
        probe.unlink(missing_ok=True)
    return False


def _free(path: Path) -> str:
    try:
        return f"{shutil.disk_usage(path).free / 2**20:.1f} MiB"
    except OSError:
        return "nothing"


def _die_with_parent() -> None:
    """Linux: a trial (or `--gpus` worker) process gets SIGKILL when its parent dies, so no orphan keeps writing."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    """`diffexp sweep --config SPEC [--storage URL] [--runs-dir DIR] [--gpus auto|N|LIST]`.

    Returns 0 when every trial finished (a diverged trial is finished: its divergence is its result), 1 when
    some failed for good. A bad spec or storage raises UserError before anything is created (diffexp.cli prints
    it as one `error: ...` paragraph and exits 2).
    """
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="diffexp sweep", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="sweep spec, e.g. sweeps/table6.yaml")
    parser.add_argument("--storage", help=f"Optuna storage (sqlite:///..., journal:<path>, RDB URL); default: "
                                          f"${STORAGE_URL_ENV}, else the spec's storage, else runs/<study>/study.db")
    parser.add_argument("--runs-dir", help="override the spec's runs_dir")
    parser.add_argument("--gpus", metavar="auto|N|LIST",
                        help="one worker per GPU, each pinned to its own device (CUDA_VISIBLE_DEVICES), all on the "
                             "study's storage: auto = every visible GPU, N = the first N, LIST = ids such as 0,1,2,3; "
                             "their logs go to <runs>/<study>/workers/")
    args = parser.parse_args(argv)
    # `--gpus` workers name their parent's command (with --gpus), the one that resumes them all
    resume = os.environ.get(RESUME_ENV) or "diffexp sweep " + " ".join(
        shlex.quote(mask_secrets(arg)) for arg in (sys.argv[2:] if argv is None else argv))
    try:
        return _main(args, resume)
    except WorkerSignalled as stop:
        print_line(str(stop), style="yellow")
        return 128 + stop.signum
    except StorageGaveUp as gave_up:
        print_error(str(gave_up))
        return gave_up.exit_code


def _main(args: argparse.Namespace, resume: str) -> int:
    devices = chosen_devices(args.gpus, visible_devices()) if args.gpus is not None else None
    # the structure and every row as `diffexp fit` would see it (a tune_lr spec's short runs too), before any
    # storage or file is made
    spec = load_checked_spec(args.config, repo_root=Path(__file__).resolve().parents[2], runs_dir=args.runs_dir)
    spec.storage, origin = resolve_url(args.storage, spec.storage)
    # a fair lr per case (diffexp.sweep.tune): short runs at every lr, then the comparison
    tuning = tuning_spec(spec) if spec.tune_lr is not None else None
    if devices is not None:
        if tuning is None:
            SweepRunner(spec, storage_origin=origin or "storage", resume=resume)  # makes the study and its queue
        os.environ[RESUME_ENV] = resume  # inherited by the workers
        worker_args = ["--config", args.config] + [arg for flag, value in (("--storage", args.storage),
                                                                           ("--runs-dir", args.runs_dir))
                                                    if value for arg in (flag, value)]
        return run_workers(worker_args, devices, spec.study_dir / "workers",
                           popen=functools.partial(subprocess.Popen, preexec_fn=_die_with_parent))
    if tuning is None:
        return _run(spec, origin, resume)
    # on the same storage (a server holds both studies; SQLite: each in its own dir)
    tuning_runner = SweepRunner(tuning, storage_origin=origin or "storage", resume=resume)
    with translated_errors(tuning_runner.url, tuning_runner.storage_origin):
        tuned = tuning_runner.run()
        best, means = best_lrs(tuning, tuning_runner.results())
    print_line(f"sweep {tuning.study}: " + describe(best, means, spec.objective_metric))
    return max(tuned, _run(final_spec(spec, best, means, tuning.study_dir), origin, resume))


def _run(spec: SweepSpec, origin: str | None, resume: str) -> int:
    runner = SweepRunner(spec, storage_origin=origin or "storage", resume=resume)
    with translated_errors(runner.url, runner.storage_origin):
        return runner.run()

"""`diffexp sweep --config sweeps/<name>.yaml`: run a spec's trials through an Optuna study.

Each trial is one `diffexp fit` process. Workers claim waiting trials under a lock, so none runs a point twice;
a trial whose heartbeat is older than stale_after_s is failed and its point enqueued again, up to max_attempts.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
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

from diffexp.secrets import mask_url
from diffexp.sweep import layout
from diffexp.sweep.check import check_trials
from diffexp.sweep.command import cli_value, fit_args
from diffexp.sweep.gpus import DEVICES_ENV, chosen_devices, run_workers, visible_devices
from diffexp.sweep.spec import Point, SpecError, SweepSpec, load_spec, recipe_record, slugify
from diffexp.sweep.storage import STORAGE_URL_ENV, local_lock, open_storage, resolve_url, translated_errors
from diffexp.sweep.tune import best_lrs, describe, final_spec, tuning_spec, views_of

HEARTBEAT = "diffexp_heartbeat"
POINT_PARAM = "point"
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)
DUPLICATE = "duplicate of a claimed point"  # a copy enqueued by racing workers, dropped unrun: not an attempt
console = Console(stderr=True)


def print_line(text: str, style: str | None = None) -> None:
    """One plain line on stderr (above the progress bars): never wrapped inside a path, URL or case name."""
    console.print(text, style=style, soft_wrap=True, markup=False, highlight=False)


class SweepRunner:
    def __init__(self, spec: SweepSpec, worker_name: str | None = None, storage_origin: str = "storage") -> None:
        self.spec = spec
        self.url = spec.storage_url
        self.storage_origin = storage_origin  # --storage, DIFFEXP_STORAGE or the spec's storage: for messages
        pinned = f":gpu{os.environ[DEVICES_ENV]}" if DEVICES_ENV in os.environ else ""
        self.worker = worker_name or f"{os.uname().nodename}:{os.getpid()}{pinned}"
        self.points = {p.key: p for p in spec.points()}
        with local_lock(self.url):  # the first open creates the schema: one worker at a time
            self.storage = open_storage(self.url, storage_origin)
        with translated_errors(self.url, storage_origin):
            self.study = self._create_or_load()
        self.heartbeat_every = min(10.0, spec.stale_after_s / 3)

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
        from diffexp.sweep.trial import write_json_atomic  # trial.py imports Lightning: not for `sweep --help`

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
        now, failed = time.time(), 0
        for trial in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            beat = trial.system_attrs.get(HEARTBEAT, trial.datetime_start.timestamp() if trial.datetime_start else now)
            if now - beat > self.spec.stale_after_s:
                try:
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
        for frozen in self.storage.get_all_trials(study_id, deepcopy=False, states=(TrialState.WAITING,)):
            try:
                if not self.storage.set_trial_state_values(frozen._trial_id, state=TrialState.RUNNING):
                    continue  # claimed by another worker between our read and our write
            except optuna.exceptions.UpdateFinishedTrialError:
                continue  # claimed and already finished (e.g. dropped as a duplicate) by another worker
            self.storage.set_trial_system_attr(frozen._trial_id, HEARTBEAT, time.time())
            self.storage.set_trial_user_attr(frozen._trial_id, "worker", self.worker)
            trial = optuna.Trial(self.study, frozen._trial_id)
            key = trial.suggest_categorical(POINT_PARAM, sorted(self.points))
            others = [t for t in self._trials_by_point(self.study).get(key, [])
                      if t._trial_id != frozen._trial_id and t.state in (*FINISHED, TrialState.RUNNING)]
            if others:  # enqueued twice by racing workers on a server storage: drop the copy
                self.storage.set_trial_user_attr(frozen._trial_id, "failure", DUPLICATE)
                self.study.tell(trial, state=TrialState.FAIL)
                continue
            return trial
        return None

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
        overrides = {**spec.overrides, **point.overrides, **sampled}
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
        from diffexp.sweep.trial import STORAGE_ENV

        point = self.points[trial.params[POINT_PARAM]]
        run_dir, resume = self._prepare_run_dir(point)
        command = self._command(trial, point, run_dir, resume)
        run_dir.mkdir(parents=True, exist_ok=True)
        attempt = len([p for p in run_dir.glob("trial-*.log")]) + 1
        log_path = run_dir / f"trial-{attempt}.log"
        env = {**os.environ, STORAGE_ENV: self.url, "PYTHONUNBUFFERED": "1"}
        if DEVICES_ENV in env:  # the devices this trial's process sees (`--gpus`: its worker's one GPU)
            trial.set_user_attr("devices", env[DEVICES_ENV])
        progress.update(bar, description=f"{point.case} seed {point.seed}", completed=0, total=None)
        with open(log_path, "w") as log:
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    preexec_fn=_die_with_parent)
            last_beat = 0.0
            while proc.poll() is None:
                time.sleep(0.5)
                if time.time() - last_beat > self.heartbeat_every:
                    self.storage.set_trial_system_attr(trial._trial_id, HEARTBEAT, time.time())
                    last_beat = time.time()
                _show_trial_progress(progress, bar, run_dir)
        record = _read_record(run_dir / layout.TRIAL_FILE)
        # a diverged run is a result (its trial.json says so, written by this attempt), even when it stopped
        # with an error (a non-finite loss): recorded, never retried
        diverged = (record is not None and record.get("state") == "diverged"
                    and record.get("trial_id") == trial._trial_id)
        if (proc.returncode != 0 and not diverged) or record is None:
            tail = log_path.read_text()[-1500:]
            self.storage.set_trial_user_attr(trial._trial_id, "failure", f"exit code {proc.returncode}")
            self.study.tell(trial, state=TrialState.FAIL)
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

    # -- the worker loop ----------------------------------------------------------------------------
    def run(self) -> int:
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
        return 0 if failed == 0 else 1


def _read_record(path: Path) -> dict[str, Any] | None:
    """trial.json, or None when the run wrote none (or an unreadable one)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _attempts_failed(trials: list[optuna.trial.FrozenTrial]) -> int:
    """Failed runs of a point; copies dropped as duplicates never ran and do not use up its attempts."""
    return sum(t.state == TrialState.FAIL and t.user_attrs.get("failure") != DUPLICATE for t in trials)


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
    devices = chosen_devices(args.gpus, visible_devices()) if args.gpus is not None else None
    spec = load_spec(args.config, repo_root=Path(__file__).resolve().parents[2])
    spec.storage, origin = resolve_url(args.storage, spec.storage)
    if args.runs_dir:
        spec.runs_dir = Path(args.runs_dir)
    tuning = tuning_spec(spec) if spec.tune_lr is not None else None
    if tuning is not None:  # a fair lr per case (diffexp.sweep.tune): short runs at every lr, then the comparison
        check_trials(tuning)
    check_trials(spec)  # every row as `diffexp fit` would see it, before any storage or file is made
    if devices is not None:
        if tuning is None:
            SweepRunner(spec, storage_origin=origin or "storage")  # makes the study and its queue, once
        worker_args = ["--config", args.config] + [arg for flag, value in (("--storage", args.storage),
                                                                           ("--runs-dir", args.runs_dir))
                                                    if value for arg in (flag, value)]
        return run_workers(worker_args, devices, spec.study_dir / "workers",
                           popen=functools.partial(subprocess.Popen, preexec_fn=_die_with_parent))
    if tuning is None:
        return _run(spec, origin)
    # on the same storage (a server holds both studies; SQLite: each in its own dir)
    tuning_runner = SweepRunner(tuning, storage_origin=origin or "storage")
    with translated_errors(tuning_runner.url, tuning_runner.storage_origin):
        tuned = tuning_runner.run()
        best, means = best_lrs(tuning, tuning_runner.results())
    print_line(f"sweep {tuning.study}: " + describe(best, means, spec.objective_metric))
    return max(tuned, _run(final_spec(spec, best, means, tuning.study_dir), origin))


def _run(spec: SweepSpec, origin: str | None) -> int:
    runner = SweepRunner(spec, storage_origin=origin or "storage")
    with translated_errors(runner.url, runner.storage_origin):
        return runner.run()

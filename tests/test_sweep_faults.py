"""Sweep workers under the machine's faults, each injected for real: a signal to the worker (a scheduler's
preemption), its PostgreSQL server stopped and restarted, a runs directory or a SQLite storage on a small tmpfs
that fills.

A trial stopped so is recorded as stopped by the machine (interrupted, storage outage, no space), uses none of
max_attempts, and the same `diffexp sweep` command, run again once the cause is gone, resumes it from its
checkpoint and finishes the study with every point complete exactly once.
"""

from __future__ import annotations

import getpass
import json
import os
import pwd
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import optuna
import pytest

from diffexp.checkpoint_io import read_checkpoint
from diffexp.sweep.interruptions import MARKER
from diffexp.sweep.storage import STORAGE_URL_ENV, open_storage
from tests.helpers import free_port, mounted_tmpfs, subprocess_env, write_spec

#: a trial long enough to be caught in flight: 24 steps, a checkpoint every 4, a validation at 12 and 24
LONGER = {"trainer.max_steps": 24, "trainer.val_check_interval": 12, "checkpoint.every_n_train_steps": 4}


def one_point_spec(tmp_path: Path, study: str, **extra) -> Path:
    overrides = extra.pop("more_overrides", {})
    spec = write_spec(tmp_path, study, grid={}, cases={"DIFF": {}}, seeds=[0], **extra)
    _add_overrides(spec, {**LONGER, **overrides})
    return spec


def _add_overrides(spec: Path, overrides: dict) -> None:
    import yaml

    raw = yaml.safe_load(spec.read_text())
    raw["overrides"].update(overrides)
    spec.write_text(yaml.safe_dump(raw))


def start_worker(spec: Path, log: Path, **env: str) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "diffexp", "sweep", "--config", str(spec)], cwd=spec.parent,
                                env=subprocess_env(OMP_NUM_THREADS="1", **env), stdout=out, stderr=subprocess.STDOUT)


def finish(worker: subprocess.Popen, log: Path, timeout: float = 400) -> tuple[int, str]:
    try:
        code = worker.wait(timeout=timeout)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    return code, log.read_text()


def wait_for_step(run_dir: Path, worker: subprocess.Popen, log: Path, step: int, attempt: int = 1,
                  timeout: float = 300) -> None:
    """Until the worker's `attempt`-th run of the trial in run_dir has logged progress at `step` or later."""
    deadline = time.time() + timeout
    while time.time() < deadline and worker.poll() is None:
        try:
            if (run_dir / f"trial-{attempt}.log").exists() and \
                    json.loads((run_dir / "progress.json").read_text())["step"] >= step:
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"the trial never reached step {step} (worker exit {worker.poll()}):\n"
                         f"{log.read_text()[-3000:]}")


def trials_of(url: str, study: str) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name=study, storage=open_storage(url)).get_trials(deepcopy=False)


def states(trials) -> dict[str, Counter]:
    found: dict[str, Counter] = {}
    for t in trials:
        found.setdefault(t.user_attrs["point"], Counter())[t.state.name] += 1
    return found


def one_paragraph(output: str) -> str:
    """The worker's closing `error: ...` paragraph; there is one and no traceback anywhere."""
    assert "Traceback" not in output, output[-3000:]
    assert output.count("error: ") == 1, output[-3000:]
    return output[output.index("error: "):].split("\n")[0]


# ----------------------------------------------------------------------------- the bookkeeping, on a real study


@pytest.mark.parametrize("change, message", [
    ({"grace_s": 0}, "grace_s=0: expected a positive number of seconds"),
    ({"grace_s": "long"}, "grace_s='long' has the wrong type"),
    ({"storage_retry_s": -1}, "storage_retry_s=-1: expected a number of seconds, 0 or more"),
])
def test_bad_grace_or_retry_bounds_are_refused(tmp_path, change, message):
    from diffexp.sweep import SpecError
    from diffexp.sweep.spec import load_spec

    with pytest.raises(SpecError, match=re.escape(message)):
        load_spec(write_spec(tmp_path, "bad", **change))


def test_trials_stopped_by_the_machine_use_no_attempt_and_their_point_is_enqueued_at_once(tmp_path):
    from diffexp.sweep.interruptions import INFRA_OUTCOMES, write_marker
    from diffexp.sweep.runner import SweepRunner
    from diffexp.sweep.spec import load_spec

    spec = load_spec(one_point_spec(tmp_path, "book", max_attempts=1, stale_after_s=3600))
    runner = SweepRunner(spec)
    run_dir = tmp_path / "runs/book/diff/seed0"
    run_dir.mkdir(parents=True)
    for outcome in INFRA_OUTCOMES:  # recorded by the worker itself
        trial = runner.claim()
        runner._stopped(trial, run_dir, outcome, f"{outcome} (test)")
        runner._enqueue_missing(runner.study)
        assert runner._counts() == (0, 0, 0, 1)  # nothing failed for good: the point waits again
    trial = runner.claim()  # recorded from its marker by another worker, at once (no stale wait)
    trial.set_user_attr("run_dir", str(run_dir))
    write_marker(run_dir, trial._trial_id, "interrupted", "interrupted by SIGTERM")
    assert runner._fail_stale() == 1
    runner._enqueue_missing(runner.study)
    assert runner._counts() == (0, 0, 0, 1)
    trial = runner.claim()  # a failure of the trial itself: with max_attempts 1, failed for good
    runner.storage.set_trial_user_attr(trial._trial_id, "failure", "exit code 1")
    runner.study.tell(trial, state=optuna.trial.TrialState.FAIL)
    runner._enqueue_missing(runner.study)
    assert runner._counts() == (0, 1, 0, 1)
    outcomes = [t.user_attrs.get("outcome") for t in runner.study.get_trials(deepcopy=False)]
    assert outcomes == [*INFRA_OUTCOMES, "interrupted", None]


# ----------------------------------------------------------------------------- signals


def test_a_signalled_worker_records_its_trial_interrupted_and_the_rerun_resumes_it(tmp_path):
    """SIGTERM mid-trial: the worker passes it on, records the trial interrupted (no attempt used: with
    max_attempts 1 a counted attempt would fail the point for good) and exits 143; the rerun resumes it from its
    checkpoint at once, with no wait for stale_after_s."""
    spec = one_point_spec(tmp_path, "sig", max_attempts=1, stale_after_s=3600, grace_s=60)
    url = f"sqlite:///{tmp_path / 'runs/sig/study.db'}"
    run_dir = tmp_path / "runs/sig/diff/seed0"
    log = tmp_path / "worker-1.log"
    worker = start_worker(spec, log)
    wait_for_step(run_dir, worker, log, 6)
    worker.send_signal(signal.SIGTERM)
    code, output = finish(worker, log, timeout=120)
    assert code == 128 + signal.SIGTERM, output[-3000:]
    assert "Traceback" not in output
    line = next(line for line in output.splitlines() if line.startswith("worker stopped by SIGTERM"))
    assert "recorded as interrupted, using no attempt" in line and f"Resume with: diffexp sweep --config {spec}" \
        in line
    (trial,) = trials_of(url, "sig")
    assert trial.state.name == "FAIL" and trial.user_attrs["outcome"] == "interrupted"
    assert trial.user_attrs["failure"] == "interrupted by SIGTERM"
    assert json.loads((run_dir / MARKER).read_text())["trial_id"] == trial._trial_id
    # the fit saved the step it stopped at: nothing trained is lost
    stopped_at = int(re.search(r"stopped by SIGTERM at step (\d+)", (run_dir / "trial-1.log").read_text()).group(1))
    assert read_checkpoint(run_dir / "checkpoints/last.ckpt")["global_step"] == stopped_at > 0

    log2 = tmp_path / "worker-2.log"
    started = time.time()
    code, output = finish(start_worker(spec, log2), log2)
    assert code == 0, output[-3000:]
    assert "1/1 trials finished, 0 failed for good" in output
    assert time.time() - started < 3600  # (stale_after_s: the interrupted trial was never waited for)
    assert f"resuming from {run_dir / 'checkpoints/last.ckpt'}" in (run_dir / "trial-2.log").read_text()
    assert states(trials_of(url, "sig")) == {"diff/seed0": Counter({"COMPLETE": 1, "FAIL": 1})}


@pytest.mark.heavy  # three partial runs and a whole one (about two minutes)
def test_two_preemptions_of_one_point_resume_to_the_uninterrupted_objective(tmp_path):
    spec = one_point_spec(tmp_path, "pre", max_attempts=2, stale_after_s=3600)
    url = f"sqlite:///{tmp_path / 'runs/pre/study.db'}"
    run_dir = tmp_path / "runs/pre/diff/seed0"
    for attempt, (sig, step) in enumerate([(signal.SIGTERM, 6), (signal.SIGUSR1, 14)], start=1):
        log = tmp_path / f"worker-{attempt}.log"
        worker = start_worker(spec, log)
        wait_for_step(run_dir, worker, log, step, attempt=attempt)
        worker.send_signal(sig)
        code, output = finish(worker, log, timeout=120)
        assert code == 128 + sig, output[-3000:]
    log = tmp_path / "worker-3.log"
    code, output = finish(start_worker(spec, log), log)
    assert code == 0, output[-3000:]
    trials = trials_of(url, "pre")
    assert [t.user_attrs.get("outcome") for t in trials if t.state.name == "FAIL"] == ["interrupted"] * 2
    (done,) = [t for t in trials if t.state.name == "COMPLETE"]

    (tmp_path / "ref").mkdir()
    reference = one_point_spec(tmp_path / "ref", "pre")
    log = tmp_path / "reference.log"
    code, output = finish(start_worker(reference, log), log)
    assert code == 0, output[-3000:]
    (uninterrupted,) = trials_of(f"sqlite:///{tmp_path / 'ref/runs/pre/study.db'}", "pre")
    assert done.value == uninterrupted.value


# ----------------------------------------------------------------------------- a real PostgreSQL stopped mid-trial

PASSWORD = f"pg-0utage-{secrets.token_hex(6)}"


class Postgres:
    """A throwaway PostgreSQL server of this test alone (its own data directory and port), stopped and started
    at will; as the postgres user when the tests run as root (initdb refuses root)."""

    def __init__(self) -> None:
        missing = [tool for tool in ("initdb", "pg_ctl") if shutil.which(tool) is None]
        if missing:
            pytest.skip(f"PostgreSQL server binaries not on PATH: {', '.join(missing)}")
        self.psycopg = pytest.importorskip("psycopg", reason="psycopg is not installed")
        owner = None
        if os.geteuid() == 0:
            try:
                owner = pwd.getpwnam("postgres")
            except KeyError:
                pytest.skip("running as root with no 'postgres' user to run the server as (initdb refuses root)")
        self.as_owner = {"user": owner.pw_uid, "group": owner.pw_gid, "extra_groups": []} if owner else {}
        self.base = Path(tempfile.mkdtemp(prefix="diffexp-pg-outage-"))
        self.data, self.sockets = self.base / "data", self.base / "sock"
        self.sockets.mkdir()
        pwfile = self.base / "pwfile"
        pwfile.write_text(PASSWORD + "\n")
        for path in (self.base, self.sockets, pwfile):
            if owner:
                os.chown(path, owner.pw_uid, owner.pw_gid)
        self.port, self.user = free_port(), getpass.getuser()
        self._pg("initdb", "-D", str(self.data), "-U", self.user, "--auth=md5", f"--pwfile={pwfile}", "--no-sync",
                 "-E", "UTF8")
        self.start()
        with self.psycopg.connect(host="127.0.0.1", port=self.port, user=self.user, password=PASSWORD,
                                  dbname="postgres", autocommit=True) as conn:
            conn.execute("CREATE DATABASE optuna")

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://{self.user}:{PASSWORD}@127.0.0.1:{self.port}/optuna"

    def _pg(self, *args: str) -> None:
        subprocess.run(list(args), check=True, capture_output=True, text=True, timeout=120, cwd=self.base,
                       **self.as_owner)

    def start(self) -> None:
        self._pg("pg_ctl", "-D", str(self.data), "-l", str(self.base / "server.log"), "-w", "-t", "60", "-o",
                 f"-p {self.port} -k {self.sockets} -c listen_addresses=127.0.0.1 -c fsync=off", "start")

    def stop(self) -> None:
        """As a crash does: no shutdown checkpoint, every connection cut."""
        self._pg("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def remove(self) -> None:
        if (self.data / "postmaster.pid").exists():
            subprocess.run(["pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop"], capture_output=True,
                           timeout=60, cwd=self.base, **self.as_owner)
        shutil.rmtree(self.base, ignore_errors=True)


@pytest.fixture
def own_postgres():
    server = Postgres()
    try:
        yield server
    finally:
        server.remove()


def test_storage_calls_ride_out_a_postgres_restart_and_give_up_in_one_paragraph(own_postgres):
    """The retrying storage on a real server: a call made while it is down returns once it is back; past the
    bound, StorageGaveUp names the masked URL, what failed and the resume command, never Optuna's hint about
    "exceeding max length"."""
    from diffexp.sweep.outages import RetryingStorage, StorageGaveUp
    from diffexp.sweep.storage import describe

    lines: list[str] = []
    storage = RetryingStorage(open_storage(own_postgres.url), own_postgres.url,
                              describe(own_postgres.url, STORAGE_URL_ENV), retry_s=120,
                              resume="diffexp sweep --config s.yaml", say=lines.append)
    study = optuna.create_study(study_name="retry", storage=storage)
    trial_id = storage.create_new_trial(study._study_id)
    own_postgres.stop()
    restart = threading.Timer(4, own_postgres.start)
    restart.start()
    try:
        started = time.monotonic()
        # (not create_new_trial, which Optuna itself retries a few times)
        storage.set_trial_user_attr(trial_id, "point", "p")  # waits for the server
        assert time.monotonic() - started > 3
    finally:
        restart.join()
    assert storage.get_trial(trial_id).user_attrs == {"point": "p"}
    assert len(lines) == 2 and "does not answer" in lines[0] and "answers again after" in lines[1]

    own_postgres.stop()
    storage.retry_s = 2
    with pytest.raises(StorageGaveUp) as gave_up:
        storage.set_trial_user_attr(trial_id, "case", "c")
    message = str(gave_up.value)
    masked = own_postgres.url.replace(PASSWORD, "***")
    assert message.startswith(f"{STORAGE_URL_ENV}='{masked}' did not answer for ")
    assert "(storage_retry_s=2) while calling the storage (set_trial_user_attr): OperationalError" in message
    assert message.endswith("resume with: diffexp sweep --config s.yaml")
    assert PASSWORD not in message + "".join(lines) and "max length" not in message
    assert gave_up.value.exit_code == 75


def wait_for_running_trial(url: str, study: str, worker: subprocess.Popen, log: Path, step: int) -> Path:
    """The run directory of the trial the worker runs, once it has logged progress at `step`."""
    deadline = time.time() + 300
    while time.time() < deadline and worker.poll() is None:
        try:
            running = [t for t in trials_of(url, study) if t.state.name == "RUNNING" and "run_dir" in t.user_attrs]
        except KeyError:  # the study is not made yet
            running = []
        if running:
            wait_for_step(Path(running[0].user_attrs["run_dir"]), worker, log, step)
            return Path(running[0].user_attrs["run_dir"])
        time.sleep(0.2)
    raise AssertionError(f"no trial in flight (worker exit {worker.poll()}):\n{log.read_text()[-3000:]}")


@pytest.mark.heavy  # a 20 s outage inside two trials (about a minute and a half)
def test_a_worker_rides_out_a_postgres_restart_and_finishes_every_trial_once(tmp_path, own_postgres):
    spec = write_spec(tmp_path, "outage", stale_after_s=300, storage_retry_s=120)
    _add_overrides(spec, LONGER)
    log = tmp_path / "worker.log"
    worker = start_worker(spec, log, **{STORAGE_URL_ENV: own_postgres.url})
    try:
        run_dir = wait_for_running_trial(own_postgres.url, "outage", worker, log, step=5)
        own_postgres.stop()
        time.sleep(20)
        assert worker.poll() is None, log.read_text()[-3000:]  # alive through the outage, its fit training on
        own_postgres.start()
    finally:
        code, output = finish(worker, log, timeout=600)
    assert code == 0, output[-3000:]
    assert "does not answer" in output and "answers again after" in output
    assert "max length" not in output and PASSWORD not in output and "Traceback" not in output
    found = states(trials_of(own_postgres.url, "outage"))
    assert sorted(found) == ["head-norm-false/seed0", "head-norm-false/seed1", "head-norm-true/seed0",
                             "head-norm-true/seed1"]
    assert all(counts == Counter({"COMPLETE": 1}) for counts in found.values()), found
    assert len(list(run_dir.glob("trial-*.log"))) == 1  # the trial in flight ran once, through the outage


@pytest.mark.heavy  # two fits around the outage (over two minutes); the retry bound is checked by default above
def test_a_worker_gives_up_on_a_storage_gone_too_long_in_one_paragraph_and_the_rerun_finishes(tmp_path,
                                                                                               own_postgres):
    # 80 steps and a heartbeat every 2 s (stale_after_s / 3): the trial is still training when its heartbeat
    # gives up; the stale rule never fires, since the stopped trial's marker is found first
    spec = one_point_spec(tmp_path, "gone", storage_retry_s=3, stale_after_s=6, max_attempts=1, grace_s=60,
                          more_overrides={"trainer.max_steps": 80})
    log = tmp_path / "worker-1.log"
    worker = start_worker(spec, log, **{STORAGE_URL_ENV: own_postgres.url})
    try:
        run_dir = wait_for_running_trial(own_postgres.url, "gone", worker, log, step=5)
        own_postgres.stop()
        code, output = finish(worker, log, timeout=180)
    finally:
        if not (own_postgres.data / "postmaster.pid").exists():
            own_postgres.start()
    assert code == 75, output[-3000:]
    message = one_paragraph(output)
    masked = own_postgres.url.replace(PASSWORD, "***")
    assert f"{STORAGE_URL_ENV}='{masked}' did not answer for" in message
    assert "(storage_retry_s=3) while writing a trial's heartbeat" in message
    assert f"resume with: diffexp sweep --config {spec}" in message
    assert "Trial diff/seed0 was stopped" in message
    assert PASSWORD not in output and "max length" not in output and "[SQL" not in output
    assert json.loads((run_dir / MARKER).read_text())["outcome"] == "storage outage"

    log = tmp_path / "worker-2.log"
    code, output = finish(start_worker(spec, log, **{STORAGE_URL_ENV: own_postgres.url}), log)
    assert code == 0, output[-3000:]
    trials = trials_of(own_postgres.url, "gone")
    assert states(trials) == {"diff/seed0": Counter({"COMPLETE": 1, "FAIL": 1})}
    assert [t.user_attrs.get("outcome") for t in trials if t.state.name == "FAIL"] == ["storage outage"]
    assert "resuming from" in (run_dir / "trial-2.log").read_text()


# ----------------------------------------------------------------------------- a small tmpfs that fills


@pytest.fixture
def tmpfs(tmp_path):
    """A 64 MiB tmpfs at tmp_path/disk (root only), unmounted afterwards."""
    with mounted_tmpfs(tmp_path / "disk", "64m") as mount:
        yield mount


def fill(disk: Path) -> Path:
    """Write a file until the disk is full (unbuffered: every byte that fits is on it); removing it frees the space."""
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as handle:
        for chunk in (2**20, 4096, 1):
            try:
                while True:
                    handle.write(b"\0" * chunk)
            except OSError:
                pass
    return filler


def test_a_sweep_on_a_full_disk_stops_before_its_first_trial_in_one_paragraph(tmp_path, tmpfs):
    spec = one_point_spec(tmp_path, "fullnow", runs_dir=str(tmpfs / "runs"), storage=f"sqlite:///{tmp_path}/study.db")
    fill(tmpfs)
    log = tmp_path / "worker.log"
    code, output = finish(start_worker(spec, log), log, timeout=120)
    assert code == 2, output[-3000:]
    message = one_paragraph(output)
    assert f"no space left on the device to write {tmpfs}/runs/fullnow/sweep.json" in message
    assert "Free space there, then run the same `diffexp sweep` command again" in message


@pytest.mark.heavy  # two fits around the full disk (about a minute and a half)
def test_a_runs_directory_that_fills_mid_trial_stops_the_worker_and_the_rerun_finishes(tmp_path, tmpfs):
    spec = one_point_spec(tmp_path, "full", runs_dir=str(tmpfs / "runs"), storage=f"sqlite:///{tmp_path}/study.db",
                          max_attempts=1, stale_after_s=3600)
    run_dir = tmpfs / "runs/full/diff/seed0"
    log = tmp_path / "worker-1.log"
    worker = start_worker(spec, log)
    wait_for_step(run_dir, worker, log, 5)
    filler = fill(tmpfs)
    code, output = finish(worker, log, timeout=180)
    assert code == 2, output[-3000:]
    message = one_paragraph(output)
    assert f"no space left on the device that holds {run_dir}" in message
    assert "recorded as stopped by the full disk" in message and "uses none of max_attempts" in message
    assert f"resume with: diffexp sweep --config {spec}" in message
    (trial,) = trials_of(f"sqlite:///{tmp_path}/study.db", "full")
    assert trial.state.name == "FAIL" and trial.user_attrs["outcome"] == "no space"

    filler.unlink()  # space freed: the same command finishes the study
    log = tmp_path / "worker-2.log"
    code, output = finish(start_worker(spec, log), log)
    assert code == 0, output[-3000:]
    assert "1/1 trials finished, 0 failed for good" in output
    assert states(trials_of(f"sqlite:///{tmp_path}/study.db", "full")) == \
        {"diff/seed0": Counter({"COMPLETE": 1, "FAIL": 1})}


@pytest.mark.heavy  # two fits around the full disk (about two minutes)
def test_a_sqlite_storage_on_a_disk_that_fills_stops_the_worker_in_one_paragraph(tmp_path, tmpfs):
    url = f"sqlite:///{tmpfs}/study.db"
    spec = one_point_spec(tmp_path, "dbfull", storage=url, max_attempts=1, stale_after_s=3600)
    run_dir = tmp_path / "runs/dbfull/diff/seed0"
    log = tmp_path / "worker-1.log"
    worker = start_worker(spec, log)
    wait_for_step(run_dir, worker, log, 5)
    filler = fill(tmpfs)
    code, output = finish(worker, log, timeout=180)
    assert code == 2, output[-3000:]
    message = one_paragraph(output)
    assert f"storage='{url}': the storage's disk is full" in message
    assert "max length" not in output
    assert f"resume with: diffexp sweep --config {spec}" in message

    filler.unlink()
    log = tmp_path / "worker-2.log"
    code, output = finish(start_worker(spec, log), log)
    assert code == 0, output[-3000:]
    trials = trials_of(url, "dbfull")
    assert states(trials) == {"diff/seed0": Counter({"COMPLETE": 1, "FAIL": 1})}
    assert [t.user_attrs.get("outcome") for t in trials if t.state.name == "FAIL"] == ["no space"]

"""Sweeps across machines: `diffexp sweep` workers sharing one study on a real PostgreSQL server.

The fixture starts a throwaway server on 127.0.0.1 (a free port, password authentication), and
removes it afterwards. Skipped where the PostgreSQL server binaries or psycopg are missing.
"""

from __future__ import annotations

import csv
import getpass
import json
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import optuna
import pytest

from diffexp.compare import main as compare_main
from diffexp.secrets import mask_url
from diffexp.sweep.storage import STORAGE_URL_ENV, open_storage
from tests.helpers import subprocess_env, write_spec

PASSWORD = f"pg-S3cret-{secrets.token_hex(6)}"


@dataclass
class Server:
    port: int
    user: str
    database: str = "optuna"

    def url(self, form: str = "user:pw@") -> str:
        """The study's URL with the password in each form a user may write it."""
        host = f"127.0.0.1:{self.port}/{self.database}"
        return {"user:pw@": f"postgresql+psycopg://{self.user}:{PASSWORD}@{host}",
                ":pw@": f"postgresql+psycopg://:{PASSWORD}@{host}",  # libpq's default user: the OS user
                "?password=": f"postgresql+psycopg://{self.user}@{host}?password={PASSWORD}"}[form]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def postgres():
    missing = [tool for tool in ("initdb", "pg_ctl") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"PostgreSQL server binaries not on PATH: {', '.join(missing)}")
    psycopg = pytest.importorskip("psycopg", reason="psycopg is not installed (pip install 'diffexp[postgres]')")
    owner = None
    if os.geteuid() == 0:  # initdb refuses to run as root: the server runs as the postgres user
        try:
            owner = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root with no 'postgres' user to run the server as (initdb refuses root)")
    as_owner = {"user": owner.pw_uid, "group": owner.pw_gid, "extra_groups": []} if owner else {}
    base = Path(tempfile.mkdtemp(prefix="diffexp-pg-"))
    data, sockets, pwfile = base / "data", base / "sock", base / "pwfile"
    sockets.mkdir()
    pwfile.write_text(PASSWORD + "\n")
    for path in (base, sockets, pwfile):
        if owner:
            os.chown(path, owner.pw_uid, owner.pw_gid)
    # the role is named like the OS user, so a URL without a user name (libpq's default) logs in too
    server = Server(port=_free_port(), user=getpass.getuser())

    def pg(*args: str) -> None:
        subprocess.run(list(args), check=True, capture_output=True, text=True, timeout=120, cwd=base, **as_owner)

    try:
        pg("initdb", "-D", str(data), "-U", server.user, "--auth=md5", f"--pwfile={pwfile}", "--no-sync",
           "-E", "UTF8")
        pg("pg_ctl", "-D", str(data), "-l", str(base / "server.log"), "-w", "-t", "60", "-o",
           f"-p {server.port} -k {sockets} -c listen_addresses=127.0.0.1 -c fsync=off", "start")
        with psycopg.connect(host="127.0.0.1", port=server.port, user=server.user, password=PASSWORD,
                             dbname="postgres", autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {server.database}")
        yield server
    finally:
        if (data / "postmaster.pid").exists():
            subprocess.run(["pg_ctl", "-D", str(data), "-m", "immediate", "-w", "stop"], capture_output=True,
                           timeout=60, cwd=base, **as_owner)
        shutil.rmtree(base, ignore_errors=True)


def start_worker(spec: Path, url: str, log: Path) -> subprocess.Popen:
    """`diffexp sweep --config SPEC` as each machine runs it: the storage URL only in the environment."""
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "diffexp", "sweep", "--config", str(spec)], cwd=spec.parent,
                                env=subprocess_env(**{STORAGE_URL_ENV: url}), stdout=out, stderr=subprocess.STDOUT)


def wait_for_trial_in_flight(study: optuna.Study, worker: subprocess.Popen, timeout: float = 240) -> Path:
    """The run directory of a trial `worker` is running now: claimed by it, started, not finished."""
    deadline = time.time() + timeout
    while time.time() < deadline and worker.poll() is None:
        for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            run_dir = Path(trial.user_attrs.get("run_dir", "/nonexistent"))
            # the log opens when the trial's process starts; trial.json is written when it ends
            if str(trial.user_attrs.get("worker", "")).endswith(f":{worker.pid}") and \
                    (run_dir / "trial-1.log").exists() and not (run_dir / "trial.json").exists():
                return run_dir
        time.sleep(0.2)
    raise AssertionError(f"worker {worker.pid} never had a trial in flight (exit code {worker.poll()})")


def load_study_when_created(url: str, name: str, timeout: float = 120) -> optuna.Study:
    storage, deadline = open_storage(url), time.time() + timeout
    while True:
        try:
            return optuna.load_study(study_name=name, storage=storage)
        except KeyError:
            if time.time() > deadline:
                raise
            time.sleep(0.5)


# a minute of two worker processes: the protocol is the sqlite run's (tests/test_sweep.py); kept for
# `python -m pytest -m heavy`, like the journal storage
@pytest.mark.heavy
def test_workers_on_two_machines_share_one_postgres_study(postgres, tmp_path, monkeypatch, capsys):
    # 2 cases, 6 steps each; no storage in the spec: every machine gets the URL from DIFFEXP_STORAGE
    spec = write_spec(tmp_path, "pg", seeds=[0], stale_after_s=30)  # no false stale marks under load
    logs = [tmp_path / "worker-a.log", tmp_path / "worker-b.log", tmp_path / "worker-a2.log"]
    worker_a = start_worker(spec, postgres.url("user:pw@"), logs[0])
    worker_b = start_worker(spec, postgres.url("user:pw@"), logs[1])
    try:
        study = load_study_when_created(postgres.url(), "pg")
        try:
            killed_dir = wait_for_trial_in_flight(study, worker_a)
        except AssertionError as err:
            raise AssertionError(f"{err}\n{logs[0].read_text()[-3000:]}") from None
        worker_a.send_signal(signal.SIGKILL)  # the machine dies mid-trial (its trial process goes with it)
        worker_a.wait()
        running = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
        # the other worker may have claimed a trial and not yet recorded its run_dir: skip those
        assert str(killed_dir) in {t.user_attrs.get("run_dir") for t in running}
        # the machine comes back: the same command, the password written as a query parameter this time
        worker_a = start_worker(spec, postgres.url("?password="), logs[2])
        assert worker_a.wait(timeout=400) == 0, logs[2].read_text()[-3000:]
        assert worker_b.wait(timeout=400) == 0, logs[1].read_text()[-3000:]
    finally:
        for worker in (worker_a, worker_b):
            if worker.poll() is None:
                worker.kill()
                worker.wait()

    # every point of the table finished exactly once; the killed attempt was failed as stale, then re-run
    states: dict[str, Counter] = {}
    for trial in study.get_trials(deepcopy=False):
        states.setdefault(trial.user_attrs["point"], Counter())[trial.state.name] += 1
    assert sorted(states) == ["head-norm-false/seed0", "head-norm-true/seed0"]
    assert all(counts["COMPLETE"] == 1 for counts in states.values()), states
    failures = [t.user_attrs.get("failure") for t in study.get_trials(deepcopy=False) if t.state.name == "FAIL"]
    assert failures.count("stale heartbeat (worker died)") == 1, failures
    assert "trials finished" in logs[1].read_text() and "trials finished" in logs[2].read_text()

    # compare reads the study from the server (a URL without a user name, from the environment)
    monkeypatch.setenv(STORAGE_URL_ENV, postgres.url(":pw@"))
    out = tmp_path / "cmp"
    assert compare_main(["--study", "pg", "--out", str(out), "--no-plots"]) == 0
    printed = capsys.readouterr()
    assert "head_norm=true" in printed.out and "head_norm=false" in printed.out
    assert "Missing trials" not in printed.out
    rows = list(csv.DictReader((out / "compare.csv").open()))
    assert [(r["case"], r["n_complete"], r["n_missing"]) for r in rows] == [("head_norm=true", "1", "0"),
                                                                           ("head_norm=false", "1", "0")]

    # the password is nowhere: not in what the workers or compare printed, not in any file they wrote
    assert PASSWORD not in printed.out + printed.err
    written = [p for p in (tmp_path / "runs").rglob("*") if p.is_file()] + list(out.iterdir()) + logs
    assert any(p.name.startswith("events.out.tfevents") for p in written)
    assert any(p.name.startswith("trial-") and p.suffix == ".log" for p in written)
    leaks = [str(p) for p in written if PASSWORD.encode() in p.read_bytes()]
    assert leaks == []
    assert json.loads((tmp_path / "runs/pg/sweep.json").read_text())["storage"] in \
        {mask_url(postgres.url(form)) for form in ("user:pw@", "?password=")}

"""A requeued SLURM job's `--ckpt_path last` (docs/gpu.md's fit script adds it on every requeue) resumes the run that
job trained, found by the job's line in the run's slurm-jobs.txt; a job stopped before its run saved anything starts
a new run instead of refusing; neither resumes another job's run of the same recipe name. Real `diffexp fit`
processes with SLURM's job variables set (SLURM_JOB_ID, SLURM_RESTART_COUNT); tests/test_slurm.py runs the same under
a real scheduler."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from diffexp.checkpoint_io import read_checkpoint
from diffexp.errors import UserError
from diffexp.training.runs import resolve_resume
from diffexp.training.slurm_jobs import JOBS_FILE, jobs_of, record_job
from tests.helpers import assert_bitwise_equal, callback, one_thread_env, weights_at_end, write_recipe

STEPS = 8  # checkpoints every 4 steps


def job_fit(root: Path, job: str | None, restart: int, *args: str, expect: int = 0) -> subprocess.CompletedProcess:
    """`diffexp fit ARGS` as attempt `restart` of SLURM job `job` would run it (the job's variables, no srun);
    outside SLURM for job None."""
    env = one_thread_env(SLURM_JOB_ID=job or "", SLURM_RESTART_COUNT=str(restart))
    if job is None:
        env = {k: v for k, v in env.items() if not k.startswith("SLURM_")}
    proc = subprocess.run([sys.executable, "-m", "diffexp", "fit", *args], cwd=root, env=env, text=True,
                          capture_output=True, timeout=300)
    assert proc.returncode == expect, f"exit {proc.returncode}, expected {expect}\n{proc.stderr[-3000:]}"
    return proc


def make_run(experiment: Path, version: int, job: str | None, saved: tuple[str, ...] = ()) -> Path:
    """runs/<name>/version_<k> as a fit leaves it: its job's record (record_job) and the checkpoints it saved."""
    run = experiment / f"version_{version}"
    (run / "checkpoints").mkdir(parents=True)
    if job is not None:
        record_job(run, job)
    for name in saved:
        (run / "checkpoints" / name).write_bytes(b"")
    return run


def test_last_is_the_jobs_own_run_else_a_new_run_else_the_latest_of_the_name(tmp_path, monkeypatch):
    experiment = tmp_path / "runs/shared"
    make_run(experiment, 0, None, ("last.ckpt",))
    make_run(experiment, 1, "101")  # stopped before its first save
    make_run(experiment, 2, "102", ("last.ckpt",))
    make_run(experiment, 3, "103", ("step000004.ckpt",))  # checkpoint.save_last=false
    make_run(experiment, 4, "104", ("last.ckpt",))  # the newest last.ckpt of the name
    resolve = lambda: resolve_resume("last", str(tmp_path / "runs"), "shared")  # noqa: E731

    monkeypatch.setenv("SLURM_JOB_ID", "102")
    assert resolve() == (experiment / "version_2/checkpoints/last.ckpt", "version_2")
    monkeypatch.setenv("SLURM_JOB_ID", "101")
    assert resolve() == (None, None)  # a new run
    monkeypatch.setenv("SLURM_JOB_ID", "103")
    with pytest.raises(UserError, match=r"SLURM job 103's run .*version_3 has no checkpoints/last.ckpt but saved "
                                        r"step000004.ckpt; pass one of them as --ckpt_path"):
        resolve()
    for job in ("999", None):  # a job no run lists (its first attempt), and outside SLURM: the latest of the name
        if job is None:
            monkeypatch.delenv("SLURM_JOB_ID")
        else:
            monkeypatch.setenv("SLURM_JOB_ID", job)
        assert resolve() == (experiment / "version_4/checkpoints/last.ckpt", "version_4")
    make_run(experiment, 5, "102")  # job 102 started a new run since: that run is the job's now
    monkeypatch.setenv("SLURM_JOB_ID", "102")
    assert resolve() == (None, None)


@pytest.mark.heavy  # five tiny fits (about 100 s on 2 busy cores)
def test_a_requeued_job_resumes_its_own_run_and_one_that_saved_nothing_starts_a_new_one(tmp_path):
    recipe = str(write_recipe(tmp_path, "shared", max_steps=STEPS))
    runs = tmp_path / "runs/shared"
    requeue = ("--ckpt_path", "last")  # what fit.sbatch adds when SLURM_RESTART_COUNT is set

    job_fit(tmp_path, None, 0, "--config", recipe, "--trainer.max_steps", "4")  # version_0: a finished run
    finished = (runs / "version_0/checkpoints/last.ckpt").stat().st_mtime_ns
    early = job_fit(tmp_path, "101", 0, "--config", recipe, callback("SignalAtSetup"), expect=143)  # version_1
    assert not list((runs / "version_1").glob("checkpoints/*.ckpt")), early.stderr[-2000:]
    job_fit(tmp_path, "102", 0, "--config", recipe, callback("SignalAtStep", step=2), expect=143)  # version_2
    assert read_checkpoint(runs / "version_2/checkpoints/last.ckpt", weights=False)["global_step"] == 3
    assert not (runs / "version_0" / JOBS_FILE).exists()  # a fit outside SLURM records nothing
    assert [jobs_of(runs / f"version_{k}") for k in (1, 2)] == [{"101"}, {"102"}]

    # job 101 again: its run saved nothing, so it trains a new run from step 0, resuming neither version_0 nor
    # version_2, the latest last.ckpt of the name
    again = job_fit(tmp_path, "101", 1, "--config", recipe, *requeue, weights_at_end("early"))
    assert f"SLURM job 101 started {Path('runs/shared/version_1')} before and saved no checkpoint there: " \
           "starting a new run" in again.stderr, again.stderr[-2000:]
    assert "resuming from" not in again.stderr
    assert jobs_of(runs / "version_3") == {"101"}

    # job 102 again: version_3 now holds the newest last.ckpt of the name, but job 102 resumes its own version_2
    resumed = job_fit(tmp_path, "102", 1, "--config", recipe, *requeue, weights_at_end("stopped"))
    assert "resuming from runs/shared/version_2/checkpoints/last.ckpt" in resumed.stderr, resumed.stderr[-2000:]
    # both trained STEPS steps from the same start: the new run from scratch, the resumed one across its stop
    assert read_checkpoint(runs / "version_3/checkpoints/last.ckpt", weights=False)["global_step"] == STEPS
    assert_bitwise_equal(tmp_path / "early.pt", tmp_path / "stopped.pt")
    lines = (runs / "version_2" / JOBS_FILE).read_text().splitlines()
    assert [line.split()[:2] for line in lines] == [["job=102", "restart=0"], ["job=102", "restart=1"]]
    assert not (runs / "version_4").exists()
    assert (runs / "version_0/checkpoints/last.ckpt").stat().st_mtime_ns == finished  # untouched

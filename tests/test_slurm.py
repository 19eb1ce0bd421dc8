"""Real SLURM jobs on the one-node cluster .ci/slurm-up runs (munge, slurmctld, slurmd; no mocked scheduler).

The batch scripts are the ones docs/gpu.md and docs/sweeps.md show, run as written: a block whose info string is
`bash file=NAME` is saved as NAME, and the page's `bash slurm` block is the command a user types on the login node.
On this CPU node the test adds to that command only what a GPU script cannot have here (`--gpus-per-node=0`, two
tasks of one CPU), and gives a tiny CPU recipe where the page names a GPU one; the recipes the page names are
parsed by LightningCLI as test_readme parses every other command.

In the default run: the fit script as one 2-task FSDP2 job (about a minute on 2 busy cores). Under -m heavy: that
job requeued mid-run (`scontrol requeue`: SIGTERM to every task, the job run again from the top) and signalled
(`scancel --signal=USR1`, what `--signal=USR1@120` sends before the time limit: the fit requeues its own job), each
resuming to the weights of the uninterrupted job, bit for bit; and the sweep's job array of workers sharing one
storage, the array task running a trial requeued mid-trial.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import time
from collections import Counter
from pathlib import Path

import optuna
import pytest
import torch

from diffexp.checkpoint_io import read_checkpoint
from diffexp.sweep.storage import open_storage
from diffexp.training.slurm_jobs import jobs_of
from tests.helpers import FSDP2, REPO, TINY_OVERRIDES, trials_by_state, write_fsdp_recipe, write_spec

#: what the GPU scripts ask for that this CPU node has not, given on the sbatch line (it overrides #SBATCH)
CPU_NODE = ("--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1")
CPU_ARRAY = ("--array=0-1", "--gpus-per-task=0", "--cpus-per-task=1")


def page_blocks(page: Path) -> tuple[dict[str, str], list[str]]:
    """A page's SLURM blocks: {file name: text} of its `bash file=NAME` blocks, and the command lines of its
    `bash slurm` blocks (continuations joined). test_readme checks the page's other shell blocks; these two kinds
    are not among them, as they run here."""
    files, commands, info, body = {}, [], None, []
    for line in page.read_text().splitlines():
        fence = re.match(r"\s*```(.*)$", line)
        if info is None and fence:
            info, body = fence.group(1).strip(), []
        elif info is not None and fence and not fence.group(1).strip():
            if match := re.fullmatch(r"bash file=(\S+)", info):
                files[match.group(1)] = "\n".join(body) + "\n"
            elif info == "bash slurm":
                text = "\n".join(line for line in body if line.strip() and not line.lstrip().startswith("#"))
                commands += [" ".join(c.split()) for c in text.replace("\\\n", " ").splitlines()]
            info = None
        elif info is not None:
            body.append(line)
    return files, commands


def save_scripts(page: Path, directory: Path) -> list[str]:
    """The page's scripts saved, as written, into `directory`; its login-node commands."""
    files, commands = page_blocks(page)
    assert files and commands, f"{page.name} shows no SLURM script or no command that submits it"
    for name, text in files.items():
        (directory / name).write_text(text)
    return commands


def fit_args_parse(args: list[str]) -> None:
    """The page's `diffexp fit` arguments through LightningCLI's parser (--print_config: parse, print, exit 0)."""
    from diffexp.cli import parse_config

    with contextlib.redirect_stdout(io.StringIO()):
        try:
            parse_config(args, "fit")
        except SystemExit as stop:
            assert stop.code in (0, None), f"diffexp fit {shlex.join(args)}: exit {stop.code}"


def job_log(directory: Path, job: str) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted(directory.glob(f"slurm-*{job}*.out")))


def fit_job(slurm, tmp_path: Path, name: str, steps: int, *extra: str) -> str:
    """gpu.md's fit.sbatch submitted as the page says, on a tiny 2-rank FSDP2 CPU recipe named `name` (and `extra`
    fit arguments)."""
    [command] = save_scripts(REPO / "docs/gpu.md", tmp_path)
    argv = shlex.split(command)
    assert argv[:2] == ["sbatch", "fit.sbatch"], command
    fit_args_parse(argv[2:])  # the page's GPU recipes: a valid fit
    recipe = write_fsdp_recipe(tmp_path, name, devices=2, batch=2, strategy=FSDP2 % "false", steps=steps)
    return slurm.sbatch(tmp_path / "fit.sbatch", *CPU_NODE, args=("--config", recipe.name, *extra))


def test_the_fit_script_of_gpu_md_trains_one_fsdp2_run_over_its_two_srun_tasks(slurm, tmp_path):
    """srun's two tasks are one 2-rank FSDP2 run (one shard each, the trained weights consolidated), not two
    1-process runs: Lightning took its world from SLURM's environment, and the job ends COMPLETED."""
    job = fit_job(slurm, tmp_path, "slurmfit", steps=2)
    [done] = slurm.wait(job, timeout=400)
    log = job_log(tmp_path, job)
    assert (done["JobState"], done["ExitCode"]) == ("COMPLETED", "0:0"), log[-3000:]
    assert "FSDP2 over 2 rank(s)" in log and "Starting with 2 processes" in log, log[-3000:]
    last = tmp_path / "runs/slurmfit/version_0/checkpoints/last.ckpt"
    assert sorted(p.name for p in last.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert not (tmp_path / "runs/slurmfit/version_1").exists()  # one run, not one per task
    saved = read_checkpoint(last)
    assert saved["global_step"] == 2
    trained = torch.load(tmp_path / "slurmfit.pt", weights_only=True)
    weights = {k.removeprefix("model."): v for k, v in saved["state_dict"].items()}
    assert weights.keys() == trained.keys() and all(torch.equal(weights[k], trained[k]) for k in trained)


def last_step(run: Path) -> int:
    last = run / "checkpoints/last.ckpt"
    try:  # a sharded checkpoint is a directory, swapped in whole; a file is renamed into place
        return read_checkpoint(last)["global_step"] if last.exists() else 0
    except (OSError, RuntimeError, ValueError):  # swapped while being read
        return 0


def preempt_when_saved(slurm, tmp_path: Path, steps: int, commands: dict[str, tuple[str, ...]],
                       jobs: dict[str, str]) -> dict[str, int]:
    """For each job (by its run's name): once its run has saved a checkpoint (every 4 steps) and has steps left,
    run its command (scancel, scontrol) on it; then wait for SLURM to queue each again and let it start at once.
    The step each first attempt saved last."""
    runs = {name: tmp_path / f"runs/{name}/version_0" for name in jobs}
    pending, deadline = dict(commands), time.monotonic() + 400
    while pending:
        for name in list(pending):
            if 4 <= last_step(runs[name]) < steps - 8:
                slurm.run(*pending.pop(name), jobs[name])
        assert time.monotonic() < deadline, [job_log(tmp_path, jobs[name])[-2000:] for name in pending]
        time.sleep(0.2)
    for job in jobs.values():
        slurm.wait(job, until=lambda j: j[0]["Restarts"] == "1" and j[0]["JobState"] == "PENDING", timeout=180)
        slurm.release(job)
    return {name: last_step(run) for name, run in runs.items()}


@pytest.mark.heavy  # three 2-task jobs of 24 steps side by side, two of them run twice (about 4 min on 2 cores)
def test_a_preempted_fit_job_resumes_to_the_weights_of_the_uninterrupted_job(slurm, tmp_path):
    """Two preemptions of gpu.md's fit job, each against the same job left alone:
    - `scontrol requeue` (what a preempting scheduler does): SIGTERM to every task; the fit saves the step it was
      on and exits 143, SLURM queues the job again;
    - `scancel --signal=USR1` (what `--signal=USR1@120` sends before the time limit): the fit saves, exits 138 and
      requeues its own job.
    Both rerun the script, whose `${SLURM_RESTART_COUNT:+--ckpt_path last}` resumes from the saved step, append to
    the run's version directory, and end on the uninterrupted job's weights, bit for bit. The USR1 job also guards
    against Lightning's own SLURM handler coming back: it saved from inside the signal handler, mid-collective, and
    such a job died of a gloo size mismatch (srun exit 134, nothing saved, no requeue)."""
    steps = 24
    reference = fit_job(slurm, tmp_path, "alone", steps)
    preempted = {"requeued": fit_job(slurm, tmp_path, "requeued", steps),
                 "timed": fit_job(slurm, tmp_path, "timed", steps)}
    saved = preempt_when_saved(slurm, tmp_path, steps, {"requeued": ("scontrol", "requeue"),
                                                        "timed": ("scancel", "--signal=USR1")}, preempted)
    [alone] = slurm.wait(reference, timeout=600)
    assert alone["JobState"] == "COMPLETED", job_log(tmp_path, reference)[-3000:]
    uninterrupted = torch.load(tmp_path / "alone.pt", weights_only=True)
    signals = {"requeued": ("SIGTERM", 143), "timed": ("SIGUSR1", 138)}
    for name, job in preempted.items():
        [done] = slurm.wait(job, timeout=600)
        log = job_log(tmp_path, job)
        assert (done["JobState"], done["ExitCode"], done["Restarts"]) == ("COMPLETED", "0:0", "1"), log[-3000:]
        signame, code = signals[name]
        assert f"stopped by {signame} at step {saved[name]}, exit code {code}" in log, log[-4000:]
        assert f"resuming from runs/{name}/version_0/checkpoints/last.ckpt" in log, log[-3000:]
        if name == "timed":
            assert f"requeued SLURM job {job}" in log, log[-3000:]
        run = tmp_path / f"runs/{name}"
        assert not (run / "version_1").exists() and list((run / "version_0").glob("config.resumed-*.yaml"))
        resumed = torch.load(tmp_path / f"{name}.pt", weights_only=True)
        assert resumed.keys() == uninterrupted.keys()
        for key in uninterrupted:
            assert torch.equal(resumed[key], uninterrupted[key]), (name, key)


@pytest.mark.heavy  # one 2-task job of 8 steps, then a second one requeued before its first save (about 3 min)
def test_a_fit_job_requeued_before_its_first_save_starts_a_new_run_and_resumes_no_other(slurm, tmp_path):
    """A job preempted while it prepares its data (here: held at setup on its first attempt) has a run directory
    but no checkpoint. Its requeue's `--ckpt_path last` starts a new run, trained from scratch to the weights of the
    job before it, instead of refusing or resuming that earlier job's finished run of the same name."""
    steps = 8
    earlier = fit_job(slurm, tmp_path, "early", steps)  # version_0
    [done] = slurm.wait(earlier, timeout=400)
    assert done["JobState"] == "COMPLETED", job_log(tmp_path, earlier)[-3000:]
    finished = torch.load(tmp_path / "early.pt", weights_only=True)
    saved_at = (tmp_path / "runs/early/version_0/checkpoints/last.ckpt").stat().st_mtime_ns
    hold = "--trainer.callbacks+=" + json.dumps({"class_path": "tests.helpers.HoldFirstAttempt"})
    job = fit_job(slurm, tmp_path, "early", steps, hold)
    held = tmp_path / "runs/early/version_1"
    deadline = time.monotonic() + 300
    while not jobs_of(held):  # the run directory exists and lists the job: the fit is at its setup
        assert time.monotonic() < deadline, job_log(tmp_path, job)[-3000:]
        time.sleep(0.2)
    slurm.run("scontrol", "requeue", job)
    slurm.wait(job, until=lambda j: j[0]["Restarts"] == "1" and j[0]["JobState"] == "PENDING", timeout=180)
    slurm.release(job)
    [done] = slurm.wait(job, timeout=600)
    log = job_log(tmp_path, job)
    assert (done["JobState"], done["ExitCode"], done["Restarts"]) == ("COMPLETED", "0:0", "1"), log[-3000:]
    assert not list(held.glob("checkpoints/*")), log[-3000:]
    assert (f"SLURM job {job} started runs/early/version_1 before and saved no checkpoint there: starting a new run"
            in log), log[-3000:]
    assert "resuming from" not in log
    rerun = tmp_path / "runs/early/version_2"
    assert jobs_of(rerun) == {job} and read_checkpoint(rerun / "checkpoints/last.ckpt")["global_step"] == steps
    rerun_weights = torch.load(tmp_path / "early.pt", weights_only=True)  # from scratch: the earlier job's, bit for bit
    assert rerun_weights.keys() == finished.keys()
    assert all(torch.equal(rerun_weights[k], finished[k]) for k in finished)
    assert (tmp_path / "runs/early/version_0/checkpoints/last.ckpt").stat().st_mtime_ns == saved_at
    assert not list((tmp_path / "runs/early/version_0").glob("config.resumed-*.yaml"))


@pytest.mark.heavy  # four tiny trials of 40 steps on a 2-task array, one task requeued (a few minutes)
def test_the_sweep_array_of_sweeps_md_runs_every_trial_once_and_a_requeued_tasks_trial_is_resumed(slurm, tmp_path):
    """sweeps.md's job array: two workers, each an array task with its own CPU, on one journal storage; every
    point completes exactly once; an array task requeued in the middle of a trial leaves it to be resumed from
    its checkpoint (by whichever worker claims it next), and no finished trial runs again."""
    commands = save_scripts(REPO / "docs/sweeps.md", tmp_path)
    export, submit = (shlex.split(c) for c in commands)
    assert export[0] == "export" and export[1].startswith("DIFFEXP_STORAGE=journal:$PWD/"), export
    assert submit[:2] == ["sbatch", "sweep.sbatch"] and submit[2].startswith("sweeps/"), submit
    assert (REPO / submit[2]).is_file()
    url = export[1].split("=", 1)[1].replace("$PWD", str(tmp_path))
    overrides = {**TINY_OVERRIDES, "trainer.max_steps": 40, "trainer.val_check_interval": 20,
                 "checkpoint.every_n_train_steps": 4, "data.cache_dir": str(tmp_path / "cache")}
    spec = write_spec(tmp_path, "slurmsweep", overrides=overrides, stale_after_s=20, max_attempts=3)
    job = slurm.sbatch(tmp_path / "sweep.sbatch", *CPU_ARRAY, args=(spec.name,), env={"DIFFEXP_STORAGE": url})
    study = tmp_path / "runs/slurmsweep"

    def in_flight() -> dict[str, str]:  # the array task running a trial that has saved a checkpoint: its point
        found = {}
        with contextlib.suppress(Exception):  # the study may not exist yet
            for trial in optuna.load_study(study_name="slurmsweep", storage=open_storage(url)).get_trials(
                    deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
                point, pid = trial.user_attrs["point"], trial.user_attrs["worker"].split(":")[1]
                saved = list((study / point).glob("**/checkpoints/last.ckpt"))
                if saved and 4 <= last_step(saved[0].parent.parent) < 32:
                    found[owner_of(pid)] = point
        return {task: point for task, point in found.items() if task}

    def owner_of(pid: str) -> str | None:  # the array task whose processes include the worker's
        for task in slurm.jobs(job):
            listed = slurm.run("scontrol", "listpids", task["JobId"], check=False).split()
            if pid in listed:  # named as ARRAY_TASK: the first task's own JobId is the array's, all of it
                return f"{task['ArrayJobId']}_{task['ArrayTaskId']}"
        return None

    deadline = time.monotonic() + 400
    while not (busy := in_flight()):
        assert time.monotonic() < deadline, "no trial saved a checkpoint"
        time.sleep(0.5)
    task, point = next(iter(busy.items()))
    running = [t for t in slurm.jobs(job) if t["JobState"] == "RUNNING"]
    assert len(running) == 2 and running[0]["CPU_IDs"] != running[1]["CPU_IDs"], running  # a CPU per task
    slurm.run("scontrol", "requeue", task)
    slurm.wait(task, until=lambda jobs: jobs[0]["Restarts"] == "1" and jobs[0]["JobState"] == "PENDING", timeout=120)
    slurm.release(task)
    tasks = slurm.wait(job, timeout=900)
    assert [t["JobState"] for t in tasks] == ["COMPLETED", "COMPLETED"], [job_log(tmp_path, job)[-3000:]]
    states = trials_by_state(url, "slurmsweep")
    assert sorted(states) == ["head-norm-false/seed0", "head-norm-false/seed1",
                              "head-norm-true/seed0", "head-norm-true/seed1"]
    assert all(c["COMPLETE"] == 1 and c["RUNNING"] == 0 for c in states.values()), states
    # the requeued task's trial ran again (its first attempt failed as stale, or was marked interrupted), resuming
    # from its checkpoint; every other trial ran once
    assert all(c == Counter({"COMPLETE": 1}) for p, c in states.items() if p != point), states
    assert list((study / point).glob("**/config.resumed-*.yaml")), "the interrupted trial started over"
    assert not [p for p in states if p != point and list((study / p).glob("**/config.resumed-*.yaml"))]
    workers = {t.user_attrs.get("worker") for t in optuna.load_study(study_name="slurmsweep", storage=open_storage(url))
               .get_trials(deepcopy=False) if t.state.name == "COMPLETE"}
    assert len(workers) >= 2, workers  # both array tasks claimed trials

"""Which run a SLURM job trains, so that a requeued job resumes its own run and no other.

A fit inside a SLURM job (SLURM_JOB_ID set; a job array's tasks each have their own) appends a line to its run
directory's `slurm-jobs.txt` when it starts: the job, its restart count, the host and the time. A requeued job runs
its script again from the top with `--ckpt_path last` (docs/gpu.md); resolve_resume then looks for the run that
lists this job before anything else:

- the job's run has last.ckpt: it resumes that run, even where another job of the same recipe name saved later;
- the job's run saved nothing yet (the job was stopped during data preparation or its first steps): a new run starts,
  as the first attempt did, instead of refusing or resuming another job's run;
- no run lists the job (its first attempt, or a job submitted to continue an earlier job's run): `last` means the
  latest last.ckpt of the recipe's name, as outside SLURM.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

#: in a run directory: one line per SLURM job attempt that trained the run
JOBS_FILE = "slurm-jobs.txt"


def current_job() -> str | None:
    """This process's SLURM job (SLURM_JOB_ID), or None outside SLURM."""
    return os.environ.get("SLURM_JOB_ID") or None


def record_job(run_dir: Path, job: str) -> None:
    """Append this attempt of `job` to the run's record (global rank 0 only: one line per attempt)."""
    restart = os.environ.get("SLURM_RESTART_COUNT", "0")
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with open(run_dir / JOBS_FILE, "a", encoding="utf-8") as f:
            f.write(f"job={job} restart={restart} host={socket.gethostname()} started={stamp}\n")
    except OSError as err:  # a full disk stops the fit at its first save, which says so; this only warns
        print(f"warning: could not record SLURM job {job} in {run_dir / JOBS_FILE} ({err.strerror or err}); "
              "if the job is requeued, --ckpt_path last resumes the latest run of this name", file=sys.stderr)


def jobs_of(run_dir: Path) -> set[str]:
    """The SLURM jobs a run's record lists (empty for a run trained outside SLURM)."""
    try:
        lines = (run_dir / JOBS_FILE).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return set()
    return {field.removeprefix("job=") for line in lines for field in line.split()[:1] if field.startswith("job=")}


def run_of_job(runs: list[Path], job: str) -> Path | None:
    """The first of `runs` (newest first) whose record lists `job`, or None."""
    return next((run for run in runs if job in jobs_of(run)), None)

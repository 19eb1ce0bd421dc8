"""Without a live bar (a log file, a SLURM job), a fit says where it is every DIFFEXP_PROGRESS_EVERY_S seconds
(30 unless set): step, train/loss, tokens/s and the ETA, so a log is never silent between validations."""

from __future__ import annotations

import re
import subprocess
import sys

from diffexp.training.report import progress_line
from tests.helpers import one_thread_env, write_recipe


def test_the_line_says_step_loss_rate_and_eta():
    assert progress_line(191, 400, 2.34567, 4210.4, 0.5) == \
        "step 191/400  train/loss 2.3457  4,210 tokens/s  ETA 1.7 min"
    assert progress_line(10, -1, None, None, 0.5) == "step 10"  # no max_steps: no ETA
    assert progress_line(1, 100_000, 3.0, 10.0, 2.0).endswith("ETA 55.6 h")


def test_a_fit_without_a_tty_prints_progress_lines(tmp_path):
    recipe = write_recipe(tmp_path, "lines", max_steps=6)
    proc = subprocess.run([sys.executable, "-m", "diffexp", "fit", "--config", str(recipe)], cwd=tmp_path,
                          env=one_thread_env(DIFFEXP_PROGRESS_EVERY_S="0"), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = re.findall(r"^step (\d+)/6  train/loss \d+\.\d{4}  [\d,]+ tokens/s  ETA \d+ s$", proc.stdout, re.M)
    assert [int(step) for step in lines] == [1, 2, 3, 4, 5, 6]


def test_a_bad_interval_is_refused_before_any_file(tmp_path):
    recipe = write_recipe(tmp_path, "bad", max_steps=2)
    proc = subprocess.run([sys.executable, "-m", "diffexp", "fit", "--config", str(recipe)], cwd=tmp_path,
                          env=one_thread_env(DIFFEXP_PROGRESS_EVERY_S="soon"), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2
    assert "DIFFEXP_PROGRESS_EVERY_S='soon' is invalid: expected a number of seconds, 0 or more" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "runs").exists()

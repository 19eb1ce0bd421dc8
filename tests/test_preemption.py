"""A fit stopped by a signal (a scheduler's SIGTERM, Ctrl-C's SIGINT, SLURM's `--signal` SIGUSR1): it finishes the
optimizer step under way, saves last.ckpt of that step, prints its summary with the resume command and exits with
128 + the signal's number; resumed, it ends on the weights of a run never stopped. Real signals to real `diffexp
fit` processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from diffexp.checkpoint_io import read_checkpoint
from diffexp.training import preemption
from tests.helpers import assert_bitwise_equal, callback, one_thread_env, scalars, weights_at_end, write_recipe

STEPS = 12  # the tiny recipe: checkpoints every 4 steps, validation every 6, logs every 2


def fit(root: Path, *args: str, expect: int = 0, timeout: int = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "diffexp", "fit", *args], cwd=root, env=one_thread_env(), text=True,
                          capture_output=True, timeout=timeout)
    assert proc.returncode == expect, f"exit {proc.returncode}, expected {expect}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """The run never stopped, whose final weights every resumed run must end on."""
    root = tmp_path_factory.mktemp("preemption")
    fit(root, "--config", str(write_recipe(root, "whole", max_steps=STEPS)), weights_at_end("whole"))
    return root


def last_step(root: Path, name: str) -> int:
    return read_checkpoint(root / f"runs/{name}/version_0/checkpoints/last.ckpt", weights=False)["global_step"]


def test_sigterm_mid_step_saves_that_step_and_the_resumed_run_ends_on_the_uninterrupted_weights(root):
    recipe = str(write_recipe(root, "stopped", max_steps=STEPS))
    stopped = fit(root, "--config", recipe, callback("SignalAtStep", step=2), expect=143)  # during the 3rd step
    assert "received SIGTERM: stopping after this optimizer step and saving a checkpoint" in stopped.stderr
    assert "== diffexp fit: stopped by SIGTERM at step 3, exit code 143" in stopped.stdout
    config = "runs/stopped/version_0/config.yaml"
    assert (f"resume          diffexp fit --config {config} --ckpt_path runs/stopped/version_0/checkpoints/last.ckpt"
            in stopped.stdout)
    assert last_step(root, "stopped") == 3  # the step under way was finished and saved, off the every-4 trigger
    assert "Traceback" not in stopped.stderr

    fit(root, "--config", config, "--ckpt_path", "last", weights_at_end("stopped"))
    assert_bitwise_equal(root / "whole.pt", root / "stopped.pt")
    # one step axis: every logged step once, none lost, as in the run never stopped
    whole, resumed = scalars(root / "runs/whole/version_0"), scalars(root / "runs/stopped/version_0")
    assert [step for step, _ in resumed["train/loss"]] == [step for step, _ in whole["train/loss"]]
    torch.testing.assert_close([v for _, v in resumed["train/loss"]], [v for _, v in whole["train/loss"]])


@pytest.mark.parametrize(("name", "code"), [("SIGINT", 130), ("SIGUSR1", 138)])
def test_sigint_and_sigusr1_stop_the_same_way_with_their_exit_codes(root, name, code):
    run = f"by_{name.lower()}"
    stopped = fit(root, "--config", str(write_recipe(root, run, max_steps=STEPS)),
                  callback("SignalAtStep", step=6, signum=name), expect=code)
    assert f"== diffexp fit: stopped by {name} at step 7, exit code {code}" in stopped.stdout
    assert last_step(root, run) == 7


def test_a_signal_during_validation_lets_it_finish_then_saves_after_it(root):
    """The validation after step 6 runs to its end (its best checkpoint is written), then last.ckpt of step 6."""
    stopped = fit(root, "--config", str(write_recipe(root, "in_val", max_steps=STEPS)),
                  callback("SignalAtStep", step=6, during="validation"), expect=143)
    assert "stopped by SIGTERM at step 6" in stopped.stdout
    assert last_step(root, "in_val") == 6
    checkpoints = root / "runs/in_val/version_0/checkpoints"
    assert [p.name for p in checkpoints.glob("step000006-val*.ckpt")]  # that validation's best file
    assert "step 6: val/loss" in stopped.stdout


def test_a_signal_during_a_save_lets_it_finish_then_stops_after_the_next_step(root):
    """SIGTERM arriving while step 4's checkpoint is written: that file is written whole, the run stops after the
    step under way next (5, saved), and the resumed run ends on the uninterrupted weights."""
    recipe = str(write_recipe(root, "in_save", max_steps=STEPS))
    stopped = fit(root, "--config", recipe, callback("SignalDuringSave", step=4), expect=143)
    assert "stopped by SIGTERM at step 5, exit code 143" in stopped.stdout
    assert last_step(root, "in_save") == 5
    fit(root, "--config", "runs/in_save/version_0/config.yaml", "--ckpt_path", "last", weights_at_end("in_save"))
    assert_bitwise_equal(root / "whole.pt", root / "in_save.pt")


def test_sigterm_from_outside_while_training(root):
    """A real SIGTERM from another process at a moment the test does not choose: exit 143, last.ckpt at the step
    it stopped at, and resumable."""
    recipe = str(write_recipe(root, "outside", max_steps=2000))
    out = root / "outside.out"
    with open(out, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "diffexp", "fit", "--config", recipe], cwd=root,
                                env=one_thread_env(), stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 240
        while "step 6: val/loss" not in out.read_text() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert proc.poll() is None, out.read_text()[-3000:]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 143, out.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    text = out.read_text()
    step = last_step(root, "outside")
    assert 6 <= step < 2000 and f"stopped by SIGTERM at step {step}, exit code 143" in text


def test_outside_training_a_signal_stops_at_once_with_its_code():
    """Before training starts and after it ends there is nothing to finish: the signal stops the process there
    (SystemExit 128 + signum), and the handlers in place before are back afterwards."""
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(preemption.Preempted) as stopped, preemption.handling_signals():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)  # the handler runs in this thread at the next bytecode
    assert stopped.value.code == 143 and stopped.value.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before

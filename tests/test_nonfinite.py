"""A NaN/inf loss or gradient norm stops the run before the optimizer step, keeping the last finite state."""

from __future__ import annotations

import re

import pytest
import torch

from diffexp.cli import main
from diffexp.training.nonfinite import NonFiniteError
from tests.helpers import write_recipe


def all_finite(tree) -> bool:
    if isinstance(tree, torch.Tensor):
        return not tree.is_floating_point() or bool(torch.isfinite(tree).all())
    if isinstance(tree, dict):
        return all(all_finite(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return all(all_finite(v) for v in tree)
    return True


@pytest.mark.slow
@pytest.mark.parametrize("quantity, clip, rows", [("vitals/grad_norm", 1.0, None), ("train/loss", 0.0, None),
                                                   ("train/loss", 0.0, 8)],
                         ids=["grad_norm", "loss", "loss-accum"])
def test_non_finite_value_stops_and_saves_the_last_finite_state(tmp_path, monkeypatch, quantity, clip, rows):
    """rows 8: two micro-batches of 4 per step; the losses are checked once per optimizer step, before it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DIFFEXP_DEBUG", "1")  # the error itself, rather than `error: ...` and exit 2
    inject = ('--trainer.callbacks+={"class_path": "tests.helpers.InjectNonFinite", "init_args": '
              f'{{"step": 5, "quantity": "{quantity}", "weights_path": "{tmp_path / "before.pt"}"}}}}')
    with pytest.raises(NonFiniteError) as error:
        main(["fit", "--config", str(write_recipe(tmp_path, max_steps=8)), inject,
              "--trainer.gradient_clip_val", str(clip), *(["--global_batch.rows", str(rows)] if rows else [])])

    run = tmp_path / "runs/run/version_0"
    saved = run / "checkpoints/last-finite-step000005.ckpt"
    message = str(error.value)
    assert message.startswith(f"{quantity} is ") and " at step 5;" in message
    assert "model.optim.lr" in message
    if clip:  # clipping on: lower it (raising it, the old advice, makes things worse)
        assert "lower trainer.gradient_clip_val (now 1)" in message
    else:
        assert "enable gradient clipping with trainer.gradient_clip_val" in message
    relative = "runs/run/version_0"  # as configured: save_dir runs, run from tmp_path
    assert f"--config {relative}/config.yaml --ckpt_path {relative}/checkpoints/{saved.name} " in message

    checkpoint = torch.load(saved, weights_only=True)
    assert checkpoint["global_step"] == 5
    before = torch.load(tmp_path / "before.pt", weights_only=True)
    assert checkpoint["state_dict"].keys() == before.keys()
    for name, value in before.items():  # the weights the failing step started from, not updated
        assert torch.equal(checkpoint["state_dict"][name], value), name
    assert checkpoint["optimizer_states"][0]["state"]  # Adam moments, to resume with
    for path in run.glob("checkpoints/*.ckpt"):  # no non-finite weight or optimizer state in any checkpoint
        checkpoint = torch.load(path, weights_only=True)
        assert all_finite([checkpoint["state_dict"], checkpoint["optimizer_states"]]), path.name

    # the advised command resumes with the lower lr (the injecting callback left out) and finishes the run
    command = re.search(r"resume: diffexp (fit .*? --trainer\.gradient_clip_val \S+?)\.(?: |$)", message).group(1)
    main([*command.split(), "--trainer.callbacks=[]"])
    last = torch.load(run / "checkpoints/last.ckpt", weights_only=True)
    assert last["global_step"] == 8
    assert last["optimizer_states"][0]["param_groups"][0]["initial_lr"] == pytest.approx(1.5e-3)


@pytest.mark.heavy  # two sharded processes (about a minute on 2 cores)
def test_a_non_finite_loss_on_one_rank_stops_every_rank_together(tmp_path):
    """FSDP2 on 2 CPU processes, rank 1's loss inf at step 3: both ranks see the all-reduced flag, save the
    last finite state together (a sharded checkpoint, one shard per rank) and stop, saying what to do."""
    import subprocess
    import sys

    from diffexp.checkpoint_io import read_checkpoint
    from tests.helpers import FSDP2, one_thread_env
    from tests.helpers import write_fsdp_recipe as write

    recipe = write(tmp_path, "sharded", devices=2, batch=2, strategy=FSDP2 % "false")
    inject = ('--trainer.callbacks+={"class_path": "tests.helpers.InjectNonFinite", "init_args": '
              '{"step": 3, "quantity": "train/loss", "weights_path": "unused.pt", "rank": 1}}')
    proc = subprocess.run([sys.executable, "-m", "diffexp", "fit", "--config", str(recipe), inject], cwd=tmp_path,
                          env=one_thread_env(), text=True, capture_output=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "train/loss is " in proc.stderr and " at step 3;" in proc.stderr, proc.stderr[-3000:]
    saved = tmp_path / "runs/sharded/version_0/checkpoints/last-finite-step000003.ckpt"
    assert sorted(p.name for p in saved.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert read_checkpoint(saved)["global_step"] == 3

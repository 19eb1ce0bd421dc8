"""FSDP2 on CPU processes (gloo): the sharded path every GPU run takes, run for real on 2 processes.

One 2-process sharded fit is the reference for everything: a 1-process fit with the same global batch must
match it (losses, every logged value, final weights), a sharded run killed mid-run and resumed, or stopped and
resumed on 1 process (its shards resharded on load), must end on its weights, its sharded checkpoint must
consolidate to them, and two torchrun "nodes" on localhost (HSDP mesh) must train like it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diffexp.checkpoint_io import read_checkpoint
from tests.helpers import FSDP2, RTOL, assert_same_weights, free_port, one_thread_env, scalars
from tests.helpers import FSDP_STEPS as STEPS
from tests.helpers import write_fsdp_recipe as write


def fit(root: Path, *args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "diffexp", "fit", *args], cwd=root, env=one_thread_env(), text=True,
                          capture_output=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """The sharded reference run (2 processes x 2 rows) in a shared directory."""
    root = tmp_path_factory.mktemp("fsdp2")
    fit(root, "--config", str(write(root, "sharded", devices=2, batch=2, strategy=FSDP2 % "false")))
    return root


def logged(root: Path, name: str) -> dict[str, list[tuple[int, float]]]:
    return scalars(root / "runs" / name / "version_0")


def test_sharded_run_writes_one_shard_per_rank_and_consolidates_to_the_trained_weights(root):
    last = root / "runs/sharded/version_0/checkpoints/last.ckpt"
    assert last.is_dir() and sorted(p.name for p in last.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    trained = torch.load(root / "sharded.pt", weights_only=True)
    consolidated = read_checkpoint(last)
    assert consolidated["global_step"] == STEPS
    weights = {k.removeprefix("model."): v for k, v in consolidated["state_dict"].items()}
    assert weights.keys() == trained.keys()
    for key in trained:
        assert torch.equal(weights[key], trained[key]), key
    # no staging directory of the atomic save is left behind
    assert not [p for p in last.parent.iterdir() if p.name.startswith(".")]


def test_two_processes_train_like_one_with_the_same_global_batch(root):
    fit(root, "--config", str(write(root, "single", devices=1, batch=4, strategy="auto")))
    sharded, single = logged(root, "sharded"), logged(root, "single")
    compared = [tag for tag in single if tag.startswith(("train/", "val/", "vitals/"))
                and not tag.startswith("vitals/throughput/")]  # rates: timing
    assert {"train/loss", "vitals/grad_norm", "vitals/lambda/layer_01", "vitals/layer_01/act_max_abs",
            "val/loss_ar_hit", "vitals/attn_sink", "vitals/grad_spikes", "train/lr"} <= set(compared)
    for tag in compared:
        assert tag in sharded, f"{tag} is logged by one process but not under FSDP2"
        steps, values = zip(*single[tag])
        assert [s for s, _ in sharded[tag]] == list(steps), tag
        torch.testing.assert_close(torch.tensor([v for _, v in sharded[tag]]), torch.tensor(values), rtol=RTOL,
                                   atol=1e-6, msg=tag)
    assert len(sharded["train/loss"]) == STEPS
    assert_same_weights(torch.load(root / "single.pt", weights_only=True),
                        torch.load(root / "sharded.pt", weights_only=True))


def test_clipped_two_processes_train_like_one(root):
    """Gradient clipping by the norm computed once for the logs (its shards' all-reduce under FSDP2)."""
    clip = ("--trainer.gradient_clip_val", "0.05", "--trainer.max_steps", "4")  # below every step's norm: all clip
    fit(root, "--config", str(write(root, "sharded_clip", devices=2, batch=2, strategy=FSDP2 % "false")), *clip)
    fit(root, "--config", str(write(root, "single_clip", devices=1, batch=4, strategy="auto")), *clip)
    norms = [v for _, v in logged(root, "single_clip")["vitals/grad_norm"]]
    assert min(norms) > 0.05
    assert_same_weights(torch.load(root / "single_clip.pt", weights_only=True),
                        torch.load(root / "sharded_clip.pt", weights_only=True))


def test_dint_with_a_learned_gamma_shards_and_trains_like_one_process(root):
    """FSDP2 shards no 0-d parameter; DINT's learned gamma has shape (1,), so a sharded DINT run trains, like one
    process with the same global batch, gamma included."""
    dint = ("--model.arch.attention", "dint", "--model.arch.gamma", "learned", "--trainer.max_steps", "2")
    fit(root, "--config", str(write(root, "sharded_dint", devices=2, batch=2, strategy=FSDP2 % "false")), *dint)
    fit(root, "--config", str(write(root, "single_dint", devices=1, batch=4, strategy="auto")), *dint)
    sharded = torch.load(root / "sharded_dint.pt", weights_only=True)
    gammas = [key for key in sharded if key.endswith("attn.gamma")]
    assert len(gammas) == 2 and all(sharded[key].shape == (1,) for key in gammas)
    assert_same_weights(torch.load(root / "single_dint.pt", weights_only=True), sharded)


@pytest.mark.heavy  # torchrun killed and relaunched (about 50 s); test_elastic_resume.py stops and resumes ranks
def test_kill_of_the_launcher_then_resume_ends_on_the_uninterrupted_weights(root):
    recipe = write(root, "killed", devices=2, batch=2, strategy=FSDP2 % "false")
    kill = '--trainer.callbacks+={"class_path": "tests.helpers.KillRankZeroAtStep", "init_args": {"step": 6}}'
    proc = subprocess.Popen([sys.executable, "-m", "diffexp", "fit", "--config", str(recipe), kill], cwd=root,
                            env=one_thread_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    assert proc.wait(timeout=240) == -signal.SIGKILL
    with contextlib.suppress(ProcessLookupError):  # rank 1 waits on its lost peer: end it, as a scheduler would
        os.killpg(proc.pid, signal.SIGKILL)
    last = root / "runs/killed/version_0/checkpoints/last.ckpt"
    assert read_checkpoint(last, weights=False)["global_step"] == 4
    fit(root, "--config", str(recipe), "--ckpt_path", "last")
    trained, resumed = (torch.load(root / f"{n}.pt", weights_only=True) for n in ("sharded", "killed"))
    for key in trained:
        assert torch.equal(resumed[key], trained[key]), key
    assert [s for s, _ in logged(root, "killed")["train/loss"]][-1] == STEPS


def test_sigterm_to_one_rank_stops_every_rank_after_the_step_saved_and_resumes_to_the_same_weights(root):
    """A scheduler's signal reaching rank 1 only: both ranks finish the step, save their shards of it and exit 143;
    the resumed run ends on the uninterrupted sharded run's weights."""
    recipe = write(root, "preempted", devices=2, batch=2, strategy=FSDP2 % "false")
    signal_rank_one = ('--trainer.callbacks+={"class_path": "tests.helpers.SignalAtStep", '
                       '"init_args": {"step": 2, "rank": 1}}')
    proc = subprocess.run([sys.executable, "-m", "diffexp", "fit", "--config", str(recipe), signal_rank_one],
                          cwd=root, env=one_thread_env(), text=True, capture_output=True, timeout=240)
    assert proc.returncode == 143, proc.stderr[-3000:]
    assert "stopped by SIGTERM at step 3, exit code 143" in proc.stdout
    last = root / "runs/preempted/version_0/checkpoints/last.ckpt"
    assert sorted(p.name for p in last.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert read_checkpoint(last, weights=False)["global_step"] == 3
    fit(root, "--config", str(recipe), "--ckpt_path", "last")
    trained, resumed = (torch.load(root / f"{n}.pt", weights_only=True) for n in ("sharded", "preempted"))
    for key in trained:
        assert torch.equal(resumed[key], trained[key]), key


@pytest.mark.heavy  # two torchrun launchers (about 25 s); the one-node sharded runs stay in the default run
def test_two_torchrun_nodes_on_localhost_train_together_on_an_hsdp_mesh(root):
    recipe = write(root, "nodes", devices=1, batch=2, strategy=FSDP2 % "true")
    port, torchrun = free_port(), str(Path(sys.executable).parent / "torchrun")
    nodes = [subprocess.Popen([torchrun, "--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(rank),
                               "--master_addr", "127.0.0.1", "--master_port", str(port), "-m", "diffexp", "fit",
                               "--config", str(recipe), "--trainer.num_nodes", "2"], cwd=root, env=one_thread_env(),
                              text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for rank in (0, 1)]
    outputs = [node.communicate(timeout=240)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert "FSDP2 over 2 rank(s) (2 replicate x 1 shard" in outputs[0]
    assert_same_weights(torch.load(root / "nodes.pt", weights_only=True),
                        torch.load(root / "sharded.pt", weights_only=True))


@pytest.mark.heavy  # two more torchrun launches (about 40 s); test_elastic_resume.py resumes 2 ranks on 1 by default
def test_a_sharded_checkpoint_resumes_on_another_world_size_with_the_same_global_batch(root):
    """torch.distributed.checkpoint reshards on load: 2 processes' shards continue on 1 process, which reads the
    rest of the same global order (4 rows a step) and ends on the uninterrupted 2-process run's weights."""
    recipe = write(root, "elastic", devices=2, batch=2, strategy=FSDP2 % "false")
    fit(root, "--config", str(recipe), "--trainer.max_steps", "4", "--model.optim.schedule_steps", str(STEPS))
    fit(root, "--config", str(recipe), "--trainer.devices", "1", "--data.batch_size", "4",
        "--model.optim.schedule_steps", str(STEPS), "--ckpt_path", "last")
    last = root / "runs/elastic/version_0/checkpoints/last.ckpt"
    assert sorted(p.name for p in last.glob("*.distcp")) == ["__0_0.distcp"]  # the resumed run saved 1 shard
    sharded, elastic = logged(root, "sharded"), logged(root, "elastic")
    assert [s for s, _ in elastic["train/loss"]] == [s for s, _ in sharded["train/loss"]] == list(range(STEPS))
    torch.testing.assert_close(torch.tensor([v for _, v in elastic["train/loss"]]),
                               torch.tensor([v for _, v in sharded["train/loss"]]), rtol=RTOL, atol=1e-6)
    assert_same_weights(torch.load(root / "sharded.pt", weights_only=True),
                        torch.load(root / "elastic.pt", weights_only=True))


def test_resuming_a_sharded_checkpoint_with_another_global_batch_is_refused_before_work(root, monkeypatch, capsys):
    from diffexp.cli import main

    monkeypatch.chdir(root)
    recipe = write(root, "sharded", devices=1, batch=2, strategy=FSDP2 % "false")  # 1 x 2 rows, the run's are 4
    before = sorted(p.name for p in (root / "runs/sharded").iterdir())
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(recipe), "--ckpt_path", "last"])
    err = " ".join(capsys.readouterr().err.split())
    assert ("global batch (data.batch_size x world size x trainer.accumulate_grad_batches): checkpoint 4 rows, this "
            "config 2 (2 x 1 x 1)") in err and "add --global_batch.rows 4" in err
    assert "Traceback" not in err and sorted(p.name for p in (root / "runs/sharded").iterdir()) == before

"""Elastic training order: the rows of every optimizer step are a function of the seed and the global batch alone,
so a run may stop at one world size (or data.batch_size) and resume at another with the same global batch.

Unit tests drive the loader directly, one loader per simulated rank, over rows that are their own index; end to
end, DDP on CPU processes (gloo) stops a run and resumes it with another number of processes and must end where an
uninterrupted 1-process run ends: the same loss at every step and the same weights.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from diffexp.data.loader import PackedRows, ResumableDataLoader
from diffexp.errors import UserError
from diffexp.training.global_batch import resumed_layout
from tests.helpers import RTOL, assert_same_weights, one_thread_env, scalars

SEED = 3


# ----------------------------------------------------------------------------- the loader, rank by rank


def index_rows(n: int) -> PackedRows:
    """n rows whose only token is their index: a batch says which rows it holds."""
    return PackedRows(np.arange(n, dtype=np.int64)[:, None])


def rank_loaders(n: int, rows: int, world: int, batch: int) -> list[ResumableDataLoader]:
    return [ResumableDataLoader(index_rows(n), batch_size=batch, seed=SEED, num_replicas=world, rank=rank,
                                global_batch_rows=rows) for rank in range(world)]


def micro_batches(loader: ResumableDataLoader, count: int) -> list[list[int]]:
    """The next `count` batches (as row indices), continuing into new epochs as Lightning does: a new iter()."""
    batches: list[list[int]] = []
    while len(batches) < count:
        for batch in loader:
            batches.append(batch[:, 0].tolist())
            if len(batches) == count:
                break
    return batches


def steps(loaders: list[ResumableDataLoader], count: int) -> list[list[int]]:
    """The next `count` optimizer steps: each step's rows from all ranks, placed back at their positions in the
    global batch (rank r holds positions r, r + W, ...)."""
    world, batch = len(loaders), loaders[0].batch_size
    accumulate = loaders[0].sampler.global_batch_rows // (world * batch)
    per_rank = [micro_batches(loader, count * accumulate) for loader in loaders]
    result = []
    for step in range(count):
        global_batch = [0] * (world * batch * accumulate)
        for rank, batches in enumerate(per_rank):
            rows = [row for b in batches[step * accumulate:(step + 1) * accumulate] for row in b]
            global_batch[rank::world] = rows
        result.append(global_batch)
    return result


def global_order(n: int, rows: int, count: int) -> list[list[int]]:
    """The definition: epoch e is randperm(n) seeded by SEED + e, cut into n // rows global batches."""
    per_epoch, result = n // rows, []
    for epoch in range(count // per_epoch + 1):
        permutation = torch.randperm(n, generator=torch.Generator().manual_seed(SEED + epoch)).tolist()
        result += [permutation[s * rows:(s + 1) * rows] for s in range(per_epoch)]
    return result[:count]


@pytest.mark.parametrize("rows, layouts", [(4, [(1, 4), (1, 2), (1, 1), (2, 2), (2, 1), (4, 1)]),
                                           (12, [(1, 12), (2, 3), (3, 2), (3, 4), (6, 1)])])
def test_steps_read_the_same_rows_at_any_world_size_and_micro_batch(rows, layouts):
    n = 3 * rows + rows // 2  # 3 steps an epoch; the remainder is dropped so every epoch ends on a step
    expected = global_order(n, rows, 8)  # into the third epoch
    for world, batch in layouts:
        assert steps(rank_loaders(n, rows, world, batch), 8) == expected, (world, batch)
    assert len(rank_loaders(n, rows, 2, 1)[0]) == 3 * rows // 2  # micro-batches per epoch: whole steps only


# (processes, data.batch_size) of the saving and the resuming run, 4 rows a step
@pytest.mark.parametrize("saved_at, resumed_at", [((2, 2), (1, 2)), ((2, 2), (1, 4)), ((1, 1), (2, 2)),
                                                  ((1, 4), (4, 1))])
@pytest.mark.parametrize("stop_after", [1, 3, 4, 6])  # mid-epoch, an epoch's last step, the next epoch
def test_state_saved_at_one_world_size_resumes_the_remaining_steps_at_another(saved_at, resumed_at, stop_after):
    n, rows = 18, 4  # 4 steps an epoch, 2 rows dropped
    expected = global_order(n, rows, 9)
    saved = rank_loaders(n, rows, *saved_at)
    assert steps(saved, stop_after) == expected[:stop_after]
    states = [loader.state_dict() for loader in saved]
    assert all(state == states[0] for state in states)  # every rank saves the same position of the global order
    assert json.loads(json.dumps(states[0])) == states[0]  # plain data, checkpoint friendly
    resumed = rank_loaders(n, rows, *resumed_at)
    for loader in resumed:
        loader.load_state_dict(states[0])
    assert steps(resumed, 9 - stop_after) == expected[stop_after:]


def test_a_state_from_before_the_global_order_resumes_at_its_world_size():
    """Old states count each rank's batches; their rows are the same prefix of the global order."""
    n, rows = 18, 4
    old_state = {"epoch": 0, "batches_yielded": 3, "seed": SEED, "num_rows": n, "batch_size": 2, "num_replicas": 2}
    resumed = rank_loaders(n, rows, 2, 2)
    for loader in resumed:
        loader.load_state_dict(old_state)
    assert steps(resumed, 3) == global_order(n, rows, 6)[3:]


def saved_state(**changes) -> dict:
    loaders = rank_loaders(18, 4, 1, 1)
    micro_batches(loaders[0], 1)
    return {**loaders[0].state_dict(), **changes}


@pytest.mark.parametrize("changes, layout, message", [
    ({"global_batch_rows": 8}, (1, 1), r"global batches of 8 rows .* this run's are 4 \(data.batch_size 1 x world "
                                       r"size 1 x trainer.accumulate_grad_batches 4\); resume with "
                                       r"--global_batch.rows 8"),
    ({"seed": 9}, (1, 1), r"shuffled with seed 9, this run's with 3; resume with the saved run's "
                          r"seed_everything .* --data.order_seed 9 restores it"),
    ({"num_rows": 20}, (1, 1), r"training split had 20 rows, this run's has 18"),
    ({}, (2, 1), r"saved after 1 rows of epoch 0, which is not a whole number of this run's micro-steps of 2 rows "
                 r"\(data.batch_size 1 x world size 2\)"),
])
def test_a_state_of_another_order_is_refused_naming_the_key(changes, layout, message):
    loader = rank_loaders(18, 4, *layout)[0]
    with pytest.raises(UserError, match=message):
        loader.load_state_dict(saved_state(**changes))


# ----------------------------------------------------------------------------- Lightning's batch counters


class FakeTrainer:
    def __init__(self, world_size: int, batch_size: int, accumulate: int) -> None:
        self.world_size, self.accumulate_grad_batches = world_size, accumulate
        self.datamodule = type("Data", (), {"batch_size": batch_size})()


def checkpoint_after(ready: int, completed: int, earlier_epochs_batches: int = 0) -> dict:
    def progress(base: int) -> dict:
        return {"ready": base + ready, "started": base + ready, "processed": base + ready,
                "completed": base + completed}

    return {"diffexp_run": {"world_size": 2, "accumulate_grad_batches": 1, "batch_size": 2},
            "loops": {"fit_loop": {"epoch_loop.batch_progress": {
                "total": progress(earlier_epochs_batches), "current": progress(0), "is_last_batch": False}}}}


def test_the_batch_counters_move_to_the_new_micro_batch_keeping_where_the_save_happened():
    # saved at 2 processes x 2 rows, 3 steps into the second epoch of 4 steps, in on_train_batch_end
    checkpoint = checkpoint_after(ready=3, completed=2, earlier_epochs_batches=4)
    resumed_layout(checkpoint, FakeTrainer(world_size=1, batch_size=1, accumulate=4))  # 4 micro-batches a step
    progress = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]
    assert progress["current"] == {"ready": 12, "started": 12, "processed": 12, "completed": 11}
    assert progress["total"] == {"ready": 28, "started": 28, "processed": 28, "completed": 27}


@pytest.mark.parametrize("layout, message", [
    ((1, 2, 1), r"global batch \(data.batch_size x world size x trainer.accumulate_grad_batches\) of the "
                r"checkpoint's run is 4 rows \(2 x 1 x 2\), this run's is 2 rows \(2 x 1 x 1\);.* Resume with "
                r"--global_batch.rows 4"),
    ((4, 1, 1), r"after 2 rows of its epoch, not a whole number of this run's micro-steps of 4 rows"),
])
def test_a_resume_with_another_global_batch_or_off_a_step_is_refused(layout, message):
    checkpoint = checkpoint_after(ready=1, completed=0)
    checkpoint["diffexp_run"] = {"world_size": 1, "accumulate_grad_batches": 2, "batch_size": 2}  # 4 rows
    world, batch, accumulate = layout
    with pytest.raises(UserError, match=message):
        resumed_layout(checkpoint, FakeTrainer(world, batch, accumulate))


# ----------------------------------------------------------------------------- end to end: DDP on CPU processes

STEPS = 6
RECIPE = """
seed_everything: 7
trainer:
  accelerator: cpu
  devices: 1
  max_steps: {steps}
  val_check_interval: 3
  limit_val_batches: 1
  log_every_n_steps: 1
  enable_progress_bar: false
  enable_model_summary: false
  logger:
    class_path: lightning.pytorch.loggers.TensorBoardLogger
    init_args: {{save_dir: runs, name: {name}, default_hp_metric: false}}
  callbacks:
    - class_path: tests.helpers.SaveFullWeights
      init_args: {{path: {name}.pt}}
    - class_path: tests.helpers.RecordStepLosses
      init_args: {{path: {name}.jsonl}}
checkpoint:
  every_n_train_steps: 1
global_batch:
  rows: 4
model:
  arch: {{attention: diff_v1, d_model: 32, n_layers: 2, n_heads: 2, max_seq_len: 32}}
  optim: {{lr: 3.0e-3, warmup_steps: 2, schedule_steps: {steps}}}
data:
  class_path: diffexp.data.mqar.MQARDataModule
  init_args: {{vocab_size: 32, seq_len: 32, num_kv_pairs: 4, train_size: 18, val_size: 8, batch_size: 4}}
"""
# MQAR rows are made from (seed, index) alone, and each has the same number of scored tokens, so the mean loss
# of a global batch does not depend on how it is split; 18 rows: 4 steps an epoch (2 rows dropped), so the runs
# cross an epoch boundary. A vocabulary of 32 keeps every embedding row trained: rows with near-zero gradients
# would turn fp32 reduction-order noise into visible Adam updates.


def layout(processes: int, batch: int) -> list[str]:
    return ["--trainer.devices", str(processes), "--trainer.strategy", "ddp" if processes > 1 else "auto",
            "--data.init_args.batch_size", str(batch)]


def run(root: Path, name: str, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
    recipe = root / f"{name}.yaml"
    recipe.write_text(RECIPE.format(name=name, steps=STEPS))
    proc = subprocess.run([sys.executable, "-m", "diffexp", "fit", "--config", str(recipe), *args], cwd=root,
                          env=one_thread_env(), text=True, capture_output=True, timeout=240)
    if ok:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def step_losses(root: Path, name: str) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (root / f"{name}.jsonl").read_text().splitlines())]


def assert_trained_like_the_reference(root: Path, name: str) -> None:
    reference, elastic = step_losses(root, "reference"), step_losses(root, name)
    assert [s for s, _ in elastic] == [s for s, _ in reference] == list(range(STEPS))
    torch.testing.assert_close(torch.tensor([v for _, v in elastic]), torch.tensor([v for _, v in reference]),
                               rtol=RTOL, atol=1e-6)
    lr, reference_lr = (scalars(root / "runs" / run_name / "version_0")["train/lr"] for run_name in (name, "reference"))
    assert [s for s, _ in lr] == [s for s, _ in reference_lr]  # the same schedule
    assert [v for _, v in lr] == pytest.approx([v for _, v in reference_lr], rel=1e-6)
    assert_same_weights(torch.load(root / "reference.pt", weights_only=True),
                        torch.load(root / f"{name}.pt", weights_only=True))


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """The uninterrupted reference: 1 process, 4 rows a step, no accumulation."""
    root = tmp_path_factory.mktemp("elastic")
    run(root, "reference", *layout(1, 4))
    return root


@pytest.mark.slow
def test_two_processes_stopped_then_resumed_on_one_train_like_one(root):
    # 2 processes x 2 rows for 3 steps, then 1 process x 2 rows x 2 accumulated micro-batches
    run(root, "two_to_one", *layout(2, 2), "--trainer.max_steps", "3")
    run(root, "two_to_one", *layout(1, 2), "--ckpt_path", "last")
    assert_trained_like_the_reference(root, "two_to_one")


@pytest.mark.heavy  # the same protocol, two processes to one, stays in the default run
def test_one_process_killed_then_resumed_on_two_trains_like_one(root):
    # 1 process x 1 row x 4 micro-batches, killed right after the checkpoint of step 3 (12 micro-batches into the
    # epoch), then 2 processes x 1 row x 2 micro-batches (6 micro-batches into it)
    kill = '--trainer.callbacks+={"class_path": "tests.helpers.KillAfterCheckpoint", "init_args": {"step": 3}}'
    assert run(root, "one_to_two", *layout(1, 1), kill, ok=False).returncode == -9
    run(root, "one_to_two", *layout(2, 1), "--ckpt_path", "last")
    assert_trained_like_the_reference(root, "one_to_two")


def test_a_resume_with_another_global_batch_is_refused_before_work(root, monkeypatch, capsys):
    from diffexp.cli import main

    monkeypatch.chdir(root)
    recipe = root / "reference.yaml"
    before = sorted(p.name for p in (root / "runs/reference").iterdir())
    with pytest.raises(SystemExit):  # 2 processes x 4 rows: 8 rows a step, the checkpoint's are 4
        main(["fit", "--config", str(recipe), "--global_batch.rows", "8", *layout(2, 4), "--trainer.max_steps",
              "8", "--ckpt_path", "last"])
    err = " ".join(capsys.readouterr().err.split())
    assert ("global batch (data.batch_size x world size x trainer.accumulate_grad_batches): checkpoint 4 rows, this "
            "config 8 (4 x 2 x 1)") in err and "add --global_batch.rows 4" in err
    assert "Traceback" not in err and sorted(p.name for p in (root / "runs/reference").iterdir()) == before

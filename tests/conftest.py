"""Fixtures shared by several test modules."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # Triton's CPU interpreter for test_triton_kernels.py; read as triton is
    os.environ.setdefault("TRITON_INTERPRET", "1")  # first imported (lightning imports it), so set it here

from tests.helpers import PATTERN, bpe_text_checkpoint, no_process_group_left, save_checkpoint, small_model  # noqa: E402


def _share_the_cores_among_workers() -> None:
    """Under pytest-xdist each worker takes its share of the cores for torch's threads (and the processes it starts):
    two workers of two OpenMP threads each on two cores spend most of their time spinning at each other's barriers.
    Tests that need more threads set them themselves."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = max(1, cores // workers)
        torch.set_num_threads(threads)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))


_share_the_cores_among_workers()



@pytest.fixture(autouse=True)
def no_process_group_outlives_its_test():
    """Each test starts without a default process group or a distributed environment of an earlier one."""
    with no_process_group_left():
        yield


@pytest.fixture(scope="session")
def memorised(tmp_path_factory):
    """A byte DIFF V2 checkpoint (max_seq_len 128) that learned PATTERN repeated (full-batch Adam, seconds)."""
    module = small_model(max_seq_len=128)
    text = torch.tensor(list((PATTERN * 8).encode()))[:97]
    optimizer = torch.optim.Adam(module.parameters(), lr=3e-3)
    for _ in range(150):
        logits = module.model(text[None, :-1])
        loss = torch.nn.functional.cross_entropy(logits[0], text[1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.1
    return save_checkpoint(module, tmp_path_factory.mktemp("run") / "memorised.ckpt")


@pytest.fixture(scope="session")
def bpe_checkpoint(tmp_path_factory):
    """A small model trained one step on a 300-token BPE (helpers.bpe_text_checkpoint), holding its tokenizer."""
    return bpe_text_checkpoint(tmp_path_factory.mktemp("bpe"))[0]


@pytest.fixture(scope="session")
def slurm():
    """The one-node SLURM cluster (.ci/slurm-up; in DIFFEXP_SLURM_DIR, default /tmp/diffexp-slurm): the one CI
    started, else one this session starts and leaves running for the next; skipped where slurm-wlm is missing."""
    from pathlib import Path

    from tests.helpers import slurm_cluster

    cluster = slurm_cluster(Path(os.environ.get("DIFFEXP_SLURM_DIR", "/tmp/diffexp-slurm")))
    if isinstance(cluster, str):
        pytest.skip(cluster)
    return cluster

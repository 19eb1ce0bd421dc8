"""Runs that share a cache (a sweep's trials) and start at once prepare a raw source once, and both train on it."""

from __future__ import annotations

import subprocess
import sys
import time

from tests.helpers import subprocess_env

PREPARE_AT = """
import sys, time
from diffexp.data.datamodule import TextDataModule
data = TextDataModule(source="stdlib", seq_len=32, batch_size=2, max_chars=60000, cache_dir=sys.argv[1])
while time.time() < float(sys.argv[2]):
    pass
print(data.prepared.directory, data.prepared_from_cache)
"""


def test_two_runs_starting_at_once_prepare_the_shared_cache_once(tmp_path):
    start = time.time() + 6  # both import first, then ask for the data at the same instant
    runs = [subprocess.Popen([sys.executable, "-c", PREPARE_AT, str(tmp_path / "cache"), str(start)], cwd=tmp_path,
                             env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for _ in range(2)]
    outputs = [run.communicate(timeout=300)[0] for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outputs
    last_lines = sorted(output.strip().splitlines()[-1] for output in outputs)
    assert last_lines[0].split()[0] == last_lines[1].split()[0]  # the same cache entry
    assert [line.split()[1] for line in last_lines] == ["False", "True"]  # prepared by one, found by the other
    assert len(list((tmp_path / "cache" / "prepared").iterdir())) == 2  # the entry and its lock file

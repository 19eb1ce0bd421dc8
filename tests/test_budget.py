"""Every time estimate comes from the measured fit in bench/fits.json, scaled by FLOPs: a different recorded
tokens/s changes every time in proportion, and the size files, sweep specs and docs state what it gives now."""

from __future__ import annotations

import heapq
import json
import re
from collections.abc import Sequence
from pathlib import Path

import pytest
import yaml

import diffexp.compare.budget as budget_module
from diffexp.compare.budget import FITS, MeasuredFit, RunBudget, duration, measured_fit
from diffexp.compare.params import Recipe, budget, run_header
from tests.helpers import REPO, stdout_of

GPU_SWEEPS = sorted((REPO / "sweeps").glob("gpu_*.yaml"))
#: every GPU spec that states its time: the five variants at each size, and the other studies at 125m
TIMED_SWEEPS = GPU_SWEEPS + [REPO / "sweeps/softmax_constraint_125m.yaml"]
UNIT = {"min": 60, "h": 3600, "d": 86400}


# The `# time:` line of a GPU sweep spec's header, as its trials priced by the measured fit give it: what the spec
# states (test_gpu_sweep_specs_state_their_time_from_the_measured_fit prints the line to write when it is stale).
def node_seconds(trial_seconds: Sequence[float], workers: int) -> float:
    """The wall time of trials run in order by `workers` workers, each taking the next trial when it is free."""
    free = [0.0] * workers
    for seconds in trial_seconds:
        heapq.heappush(free, heapq.heappop(free) + seconds)
    return max(free)


def sweep_estimate(trials: Sequence[RunBudget], fit: MeasuredFit, per_gpu: bool, node_gpus: int = 8) -> str:
    """A sweep's time on one node, in a spec's header: its trials in order, each on one GPU (`--gpus auto`, one
    worker per GPU) or each on the whole node (FSDP2 over its GPUs, one worker); the GPU-hours its trials use, and
    those of the node for that time (what is billed: GPUs idle once no trial is left for them)."""
    gpus, workers = (1, node_gpus) if per_gpu else (node_gpus, 1)
    wall = node_seconds([run.seconds(gpus, fit) for run in trials], workers)
    gpu_hours = sum(run.seconds(1, fit) for run in trials) / 3600
    how = "one trial per GPU" if per_gpu else "one trial at a time on all its GPUs"
    return (f"# time: about {duration(wall)} on one {node_gpus}-{fit.gpu} node ({how}), {gpu_hours:,.0f} "
            f"{fit.gpu}-hours of trials, {wall * node_gpus / 3600:,.0f} of the node's; every variant at the measured "
            f"fit's rate (bench/fits.json: {fit.machine}, {fit.commit})")


def params_stdout(args: list[str]) -> str:
    return stdout_of(["params", *args])


def one_gpu_seconds(line: str, gpu: str = "H100") -> float:
    number, unit = re.search(rf"; 1 {gpu} ([\d.]+) (min|h|d)", line).groups()
    return float(number) * UNIT[unit]


def test_the_estimate_follows_the_recorded_tokens_per_s(tmp_path, monkeypatch):
    """Record the fit at 3x the tokens/s on another machine: the size file's line for the same run says a third
    of the time, and names the new record."""
    monkeypatch.chdir(REPO)
    args = ["recipes/gpu/variant/diff_v1.yaml", "--headers"]
    record = json.loads(FITS.read_text())[-1]
    before = params_stdout(args)
    faster = tmp_path / "fits.json"
    faster.write_text(json.dumps([record, {**record, "tokens_per_s": 3 * record["tokens_per_s"], "commit": "abc1234",
                                           "machine": "one test GPU"}]))
    monkeypatch.setattr(budget_module, "FITS", faster)
    after = params_stdout(args)
    assert run_header(measured_fit()) in after and "abc1234" in run_header(measured_fit())
    lines = lambda text: [ln for ln in text.splitlines() if "# run[diff_v1]" in ln]  # noqa: E731
    assert len(lines(before)) == len(lines(after)) == 8  # one per size
    for old, new in zip(lines(before), lines(after)):
        ratio = one_gpu_seconds(new) / one_gpu_seconds(old)
        assert abs(ratio - 1 / 3) < 0.02, (old, new)  # the printed figures carry 2-3 digits
    run = RunBudget(steps=100, rows=8, seq_len=2048, flops_per_token=1e9)
    assert run.seconds(1, measured_fit(faster)) == pytest.approx(run.seconds(1, measured_fit(FITS)) / 3)
    assert run.seconds(8, measured_fit(FITS)) == pytest.approx(run.seconds(1, measured_fit(FITS)) / 8)


def test_the_measured_fits_rate_is_its_tokens_per_s_times_its_flops_per_token():
    fit = measured_fit()
    record = json.loads(FITS.read_text())[-1]
    assert fit.tokens_per_s == record["tokens_per_s"] and fit.commit == record["commit"]
    # the recorded model at 2048 tokens: 85.4M parameters with the byte vocabulary (docs/gpu.md)
    assert 6e8 < fit.flops_per_token < 8e8
    assert fit.flops_per_s_per_gpu == pytest.approx(fit.tokens_per_s * fit.flops_per_token)
    assert f"{fit.tokens_per_s:,.0f} tokens/s" in fit.basis() and fit.machine in fit.basis()


def test_without_a_record_no_time_is_printed(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(budget_module, "FITS", tmp_path / "absent.json")
    printed = params_stdout(["recipes/gpu/variant/baseline/125m.yaml", "--headers"])
    run = next(line for line in printed.splitlines() if "# run[baseline]:" in line)
    assert run.endswith("FLOPs") and "H100" not in printed and "no measured fit" in " ".join(printed.split())


def test_node_seconds_fills_workers_in_order():
    assert node_seconds([3, 3, 3], 2) == 6
    assert node_seconds([5, 1, 1, 1], 2) == 5
    assert node_seconds([2] * 15, 8) == 4  # two rounds
    assert node_seconds([1, 2, 3], 1) == 6


def sweep_trials(spec: Path) -> tuple[list[RunBudget], bool]:
    raw = yaml.safe_load(spec.read_text())
    trials = [budget(Recipe(name, tuple(Path(f) for f in (case or {}).get("base", raw["base"]))))
              for _ in raw["seeds"] for name, case in raw["cases"].items()]
    return trials, "--gpus auto" in spec.read_text()


@pytest.mark.parametrize("spec", TIMED_SWEEPS, ids=lambda p: p.stem)
def test_gpu_sweep_specs_state_their_time_from_the_measured_fit(spec, monkeypatch):
    monkeypatch.chdir(REPO)
    trials, per_gpu = sweep_trials(spec)
    assert len(trials) == (15 if spec in GPU_SWEEPS else 18)
    expected = sweep_estimate(trials, measured_fit(), per_gpu)
    stated = [line for line in spec.read_text().splitlines() if line.startswith("# time: ")]
    assert stated == [expected], f"{spec.name}: its header's time line should read\n{expected}"
    assert "MFU" not in spec.read_text()


def test_docs_state_the_times_the_size_files_state(monkeypatch):
    """docs/gpu.md's baseline table and docs/sweeps.md's sweep table: the figures computed now."""
    monkeypatch.chdir(REPO)
    fit = measured_fit()
    gpu_md, sweeps_md = (REPO / "docs/gpu.md").read_text(), (REPO / "docs/sweeps.md").read_text()
    for size_file in sorted((REPO / "recipes/gpu/size").glob("*.yaml")):
        line = next(ln for ln in size_file.read_text().splitlines() if ln.startswith("# run[baseline]:"))
        one, eight = re.search(r"; 1 H100 (.+), 8 H100 (.+)$", line).groups()
        assert f"| {size_file.stem} |" in gpu_md
        row = next(ln for ln in gpu_md.splitlines() if ln.startswith(f"| {size_file.stem} |")
                   and re.search(r"\| [\d.]+e\d+ \|", ln))
        assert row.endswith(f"| {one} | {eight} |"), (row, one, eight)
    for spec in GPU_SWEEPS:
        trials, per_gpu = sweep_trials(spec)
        wall = re.search(r"# time: about (\S+ \S+) ", sweep_estimate(trials, fit, per_gpu)).group(1)
        row = next(ln for ln in sweeps_md.splitlines() if f"`sweeps/{spec.name}`" in ln)
        assert row.endswith(f"| {wall} |"), (row, wall)
        if spec.name == "gpu_125m.yaml":  # the table of every spec, above, says the same
            specs_row = next(ln for ln in sweeps_md.splitlines() if "`sweeps/gpu_<size>.yaml`" in ln)
            assert f"125m: {wall} on one 8-H100 node" in specs_row, (specs_row, wall)
    for text in (gpu_md, sweeps_md):
        assert fit.commit in text and "bench/fits.json" in text and "35-42%" not in text and "42-35%" not in text


def test_gpu_page_and_base_recipe_state_the_125m_times(monkeypatch):
    """docs/gpu.md's and base.yaml's 125m figures: the five variants' range on one H100 and the 125m sweep's."""
    monkeypatch.chdir(REPO)
    size_file = (REPO / "recipes/gpu/size/125m.yaml").read_text().splitlines()
    hours = sorted(one_gpu_seconds(ln) / 3600 for ln in size_file
                   if re.match(r"# run\[(baseline|diff_v1|diff_v2|shared_diff|dint)\]:", ln))
    assert len(hours) == 5 and all(1 <= h < 10 for h in hours)
    span = f"{hours[0]:.1f}-{hours[-1]:.1f} h"
    gpu_md, base = (REPO / "docs/gpu.md").read_text(), (REPO / "recipes/gpu/base.yaml").read_text()
    assert f"takes {span} on one H100" in " ".join(gpu_md.split())
    assert f"# time[125m]: {span} on one H100" in base
    sweep = next(ln for ln in (REPO / "sweeps/gpu_125m.yaml").read_text().splitlines() if ln.startswith("# time: "))
    wall, gpu_hours, node_hours = re.search(r"about (\S+ \S+) on .*, ([\d,]+) H100-hours of trials, ([\d,]+) of the "
                                            "node's", sweep).groups()
    assert (f"sweep about {wall} on an 8-H100 node, {gpu_hours} H100-hours of trials and {node_hours} of the node's"
            in " ".join(gpu_md.split()))
    measured = measured_fit()
    for text in (gpu_md, base):
        assert measured.commit in text and f"{measured.tokens_per_s:,.0f} tokens/s" in text


def test_duration_picks_the_unit():
    assert duration(90) == "1.5 min" and duration(7200) == "2.0 h" and duration(4 * 86400) == "4.0 d"

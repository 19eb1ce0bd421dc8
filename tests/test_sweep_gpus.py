"""`diffexp sweep --gpus`: one worker per GPU, each pinned to its own device, tested on CPU with a fake device list;
the GPU sweep specs (a recipe as a list of files) expand into the runs the GPU recipes document."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import optuna
import pytest

from diffexp.errors import UserError
from diffexp.sweep.command import fit_args
from diffexp.sweep.gpus import DEVICES_ENV, chosen_devices, run_workers, visible_devices
from diffexp.sweep.spec import load_spec
from diffexp.sweep.storage import open_storage
from tests.helpers import REPO, exit_code, subprocess_env, trials_by_state, write_spec


def test_visible_devices_follow_cuda_visible_devices():
    assert visible_devices({DEVICES_ENV: "0,1,2"}) == ["0", "1", "2"]
    assert visible_devices({DEVICES_ENV: "GPU-a1, GPU-b2"}) == ["GPU-a1", "GPU-b2"]
    assert visible_devices({DEVICES_ENV: "-1"}) == [] and visible_devices({DEVICES_ENV: ""}) == []
    assert visible_devices({}, count=lambda: 4) == ["0", "1", "2", "3"]  # unset: torch's count


def test_gpus_picks_every_visible_device_the_first_n_or_a_list():
    visible = ["0", "1", "2", "3"]
    assert chosen_devices("auto", visible) == visible
    assert chosen_devices("2", visible) == ["0", "1"]
    assert chosen_devices("1,3", visible) == ["1", "3"]


@pytest.mark.parametrize("value, visible, message", [
    ("auto", [], "--gpus auto: no GPU is visible here"),
    ("0", ["0", "1"], "--gpus 0: 0 worker(s) asked for, 2 GPU(s) visible (0, 1)"),
    ("5", ["0", "1"], "--gpus 5: 5 worker(s) asked for, 2 GPU(s) visible"),
    ("all", ["0"], "--gpus 'all': not a GPU count or list"),
    ("1,1", ["0", "1"], "a device list names each device once"),
    ("0,,1", ["0", "1"], "a device list names each device once"),
    ("0,7", ["0", "1"], "device(s) 7 not visible (0, 1)"),
])
def test_bad_gpus_values_are_refused_naming_the_flag(value, visible, message):
    with pytest.raises(UserError) as refused:
        chosen_devices(value, visible)
    assert message in str(refused.value)


class FakeWorker:
    """A worker process that records what it was started with; the one on device 7 exits 1."""

    started: list[dict] = []

    def __init__(self, command, stdout, stderr, env):
        self.pid, self.code = 1000 + len(FakeWorker.started), int(env[DEVICES_ENV] == "7")
        FakeWorker.started.append({"command": command, "env": env})
        stdout.write(f"worker {env[DEVICES_ENV]} done\n")

    def wait(self):
        return self.code

    def send_signal(self, signum):
        pass


def test_each_worker_is_pinned_to_its_own_device(tmp_path):
    FakeWorker.started = []
    code = run_workers(["--config", "sweeps/x.yaml"], ["2", "5", "7"], tmp_path / "workers", popen=FakeWorker)
    assert code == 1  # the largest exit code of the workers
    assert [w["env"][DEVICES_ENV] for w in FakeWorker.started] == ["2", "5", "7"]
    assert all(w["command"][1:] == ["-m", "diffexp", "sweep", "--config", "sweeps/x.yaml"]
               for w in FakeWorker.started)
    logs = sorted((tmp_path / "workers").glob("*.log"))
    assert [p.name.split("-")[0] for p in logs] == ["gpu2", "gpu5", "gpu7"]
    run_workers(["--config", "sweeps/x.yaml"], ["2"], tmp_path / "workers", popen=FakeWorker)
    assert len(list((tmp_path / "workers").glob("gpu2-*.log"))) in (1, 2)  # a new log, or -1 within a second
    assert all(p.read_text() for p in logs)  # not overwritten


def test_bad_gpus_is_refused_before_anything_is_made(tmp_path, monkeypatch):
    monkeypatch.setenv(DEVICES_ENV, "0,1")
    spec = write_spec(tmp_path, "bad-gpus")
    assert exit_code(["sweep", "--config", str(spec), "--gpus", "3"]) == 2
    assert not (tmp_path / "runs").exists()


@pytest.mark.heavy  # two real trials end to end (about a minute); the pinning itself is tested above
def test_one_command_fills_the_fake_node_with_pinned_workers(tmp_path):
    """Two fake GPUs: two workers, each trial run once, its process seeing only its worker's device."""
    spec = write_spec(tmp_path, "node", seeds=[0])
    proc = subprocess.Popen([sys.executable, "-m", "diffexp", "sweep", "--config", str(spec), "--gpus", "auto"],
                            cwd=tmp_path, env=subprocess_env(**{DEVICES_ENV: "0,1"}), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = proc.communicate(timeout=900)
    finally:
        proc.kill()  # its workers die with it (PR_SET_PDEATHSIG), their trials with them
    assert proc.returncode == 0, stderr[-3000:]
    assert "worker on GPU 0" in stderr and "worker on GPU 1" in stderr
    url = f"sqlite:///{tmp_path / 'runs/node/study.db'}"
    states = trials_by_state(url, "node")
    assert len(states) == 2 and all(c == Counter({"COMPLETE": 1}) for c in states.values()), states
    trials = optuna.load_study(study_name="node", storage=open_storage(url)).get_trials(deepcopy=False)
    for trial in trials:
        assert trial.user_attrs["devices"] in ("0", "1")
        assert trial.user_attrs["worker"].endswith(f":gpu{trial.user_attrs['devices']}"), trial.user_attrs
    logs = sorted((tmp_path / "runs/node/workers").glob("gpu*.log"))
    assert [p.name[:4] for p in logs] == ["gpu0", "gpu1"]
    assert all("trials finished" in p.read_text() for p in logs)  # each worker ran to the end of the study


SIZES = sorted(p.stem for p in (REPO / "recipes/gpu/size").glob("*.yaml"))


@pytest.mark.parametrize("size", SIZES)
def test_every_gpu_size_has_a_paired_five_variant_sweep(size):
    """sweeps/gpu_<size>.yaml: the papers' five variants from the GPU recipes' files, 3 shared seeds."""
    spec = load_spec(REPO / f"sweeps/gpu_{size}.yaml", repo_root=REPO)
    assert spec.seeds == [0, 1, 2] and len(spec.points()) == 15
    gpu = REPO / "recipes/gpu"
    expected = {"Transformer": "baseline", "DIFF": "diff_v1", "DIFF V2": "diff_v2", "Shared DIFF": "shared_diff",
                "DINT": "dint"}
    for point in spec.points():
        args = fit_args(spec, point, point.overrides)
        configs = [args[i + 1] for i, arg in enumerate(args) if arg == "--config"]
        variant = expected[point.case]
        files = [gpu / "base.yaml", gpu / "size" / f"{size}.yaml", gpu / "variant" / f"{variant}.yaml"]
        part = gpu / "variant" / variant / f"{size}.yaml"
        assert configs == [str(p.resolve()) for p in files + ([part] if part.is_file() else [])], point.key
        assert point.overrides == {}  # the recipes as documented, nothing changed

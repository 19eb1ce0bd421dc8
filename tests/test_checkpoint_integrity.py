"""Checkpoints that refuse corruption: bytes changed inside a checkpoint after it was written (a faulty copy, a failing
disk) are refused by name, exit 2, no traceback, before any work, by every command that reads one: `fit --ckpt_path`,
`generate`, `export`, `eval` and `model.init_from`; for .ckpt files (their zip records' CRC-32s), sharded directories
and exports (their SHA256SUMS). Checkpoints written before the sums existed still load. And `diffexp export` to a full
disk (a real, small tmpfs) is the one-paragraph no-space error, leaving nothing behind.

torch.load itself checks nothing: the first test shows a flipped tensor loading silently, which is why this matters.
"""

from __future__ import annotations

import hashlib
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from diffexp.checkpoint_io import CHECKSUMS, read_checkpoint
from diffexp.cli import main
from diffexp.errors import UserError
from tests.helpers import mounted_tmpfs, no_process_group_left, write_recipe

FSDP2 = ["--trainer.strategy.class_path", "diffexp.parallel.FSDP2Strategy"]
FLIPPED = 64  # bytes changed, as in the finding that started this: the largest embedding weight became 2070


def largest_record(path: Path) -> tuple[str, int, int]:
    """(name, offset of its data in the file, size) of the largest record of a torch.save zip: a tensor's bytes."""
    with zipfile.ZipFile(path) as archive:
        info = max(archive.infolist(), key=lambda i: i.file_size)
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        header = f.read(30)
    name_length, extra_length = struct.unpack("<HH", header[26:30])
    return info.filename, info.header_offset + 30 + name_length + extra_length, info.file_size


def flip(path: Path, offset: int, count: int = FLIPPED) -> None:
    """Invert `count` bytes at `offset` in place: what a faulty copy does, the size and the format unchanged."""
    data = bytearray(path.read_bytes())
    data[offset:offset + count] = bytes(b ^ 0xFF for b in data[offset:offset + count])
    path.write_bytes(bytes(data))


def flipped_ckpt(source: Path, target: Path) -> str:
    """A copy of the .ckpt at `source` with bytes flipped in the middle of its largest tensor; the record's name."""
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
    name, start, size = largest_record(target)
    flip(target, start + size // 2)
    return name.split("/", 1)[1]


def flip_in_file(path: Path) -> None:
    """Flip bytes in the middle of a file that is no zip (a .distcp shard, safetensors): inside its tensor data."""
    flip(path, path.stat().st_size // 2, min(FLIPPED, path.stat().st_size // 4))


def run(args: list[str], capsys) -> tuple[int, str]:
    """`diffexp ARGS` in this process: (exit code, everything it printed)."""
    try:
        main(args)
        code = 0
    except SystemExit as done:
        code = done.code or 0
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and "cache" not in p.parts}


def assert_refused(code: int, output: str, path: Path, key: str, *words: str) -> None:
    assert code == 2, output
    assert f"{key}={str(path)!r}" in output, output
    assert "the checkpoint is damaged" in output and "copy it again" in output, output
    assert all(word in output for word in words), output
    assert "Traceback" not in output, output


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 4-step DIFF V1 run (runs/run/version_0/checkpoints/last.ckpt), its recipe, and its export."""
    root = tmp_path_factory.mktemp("integrity")
    recipe = write_recipe(root, attention="diff_v1", max_steps=4)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        main(["fit", "--config", str(recipe)])
        with pytest.raises(SystemExit) as done:
            main(["export", "runs/run/version_0/checkpoints/last.ckpt", "exported"])
        assert done.value.code == 0
    return root, recipe


@pytest.fixture
def workdir(trained, tmp_path, monkeypatch):
    """A copy of the trained run and its export to damage, as the working directory."""
    root, recipe = trained
    shutil.copytree(root / "runs", tmp_path / "runs")
    shutil.copytree(root / "exported", tmp_path / "exported")
    monkeypatch.chdir(tmp_path)
    return tmp_path, recipe


def test_torch_load_takes_flipped_weights_and_read_checkpoint_refuses_them(workdir):
    root, _ = workdir
    good = root / "runs/run/version_0/checkpoints/last.ckpt"
    bad = root / "damaged.ckpt"
    record = flipped_ckpt(good, bad)
    changed = torch.load(bad, weights_only=True)["state_dict"]
    original = torch.load(good, weights_only=True)["state_dict"]
    assert any(not torch.equal(changed[k], v) for k, v in original.items())  # loaded silently, weights changed
    with pytest.raises(UserError) as refused:
        read_checkpoint(bad, "--ckpt_path", weights=False)
    message = str(refused.value)
    assert f"its record {record} fails its CRC-32 check" in message
    assert read_checkpoint(good)["state_dict"].keys() == original.keys()  # the intact one reads as before


ENTRY_POINTS = {
    "fit --ckpt_path": lambda recipe, ckpt: ["fit", "--config", str(recipe), "--ckpt_path", str(ckpt),
                                             "--trainer.max_steps", "8"],
    "validate": lambda recipe, ckpt: ["validate", "--config", str(recipe), "--ckpt_path", str(ckpt)],
    "generate": lambda recipe, ckpt: ["generate", str(ckpt), "--prompt", "hello", "--max-new-tokens", "4",
                                      "--device", "cpu"],
    "export": lambda recipe, ckpt: ["export", str(ckpt), "out"],
    "eval": lambda recipe, ckpt: ["eval", "mqar", str(ckpt), "--seq-len", "32", "--num-kv-pairs", "2",
                                  "--samples", "4", "--device", "cpu", "--out", "eval-out"],
    "model.init_from": lambda recipe, ckpt: ["fit", "--config", str(recipe), "--model.init_from", str(ckpt),
                                             "--trainer.logger.init_args.name", "warm"],
}
KEYS = {"fit --ckpt_path": "--ckpt_path", "validate": "--ckpt_path", "generate": "CKPT", "export": "CKPT",
        "eval": "CKPT", "model.init_from": "model.init_from"}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_a_flipped_ckpt_is_refused_by_name_before_any_work(workdir, capsys, entry):
    root, recipe = workdir
    last = root / "runs/run/version_0/checkpoints/last.ckpt"
    record = flipped_ckpt(last, last.with_name("damaged.ckpt"))
    last.with_name("damaged.ckpt").replace(last)  # the run's own last.ckpt, as --ckpt_path last would find it
    before = snapshot(root)
    code, output = run(ENTRY_POINTS[entry](recipe, last), capsys)
    assert_refused(code, output, last, KEYS[entry], f"record {record} fails its CRC-32 check")
    assert snapshot(root) == before  # nothing written: no run directory, no export, no eval output


def test_fit_ckpt_path_last_refuses_the_damaged_last_and_names_the_others(workdir, capsys):
    root, recipe = workdir
    last = root / "runs/run/version_0/checkpoints/last.ckpt"
    others = sorted(p.name for p in last.parent.glob("*.ckpt") if p != last)
    flipped_ckpt(last, last.with_name("damaged.ckpt"))
    last.with_name("damaged.ckpt").replace(last)
    code, output = run(["fit", "--config", str(recipe), "--ckpt_path", "last", "--trainer.max_steps", "8"], capsys)
    assert_refused(code, output, Path("runs/run/version_0/checkpoints/last.ckpt"), "--ckpt_path")
    assert all(name in output for name in others[:4]) and others, output


def test_an_intact_checkpoint_resumes(workdir, capsys):
    root, recipe = workdir
    code, output = run(["fit", "--config", str(recipe), "--ckpt_path", "last", "--trainer.max_steps", "6",
                        "--model.optim.schedule_steps", "4"], capsys)
    assert code == 0, output
    assert torch.load(root / "runs/run/version_0/checkpoints/last.ckpt", weights_only=True)["global_step"] == 6


def test_a_flipped_zip_header_is_refused_too(workdir):
    """A change outside the tensors (a record's name in its local header) is refused as damage, not read."""
    root, _ = workdir
    bad = root / "header.ckpt"
    shutil.copyfile(root / "runs/run/version_0/checkpoints/last.ckpt", bad)
    flip(bad, 30, 4)  # the first record's name, in its local header
    with pytest.raises(UserError) as refused:
        read_checkpoint(bad, "CKPT")
    assert "the checkpoint is damaged" in str(refused.value)


# -- exports --------------------------------------------------------------------------------------------------

def test_an_export_lists_every_file_in_sha256sums(workdir):
    root, _ = workdir
    out = root / "exported"
    listed = {line.split("  ", 1)[1]: line.split("  ", 1)[0]
              for line in (out / CHECKSUMS).read_text().splitlines()}
    assert set(listed) == {p.name for p in out.iterdir()} - {CHECKSUMS}
    assert all(hashlib.sha256((out / name).read_bytes()).hexdigest() == digest for name, digest in listed.items())
    check = subprocess.run(["sha256sum", "-c", CHECKSUMS], cwd=out, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr  # the usual tool reads it as well


@pytest.mark.parametrize("entry", ["generate", "eval", "model.init_from", "export"])
def test_a_flipped_export_is_refused_by_name(workdir, capsys, entry):
    root, recipe = workdir
    out = root / "exported"
    flip_in_file(out / "model.safetensors")
    before = snapshot(root)
    code, output = run(ENTRY_POINTS[entry](recipe, out), capsys)
    assert_refused(code, output, out, KEYS[entry], "model.safetensors does not match its SHA-256 in SHA256SUMS")
    assert snapshot(root) == before


def test_an_export_from_before_sha256sums_is_checked_against_its_config_and_loads_when_intact(workdir, capsys):
    """Exports written before SHA256SUMS carry their weights' SHA-256 in config.json: still checked, still read."""
    root, _ = workdir
    out = root / "exported"
    (out / CHECKSUMS).unlink()
    assert read_checkpoint(out, "CKPT")["state_dict"]
    flip_in_file(out / "model.safetensors")
    code, output = run(ENTRY_POINTS["generate"](None, out), capsys)
    assert_refused(code, output, out, "CKPT", "model.safetensors does not match the SHA-256 its config.json records")


def test_a_changed_config_of_an_export_is_refused(workdir):
    root, _ = workdir
    config = root / "exported/config.json"
    text = config.read_text()
    config.write_text(text.replace('"n_layers": 2', '"n_layers": 1'))
    with pytest.raises(UserError) as refused:
        read_checkpoint(root / "exported", "CKPT", weights=False)
    assert "config.json does not match its SHA-256" in str(refused.value)


def test_a_flipped_hf_export_is_refused_by_name(workdir, capsys):
    pytest.importorskip("transformers")
    root, recipe = workdir
    out = root / "hf"
    assert run(["export", "runs/run/version_0/checkpoints/last.ckpt", str(out), "--format", "hf"], capsys)[0] == 0
    assert (out / CHECKSUMS).is_file()
    assert run(ENTRY_POINTS["generate"](recipe, out), capsys)[0] == 0  # intact: read
    flip_in_file(out / "model.safetensors")
    code, output = run(ENTRY_POINTS["generate"](recipe, out), capsys)
    assert_refused(code, output, out, "CKPT", "model.safetensors does not match its SHA-256")


# -- sharded directories (FSDP2Strategy, one CPU process: the same save as on many) ---------------------------

@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded")
    recipe = write_recipe(root, attention="diff_v1", max_steps=4)
    with pytest.MonkeyPatch.context() as patch, no_process_group_left():
        patch.chdir(root)
        main(["fit", "--config", str(recipe), *FSDP2])
    return root, recipe


@pytest.fixture
def sharded_copy(sharded, tmp_path, monkeypatch):
    root, recipe = sharded
    shutil.copytree(root / "runs", tmp_path / "runs")
    monkeypatch.chdir(tmp_path)
    return tmp_path / "runs/run/version_0/checkpoints/last.ckpt", recipe


def test_a_sharded_checkpoint_lists_its_shards_and_index(sharded_copy):
    last, _ = sharded_copy
    names = {line.split("  ", 1)[1] for line in (last / CHECKSUMS).read_text().splitlines()}
    assert names == {p.name for p in last.iterdir()} - {CHECKSUMS}
    assert ".metadata" in names and "meta.pt" in names and any(n.endswith(".distcp") for n in names)
    assert read_checkpoint(last)["state_dict"]


def test_a_flipped_shard_is_refused_by_fit_and_generate(sharded_copy, capsys):
    last, recipe = sharded_copy
    shard = sorted(last.glob("*.distcp"))[0]
    flip_in_file(shard)
    before = snapshot(last.parents[3])
    code, output = run(["fit", "--config", str(recipe), *FSDP2, "--ckpt_path", "last", "--trainer.max_steps", "8"],
                       capsys)
    assert_refused(code, output, Path("runs/run/version_0/checkpoints/last.ckpt"), "--ckpt_path",
                   f"{shard.name} does not match its SHA-256 in SHA256SUMS")
    code, output = run(ENTRY_POINTS["generate"](recipe, last), capsys)
    assert_refused(code, output, last, "CKPT", shard.name)
    assert snapshot(last.parents[3]) == before


def test_a_sharded_checkpoint_from_before_sha256sums_still_loads_and_resumes(sharded_copy, capsys):
    last, recipe = sharded_copy
    (last / CHECKSUMS).unlink()
    assert read_checkpoint(last)["state_dict"]
    code, output = run(["fit", "--config", str(recipe), *FSDP2, "--ckpt_path", "last", "--trainer.max_steps", "6",
                        "--model.optim.schedule_steps", "4"], capsys)
    assert code == 0, output
    assert (last / CHECKSUMS).is_file()  # the new save wrote its sums


#: what a launched process of a distributed run finds in its environment
LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "GLOBAL_RANK", "RANK", "WORLD_SIZE",
                    "LOCAL_WORLD_SIZE", "GROUP_RANK")


@pytest.mark.heavy  # a 2-process FSDP2 fit and a refused 2-process resume (about 40 s); one process runs by default
def test_two_ranks_hash_their_own_shards_and_a_flipped_one_stops_every_rank(tmp_path):
    from tests.helpers import FSDP2 as FSDP2_STRATEGY
    from tests.helpers import free_port, one_thread_env, write_fsdp_recipe

    recipe = write_fsdp_recipe(tmp_path, "two", devices=2, batch=2, strategy=FSDP2_STRATEGY % "false")

    def fit(*args: str) -> subprocess.CompletedProcess:
        # a launch of its own: the in-process FSDP2 fits above left their rank variables in this environment
        env = {name: value for name, value in one_thread_env().items() if name not in LAUNCH_VARIABLES}
        env["MASTER_PORT"] = str(free_port())
        return subprocess.run([sys.executable, "-m", "diffexp", "fit", "--config", str(recipe), *args], cwd=tmp_path,
                              env=env, text=True, capture_output=True, timeout=300)

    done = fit()
    assert done.returncode == 0, done.stderr[-3000:]
    last = tmp_path / "runs/two/version_0/checkpoints/last.ckpt"
    listed = dict(reversed(line.split("  ", 1)) for line in (last / CHECKSUMS).read_text().splitlines())
    shards = sorted(p.name for p in last.glob("*.distcp"))
    assert len(shards) >= 2 and {name.split("_")[2] for name in shards} == {"0", "1"}  # one set per rank
    assert set(listed) == {p.name for p in last.iterdir()} - {CHECKSUMS}
    assert all(hashlib.sha256((last / name).read_bytes()).hexdigest() == digest for name, digest in listed.items())
    rank_1 = next(name for name in shards if name.startswith("__1_"))
    flip_in_file(last / rank_1)
    refused = fit("--ckpt_path", "last", "--trainer.max_steps", "12", "--model.optim.schedule_steps", "8")
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "the checkpoint is damaged" in refused.stderr and f"{rank_1} does not match its SHA-256" in refused.stderr
    assert "Traceback" not in refused.stderr


# -- export to a full disk: a real tmpfs ----------------------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path):
    """A 64 KiB tmpfs at tmp_path/disk, unmounted afterwards; skipped where mounting is not permitted."""
    with mounted_tmpfs(tmp_path / "disk", "64k") as mount:
        yield mount


@pytest.mark.parametrize("weights_format", ["safetensors", "torch", "hf"])
def test_export_to_a_full_disk_is_one_paragraph_and_leaves_nothing(workdir, capsys, small_disk, weights_format):
    if weights_format == "hf":
        pytest.importorskip("transformers")
    root, _ = workdir
    out = small_disk / "model"
    code, output = run(["export", "runs/run/version_0/checkpoints/last.ckpt", str(out), "--format", weights_format],
                       capsys)
    assert code == 2, output
    assert f"OUT={str(out)!r}: no space left on the device to write the export: it needs about" in output, output
    assert "free on that file system" in output and "Nothing was written" in output, output
    assert "Traceback" not in output and "SafetensorError" not in output, output
    assert list(small_disk.iterdir()) == []  # no partial directory, no staging directory
    needed = float(output.split("it needs about ", 1)[1].split(" KiB", 1)[0])
    assert needed * 1024 > 64 * 1024  # the weights' size, more than the disk holds
    code, output = run(["export", "runs/run/version_0/checkpoints/last.ckpt", "roomy", "--format", weights_format],
                       capsys)
    assert code == 0 and (root / "roomy" / CHECKSUMS).is_file(), output  # the same export, where there is room

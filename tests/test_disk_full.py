"""A disk that fills during a checkpoint save: one paragraph naming the checkpoint and the space it needs, exit 2, no
traceback; the checkpoints saved before stay intact and the run resumes from them.

The full disk is injected (no tmpfs can be mounted here): the first checkpoint is written, then every write into a
later one raises ENOSPC after a few hundred bytes, through torch.save's file (AtomicCheckpointIO) or through
torch.distributed.checkpoint's streams (FSDP2Strategy's sharded directories; FSDP2 gathering one file goes
through AtomicCheckpointIO on rank 0).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from pathlib import Path

import pytest
import torch

from diffexp.checkpoint_io import no_space_error, read_checkpoint, save_failed_for_space, tensor_bytes
from diffexp.cli import main
from diffexp.errors import UserError
from diffexp.training import runs
from diffexp.training.runs import AtomicCheckpointIO
from tests.helpers import write_recipe

FSDP2 = ["--trainer.strategy.class_path", "diffexp.parallel.FSDP2Strategy"]
# a save's own name: AtomicCheckpointIO's temporary file or FSDP2Strategy's staging directory
SAVE = re.compile(r"\..+\.ckpt\.[0-9a-z_]+\.tmp")


class FillingFile:
    """A file whose writes raise ENOSPC once `room` bytes are written, as a full disk does."""

    def __init__(self, file, room: int) -> None:
        self.file, self.room = file, room

    def write(self, data) -> int:
        data = bytes(data)
        if len(data) > self.room:
            self.file.write(data[: self.room])
            self.room = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.file.write(data)

    def __getattr__(self, name):
        return getattr(self.file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()


class Disk:
    """Room for the first checkpoint save only: writes into any later one fill the disk."""

    def __init__(self) -> None:
        self.saves: list[str] = []

    def wrap(self, file, path: str):
        save = next((part for part in Path(path).parts if SAVE.fullmatch(part)), None)
        if save is None:
            return file
        if not self.saves or save == self.saves[0]:
            self.saves[:1] = [save]
            return file
        self.saves.append(save)
        return FillingFile(file, room=300)


@pytest.fixture
def full_disk(monkeypatch):
    disk = Disk()
    real_fdopen = os.fdopen

    class FillingOs:  # runs.py's os, with fdopen going through the disk
        def __getattr__(self, name):
            return getattr(os, name)

        @staticmethod
        def fdopen(fd, *args, **kwargs):
            return disk.wrap(real_fdopen(fd, *args, **kwargs), os.readlink(f"/proc/self/fd/{fd}"))

    monkeypatch.setattr(runs, "os", FillingOs())
    from torch.distributed.checkpoint.filesystem import FileSystem

    real_create_stream = FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with real_create_stream(self, path, mode) as stream:
            yield disk.wrap(stream, str(path)) if "w" in mode else stream

    monkeypatch.setattr(FileSystem, "create_stream", create_stream)
    return disk


def test_atomic_save_leaves_the_previous_checkpoint_and_no_partial_file(tmp_path, full_disk):
    io = AtomicCheckpointIO()
    first = {"state_dict": {"w": torch.ones(4096)}, "global_step": 4}
    io.save_checkpoint(first, tmp_path / "checkpoints/last.ckpt")
    with pytest.raises(UserError) as err:
        io.save_checkpoint({"state_dict": {"w": torch.zeros(4096)}, "global_step": 8},
                           tmp_path / "checkpoints/last.ckpt")
    message = str(err.value)
    assert str(tmp_path / "checkpoints/last.ckpt") in message and "needs about 16.0 KiB" in message
    assert "free on that file system" in message and "--ckpt_path last" in message
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["last.ckpt"]
    assert torch.load(tmp_path / "checkpoints/last.ckpt", weights_only=True)["global_step"] == 4


def test_no_space_is_told_from_other_failures(tmp_path):
    full = OSError(errno.ENOSPC, "No space left on device")
    try:
        try:
            raise full
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 768 vs 662") from None
    except RuntimeError as err:
        wrapped = err  # what torch.save raises: its own error, the ENOSPC as its context
    assert save_failed_for_space(wrapped, tmp_path / "x.ckpt", needed=1)
    assert save_failed_for_space(OSError(errno.EDQUOT, "Disk quota exceeded"), tmp_path / "x.ckpt", needed=1)
    # the same words from torch without an errno: a full disk only when less than the checkpoint is free
    bare = RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")
    assert save_failed_for_space(bare, tmp_path / "x.ckpt", needed=2**62)
    assert not save_failed_for_space(bare, tmp_path / "x.ckpt", needed=1)
    assert not save_failed_for_space(OSError(errno.EACCES, "Permission denied"), tmp_path / "x.ckpt", needed=2**62)
    assert not save_failed_for_space(ValueError("a bug"), tmp_path / "x.ckpt", needed=2**62)
    tied = torch.ones(1024)
    assert tensor_bytes({"state_dict": {"a": tied, "b": tied}, "optimizer_states": [{"m": torch.ones(2)}]}) == 4104
    assert "start the run again" in str(no_space_error(tmp_path / "checkpoints/last.ckpt", 10))


def _fit_until_the_disk_fills(tmp_path, capsys, extra: list[str]) -> tuple[Path, str]:
    recipe = write_recipe(tmp_path, attention="diff_v1", max_steps=8)
    # step 4 writes last.ckpt; the validation at step 6 writes the best checkpoint, into a full disk
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", str(recipe), *extra])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    return recipe, err[err.find("error:"):]


@pytest.mark.parametrize("strategy", [[], FSDP2, [*FSDP2, "--trainer.strategy.init_args.save_distributed_checkpoint",
                                                "false"]], ids=["torch.save", "fsdp2-sharded", "fsdp2-one-file"])
def test_full_disk_during_fit_stops_with_one_paragraph_and_resumes(tmp_path, monkeypatch, capsys, full_disk,
                                                                    strategy):
    monkeypatch.chdir(tmp_path)
    recipe, message = _fit_until_the_disk_fills(tmp_path, capsys, strategy)
    checkpoints = tmp_path / "runs/run/version_0/checkpoints"
    assert "Traceback" not in message and message.count("error:") == 1
    assert "no space left on the device to save the checkpoint" in message
    # the best checkpoint of step 6's validation did not fit; the newest saved is step 4's last.ckpt
    assert "checkpoint runs/run/version_0/checkpoints/step000006-" in message
    assert "needs about" in message and "is free on that file system" in message
    assert "the newest is runs/run/version_0/checkpoints/last.ckpt" in message
    assert "--checkpoint.dirpath" in message and "--ckpt_path last" in message
    assert [p.name for p in checkpoints.iterdir()] == ["last.ckpt"]  # no partial file or staging directory left
    assert read_checkpoint(checkpoints / "last.ckpt")["global_step"] == 4

    monkeypatch.undo()  # space freed
    monkeypatch.chdir(tmp_path)
    main(["fit", "--config", str(recipe), *strategy, "--ckpt_path", "last"])
    assert "resuming from runs/run/version_0/checkpoints/last.ckpt" in capsys.readouterr().err
    assert read_checkpoint(checkpoints / "last.ckpt")["global_step"] == 8

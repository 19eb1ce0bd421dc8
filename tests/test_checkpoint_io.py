"""read_checkpoint: every unreadable checkpoint is a UserError naming the file and the problem."""

from __future__ import annotations

import random
import warnings

import pytest
import torch

from diffexp.checkpoint_io import model_hparams, read_checkpoint
from diffexp.errors import UserError
from diffexp.model.config import ModelConfig
from tests.helpers import save_untrained_checkpoint


class NotAllowed:
    """A class a weights-only load must refuse to unpickle."""


@pytest.fixture(scope="module")
def real_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "last.ckpt"
    save_untrained_checkpoint(ModelConfig(attention="diff_v1", vocab_size=64, d_model=32, n_layers=1, n_heads=2,
                                          max_seq_len=64), path)
    return path


def broken(tmp_path, real_ckpt, kind: str):
    path = tmp_path / f"{kind}.ckpt"
    if kind == "truncated":
        data = real_ckpt.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif kind == "random":
        path.write_bytes(random.Random(0).randbytes(5000))  # fixed bytes: the same input every run
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "text":
        path.write_text("model weights go here\n")
    elif kind == "plain_dict":
        torch.save({"a": 1}, path)
    elif kind == "state_dict":
        torch.save({"weight": torch.zeros(3), "bias": torch.zeros(3)}, path)
    elif kind == "unsafe":
        torch.save({"state_dict": {}, "hyper_parameters": {"arch": {}}, "obj": NotAllowed()}, path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "missing":
        pass
    return path


PROBLEMS = {
    "truncated": "truncated", "random": "not a PyTorch checkpoint", "empty": "empty", "text": "not a PyTorch",
    "plain_dict": "not a diffexp checkpoint", "state_dict": "bare state dict", "unsafe": "NotAllowed",
    "directory": "not a checkpoint file, a sharded checkpoint", "missing": "no such file",
}


@pytest.mark.parametrize("kind", list(PROBLEMS))
def test_unreadable_checkpoints_are_user_errors(tmp_path, real_ckpt, kind):
    path = broken(tmp_path, real_ckpt, kind)
    with pytest.raises(UserError) as error:
        read_checkpoint(path, key="--ckpt_path")
    message = str(error.value)
    assert message.startswith(f"--ckpt_path={str(path)!r}: "), message
    assert PROBLEMS[kind] in message, message
    assert "weights_only=False" not in message and "weights_only` set to `False" not in message
    assert error.value.__cause__ is None  # torch's exception (and its advice) is not chained into the report


def test_unsafe_file_message_never_suggests_an_unsafe_load(tmp_path, real_ckpt):
    path = broken(tmp_path, real_ckpt, "unsafe")
    with pytest.raises(UserError) as error:
        read_checkpoint(path, key="CKPT")
    assert "False" not in str(error.value) and "safe_globals" not in str(error.value)


def test_a_checkpoints_directory_points_at_the_file_inside(tmp_path, real_ckpt):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.ckpt").write_bytes(real_ckpt.read_bytes())
    with pytest.raises(UserError, match="did you mean .*last.ckpt"):
        read_checkpoint(tmp_path / "checkpoints")


def test_a_real_checkpoint_and_its_hparams(real_ckpt):
    checkpoint = read_checkpoint(real_ckpt)
    assert "state_dict" in checkpoint and checkpoint["hyper_parameters"]["arch"]["attention"] == "diff_v1"
    hparams = model_hparams(read_checkpoint(real_ckpt, weights=False))  # no tensors loaded
    assert hparams["arch"]["attention"] == "diff_v1" and hparams["arch"]["max_seq_len"] == 64
    assert hparams["optim"]["lr"] > 0 and hparams["data"] == {} and hparams["global_step"] == 0


def test_a_sharded_checkpoint_directory_reads_as_one_checkpoint(tmp_path, real_ckpt):
    """The layout Lightning's FSDP strategy writes: DCP shards of {"model": state_dict} plus meta.pt."""
    import torch.distributed.checkpoint as dcp

    full = torch.load(real_ckpt, weights_only=True)
    sharded = tmp_path / "last.ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": full["state_dict"]}, checkpoint_id=sharded, no_dist=True)
    torch.save({k: v for k, v in full.items() if k != "state_dict"}, sharded / "meta.pt")
    checkpoint = read_checkpoint(sharded)
    assert checkpoint["state_dict"].keys() == full["state_dict"].keys()
    assert all(torch.equal(checkpoint["state_dict"][k], v) for k, v in full["state_dict"].items())
    assert model_hparams(read_checkpoint(sharded, weights=False))["arch"] == full["hyper_parameters"]["arch"]

    (sharded / "meta.pt").unlink()
    with pytest.raises(UserError, match="meta.pt"):
        read_checkpoint(sharded)


@pytest.mark.parametrize("backend", ["flash_attn", "triton", "sdpa", "eager"])
def test_a_checkpoint_with_retired_backend_settings_still_loads(tmp_path, real_ckpt, backend):
    """backend_fallback and the flash_attn/triton backends are gone; they computed what sdpa does, so an older
    checkpoint reads as that model, ready to build."""
    from diffexp.training.loading import load_checkpoint, load_model

    saved = torch.load(real_ckpt, weights_only=True)
    saved["hyper_parameters"]["arch"] = {**saved["hyper_parameters"]["arch"], "backend": backend,
                                         "backend_fallback": True}
    path = tmp_path / "old.ckpt"
    torch.save(saved, path)
    checkpoint, hparams = load_checkpoint(str(path))
    assert "backend_fallback" not in hparams["arch"]
    assert hparams["arch"]["backend"] == ("eager" if backend == "eager" else "sdpa")
    model = load_model(checkpoint, str(path), "cpu").model
    assert model.cfg.backend == hparams["arch"]["backend"]

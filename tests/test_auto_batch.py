"""`data.batch_size: auto` (diffexp.training.auto_batch): the micro-batch the memory estimate fits on one GPU, the
tokens per step kept, refused elsewhere before any file is written, and a resume that reuses the saved number."""

from __future__ import annotations

import pytest
import torch
import yaml

from diffexp.cli import main
from diffexp.errors import UserError
from diffexp.model.config import ModelConfig
from diffexp.parallel.memory import FIT_FRACTION, estimate_memory
from diffexp.training import auto_batch
from diffexp.training.auto_batch import choose_micro_batch
from diffexp.training.loss import token_losses
from tests.helpers import write_recipe

ARCH = ModelConfig(attention="diff_v1", d_model=32, n_layers=2, n_heads=2, vocab_size=257, max_seq_len=64)


def needed(micro_batch: int, arch: ModelConfig = ARCH) -> int:
    return estimate_memory(arch, micro_batch, 32, 1, torch.float32, loss=token_losses).total


def free_for(micro_batch: int, arch: ModelConfig = ARCH) -> int:
    """Free bytes in which `micro_batch` just fits FIT_FRACTION, and twice it does not."""
    return int(needed(micro_batch, arch) / FIT_FRACTION) + 1


def test_the_largest_micro_batch_that_fits_with_the_rows_of_a_step_kept():
    choose = lambda free, rows: choose_micro_batch(ARCH, 32, free, rows, torch.float32)  # noqa: E731
    assert needed(16) > FIT_FRACTION * free_for(8)
    assert choose(free_for(8), 64) == (8, 8)  # 64 rows a step: 8 micro-batches of 8
    assert choose(free_for(8) - 2, 64) == (4, 16)
    assert choose(free_for(8), 24) == (8, 3)  # a divisor of the rows, so the accumulation is whole
    assert choose(free_for(8), 20) == (5, 4)
    assert choose(10 * free_for(64), 32) == (32, 1)  # never past the global batch
    with pytest.raises(UserError, match=r"data.batch_size='auto' is invalid: even a micro-batch of 1 x 32 tokens"):
        choose(needed(1) // 2, 64)


def _fit(tmp_path, *extra: str) -> None:
    main(["fit", "--config", str(write_recipe(tmp_path, attention="diff_v1", max_steps=4)),
          "--data.batch_size", "auto", *extra])


@pytest.mark.parametrize("case, patch, extra, message", [
    ("cpu", {}, ["--global_batch.rows", "8"], "this run trains on CPU"),
    ("two gpus", {"is_available": True, "device_count": 2}, ["--global_batch.rows", "8"],
     "this run trains on 2 (trainer.devices x trainer.num_nodes)"),
    ("no global batch", {"is_available": True, "device_count": 1}, [], "auto needs global_batch.rows"),
])
def test_auto_is_refused_off_one_gpu_before_any_file_is_written(case, patch, extra, message, tmp_path, monkeypatch,
                                                                capsys):
    monkeypatch.chdir(tmp_path)
    for name, value in patch.items():
        monkeypatch.setattr(torch.cuda, name, lambda value=value: value)
    with pytest.raises(SystemExit):
        _fit(tmp_path, *extra)
    err = capsys.readouterr().err
    assert "data.batch_size='auto' is invalid" in err and message in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()


def test_the_chosen_number_is_saved_and_a_resume_reuses_it_without_estimating(tmp_path, monkeypatch, capsys):
    """A CPU run stands in for the GPU (only the device's identity and free memory are patched): the number auto
    picks is the run's config and checkpoint's, the accumulation keeps global_batch.rows; a resume from that run
    with `auto` again takes the checkpoint's number, whatever the device has free now."""
    from diffexp.training.cli import parse_config
    from diffexp.training.preflight import model_sections

    monkeypatch.chdir(tmp_path)
    # the model as configured (its vocab_size before the data module's tokenizer replaces it)
    free = free_for(4, model_sections(parse_config(["--config", str(write_recipe(tmp_path))]))[0])
    monkeypatch.setattr(auto_batch, "_single_cuda_device", lambda trainer: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 2 * free))
    _fit(tmp_path, "--global_batch.rows", "8")
    err = capsys.readouterr().err
    assert "data.batch_size auto: 4 " in err and "accumulating 2 micro-batch(es) per step" in err
    run = tmp_path / "runs/run/version_0"
    assert yaml.safe_load((run / "config.yaml").read_text())["data"]["init_args"]["batch_size"] == 4
    saved = torch.load(run / "checkpoints/last.ckpt", weights_only=True)
    assert (saved["diffexp_run"]["batch_size"], saved["diffexp_run"]["accumulate_grad_batches"]) == (4, 2)

    def no_estimate(*args, **kwargs):
        raise AssertionError("a resume re-estimated the micro-batch")

    monkeypatch.setattr(auto_batch, "choose_micro_batch", no_estimate)
    monkeypatch.setattr(torch.cuda, "mem_get_info", no_estimate)
    _fit(tmp_path, "--global_batch.rows", "8", "--trainer.max_steps", "6", "--model.optim.schedule_steps", "4",
         "--ckpt_path", "last")
    assert "data.batch_size auto: 4, the resumed run's" in capsys.readouterr().err
    resumed = torch.load(run / "checkpoints/last.ckpt", weights_only=True)
    assert resumed["global_step"] == 6 and resumed["diffexp_run"]["batch_size"] == 4
    config = next(p for p in run.iterdir() if p.name.startswith("config.resumed-"))
    assert yaml.safe_load(config.read_text())["data"]["init_args"]["batch_size"] == 4

"""What this machine cannot build (the accelerator, the devices, the strategy, the precision, the attention backend),
asked for as a user would: each case exits 2 with one paragraph naming the key, no traceback, before any data, model
or run directory exists. Lightning raised these from inside the Trainer's construction, after the data and the
model were built and the run directory reserved."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from diffexp.cli import main
from diffexp.data import TextDataModule
from diffexp.model.decoder import Decoder
from diffexp.training import DiffexpLM
from tests.helpers import write_recipe


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _nccl() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_nccl_available()


gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
FSDP2 = ["--trainer.strategy.class_path", "diffexp.parallel.FSDP2Strategy"]

# (id, arguments after `diffexp fit --config RECIPE`, fragments the message must hold, marks)
CASES = [
    ("accelerator-gpu", ["--trainer.accelerator", "gpu"], ["trainer.accelerator='gpu'", "cpu"], [gpu]),
    ("accelerator-cuda", ["--trainer.accelerator", "cuda"], ["trainer.accelerator='cuda'"], [gpu]),
    ("more-devices-than-gpus", ["--trainer.devices", "64", "--trainer.accelerator", "gpu"],
     ["trainer.accelerator='gpu'"], []),
    ("accelerator-mps", ["--trainer.accelerator", "mps"], ["trainer.accelerator='mps'"], []),
    ("accelerator-tpu", ["--trainer.accelerator", "tpu"], ["trainer.accelerator='tpu'", "torch_xla"],
     [pytest.mark.skipif(_has("torch_xla"), reason="torch_xla is installed")]),
    ("accelerator-name", ["--trainer.accelerator", "foo"], ["trainer.accelerator='foo'", "cpu"], []),
    ("strategy-fsdp-on-cpu", ["--trainer.strategy", "fsdp", "--trainer.accelerator", "cpu"],
     ["trainer.strategy='fsdp'", "GPU"], []),
    ("strategy-deepspeed", ["--trainer.strategy", "deepspeed"], ["trainer.strategy='deepspeed'", "DeepSpeed"],
     [pytest.mark.skipif(_has("deepspeed"), reason="deepspeed is installed")]),
    ("strategy-deepspeed-class", ["--trainer.strategy.class_path", "lightning.pytorch.strategies.DeepSpeedStrategy"],
     ["trainer.strategy='lightning.pytorch.strategies.DeepSpeedStrategy'", "DeepSpeed"],
     [pytest.mark.skipif(_has("deepspeed"), reason="deepspeed is installed")]),
    ("strategy-xla", ["--trainer.strategy", "xla"], ["trainer.strategy='xla'"],
     [pytest.mark.skipif(_has("torch_xla"), reason="torch_xla is installed")]),
    ("strategy-name", ["--trainer.strategy", "foo"], ["trainer.strategy='foo'"], []),
    ("strategy-class-as-name", ["--trainer.strategy", "diffexp.parallel.FSDP2Strategy"],
     ["trainer.strategy='diffexp.parallel.FSDP2Strategy'", "--trainer.strategy.class_path"], []),
    ("process-group-nccl", [*FSDP2, "--trainer.strategy.init_args.process_group_backend", "nccl"],
     ["trainer.strategy.init_args.process_group_backend='nccl'", "gloo"],
     [pytest.mark.skipif(_nccl(), reason="this torch has NCCL")]),
    ("process-group-unknown", [*FSDP2, "--trainer.strategy.init_args.process_group_backend", "foo"],
     ["trainer.strategy.init_args.process_group_backend='foo'"], []),
    ("devices-zero", ["--trainer.devices", "0"], ["trainer.devices='0'"], []),
    ("devices-negative", ["--trainer.devices", "-2"], ["trainer.devices", "-2"], []),
    ("num-nodes-zero", ["--trainer.num_nodes", "0"], ["trainer.num_nodes=0"], []),
    ("precision-transformer-engine", ["--trainer.precision", "transformer-engine"],
     ["trainer.precision='transformer-engine'", "transformer_engine"],
     [pytest.mark.skipif(_has("transformer_engine"), reason="transformer_engine is installed")]),
    ("profiler-name", ["--trainer.profiler", "foo"], ["trainer.profiler='foo'"], []),
    ("max-time", ["--trainer.max_time", "abc"], ["trainer.max_time='abc'"], []),
    ("backend-retired", ["--model.arch.backend", "flash_attn"],
     ["model.arch.backend", "flash_attn", "allowed: sdpa or eager"], []),
]


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Path:
    return write_recipe(tmp_path_factory.mktemp("build"), attention="diff_v1", max_steps=4)


@pytest.fixture
def no_work(monkeypatch):
    def trap(*args, **kwargs):
        raise AssertionError("work started on a config this machine cannot build")

    monkeypatch.setattr(Decoder, "__init__", trap)
    monkeypatch.setattr(DiffexpLM, "training_step", trap)
    monkeypatch.setattr(TextDataModule, "ensure_prepared", trap, raising=False)
    monkeypatch.setattr(TextDataModule, "prepare_data", trap)
    monkeypatch.setattr(TextDataModule, "setup", trap)


@pytest.mark.parametrize("args, fragments", [pytest.param(*c[1:3], marks=c[3], id=c[0]) for c in CASES])
def test_unbuildable_config_fails_before_work_with_one_paragraph(recipe, no_work, monkeypatch, capsys, args,
                                                                 fragments):
    monkeypatch.chdir(recipe.parent)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # conftest's: Triton's CPU interpreter, for kernel tests
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", str(recipe), *args])
    assert exit_.value.code == 2
    text = capsys.readouterr().err
    assert "Traceback" not in text
    message = text[text.find("error:"):]
    assert message.startswith("error:") and message.count("error:") == 1, text[-2000:]
    assert len(message.strip().splitlines()) == 2, message  # the paragraph, then the DIFFEXP_DEBUG hint
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert not (recipe.parent / "runs").exists()


def test_only_what_lightning_raises_for_a_value_becomes_a_user_error():
    from lightning.pytorch import Trainer

    from diffexp.errors import UserError
    from diffexp.training.checkpointing import check_checkpoint_settings
    from diffexp.training.construction import trainer_build_errors

    with pytest.raises(UserError, match=r"^trainer.num_nodes=0 is invalid: .*positive integer"):
        with trainer_build_errors({"num_nodes": 0}):
            Trainer(num_nodes=0, logger=False, enable_checkpointing=False)
    with pytest.raises(TypeError):  # raised in diffexp's own code: a bug keeps its traceback
        with trainer_build_errors({}):
            check_checkpoint_settings({"save_top_k": "many"}, {}, "fit")
    with pytest.raises(KeyError):  # not a kind Lightning raises for a value
        with trainer_build_errors({}):
            {}["accelerator"]

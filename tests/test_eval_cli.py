"""`diffexp eval icl|mqar` on a checkpoint: files in the run's eval/ and scalars in its TensorBoard."""

from __future__ import annotations

import lightning as L
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from diffexp.cli import main
from diffexp.model.config import ModelConfig
from diffexp.training import DiffexpLM


@pytest.fixture
def checkpoint(tmp_path):
    module = DiffexpLM(ModelConfig(attention="dint", vocab_size=512, d_model=32, n_layers=1, n_heads=2,
                                   max_seq_len=512))
    trainer = L.Trainer(max_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.strategy.connect(module)
    path = tmp_path / "run" / "checkpoints" / "last.ckpt"
    trainer.save_checkpoint(path)
    return path


def run(args):
    with pytest.raises(SystemExit) as exit_:
        main(["eval", *args])
    return exit_.value.code


def test_eval_mqar(checkpoint, capsys):
    assert run(["mqar", str(checkpoint), "--seq-len", "64", "--num-kv-pairs", "4", "--samples", "16",
                "--device", "cpu"]) == 0
    assert '"mqar/accuracy"' in capsys.readouterr().out
    assert (checkpoint.parent.parent / "eval" / "mqar-seq64-kv4.json").is_file()
    assert "mqar/accuracy_seq64_kv4" in EventAccumulator(str(checkpoint.parent.parent)).Reload().Tags()["scalars"]


def test_eval_icl(checkpoint):
    # vocab_size 512 and no tokenizer saved: the byte tokenizer is named, not guessed
    assert run(["icl", str(checkpoint), "--n-demos", "1", "2", "--n-orderings", "2", "--n-tests", "4",
                "--device", "cpu"]) == 2
    assert run(["icl", str(checkpoint), "--n-demos", "1", "2", "--n-orderings", "2", "--n-tests", "4",
                "--device", "cpu", "--tokenizer", "byte"]) == 0
    assert list((checkpoint.parent.parent / "eval").glob("icl*.csv"))


def test_eval_icl_uses_the_task_shape_the_checkpoint_was_trained_on(tmp_path, capsys):
    from diffexp.data.icl import ICLDataModule

    module = DiffexpLM(ModelConfig(vocab_size=257, d_model=32, n_layers=1, n_heads=2, max_seq_len=256))
    data = ICLDataModule(k_classes=3, group_size=6, words_per_input=2, seq_len=64, batch_size=2, train_size=2)
    trainer = L.Trainer(max_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.strategy.connect(module)
    trainer.datamodule = data
    path = tmp_path / "run" / "checkpoints" / "last.ckpt"
    trainer.save_checkpoint(path)
    args = ["icl", str(path), "--n-demos", "1", "--n-orderings", "1", "--n-tests", "3", "--device", "cpu"]
    assert run(args) == 0
    assert "ICL task: K=3, 6 words per class, 2 per input" in capsys.readouterr().out
    assert run([*args, "--words-per-input", "3"]) == 0  # a flag wins over the checkpoint
    assert "ICL task: K=3, 6 words per class, 3 per input" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["needle", "icl", "mqar"])
def test_eval_callbacks_refuse_fsdp_before_training(name):
    from types import SimpleNamespace

    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

    from diffexp.evals import Evaluate

    callback = Evaluate(name)
    callback.setup(SimpleNamespace(strategy=DDPStrategy()), None, "test")  # fine (inputs are made for fit)
    with pytest.raises(ValueError, match=f"cannot run under FSDPStrategy.*diffexp eval {name} "):
        callback.setup(SimpleNamespace(strategy=FSDPStrategy()), None, "fit")

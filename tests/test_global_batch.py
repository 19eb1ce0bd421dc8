"""global_batch.rows: the tokens per step stay what the recipe says, whatever the number of processes."""

from __future__ import annotations

import pytest
import torch

from diffexp.errors import UserError
from diffexp.training.global_batch import accumulation_for
from tests.helpers import scalars, write_recipe


def test_accumulation_makes_up_the_global_batch_or_is_refused():
    assert accumulation_for(128, micro_batch=8, world_size=8) == 2
    assert accumulation_for(128, micro_batch=8, world_size=16) == 1
    assert accumulation_for(128, micro_batch=8, world_size=4) == 4
    with pytest.raises(UserError, match=r"global_batch.rows=128: 3 process\(es\) x data.batch_size 8 read 24 rows.*"
                                        r"e.g. 120, 144"):
        accumulation_for(128, micro_batch=8, world_size=3)


def test_a_run_accumulates_to_the_global_batch_and_validates_on_steps(tmp_path, monkeypatch):
    from diffexp.cli import main

    monkeypatch.chdir(tmp_path)
    recipe = write_recipe(tmp_path, max_steps=4)  # data.batch_size 4
    main(["fit", "--config", str(recipe), "--global_batch.rows", "12", "--trainer.val_check_interval", "2",
          "--trainer.log_every_n_steps", "1"])
    logged = scalars(tmp_path / "runs/run/version_0")
    assert [step for step, _ in logged["train/loss"]] == [1, 2, 3, 4]  # 4 optimizer steps ...
    # written straight to the loggers, once per optimizer step, not once per micro-batch
    assert [step for step, _ in logged["vitals/lambda/layer_01"]] == [1, 2, 3, 4]
    per_layer, whole = logged["vitals/layer_01/act_max_abs"], logged["vitals/act_max_abs"]
    assert [step for step, _ in per_layer] == [step for step, _ in whole]
    assert [step for step, _ in whole] == [1]  # diagnostics.every_n_steps 4: the first step only
    # ... of 12 rows: 3 micro-batches of 4 each
    assert torch.load(next((tmp_path / "runs/run/version_0/checkpoints").glob("last.ckpt")),
                      weights_only=False)["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["completed"] == 12
    assert [step for step, _ in logged["val/loss"]] == [2, 4]  # every 2 steps, not every 2 micro-batches

"""Gradient clipping by the norm the module already computed equals Lightning's clip_grad_norm_, bit for bit."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from diffexp.model.config import ModelConfig
from diffexp.training import DiffexpLM


def train(clip: float, through_lightning: bool, monkeypatch) -> tuple[dict, list[float]]:
    if through_lightning:  # the module's shortcut off: Lightning computes the norm again and clips
        monkeypatch.setattr(DiffexpLM, "configure_gradient_clipping", L.LightningModule.configure_gradient_clipping)
    torch.manual_seed(0)
    module = DiffexpLM(ModelConfig(attention="diff_v1", d_model=32, n_layers=2, n_heads=2, vocab_size=61,
                                   max_seq_len=16), ar_hit={"enabled": False})
    norms = []
    module.on_after_backward = lambda: None
    original = module.on_before_optimizer_step
    module.on_before_optimizer_step = lambda opt: (original(opt), norms.append(module.last_grad_norm))
    data = DataLoader(torch.randint(0, 61, (24, 17)), batch_size=4)
    trainer = L.Trainer(max_steps=5, gradient_clip_val=clip, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1)
    trainer.fit(module, data)
    monkeypatch.undo()
    return {k: v.clone() for k, v in module.state_dict().items()}, norms


@pytest.mark.parametrize("clip", [0.05, 100.0])
def test_clipping_by_the_computed_norm_equals_lightnings(clip, monkeypatch):
    ours, norms = train(clip, False, monkeypatch)
    lightnings, _ = train(clip, True, monkeypatch)
    assert (max(norms) > clip) == (clip < 1)  # the small limit clips every step, the large one never
    for key in ours:
        assert torch.equal(ours[key], lightnings[key]), key

"""The training step without waste (issue 54, part 2): one compiled graph for every layer of a variant, the
chunked cross-entropy against the plain one, fused/foreach AdamW."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from diffexp.model import Decoder
from diffexp.model.compile import compile_blocks
from diffexp.model.config import ModelConfig


def _graphs(attention: str, n_layers: int) -> int:
    torch._dynamo.reset()
    counter = CompileCounter()
    cfg = ModelConfig(attention=attention, n_layers=n_layers, d_model=32, n_heads=2, vocab_size=64, max_seq_len=16,
                      backend="sdpa")
    model = Decoder(cfg)
    assert compile_blocks(model.blocks, torch.device("cpu"), backend=counter) is None
    model(torch.randint(0, 64, (2, 16)))
    return counter.frame_count


@pytest.mark.parametrize("attention", ["baseline", "diff_v1", "shared_diff", "dint", "diff_v2"])
def test_compiled_blocks_share_one_graph_across_layers(attention):
    """Layers differ only in lambda_init (depth-dependent): 4 layers compile no more graphs than 1 (a Python
    float attribute would be a guard, one graph per layer until the recompile limit, then eager)."""
    assert _graphs(attention, 4) == _graphs(attention, 1)


def test_adamw_fused_on_cuda_foreach_elsewhere():
    from diffexp.training.module import DiffexpLM, adamw_kernel

    assert adamw_kernel(torch.device("cuda", 0)) == {"fused": True}
    assert adamw_kernel(torch.device("cpu")) == {"foreach": True}
    module = DiffexpLM(ModelConfig(n_layers=1, d_model=16, n_heads=2, vocab_size=32, max_seq_len=8))
    module.optim = module.optim.__class__(**{**module.optim.__dict__, "schedule_steps": 10})
    optimizer = module.configure_optimizers()["optimizer"]
    assert optimizer.defaults["foreach"] is True and not optimizer.defaults["fused"]

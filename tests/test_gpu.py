"""GPU-only checks: flash-attn backend == eager, bf16 training step. Skipped without CUDA."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from diffexp import Decoder, ModelConfig
from diffexp.model.attention.base import flash_attn_func

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none)")
needs_flash = pytest.mark.skipif(flash_attn_func is None, reason="flash-attn is not installed (extra: flash)")
VARIANTS = ["baseline", "diff_v1", "diff_v2", "shared_diff", "dint"]


def _pair(attention: str, backend: str):
    cfg = ModelConfig(attention=attention, vocab_size=512, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2,
                      backend=backend)
    fast = Decoder(cfg).cuda()
    eager = copy.deepcopy(fast)
    for block in eager.blocks:
        block.attn.backend = "eager"
    return fast, eager


@needs_flash
@pytest.mark.parametrize("attention", VARIANTS)
def test_flash_backend_matches_eager_in_bf16(attention):
    fast, eager = _pair(attention, "flash_attn")
    idx = torch.randint(0, 512, (2, 256), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out_fast, out_eager = fast(idx).float(), eager(idx).float()
    torch.testing.assert_close(out_fast, out_eager, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("attention", VARIANTS)
def test_sdpa_bf16_training_step_is_finite_and_matches_eager(attention):
    fast, eager = _pair(attention, "sdpa")
    idx = torch.randint(0, 512, (2, 257), device="cuda")
    losses = []
    for model in (fast, eager):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(idx[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), idx[:, 1:].flatten())
        loss.backward()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[0] == pytest.approx(losses[1], rel=2e-2)

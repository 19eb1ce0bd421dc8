"""Decoding with a KV cache gives the logits of one full forward, for every variant and every flag that
changes its math (the registry's cases); greedy continuations are the same token for token; the cache
holds what each variant needs per token, and DINT's integral state grows by one number per head and token."""

from __future__ import annotations

import pytest
import torch

from diffexp import Decoder
from diffexp.model.cache import DecoderCache
from tests.helpers import CASES, make_config, small_blocks

T = 13  # prompt + decoded positions; DINT's integral walks several query blocks (small_blocks: 5 rows)


def build(case: str, **extra) -> Decoder:
    torch.manual_seed(0)
    model = Decoder(make_config(case, **extra)).eval()
    small_blocks(model)
    return model


def decode_in_pieces(model: Decoder, idx: torch.Tensor, pieces: list[int]) -> tuple[torch.Tensor, DecoderCache]:
    """Feed idx through one cache in pieces of these lengths (prefill, then tokens or chunks); all logits."""
    cache = model.new_cache()
    logits, start = [], 0
    for length in pieces:
        logits.append(model(idx[:, start:start + length], cache=cache))
        start += length
    assert start == idx.shape[1] and cache.length == start
    return torch.cat(logits, dim=1), cache


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("pieces", [[5] + [1] * 8, [1] * T, [4, 3, 1, 5]], ids=["prefill+tokens", "tokens", "chunks"])
def test_cached_decoding_equals_a_full_forward(case, pieces):
    model = build(case)
    idx = torch.randint(0, model.cfg.vocab_size, (2, T))
    with torch.no_grad():
        full = model(idx)
        cached, _ = decode_in_pieces(model, idx, pieces)
    torch.testing.assert_close(cached, full, rtol=0, atol=1e-5)


@pytest.mark.parametrize("case", list(CASES))
def test_cached_decoding_on_the_eager_backend(case):
    """The eager path (the one that materialises maps) masks chunks after a cache the same way."""
    model = build(case, backend="eager")
    idx = torch.randint(0, model.cfg.vocab_size, (2, T))
    with torch.no_grad():
        cached, _ = decode_in_pieces(model, idx, [4, 3, 1, 5])
        torch.testing.assert_close(cached, model(idx), rtol=0, atol=1e-5)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_continuation_with_the_cache_is_the_full_forwards(case):
    """Token by token: argmax of a full forward over everything so far, against prefill + cached steps."""
    model = build(case)
    prompt = torch.randint(0, model.cfg.vocab_size, (2, 4))
    with torch.no_grad():
        plain = prompt
        for _ in range(8):
            plain = torch.cat([plain, model(plain)[:, -1:].argmax(-1)], dim=1)
        cache = model.new_cache()
        logits = model(prompt, cache=cache)
        cached = prompt
        for _ in range(8):
            token = logits[:, -1:].argmax(-1)
            cached = torch.cat([cached, token], dim=1)
            logits = model(token, cache=cache)
    assert torch.equal(cached, plain)


def per_token_elements(cfg) -> int:
    """Cached numbers per token and layer, from the variant's layout (docs/generation.md, "The KV cache")."""
    d, h, h_kv = cfg.resolved_head_dim, cfg.n_heads, cfg.kv_heads
    if cfg.attention in ("baseline", "diff_v2"):
        return 2 * h_kv * d  # K and V, d wide: DIFF V2's 2h query heads read the baseline's KV heads
    if cfg.attention in ("diff_v1", "shared_diff"):
        return 2 * h_kv * d + h_kv * 2 * d  # K1 and K2, and V once, 2d wide
    assert cfg.attention == "dint", cfg.attention
    return 2 * h_kv * d + h_kv * 2 * d + h  # DIFF V1's, plus A1's column sums: one per head


@pytest.mark.parametrize("name", ["baseline", "diff_v1", "diff_v2", "shared_diff", "dint"])
def test_cache_bytes_per_token(name):
    model = build(name)
    with torch.no_grad():
        _, cache = decode_in_pieces(model, torch.randint(0, 61, (3, T)), [6, 1, 6])
    per_layer = per_token_elements(model.cfg) * 4  # fp32
    assert cache.bytes_per_token() == 3 * model.cfg.n_layers * per_layer
    if name == "dint":  # the integral's state: one column sum per head and position, not T x T
        assert cache.layers[0].state["col_sums"].shape == (3, model.cfg.n_heads, cache.allocated)
        assert T <= cache.allocated < 2 * T


def test_at_matched_parameters_every_two_map_cache_equals_the_baselines():
    """The V2 blog's decoding argument is about reads, not size: at the same n_kv_heads, DIFF V2 caches the
    baseline's K and V, and DIFF V1's K1, K2 (d/2 wide each, its per-map dim) and 2d-wide V add up to the same
    bytes; a decoding step reads each once (tests/test_decoding.py), and `diffexp bench decode` times it."""
    sizes = {}
    for name in ("baseline", "diff_v2", "diff_v1"):
        model = build(name, n_kv_heads=2)
        with torch.no_grad():
            _, cache = decode_in_pieces(model, torch.randint(0, 61, (1, 8)), [8])
        sizes[name] = cache.bytes_per_token()
    assert sizes["diff_v2"] == sizes["baseline"] == sizes["diff_v1"]


def test_rewinding_decodes_the_same_tokens_again():
    for name in ("dint", "diff_v2"):
        model = build(name)
        idx = torch.randint(0, 61, (2, 10))
        with torch.no_grad():
            cache = model.new_cache()
            model(idx[:, :6], cache=cache)
            mark = cache.mark()
            first = model(idx[:, 6:], cache=cache)
            cache.rewind(mark)
            again = model(idx[:, 6:], cache=cache)
        assert cache.length == 10 and torch.equal(first, again), name


def test_cache_refuses_positions_past_max_seq_len():
    model = build("baseline")
    cache = model.new_cache()
    with torch.no_grad():
        model(torch.zeros(1, model.cfg.max_seq_len - 1, dtype=torch.long), cache=cache)
        model(torch.zeros(1, 1, dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match="max_seq_len=64"):
            model(torch.zeros(1, 1, dtype=torch.long), cache=cache)
    assert cache.length == model.cfg.max_seq_len  # the refused call changed nothing


def test_weights_need_a_full_forward():
    model = build("dint")
    with pytest.raises(ValueError, match="without a cache"):
        model(torch.zeros(1, 3, dtype=torch.long), need_weights=True, cache=model.new_cache())


def test_a_variant_without_cache_support_says_so():
    """A variant whose forward takes no cache (written before decoding existed) still trains; asking it for a
    cache is a clear error, not a TypeError deep in a layer."""
    from diffexp.model.attention.baseline import BaselineAttention

    class NoCache(BaselineAttention):
        def forward(self, x, need_weights=False):
            return super().forward(x, need_weights)

    model = build("baseline")
    for block in model.blocks:
        block.attn.__class__ = NoCache
    model(torch.zeros(1, 3, dtype=torch.long))  # a full forward still works
    with pytest.raises(ValueError, match="no decoding with a cache"):
        model.new_cache()

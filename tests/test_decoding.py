"""Decoding at the baseline's cost: the one-token step (eager and torch.compile'd on a static cache) gives the
logits of a full forward for every variant; rows of different lengths decode together as each would alone."""

from __future__ import annotations

import pytest
import torch

from diffexp import Decoder
from diffexp.generate.decode import generate as sample
from diffexp.generate.decode import prompt_rows, static_capacity
from diffexp.generate.sampling import Sampling
from diffexp.model.cache import DecoderCache
from diffexp.model.compile import compile_unavailable
from tests.helpers import CASES, make_config, small_blocks

VARIANTS = ["baseline", "diff_v1", "diff_v2", "shared_diff", "dint", "softpick", "ssmax"]
COMPILE_MISSING = compile_unavailable(torch.device("cpu"))


def generate(model, prompt, max_new_tokens: int, **options):
    """Greedy tokens."""
    return sample(model, prompt, max_new_tokens, Sampling(temperature=0.0), **options)


def build(case: str, **extra) -> Decoder:
    torch.manual_seed(0)
    model = Decoder(make_config(case, **extra)).eval()
    small_blocks(model)
    return model


def step_through(model, idx, prefill: int, cache) -> torch.Tensor:
    """Logits (B, T - prefill, vocab) of idx's tokens after `prefill`, one decode_step each."""
    with torch.no_grad():
        model(idx[:, :prefill], cache=cache)
        return torch.stack([model.decode_step(idx[:, t:t + 1], cache) for t in range(prefill, idx.shape[1])], 1)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
def test_a_step_gives_the_full_forwards_logits(case, static):
    """Static: the step reads the whole capacity and masks the positions not written yet."""
    model = build(case)
    idx = torch.randint(0, model.cfg.vocab_size, (2, 12))
    with torch.no_grad():
        full = model(idx)[:, 5:]
    stepped = step_through(model, idx, 5, model.new_cache(capacity=20, static=static))
    torch.testing.assert_close(stepped, full, rtol=0, atol=1e-5)


def ragged_rows(vocab: int) -> list[torch.Tensor]:
    return [torch.randint(0, vocab, (n,)) for n in (3, 9, 6)]


@pytest.mark.parametrize("case", list(CASES))
def test_rows_of_different_lengths_decode_as_each_alone(case):
    model = build(case)
    rows = ragged_rows(model.cfg.vocab_size)
    together = torch.stack(list(generate(model, rows, 6)), 1)
    for i, row in enumerate(rows):
        alone = torch.stack(list(generate(model, row[None], 6)), 1)
        assert torch.equal(together[i], alone[0]), (case, i)


def test_a_ragged_step_matches_each_rows_full_forward():
    """Logits, not only argmaxes: each row at its own position, its own keys masked, DINT's n its own."""
    for name in ("baseline", "dint", "diff_v2"):
        model = build(name)
        rows = ragged_rows(model.cfg.vocab_size)
        nexts = torch.randint(0, model.cfg.vocab_size, (3, 1))
        caches = []
        with torch.no_grad():
            for row in rows:
                caches.append(model.new_cache(capacity=16))
                model(row[None], cache=caches[-1])
            logits = model.decode_step(nexts, DecoderCache.stack(caches))
            for i, row in enumerate(rows):
                full = model(torch.cat([row, nexts[i]])[None])[0, -1]
                torch.testing.assert_close(logits[i], full, rtol=0, atol=1e-5)


def test_a_ragged_cache_refuses_a_chunk():
    model = build("baseline")
    cache = DecoderCache.stack([model.new_cache(16), model.new_cache(16)])
    cache.lengths = [3, 5]
    with pytest.raises(ValueError, match="decode one token at a time"):
        model(torch.zeros(2, 2, dtype=torch.long), cache=cache)


def test_a_cache_refuses_positions_past_its_capacity():
    model = build("diff_v1")
    cache = model.new_cache(capacity=6)
    with torch.no_grad():
        model(torch.zeros(1, 6, dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match="capacity=6"):
            model.decode_step(torch.zeros(1, 1, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="capacity=65"):
        model.new_cache(capacity=model.cfg.max_seq_len + 1)


def test_a_static_cache_holds_its_capacity_from_the_first_write():
    model = build("dint")
    cache, growing = model.new_cache(capacity=20, static=True), model.new_cache(capacity=20)
    with torch.no_grad():
        for c in (cache, growing):
            model(torch.zeros(2, 3, dtype=torch.long), cache=c)
    layer = cache.layers[0]
    assert all(b.shape[-2] == 20 for b in layer._buffers.values()) and layer.state["col_sums"].shape[-1] == 20
    assert growing.layers[0].state["col_sums"].shape[-1] < 20
    assert cache.bytes() == growing.bytes() > 0  # what the written positions hold, not the spare capacity


def test_static_capacity_buckets_lengths():
    assert [static_capacity(n, 64) for n in (1, 2, 3, 17, 64)] == [1, 2, 4, 32, 64]
    assert static_capacity(40, 48) == 48


def test_prompt_rows_are_checked():
    with pytest.raises(ValueError, match="non-empty"):
        prompt_rows([[1, 2], []])
    with pytest.raises(ValueError, match="batch, T"):
        prompt_rows(torch.zeros(3, dtype=torch.long))


def stacked_and_alone(model) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens (3, 5) of rows of different lengths: stepped together through decode_step on one stacked
    static cache, and each generated alone (eager, growing caches)."""
    rows = ragged_rows(model.cfg.vocab_size)
    alone = [torch.stack(list(generate(model, row[None], 5)), 1)[0] for row in rows]
    with torch.no_grad():
        caches = [model.new_cache(capacity=16, static=True) for _ in rows]
        firsts = [model(row[None], cache=c)[:, -1].argmax(-1) for row, c in zip(rows, caches)]
        cache, token, together = DecoderCache.stack(caches), torch.cat(firsts)[:, None], [torch.cat(firsts)]
        for _ in range(4):
            token = model.decode_step(token, cache).argmax(-1, keepdim=True)
            together.append(token[:, 0])
    return torch.stack(together, 1), torch.stack(alone)


@pytest.fixture
def fresh_dynamo():
    """Compiled steps of earlier tests count against torch.compile's per-function limit: start from none."""
    torch.compiler.reset()
    yield
    torch.compiler.reset()


@pytest.mark.skipif(COMPILE_MISSING is not None, reason=f"torch.compile cannot run here: {COMPILE_MISSING}")
@pytest.mark.parametrize("name", VARIANTS)
def test_the_compiled_step_equals_the_eager_step(name, fresh_dynamo):
    """Inductor on CPU: one compiled graph per model, reused at every position and by rows of different lengths."""
    model = build(name)
    idx = torch.randint(0, model.cfg.vocab_size, (3, 12))
    eager = step_through(model, idx, 5, model.new_cache(capacity=16, static=True))
    assert model.compile_decoding() is None
    compiled = step_through(model, idx, 5, model.new_cache(capacity=16, static=True))
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-5)
    with torch.compiler.set_stance("fail_on_recompile"):  # no recompiles for other positions or rows
        together, alone = stacked_and_alone(model)
    assert torch.equal(together, alone)


@pytest.mark.skipif(COMPILE_MISSING is not None, reason=f"torch.compile cannot run here: {COMPILE_MISSING}")
def test_compiled_steps_of_several_models_stay_their_own(fresh_dynamo):
    """Models compiled in one process (a benchmark, a comparison) each compile a code object of their own: they never
    look up each other's compiled steps, and steps interleaved between them recompile nothing."""
    models = [build(name) for name in ("baseline", "diff_v2", "diff_v1", "baseline")]
    idx = torch.randint(0, models[0].cfg.vocab_size, (2, 9))
    eager = [step_through(m, idx, 5, m.new_cache(capacity=16, static=True)) for m in models]
    for model in models:
        assert model.compile_decoding() is None
    assert len({id(model._compiled_step.__wrapped__.__code__) for model in models}) == len(models)
    for model, want in zip(models, eager, strict=True):  # each model's first compiled steps compile it
        torch.testing.assert_close(step_through(model, idx, 5, model.new_cache(capacity=16, static=True)), want,
                                   rtol=0, atol=1e-5)
    with torch.compiler.set_stance("fail_on_recompile"):
        for model, want in zip(models, eager, strict=True):
            compiled = step_through(model, idx, 5, model.new_cache(capacity=16, static=True))
            torch.testing.assert_close(compiled, want, rtol=0, atol=1e-5)


@pytest.mark.skipif(COMPILE_MISSING is not None, reason=f"torch.compile cannot run here: {COMPILE_MISSING}")
def test_a_compiled_step_follows_the_model_to_another_dtype(fresh_dynamo):
    model = build("diff_v2")
    assert model.compile_decoding() is None
    step_through(model, torch.zeros(1, 6, dtype=torch.long), 5, model.new_cache(capacity=16, static=True))
    model.to(torch.float64)
    idx = torch.randint(0, model.cfg.vocab_size, (2, 9))
    stepped = step_through(model, idx, 5, model.new_cache(capacity=16, static=True))
    with torch.no_grad():
        full = model(idx)[:, 5:]
    assert stepped.dtype == torch.float64
    torch.testing.assert_close(stepped, full, rtol=0, atol=1e-10)


@pytest.mark.skipif(COMPILE_MISSING is not None, reason=f"torch.compile cannot run here: {COMPILE_MISSING}")
def test_a_compiled_step_reads_the_weights_as_they_are_now(fresh_dynamo, monkeypatch):
    """The CPU step is compiled with the weights as constants (inductor's freezing; DIFF V1's lambda folded into
    one number): weights loaded or written in place after it was compiled, or swapped for other tensors, are what
    the next cache's steps read."""
    model = build("diff_v1")
    idx = torch.randint(0, model.cfg.vocab_size, (2, 9))
    assert model.compile_decoding() is None
    first = step_through(model, idx, 5, model.new_cache(capacity=16, static=True))
    torch.manual_seed(1)
    other = Decoder(model.cfg).eval()
    model.load_state_dict(other.state_dict())  # every weight written in place, the lambda vectors too
    loaded = step_through(model, idx, 5, model.new_cache(capacity=16, static=True))
    torch.testing.assert_close(loaded, step_through(model, idx, 5, model.new_cache(capacity=16)), rtol=0, atol=1e-5)
    assert not torch.allclose(loaded, first, atol=1e-3)
    with torch.no_grad():
        model.lm_head.weight.data = model.lm_head.weight.data * 2  # another tensor, not a write
    swapped = step_through(model, idx, 5, model.new_cache(capacity=16, static=True))
    torch.testing.assert_close(swapped, step_through(model, idx, 5, model.new_cache(capacity=16)), rtol=0, atol=1e-5)
    torch.testing.assert_close(swapped, 2 * loaded, rtol=1e-5, atol=1e-5)
    import diffexp.model.decoder as decoder_module

    monkeypatch.setattr(decoder_module, "compile_unavailable", lambda *a, **k: "no compiler")
    model.load_state_dict(other.state_dict())  # changed again where it cannot compile: the steps run eagerly
    torch.testing.assert_close(step_through(model, idx, 5, model.new_cache(capacity=16, static=True)), loaded,
                               rtol=0, atol=1e-5)


@pytest.fixture
def emulated_graphs(monkeypatch):
    """The CUDA graph step replay, its graphs emulated on the CPU: recording runs the step once (a GPU's capture
    runs nothing; the replay restores the running sums after it either way), and a replay reruns what was recorded
    on the tensors it was recorded with, so a token not copied into the graph's own buffer, or a new cache replayed
    on the old one's graph, gives other logits."""
    from diffexp.kernels import registry
    from diffexp.kernels.cuda_graph import GraphReplay

    def record(run):
        output = run()
        return (lambda: output.copy_(run())), output

    def warm_up(run, times):
        for _ in range(times):
            run()

    monkeypatch.setitem(registry._STEP_REPLAYS, "cpu", lambda: GraphReplay(record, warm_up))


@pytest.mark.skipif(COMPILE_MISSING is not None, reason=f"torch.compile cannot run here: {COMPILE_MISSING}")
@pytest.mark.parametrize("name", VARIANTS)
def test_the_replayed_step_equals_the_eager_step(name, fresh_dynamo, emulated_graphs):
    """One capture per cache, replayed at every position; rows of different lengths in a stacked cache too."""
    model = build(name)
    idx = torch.randint(0, model.cfg.vocab_size, (3, 12))
    eager = step_through(model, idx, 5, model.new_cache(capacity=16, static=True))
    assert model.compile_decoding("reduce-overhead") is None
    replayed = step_through(model, idx, 5, model.new_cache(capacity=16, static=True))
    torch.testing.assert_close(replayed, eager, rtol=0, atol=1e-5)
    assert model._replay.captures == 1
    together, alone = stacked_and_alone(model)
    assert torch.equal(together, alone)
    assert model._replay.captures == 2


@pytest.mark.skipif(COMPILE_MISSING is not None, reason=f"torch.compile cannot run here: {COMPILE_MISSING}")
def test_a_replayed_step_is_captured_again_when_a_weight_moves_not_when_it_is_written(fresh_dynamo, emulated_graphs):
    """A graph reads the memory it recorded: weights written in place are read as they are; a weight that is another
    tensor now (or another dtype) makes a new capture, so no replay reads a freed tensor."""
    model = build("dint")
    idx = torch.randint(0, model.cfg.vocab_size, (2, 9))
    assert model.compile_decoding("reduce-overhead") is None
    cache = model.new_cache(capacity=16, static=True)
    with torch.no_grad():
        model(idx[:, :5], cache=cache)
        start = cache.mark()
        model.decode_step(idx[:, 5:6], cache)
        torch.manual_seed(1)
        model.load_state_dict(Decoder(model.cfg).state_dict())  # written in place
        cache.rewind(start)
        loaded = model.decode_step(idx[:, 5:6], cache)
        assert model._replay.captures == 1
        model.lm_head.weight.data = model.lm_head.weight.data * 2  # another tensor
        cache.rewind(start)
        swapped = model.decode_step(idx[:, 5:6], cache)
        assert model._replay.captures == 2
        cache.rewind(start)
        model._compiled_step = None  # the eager step on the same cache, for reference
        eager = model.decode_step(idx[:, 5:6], cache)
    torch.testing.assert_close(swapped, eager, rtol=0, atol=1e-5)
    torch.testing.assert_close(swapped, 2 * loaded, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(COMPILE_MISSING is not None, reason=f"torch.compile cannot run here: {COMPILE_MISSING}")
def test_a_step_that_cannot_be_captured_decodes_without_a_graph_and_says_why(fresh_dynamo, monkeypatch):
    from diffexp.kernels import registry
    from diffexp.kernels.cuda_graph import GraphReplay

    def record(run):
        run()  # a capture that gets part of the way, then fails
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setitem(registry._STEP_REPLAYS, "cpu", lambda: GraphReplay(record, lambda run, times: run()))
    model = build("dint")
    idx = torch.randint(0, model.cfg.vocab_size, (2, 9))
    eager = step_through(model, idx, 5, model.new_cache(capacity=16, static=True))
    assert model.compile_decoding("reduce-overhead") is None
    with pytest.warns(UserWarning, match="could not be captured as a CUDA graph \\(operation not permitted"):
        stepped = step_through(model, idx, 5, model.new_cache(capacity=16, static=True))
    torch.testing.assert_close(stepped, eager, rtol=0, atol=1e-5)
    assert model._replay.captures == 0


def test_cuda_graph_decoding_is_refused_with_a_reason_where_no_replay_is_registered():
    model = build("baseline")
    assert "no step replay" in model.compile_decoding("reduce-overhead")
    assert model._compiled_step is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU; none here")
@pytest.mark.parametrize("name", VARIANTS)
def test_the_cuda_graph_step_equals_the_eager_step(name, fresh_dynamo):
    model = build(name).cuda()
    idx = torch.randint(0, model.cfg.vocab_size, (2, 12), device="cuda")
    eager = step_through(model, idx, 5, model.new_cache(capacity=16, static=True))
    assert model.compile_decoding("reduce-overhead") is None
    compiled = step_through(model, idx, 5, model.new_cache(capacity=16, static=True))
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-4)
    assert model._replay.captures == 1


@pytest.mark.skipif(COMPILE_MISSING is not None, reason=f"torch.compile cannot run here: {COMPILE_MISSING}")
def test_generate_with_compile_gives_the_eager_tokens(fresh_dynamo):
    model = build("dint")
    rows = ragged_rows(model.cfg.vocab_size)
    eager = torch.stack(list(generate(model, rows, 6)), 1)
    compiled = torch.stack(list(generate(model, rows, 6, compile=True)), 1)
    assert torch.equal(compiled, eager) and model._compiled_mode == "default"


def test_generate_warns_and_decodes_eagerly_where_compile_cannot_run(monkeypatch):
    import diffexp.model.decoder as decoder_module

    monkeypatch.setattr(decoder_module, "compile_unavailable", lambda device, **options: "no C++ compiler")
    model = build("baseline")
    with pytest.warns(UserWarning, match="no C\\+\\+ compiler"):
        tokens = list(generate(model, torch.zeros(1, 3, dtype=torch.long), 3, compile=True))
    assert len(tokens) == 3

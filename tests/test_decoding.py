"""Decoding at the baseline's cost: the one-token step (eager and torch.compile'd on a static cache) gives the
logits of a full forward for every variant; rows of different lengths decode together as each would alone."""

from __future__ import annotations

import functools

import pytest
import torch

from diffexp import Decoder
from diffexp.generate.decode import generate as sample
from diffexp.generate.decode import prompt_rows, static_capacity
from diffexp.generate.sampling import Sampling
from diffexp.model.cache import DecoderCache
from diffexp.model.compile import compile_unavailable
from diffexp.model.step_products import HAVE_CUSTOM_PASSES, StepProducts
from tests.helpers import CASES, make_config, require_cpu_kernel, small_blocks

VARIANTS = ["baseline", "diff_v1", "diff_v2", "shared_diff", "dint"]
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


@pytest.mark.parametrize("case", list(CASES))
def test_the_step_kernel_and_the_matmul_step_agree(case, monkeypatch):
    """The CPU kernel's step products (fp32 CPU) and the matmuls that run elsewhere (GPU, fp64, no compiler)."""
    from diffexp.model.kernels import cpu_native

    require_cpu_kernel()  # a compiler must build the kernel; only a machine without one has nothing to compare
    model = build(case)
    idx = torch.randint(0, model.cfg.vocab_size, (2, 12))
    kernel = step_through(model, idx, 5, model.new_cache(capacity=20, static=True))
    monkeypatch.setattr(cpu_native, "runs_step", lambda *tensors: False)
    matmuls = step_through(model, idx, 5, model.new_cache(capacity=20, static=True))
    torch.testing.assert_close(kernel, matmuls, rtol=0, atol=1e-5)


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


@pytest.fixture
def fresh_dynamo():
    """Compiled steps of earlier tests count against torch.compile's per-function limit: start from none."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield torch._dynamo.utils.counters
    torch._dynamo.reset()


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
    graphs = fresh_dynamo["stats"]["unique_graphs"]
    rows = ragged_rows(model.cfg.vocab_size)
    with torch.no_grad():
        alone = [torch.stack(list(generate(model, row[None], 5)), 1)[0] for row in rows]  # eager: growing caches
        caches = [model.new_cache(capacity=16, static=True) for _ in rows]
        firsts = [model(row[None], cache=c)[:, -1].argmax(-1) for row, c in zip(rows, caches)]
        cache, token, together = DecoderCache.stack(caches), torch.cat(firsts)[:, None], [torch.cat(firsts)]
        for _ in range(4):
            token = model.decode_step(token, cache).argmax(-1, keepdim=True)
            together.append(token[:, 0])
    assert torch.equal(torch.stack(together, 1), torch.stack(alone))
    assert fresh_dynamo["stats"]["unique_graphs"] == graphs  # no recompiles for other positions or rows


@pytest.mark.skipif(COMPILE_MISSING is not None, reason=f"torch.compile cannot run here: {COMPILE_MISSING}")
def test_compiled_steps_of_several_models_stay_their_own(fresh_dynamo):
    """Models compiled in one process (a benchmark, a comparison) each compile their own code object: they never
    look up each other's compiled steps, nor count against one recompile limit (here 2 for 4 models)."""
    import torch._dynamo

    models = [build(name) for name in ("baseline", "diff_v2", "diff_v1", "baseline")]
    idx = torch.randint(0, models[0].cfg.vocab_size, (2, 9))
    eager = [step_through(m, idx, 5, m.new_cache(capacity=16, static=True)) for m in models]
    for model in models:
        assert model.compile_decoding() is None
    with torch._dynamo.config.patch(recompile_limit=2):
        for model, want in zip(models, eager, strict=True):
            compiled = step_through(model, idx, 5, model.new_cache(capacity=16, static=True))
            torch.testing.assert_close(compiled, want, rtol=0, atol=1e-5)
    assert fresh_dynamo["stats"]["unique_graphs"] >= len(models)  # every model compiled, none left eager


@pytest.mark.skipif(COMPILE_MISSING is not None, reason=f"torch.compile cannot run here: {COMPILE_MISSING}")
def test_later_steps_on_a_cache_check_fewer_guards_and_a_new_cache_checks_them_all(fresh_dynamo, monkeypatch):
    """Steps after the first on one cache skip the guards that cannot change between them; a model changed
    between two caches (a flag the step reads) or a step in another grad mode is checked in full."""
    skipped = []
    real_stance = torch.compiler.set_stance
    monkeypatch.setattr(torch.compiler, "set_stance", lambda *a, **k: skipped.append(k) or real_stance(*a, **k))
    model = build("diff_v2")
    idx = torch.randint(0, model.cfg.vocab_size, (2, 10))
    assert model.compile_decoding() is None
    torch.testing.assert_close(step_through(model, idx, 5, model.new_cache(capacity=16, static=True)),
                               step_through(model, idx, 5, model.new_cache(capacity=16)), rtol=0, atol=1e-5)
    assert skipped == [{"skip_guard_eval_unsafe": True}] * 4  # steps 2-5
    for block in model.blocks:
        block.attn.lambda_mode = "raw"  # read while tracing: a guard on it, checked on a new cache's first step
    eager = step_through(model, idx, 5, model.new_cache(capacity=16))
    torch.testing.assert_close(step_through(model, idx, 5, model.new_cache(capacity=16, static=True)), eager,
                               rtol=0, atol=1e-5)
    cache = model.new_cache(capacity=16, static=True)
    step_through(model, idx[:, :7], 5, cache)
    with torch.enable_grad():
        in_grad_mode = model.decode_step(idx[:, 7:8], cache)
    assert in_grad_mode.requires_grad  # not the no-grad graph of the steps before
    torch.testing.assert_close(in_grad_mode.detach(), eager[:, 2], rtol=0, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(model.decode_step(idx[:, 8:9], cache), eager[:, 3], rtol=0, atol=1e-5)
        model.to(torch.float64)  # RoPE's tables fail their guards: the step is checked and traced again
        with pytest.raises(Exception, match="float64|Double"):  # the float32 cache refuses float64 keys, as eagerly
            model.decode_step(idx[:, 9:10], cache)


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


@pytest.mark.skipif(not HAVE_CUSTOM_PASSES, reason="this torch takes no custom inductor passes")
def test_one_row_products_split_in_halves_give_the_same_outputs():
    """The CPU step's pre-pass: a one-row product with an even number (64 or more) of outputs becomes two products
    over the halves, joined; narrower, odd or many-row products stay as they are. Every output is unchanged."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def products(x, w, narrow, odd, rows):
        return x @ w, x @ narrow, x @ odd, rows @ w

    args = (torch.randn(1, 48), torch.randn(48, 96), torch.randn(48, 32), torch.randn(48, 65), torch.randn(3, 48))
    graph_module = make_fx(products, tracing_mode="fake")(*args)
    find = graph_module.graph.find_nodes
    assert len(find(op="call_function", target=torch.ops.aten.mm.default)) == 4
    StepProducts()(graph_module.graph)
    graph_module.graph.lint()
    graph_module.recompile()
    assert len(find(op="call_function", target=torch.ops.aten.mm.default)) == 5
    assert len(find(op="call_function", target=torch.ops.aten.cat.default)) == 1
    for got, want in zip(graph_module(*args), products(*args)):
        torch.testing.assert_close(got, want)


@pytest.mark.skipif(not HAVE_CUSTOM_PASSES, reason="this torch takes no custom inductor passes")
def test_narrow_products_join_the_others_of_their_input_and_give_the_same_outputs():
    """Above one row, the products of one input with constant weights become one product, sliced, where one of them
    is narrow (under 64 outputs); wide-only groups, one-row inputs and weights that are inputs stay as they are."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    wide, other, narrow = torch.randn(48, 96), torch.randn(48, 64), torch.randn(48, 4)

    def products(x, one_row, w):
        return x @ wide, x @ other, x @ narrow, one_row @ wide, one_row @ narrow, x @ w, (2 * x) @ wide, (2 * x) @ other

    args = (torch.randn(3, 48), torch.randn(1, 48), torch.randn(48, 8))
    graph_module = make_fx(products)(*args)
    find = graph_module.graph.find_nodes
    assert len(find(op="call_function", target=torch.ops.aten.mm.default)) == 8
    assert len({n.target for n in find(op="get_attr")}) == 3  # the closed-over weights: constants, as when frozen
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)  # values for every node, fake, as in inductor
    FakeTensorProp(graph_module, fake_mode).propagate(*(fake_mode.from_tensor(a) for a in args))
    for node in find(op="get_attr"):
        node.meta["val"] = fake_mode.from_tensor(getattr(graph_module, node.target))
    StepProducts()(graph_module.graph)
    graph_module.graph.lint()
    graph_module.recompile()
    # x's three joined into one (x @ w's weight is an input); the one-row products split or kept; 2x's kept
    mm = find(op="call_function", target=torch.ops.aten.mm.default)
    assert sorted(n.args[1].meta["val"].shape[1] for n in mm if n.args[0].name == "x_1") == [8, 164]
    for got, want in zip(graph_module(*args), products(*args)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def compiled_with_spy(monkeypatch, stage: str, batch: int):
    """DIFF V2's step compiled at `batch` with the pass's stage `stage` counted: the change in the number of products
    per compiled graph, and the compiled and eager logits."""
    import torch._inductor.config

    import diffexp.model.step_products as products

    changes, plain = [], getattr(products, stage)

    def counting(graph):
        count = functools.partial(graph.find_nodes, op="call_function", target=torch.ops.aten.mm.default)
        before = len(count())
        plain(graph)
        changes.append(len(count()) - before)

    monkeypatch.setattr(products, stage, counting)
    model = build("diff_v2")
    idx = torch.randint(0, model.cfg.vocab_size, (batch, 9))
    # a cached step would skip the pass; config.patch, not monkeypatch, whose undo deletes this aliased option
    with torch._inductor.config.patch(force_disable_caches=True):
        assert model.compile_decoding() is None
        compiled = step_through(model, idx, 5, model.new_cache(capacity=16, static=True))
    return model, changes, compiled, step_through(model, idx, 5, model.new_cache(capacity=16))


@pytest.mark.skipif(COMPILE_MISSING is not None, reason=f"torch.compile cannot run here: {COMPILE_MISSING}")
@pytest.mark.skipif(not HAVE_CUSTOM_PASSES, reason="this torch takes no custom inductor passes")
def test_the_compiled_cpu_step_splits_its_one_row_products(fresh_dynamo, monkeypatch):
    """At batch 1 the compiled step's products with the weights go through the split, and it equals eager."""
    _, split, compiled, eager = compiled_with_spy(monkeypatch, "_split", batch=1)
    assert split and max(split) >= 3  # W_Q, W_O and the SwiGLU's products in each compiled graph (64 outputs or more)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-5)


@pytest.mark.skipif(COMPILE_MISSING is not None, reason=f"torch.compile cannot run here: {COMPILE_MISSING}")
@pytest.mark.skipif(not HAVE_CUSTOM_PASSES, reason="this torch takes no custom inductor passes")
def test_the_compiled_cpu_step_joins_diff_v2s_lambda_projection_to_its_neighbours(fresh_dynamo, monkeypatch):
    """At batch 2 each layer's products of its normed input (W_Q, W_K, W_V and the narrow W_lam) become one, and
    the compiled step equals eager."""
    model, joined, compiled, eager = compiled_with_spy(monkeypatch, "_join", batch=2)
    assert min(joined) == -3 * model.cfg.n_layers  # four products a layer become one
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-5)


@pytest.mark.skipif(COMPILE_MISSING is not None, reason=f"torch.compile cannot run here: {COMPILE_MISSING}")
def test_a_compiled_step_never_takes_another_models_weights_from_inductors_cache(fresh_dynamo):
    """Models of one shape with different weights, compiled one after the other at batch 2, where a frozen step holds
    constants made from the weights: each decodes as its own eager step, not with constants inductor's graph cache
    kept from the other (its key holds the weights' shapes, not their values)."""
    import torch._inductor.config

    model = build("baseline")
    idx = torch.randint(0, model.cfg.vocab_size, (2, 9))
    with torch._inductor.config.patch(force_disable_caches=False, fx_graph_cache=True):
        for seed in (1, 2):
            torch.manual_seed(seed)
            model.reset_parameters()
            model._compiled_step, model._compiled_mode = None, None  # compiled anew, as a new model would be
            assert model.compile_decoding() is None
            compiled = step_through(model, idx, 5, model.new_cache(capacity=16, static=True))
            eager = step_through(model, idx, 5, model.new_cache(capacity=16))
            torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU; none here")
@pytest.mark.parametrize("name", VARIANTS)
def test_the_cuda_graph_step_equals_the_eager_step(name, fresh_dynamo):
    model = build(name).cuda()
    idx = torch.randint(0, model.cfg.vocab_size, (2, 12), device="cuda")
    eager = step_through(model, idx, 5, model.new_cache(capacity=16, static=True))
    assert model.compile_decoding("reduce-overhead") is None
    compiled = step_through(model, idx, 5, model.new_cache(capacity=16, static=True))
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-4)


@pytest.mark.skipif(COMPILE_MISSING is not None, reason=f"torch.compile cannot run here: {COMPILE_MISSING}")
def test_generate_with_compile_gives_the_eager_tokens(fresh_dynamo):
    model = build("dint")
    rows = ragged_rows(model.cfg.vocab_size)
    eager = torch.stack(list(generate(model, rows, 6)), 1)
    compiled = torch.stack(list(generate(model, rows, 6, compile=True)), 1)
    assert torch.equal(compiled, eager) and fresh_dynamo["frames"]["ok"] >= 1


def test_generate_warns_and_decodes_eagerly_where_compile_cannot_run(monkeypatch):
    import diffexp.model.decoder as decoder_module

    monkeypatch.setattr(decoder_module, "compile_unavailable", lambda device, **options: "no C++ compiler")
    model = build("baseline")
    with pytest.warns(UserWarning, match="no C\\+\\+ compiler"):
        tokens = list(generate(model, torch.zeros(1, 3, dtype=torch.long), 3, compile=True))
    assert len(tokens) == 3


def test_a_shared_diff_step_on_a_gpu_multiplies_its_input_once_for_q_and_k():
    """Decoding on a GPU, Shared DIFF's four products with X (the Q and K bases and downs) are one GEMM: a step there
    is bound by its launches, and K's narrow base alone is a slow cuBLAS shape in fp32. Training, and CPU steps
    (inductor's fused vector sums), keep the four; the next test checks that both give the same maps. The meta
    device stands in for a GPU here."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountProducts(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
            return func(*args, **(kwargs or {}))

    def products(device: str, cached: bool) -> int:
        model = build("shared_diff").to(device)
        x = torch.randn(2, 1, model.cfg.d_model, device=device)
        cache = model.new_cache(capacity=8)
        cache.begin(2, 1, x.device)
        with torch.no_grad(), CountProducts() as counter:
            model.blocks[0].attn(x, cache=cache.layers[0] if cached else None)
        return counter.count

    # [W_Q; A_Q; W_K; A_K], V and O; or each of the six alone
    assert (products("meta", cached=True), products("meta", cached=False), products("cpu", cached=True)) == (3, 6, 6)


@pytest.mark.parametrize("scope", ["layer", "head"])
@pytest.mark.parametrize("sharing", ["maps", "heads"])
def test_shared_diffs_one_gemm_gives_its_separate_products(scope, sharing):
    """The GPU's decoding path (one GEMM over the joined weights, split back) against the four products."""
    attn = build("shared_diff", lowrank_scope=scope, base_sharing=sharing).blocks[0].attn
    x = torch.randn(2, 3, attn.d_model)
    with torch.no_grad():
        joined, separate = attn.joined_qk(x), (*attn.q_proj(x), *attn.k_proj(x))
    for one, other in zip(joined, separate, strict=True):
        torch.testing.assert_close(one, other, rtol=0, atol=1e-6)

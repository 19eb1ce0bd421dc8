"""model.compile: every variant's blocks compile to the same numbers as eager, and where torch.compile cannot run
the model trains without it, saying why."""

from __future__ import annotations

import pytest
import torch

from diffexp.model import Decoder
from diffexp.model.attention import variant_names
from diffexp.model.compile import compile_blocks
from diffexp.model.config import ModelConfig


def pair(attention: str) -> tuple[Decoder, Decoder]:
    extra = {"n_kv_heads": 2} if attention == "diff_v2" else {}
    cfg = ModelConfig(attention=attention, d_model=32, n_layers=2, n_heads=2, vocab_size=61, max_seq_len=32, rank=4,
                      **extra)
    torch.manual_seed(0)
    eager, compiled = Decoder(cfg), Decoder(cfg)
    compiled.load_state_dict(eager.state_dict())
    return eager, compiled


def check_same(eager: Decoder, compiled: Decoder, atol: float) -> None:
    tokens = torch.randint(0, 61, (2, 17))  # a length off every block size
    out_e, out_c = eager(tokens), compiled(tokens)
    torch.testing.assert_close(out_c, out_e, rtol=0, atol=atol)
    (out_e.square().mean()).backward()
    (out_c.square().mean()).backward()
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=atol, msg=name)


@pytest.mark.parametrize("attention", variant_names())
def test_compiled_blocks_match_eager(attention):
    """AOT autograd's joint graph (the path inductor compiles, without its code generation)."""
    eager, compiled = pair(attention)
    assert compile_blocks(compiled.blocks, torch.device("cpu"), backend="aot_eager") is None
    assert list(dict(compiled.named_parameters())) == list(dict(eager.named_parameters()))  # checkpoints unchanged
    check_same(eager, compiled, atol=1e-6)


@pytest.mark.heavy
@pytest.mark.parametrize("attention", variant_names())
def test_inductor_compiled_blocks_match_eager(attention):
    """Inductor's generated code (a C++ compiler on CPU): about 30 s per variant on 2 cores."""
    eager, compiled = pair(attention)
    assert compile_blocks(compiled.blocks, torch.device("cpu")) is None
    check_same(eager, compiled, atol=1e-4)


def test_without_a_working_compile_the_model_trains_eagerly_and_says_why(monkeypatch, recwarn):
    import lightning as L

    from diffexp.training import DiffexpLM

    def broken(*args, **kwargs):
        raise RuntimeError("Compiler: cc not found\nmore detail")

    monkeypatch.setattr(torch, "compile", broken)
    module = DiffexpLM(ModelConfig(d_model=32, n_layers=1, n_heads=2, vocab_size=61, max_seq_len=32), compile=True)
    module.trainer = L.Trainer(accelerator="cpu", devices=1, logger=False)  # configure_model reads the strategy
    with pytest.warns(UserWarning, match=r"model.compile: torch.compile cannot run here \(Compiler: cc not found\)"):
        module.configure_model()
    assert all(not hasattr(block, "_compiled_call_impl") or block._compiled_call_impl is None
               for block in module.model.blocks)


@pytest.mark.parametrize("attention, extra", [("diff_v1", {}), ("shared_diff", {"rank": 4}),
                                              ("diff_v2", {"n_kv_heads": 2}), ("dint", {}),
                                              ("dint", {"gamma": "learned"})])
def test_compiled_two_map_blocks_keep_the_cpu_kernel_in_one_graph(attention, extra):
    """On CPU a compiled block calls the compiled attention kernel as one opaque op (its fake versions give the
    shapes), with no graph break: model.compile keeps the fast path instead of tracing around it."""
    from tests.helpers import require_cpu_kernel

    require_cpu_kernel()
    torch.compiler.reset()  # the other tests compiled the same block code: fullgraph fails past the recompile limit
    torch.manual_seed(0)
    cfg = ModelConfig(attention=attention, d_model=32, n_layers=1, n_heads=2, vocab_size=61, max_seq_len=32, **extra)
    block = Decoder(cfg).blocks[0]
    graphs = []

    def keep_graph(gm, example_inputs):
        graphs.append(gm)
        return gm

    x = torch.randn(2, 17, 32, requires_grad=True)
    eager_out = block(x)[0]
    eager_out.square().mean().backward()
    eager_grad, x.grad = x.grad, None
    out = torch.compile(block, backend=keep_graph, fullgraph=True)(x)[0]
    out.square().mean().backward()
    ops = {str(node.target) for gm in graphs for sub in gm.modules() if isinstance(sub, torch.fx.GraphModule)
           for node in sub.graph.nodes if node.op == "call_function"}  # the autograd.Function's body is a subgraph
    assert any("diffexp_cpu" in op for op in ops), sorted(ops)
    torch.testing.assert_close(out, eager_out, rtol=0, atol=1e-6)
    torch.testing.assert_close(x.grad, eager_grad, rtol=0, atol=1e-6)


def test_compiled_blocks_record_the_kernel_the_door_picked_once_per_trace():
    """torch.compile traces through the kernels' profiler labels, so a compiled model says which kernel it runs
    through diffexp.kernels.recording: one pick per trace, outside the graph (fullgraph: no break), and no
    recompile on later steps, recording or not."""
    from diffexp.kernels import recording
    from tests.helpers import require_cpu_kernel

    require_cpu_kernel()
    torch.compiler.reset()
    cfg = ModelConfig(attention="diff_v1", d_model=32, n_layers=1, n_heads=2, vocab_size=61, max_seq_len=32)
    block = Decoder(cfg).blocks[0]
    graphs = []

    def count(gm, example_inputs):
        graphs.append(gm)
        return gm

    compiled = torch.compile(block, backend=count, fullgraph=True)
    x = torch.randn(2, 17, 32)
    with recording() as picks:
        compiled(x)
        compiled(x)
    assert dict(picks) == {"cpu_native": 1} and len(graphs) == 1
    compiled(x)
    with recording() as later:
        compiled(x)
    assert not later and len(graphs) == 1  # the graph runs the kernel without asking the door again
    with recording() as eager:
        block(x)
        block(x)
    assert dict(eager) == {"cpu_native": 2}

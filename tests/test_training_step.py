"""The training step without waste (issue 54, part 2): one compiled graph for every layer of a variant, the
chunked cross-entropy against the plain one, fused/foreach AdamW."""

from __future__ import annotations

import pytest
import torch

from diffexp.model import Decoder
from diffexp.model.compile import compile_blocks
from diffexp.model.config import ModelConfig


def _graphs(attention: str, n_layers: int) -> int:
    torch.compiler.reset()
    frames = []

    def counter(graph, example_inputs):  # a torch.compile backend that counts the frames it is given
        frames.append(graph)
        return graph.forward

    cfg = ModelConfig(attention=attention, n_layers=n_layers, d_model=32, n_heads=2, vocab_size=64, max_seq_len=16,
                      backend="sdpa")
    model = Decoder(cfg)
    assert compile_blocks(model.blocks, torch.device("cpu"), backend=counter) is None
    model(torch.randint(0, 64, (2, 16)))
    return len(frames)


@pytest.mark.parametrize("attention", ["baseline", "diff_v1", "shared_diff", "dint", "diff_v2"])
def test_compiled_blocks_share_one_graph_across_layers(attention):
    """Layers differ only in lambda_init (depth-dependent, a Python float): its guard fails once, at the second
    layer, and torch.compile then treats it as dynamic, so the graphs do not grow with depth (one per layer would
    reach the recompile limit and run the rest eagerly)."""
    assert _graphs(attention, 6) == _graphs(attention, 2)


def test_adamw_fused_on_cuda_foreach_elsewhere():
    from diffexp.training.module import DiffexpLM, adamw_kernel

    assert adamw_kernel(torch.device("cuda", 0)) == {"fused": True}
    assert adamw_kernel(torch.device("cpu")) == {"foreach": True}
    module = DiffexpLM(ModelConfig(n_layers=1, d_model=16, n_heads=2, vocab_size=32, max_seq_len=8))
    module.optim = module.optim.__class__(**{**module.optim.__dict__, "schedule_steps": 10})
    optimizer = module.configure_optimizers()["optimizer"]
    assert optimizer.defaults["foreach"] is True and not optimizer.defaults["fused"]


def _plain_losses(hidden, weight, targets):
    logits = hidden @ weight.T
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                                             reduction="none").view_as(targets)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_chunked_cross_entropy_matches_plain_loss_and_gradients(autocast):
    """Per-row losses, and the gradients of the LM head weight and the hidden states, against the plain
    F.cross_entropy(logits.float()) over the whole batch; 7 chunks of 5 rows with one short chunk."""
    from diffexp.training.loss import token_losses

    torch.manual_seed(0)
    hidden = torch.randn(3, 11, 16, requires_grad=True)
    weight = torch.randn(48, 16, requires_grad=True)
    targets = torch.randint(0, 48, (3, 11))
    grad_out = torch.rand(3, 11)  # a masked mean weighs the rows unequally
    results = []
    for loss_fn in (_plain_losses, lambda h, w, t: token_losses(h, w, t, chunk_logits=5 * 48)):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            losses = loss_fn(hidden, weight, targets)
        assert losses.dtype == torch.float32 and losses.shape == targets.shape
        grads = torch.autograd.grad((losses * grad_out).sum(), (hidden, weight))
        results.append((losses.detach(), *grads))
    tol = {"rtol": 1e-2, "atol": 1e-2} if autocast else {"rtol": 1e-5, "atol": 1e-6}
    for plain, chunked in zip(*results):
        torch.testing.assert_close(chunked, plain, **tol)
    if not autocast:  # the same products row by row
        torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=1e-6)


def test_chunked_cross_entropy_never_holds_the_whole_batch_of_logits():
    """Peak memory of forward + backward at a 4K vocab: the chunked loss stays below the plain one by at least
    the whole batch's fp32 logits less one chunk's."""
    from diffexp.bench.memory import peak_bytes
    from diffexp.training.loss import token_losses

    rows, vocab, dim, chunk_rows = 2048, 4096, 64, 256
    hidden = torch.randn(rows, dim, requires_grad=True)
    weight = torch.randn(vocab, dim, requires_grad=True)
    targets = torch.randint(0, vocab, (rows,))

    def run(loss_fn):
        def step():
            loss_fn(hidden, weight, targets).mean().backward()
            hidden.grad = weight.grad = None
        return peak_bytes(step, torch.device("cpu"), 0)

    plain = run(lambda h, w, t: torch.nn.functional.cross_entropy(h @ w.T, t, reduction="none"))
    chunked = run(lambda h, w, t: token_losses(h, w, t, chunk_logits=chunk_rows * vocab))
    if plain is None or chunked is None:
        pytest.skip("the CPU profiler's memory events are not available here")
    whole_logits = rows * vocab * 4
    assert plain - chunked >= whole_logits - 2 * chunk_rows * vocab * 4, (plain, chunked)


@pytest.mark.slow
def test_throughput_reads_once_per_optimizer_step_and_counts_every_micro_batch(tmp_path, monkeypatch):
    """Two micro-batches per step (global_batch.rows 8, data.batch_size 4): one reading per step, whose FLOPs and
    samples are both micro-batches', so FLOPs/s over samples/s is exactly the FLOPs of one row."""
    from lightning.fabric.utilities.throughput import Throughput

    from diffexp.cli import main
    from tests.helpers import scalars, write_recipe

    monkeypatch.chdir(tmp_path)
    readings = []
    update = Throughput.update
    monkeypatch.setattr(Throughput, "update", lambda self, **kw: (readings.append(kw), update(self, **kw))[1])
    main(["fit", "--config", str(write_recipe(tmp_path, max_steps=6)), "--global_batch.rows", "8",
          "--throughput.window_size=2", "--trainer.limit_val_batches=0"])
    assert [r["batches"] for r in readings] == [2, 4, 6, 8, 10, 12]  # one reading (and sync) per step
    logged = scalars(tmp_path / "runs/run/version_0")
    flops, samples = (logged[f"vitals/throughput/device/{name}_per_sec"] for name in ("flops", "samples"))
    assert len(flops) >= 2 and [s for s, _ in flops] == [s for s, _ in samples]
    assert not [tag for tag in logged if tag.endswith(("/batches", "/samples", "/lengths", "/time"))]  # no counts
    checkpoint = torch.load(tmp_path / "runs/run/version_0/checkpoints/last.ckpt", weights_only=True)
    arch = ModelConfig(**checkpoint["hyper_parameters"]["arch"])
    seq_len = round(readings[-1]["lengths"] / readings[-1]["samples"])  # tokens per row
    per_row = seq_len * Decoder(arch).flops_per_token(seq_len, training=True)
    for (_, f), (_, n) in zip(flops, samples):
        assert f / n == pytest.approx(per_row, rel=1e-6)


#: what reads a device tensor on the host (each waits for a GPU), counted on CPU where nothing waits
HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy")


@pytest.mark.slow
def test_a_step_that_logs_nothing_reads_the_device_once(tmp_path, monkeypatch):
    """Two micro-batches per step, every diagnostic and the throughput monitor on: a step off the logging grid
    reads from the device once (its losses, the finite check of every rank and the gradient norm, together).
    Counted: tensor reads; Strategy.reduce_boolean_decision, which on several processes reads an all-reduced flag;
    torch.cuda.synchronize, with the throughput monitor told it runs on CUDA. Before, such a step read five times
    (the losses, the any-rank flag, the gradient norm, the Diagnostics' losses, the throughput monitor's sync)."""
    import traceback

    import lightning as L
    from lightning.pytorch.strategies import Strategy

    from diffexp.training.cli import build_fit
    from diffexp.training.throughput import Throughput
    from tests.helpers import tiny_fit_args

    monkeypatch.chdir(tmp_path)
    # AdamW as on CUDA, fused: foreach AdamW reads its step counts, host tensors by design, on every step
    monkeypatch.setattr("diffexp.training.module.adamw_kernel", lambda device: {"fused": True})
    module, data, trainer = build_fit([
        *tiny_fit_args(tmp_path), "--data.batch_size", "2", "--global_batch.rows", "4", "--trainer.max_steps", "7",
        "--trainer.log_every_n_steps", "3", "--checkpoint.every_n_train_steps", "100", "--trainer.limit_val_batches",
        "0", "--trainer.enable_progress_bar", "false", "--throughput.window_size", "2"])
    reads: dict[int, list[str]] = {}

    def read(name: str) -> None:
        step = trainer.fit_loop.epoch_loop._batches_that_stepped  # the optimizer steps done: this step's index
        reads.setdefault(step, []).append(f"{name} from\n" + "".join(traceback.format_stack(limit=5)[:-2]))

    def counted(owner, name):
        original = getattr(owner, name)

        def call(*args, **kwargs):
            read(name)
            return original(*args, **kwargs)
        monkeypatch.setattr(owner, name, call)

    class Steps(L.Callback):  # counts from the first batch on, when the fit's setup is done
        def on_train_start(self, trainer, pl_module):
            for name in HOST_READS:
                counted(torch.Tensor, name)
            counted(Strategy, "reduce_boolean_decision")
            monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: read("torch.cuda.synchronize"))

    reading = Throughput.on_train_batch_end

    def on_cuda(self, trainer, *args):  # the monitor's reading as on a GPU (only it is told so)
        with monkeypatch.context() as patched:
            patched.setattr(type(trainer.strategy), "root_device", property(lambda _: torch.device("cuda", 0)))
            return reading(self, trainer, *args)

    monkeypatch.setattr(Throughput, "on_train_batch_end", on_cuda)
    trainer.callbacks.append(Steps())
    trainer.fit(module, data)
    monkeypatch.undo()
    logging_steps, observed = {2, 5, 6}, {0}  # log_every_n_steps 3 and the last step; diagnostics.every_n_steps 50
    quiet = sorted(set(range(7)) - logging_steps - observed)
    assert quiet == [1, 3, 4]
    for step in quiet:
        assert len(reads.get(step, [])) == 1, f"step {step}:\n" + "\n".join(reads.get(step, []))
    assert all(reads.get(step) for step in logging_steps)

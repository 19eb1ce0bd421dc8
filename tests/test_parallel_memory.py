"""Memory per rank before a sharded run (diffexp.parallel.memory): the counts it rests on, its refusal, and the
measured peak the end of fit sets beside it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from diffexp.errors import UserError
from diffexp.model import Decoder
from diffexp.model.config import ModelConfig
from diffexp.parallel import memory
from diffexp.parallel.memory import check_fits, peak_line, rough_training_bytes
from diffexp.training import loss as chunked_loss
from diffexp.training.loss import token_losses

VARIANTS = ["baseline", "diff_v1", "diff_v2", "shared_diff", "dint"]


def estimate_memory(*args, **kwargs) -> memory.MemoryEstimate:
    """The estimate for the trainer's loss (diffexp.training.loss.token_losses)."""
    return memory.estimate_memory(*args, **kwargs, loss=token_losses)


def arch(attention: str, n_layers: int = 4) -> ModelConfig:
    extra = {"n_kv_heads": 2} if attention == "diff_v2" else {}
    return ModelConfig(attention=attention, d_model=64, n_layers=n_layers, n_heads=4, vocab_size=97, max_seq_len=64,
                       rank=8, **extra)


def saved_bytes_for_real(cfg: ModelConfig, batch: int, seq_len: int, monkeypatch) -> int:
    """The bytes autograd keeps for the backward of a real forward and the trainer's loss (CPU tensors, the
    attention calls a GPU makes), counted per storage."""
    from diffexp.kernels import PLAIN, use
    from diffexp.model.heads import single_map
    from diffexp.training.module import DiffexpLM

    monkeypatch.setattr(single_map, "wide_v_mode", lambda q: "split")  # the GPU choice; the CPU pads Q and K
    module = DiffexpLM(replace(cfg, backend="sdpa"))
    saved: dict[int, int] = {}

    def pack(tensor):
        if not (tensor.is_leaf and tensor.requires_grad):
            saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1))
    with memory._fused_attention_stand_in(), use(PLAIN), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):  # one call per map, as on the GPU
        module._loss(tokens)  # the training step's loss: the LM head in chunks of rows
    return sum(saved.values())


def loss_backward_bytes_for_real(cfg: ModelConfig, batch: int, seq_len: int) -> int:
    """The peak bytes of the trainer's loss's backward beyond what its forward kept, on CPU tensors."""
    hidden = torch.randn(batch, seq_len, cfg.d_model, requires_grad=True)
    weight = torch.randn(cfg.vocab_size, cfg.d_model, requires_grad=True)
    targets = torch.randint(0, cfg.vocab_size, (batch, seq_len))
    with memory._LiveBytes() as live:
        loss = token_losses(hidden, weight, targets).mean()
        live.peak = kept = live.live
        loss.backward()
    return live.peak - kept


@pytest.mark.parametrize("attention", VARIANTS)
@pytest.mark.parametrize("chunk_rows", [None, 16])  # the loss in one piece, or in 4 chunks of rows
def test_states_follow_the_parameter_count_and_activations_the_real_forward(attention, chunk_rows, monkeypatch):
    cfg = arch(attention)
    if chunk_rows:
        monkeypatch.setattr(chunked_loss, "CHUNK_LOGITS", chunk_rows * cfg.vocab_size)
    n_params = Decoder(cfg).num_parameters()
    estimate = estimate_memory(cfg, micro_batch=2, seq_len=32, shard_size=4, compute_dtype=torch.float32)
    assert estimate.optimizer == 8 * n_params // 4  # AdamW's two fp32 moments of a quarter of the model
    # the 4-layer model's activations from a 1- and a 2-layer copy on the meta device, against a real forward
    # and loss, plus the loss's backward on the meta device against the same on CPU tensors
    loss_backward = loss_backward_bytes_for_real(cfg, 2, 32)
    assert estimate.activations - loss_backward == saved_bytes_for_real(cfg, 2, 32, monkeypatch)


@pytest.mark.parametrize("attention", ["diff_v1", "dint"])
@pytest.mark.parametrize("chunk_rows", [None, 100])  # the loss in one piece; chunks the small micro-batches fill
def test_a_large_micro_batch_is_extrapolated_to_its_measured_estimate(attention, chunk_rows, monkeypatch):
    """Past MEASURED_ROWS the estimate comes from three smaller micro-batches whose bytes grow linearly (those the
    loss takes in one piece and those it chunks do not grow alike: then it tries larger ones), so a micro-batch of
    millions of rows is refused in a second; it gives what measuring the micro-batch whole gives."""
    cfg = arch(attention)
    if chunk_rows:
        monkeypatch.setattr(chunked_loss, "CHUNK_LOGITS", chunk_rows * cfg.vocab_size)
    whole = estimate_memory(cfg, micro_batch=50, seq_len=32, shard_size=1, compute_dtype=torch.float32)
    monkeypatch.setattr(memory, "MEASURED_ROWS", 32)
    calls = []
    measure = memory._measure_layers
    monkeypatch.setattr(memory, "_measure_layers", lambda *args: calls.append(args[2]) or measure(*args))
    assert estimate_memory(cfg, micro_batch=50, seq_len=32, shard_size=1, compute_dtype=torch.float32) == whole
    assert max(calls) < 50


def test_the_chunked_loss_holds_one_chunk_of_logits_not_the_micro_batchs(monkeypatch):
    """A 32K vocabulary over 4 x 512 tokens: 256 MiB of fp32 logits in one piece; the chunked loss keeps the final
    hidden states and, in its backward, a few chunks' worth of fp32 logits (CHUNK_LOGITS each)."""
    cfg = replace(arch("baseline", n_layers=1), d_model=128, vocab_size=2**15, max_seq_len=512)
    logits = 4 * 512 * cfg.vocab_size
    one_piece_saved = memory._measure(cfg, 4, 512, torch.float32, lambda h, w, t: token_losses(h, w, t, 2**40))[3]
    monkeypatch.setattr(chunked_loss, "CHUNK_LOGITS", logits // 8)
    chunked_saved = memory._measure(cfg, 4, 512, torch.float32, token_losses)[3]
    hidden = 4 * 512 * cfg.d_model * 4
    assert one_piece_saved - chunked_saved >= 4 * logits - hidden  # the fp32 log-probabilities are not kept
    chunk_backward = memory._loss_backward_bytes(cfg, 4, 512, torch.float32, token_losses)
    grads = 4 * (cfg.vocab_size + 4 * 512) * cfg.d_model  # of the LM head and the hidden states
    assert chunk_backward <= 5 * 4 * logits // 8 + grads  # the recomputed chunk, its gradients
    monkeypatch.setattr(chunked_loss, "CHUNK_LOGITS", 2**40)
    assert memory._loss_backward_bytes(cfg, 4, 512, torch.float32, token_losses) > 1.5 * 4 * logits


def test_sharding_checkpointing_and_smaller_batches_shrink_what_they_should():
    cfg = arch("diff_v1", n_layers=8)
    base = estimate_memory(cfg, 4, 64, shard_size=2)
    wider = estimate_memory(cfg, 4, 64, shard_size=8)
    assert wider.optimizer == pytest.approx(base.optimizer / 4, rel=1e-6) and wider.activations == base.activations
    checkpointed = estimate_memory(cfg, 4, 64, shard_size=2, activation_checkpointing=True)
    assert checkpointed.activations < base.activations / 2 and checkpointed.optimizer == base.optimizer
    half = estimate_memory(cfg, 2, 64, shard_size=2)
    assert base.activations / 2 < half.activations < 0.6 * base.activations  # RoPE tables do not shrink


def test_a_run_that_cannot_fit_is_refused_with_what_helps():
    cfg = arch("dint", n_layers=8)
    needed = estimate_memory(cfg, 4, 64, 2, torch.bfloat16).total
    assert check_fits(cfg, 4, 64, 2, torch.bfloat16, False, available=None, loss=token_losses).startswith("memory: ")
    assert "per rank" in check_fits(cfg, 4, 64, 2, torch.bfloat16, False, available=2 * needed, loss=token_losses)
    with pytest.raises(UserError) as refused:
        check_fits(cfg, 4, 64, 2, torch.bfloat16, False, available=needed, loss=token_losses)
    message = str(refused.value)
    for option in ("activation_checkpointing true", "data.batch_size 2", "twice the GPUs (4)"):
        assert option in message


def test_activation_checkpointing_keeps_the_gradients_and_saves_less():
    cfg = arch("dint")
    tokens = torch.randint(0, cfg.vocab_size, (2, 33))
    results = []
    for recompute in (False, True):
        torch.manual_seed(0)
        model = Decoder(cfg)
        model.checkpoint_activations = recompute
        saved: list[int] = []

        def pack(tensor, saved=saved):
            saved.append(tensor.numel())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, sum(saved)))
    (loss_a, grads_a, saved_a), (loss_b, grads_b, saved_b) = results
    assert torch.equal(loss_a, loss_b)
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-5, atol=1e-7, msg=name)
    assert saved_b < saved_a / 2


def test_the_end_of_fit_sets_a_gpus_measured_peak_beside_the_estimate(monkeypatch, capsys):
    from types import SimpleNamespace

    from diffexp.training.report import print_summary

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: int(10.8 * gib))
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: int(11.4 * gib))
    assert peak_line(torch.device("cuda", 0), int(10.6 * gib)) == (
        "10.8 GiB allocated, 11.4 GiB reserved (rank 0); estimated 10.6 GiB before training (+2%)")
    assert peak_line(torch.device("cuda", 0)) == "10.8 GiB allocated, 11.4 GiB reserved (rank 0)"
    assert peak_line(torch.device("cpu"), int(10.6 * gib)) is None

    def summary(device, estimated):
        strategy = SimpleNamespace(root_device=torch.device(device), estimated_memory=estimated)
        trainer = SimpleNamespace(log_dir=None, is_global_zero=True, callbacks=[], callback_metrics={}, global_step=3,
                                  strategy=strategy)
        print_summary(trainer)
        return capsys.readouterr().out

    expected = ("peak memory     10.8 GiB allocated, 11.4 GiB reserved (rank 0); estimated 9.0 GiB before training "
                "(+20%)")
    assert expected in summary("cuda", 9 * gib)
    assert "peak memory" not in summary("cpu", 9 * gib)


# -- an unsharded CPU run against the host's free memory (diffexp.training.preflight) ---------------------------

@pytest.mark.parametrize("attention", VARIANTS)
@pytest.mark.parametrize("batch, seq_len, max_seq_len", [(1, 8, 64), (16, 64, 64), (2, 8, 100_000)])
def test_the_rough_bound_that_skips_the_cpu_check_lies_above_the_estimate(attention, batch, seq_len, max_seq_len):
    """Where the rough bound fits the free memory the estimate is never computed: it must never be below it, also
    where a long max_seq_len's RoPE table outweighs the rest."""
    cfg = replace(arch(attention), max_seq_len=max_seq_len)
    assert rough_training_bytes(cfg, batch, seq_len) >= estimate_memory(cfg, batch, seq_len, 1, torch.float32).total


def test_a_cpu_run_needing_more_than_the_free_memory_is_refused(monkeypatch):
    from diffexp.training.preflight import check_cpu_memory

    cfg, data = arch("diff_v1"), {"batch_size": 16, "seq_len": 64}
    needed = estimate_memory(cfg, 16, 64, 1, torch.float32).total
    monkeypatch.setattr(memory, "host_memory_available", lambda: needed + 1)
    check_cpu_memory(cfg, {"accelerator": "cpu"}, data)  # fits
    with pytest.raises(UserError, match=r"in each of 2 processes.*killed out of memory"):
        check_cpu_memory(cfg, {"accelerator": "cpu", "devices": 2}, data)  # two replicas on this host
    monkeypatch.setattr(memory, "host_memory_available", lambda: needed - 1)
    with pytest.raises(UserError) as refused:
        check_cpu_memory(cfg, {"accelerator": "cpu"}, data)
    assert "data.batch_size=16 x data.seq_len=64" in str(refused.value) and "d_model=64" in str(refused.value)
    # the host's later processes: the first checked for all of them, before their memory was taken
    monkeypatch.setenv("LOCAL_RANK", "1")
    check_cpu_memory(cfg, {"accelerator": "cpu", "devices": 2}, data)
    monkeypatch.delenv("LOCAL_RANK")
    # FSDP2 checks its own shards; a GPU run is not measured against the host
    check_cpu_memory(cfg, {"accelerator": "cpu", "strategy": "diffexp.parallel.FSDP2Strategy"}, data)
    check_cpu_memory(cfg, {"accelerator": "gpu"}, data)


@pytest.mark.parametrize("attention", ["baseline", "dint"])
def test_long_sequences_are_extrapolated_to_what_a_direct_measurement_gives(attention, monkeypatch):
    """Past MEASURED_TOKENS the activations come from two shorter meta forwards; they must equal a measurement at
    the full length (linear growth plus the RoPE table's fixed storage)."""
    cfg = replace(arch(attention), max_seq_len=256)
    direct = estimate_memory(cfg, 2, 192, 1, torch.float32)
    monkeypatch.setattr(memory, "MEASURED_TOKENS", 64)
    assert estimate_memory(cfg, 2, 192, 1, torch.float32) == direct


def test_dints_triton_integral_scratch_is_counted_in_half_precision(monkeypatch):
    """DINT's Triton integral (picked on CUDA in half precision) keeps PREFIX (B, h, T / 64, T) fp32 per layer for
    the backward, and makes CARRY and ROWPART in it: T^2 / 64 floats a head, which the plain path measured on the
    meta device does not keep. The estimate adds them, and the rough bound stays above it."""
    from diffexp.kernels import dint_tiles

    cfg = replace(arch("dint"), max_seq_len=4096)
    kept, backward = dint_tiles.scratch_bytes(2, cfg.n_heads, 4096, cfg.resolved_head_dim, 2 * cfg.resolved_head_dim)
    assert kept == 4 * 2 * cfg.n_heads * 4096 * 4096 // 64 and backward == 2 * kept
    with_kernel = estimate_memory(cfg, 2, 4096, 1, torch.bfloat16)
    assert memory.kernel_scratch(cfg, 2, 4096, torch.float32) == (0, 0)  # fp32: the plain path runs
    assert memory.kernel_scratch(replace(cfg, integral="mean"), 2, 4096, torch.bfloat16) == (0, 0)
    assert rough_training_bytes(cfg, 2, 4096) >= with_kernel.total
    monkeypatch.setattr(memory, "kernel_scratch", lambda *args: (0, 0))
    plain = estimate_memory(cfg, 2, 4096, 1, torch.bfloat16)
    added = with_kernel.activations - plain.activations  # every layer's PREFIX, and the backward's buffers where
    assert cfg.n_layers * kept <= added <= cfg.n_layers * kept + backward  # they outgrow the loss's backward


def test_the_triton_integrals_buffers_are_the_scratch_counted():
    """scratch_bytes against the buffers the kernel allocates (its _Call, at the default tiles)."""
    pytest.importorskip("triton")
    from diffexp.kernels import dint_tiles, triton_dint

    b, h, t, d = 2, 3, 200, 64
    q, k, v = torch.zeros(b, h, t, d), torch.zeros(b, h, t, d), torch.zeros(b, h, t, 2 * d)
    call = triton_dint._Call(q, k, v, 0.125, *triton_dint.tiles(d, 2 * d))
    prefix = call.buffer(call.nm, "cpu")
    kept, backward = dint_tiles.scratch_bytes(b, h, t, d, 2 * d)
    assert kept == prefix.nbytes and backward == prefix.nbytes + call.buffer(call.nn, "cpu").nbytes

"""Memory per rank of an FSDP2 run, computed from the model before any weight exists.

Activations are measured, not modelled: 1- and 2-layer copies run forward and the trainer's loss on the meta
device, counting what autograd saves (attention as a fused kernel saves it: q, k, v, output, log-sum-exp; the
chunked loss: the final hidden states its checkpointed LM head recomputes from), and their difference is a block.
The loss's backward, the peak of a training step's activations, is measured on the meta device too, from the bytes
alive at each op. The sharded states follow from the parameter count (`estimate_memory`).

The loss is passed in by the training floor above (`diffexp.training.loss.token_losses`): (hidden, lm_head
weight, targets) -> per-target fp32 losses.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

#: the trainer's loss: (final hidden states, LM-head weight, targets) -> per-target fp32 losses
LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

GIB = 2**30
FIT_FRACTION = 0.9  # of the device's memory: the rest for the CUDA context, NCCL buffers and fragmentation
#: the longest sequence run on the meta device; longer ones are extrapolated from it and its half (a meta forward
#: of DINT's integral walks its blocks in Python: seconds at 16K tokens)
MEASURED_TOKENS = 2048
#: tokens of a micro-batch measured as they are; larger micro-batches are extrapolated in their rows (the chunked loss
#: walks its chunks in Python: minutes for a micro-batch of millions of rows)
MEASURED_ROWS = 2**17


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank, by kind."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations

    def describe(self) -> str:
        parts = ", ".join(f"{name} {size(getattr(self, name))}"
                          for name in ("parameters", "gradients", "optimizer", "activations"))
        return f"{size(self.total)} per rank ({parts})"


def size(n_bytes: int) -> str:
    return f"{n_bytes / GIB:.1f} GiB" if n_bytes >= GIB else f"{n_bytes / 2**20:.1f} MiB"


class _FusedAttentionSaves(torch.autograd.Function):
    """What a fused attention kernel keeps for its backward, with the output's shape."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:-1], dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx, grad):  # pragma: no cover - only the forward is measured, never differentiated
        return None, None, None


@contextlib.contextmanager
def _fused_attention_stand_in():
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = lambda q, k, v, *args, **kwargs: _FusedAttentionSaves.apply(q, k, v)
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


class _LiveBytes(TorchDispatchMode):
    """The bytes of storage alive, and their peak, over the ops run under it (each op's outputs, freed when autograd
    and Python drop their last tensor); tensors made before it are not counted."""

    def __init__(self) -> None:
        super().__init__()
        self.tensors: dict[int, int] = {}  # storage -> tensors alive on it
        self.nbytes: dict[int, int] = {}
        self.live = self.peak = 0

    def _release(self, key: int) -> None:
        self.tensors[key] -= 1
        if not self.tensors[key]:
            del self.tensors[key]
            self.live -= self.nbytes.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor):
                key = tensor.untyped_storage()._cdata
                if key not in self.tensors:
                    self.tensors[key], self.nbytes[key] = 0, tensor.untyped_storage().nbytes()
                    self.live += self.nbytes[key]
                    self.peak = max(self.peak, self.live)
                self.tensors[key] += 1
                weakref.finalize(tensor, self._release, key)
        return out


def _loss_backward_bytes(arch, micro_batch: int, seq_len: int, dtype: torch.dtype, loss: LossFn) -> int:
    """The peak bytes the loss's backward holds beyond what its forward kept, measured on the meta device: each
    chunk's logits recomputed in fp32, their gradients, and the gradients of the hidden states and the LM head."""
    with torch.device("meta"):
        hidden = torch.empty(micro_batch, seq_len, arch.d_model, dtype=dtype, requires_grad=True)
        weight = torch.empty(arch.vocab_size, arch.d_model, dtype=dtype, requires_grad=True)
        targets = torch.zeros(micro_batch, seq_len, dtype=torch.long)
    with _LiveBytes() as live:
        total = loss(hidden, weight, targets).mean()
        live.peak = kept = live.live
        total.backward()
    return live.peak - kept


def _linear_in(measure: Callable[[int], tuple[int, ...]], n: int, start: int) -> tuple[int, ...]:
    """measure(n), a tuple of byte counts, extrapolated from measure at start, 2 start and 3 start where those grow
    linearly (saved activations do per row, once the loss's chunks are all full ones); start doubles until they do,
    and n within 3 start is measured as it is."""
    while 3 * start < n:
        a, b, c = measure(start), measure(2 * start), measure(3 * start)
        if all(z - y == y - x for x, y, z in zip(a, b, c, strict=True)):
            return tuple(x + (y - x) * (n - start) // start for x, y in zip(a, b, strict=True))
        start *= 2
    return measure(n)


def _measure_layers(arch, n_layers: int, micro_batch: int, seq_len: int, dtype: torch.dtype,
                    loss: LossFn) -> tuple[int, int]:
    """(parameters, bytes saved for the backward by the forward and the loss) of an n_layers copy, on the meta
    device."""
    from diffexp.model import Decoder

    cfg = replace(arch, n_layers=n_layers, backend="sdpa")
    with torch.device("meta"):
        model = Decoder(cfg).to(dtype)
    saved: dict[int, int] = {}

    def count_saved(tensor: torch.Tensor) -> torch.Tensor:
        if not (tensor.is_leaf and tensor.requires_grad):  # parameters are counted as parameters
            storage = tensor.untyped_storage()
            saved[storage._cdata] = max(saved.get(storage._cdata, 0), storage.nbytes())
        return tensor

    tokens = torch.zeros(micro_batch, seq_len + 1, dtype=torch.long, device="meta")
    with _fused_attention_stand_in(), torch.autograd.graph.saved_tensors_hooks(count_saved, lambda tensor: tensor):
        hidden = model(tokens[:, :-1], head=False)  # as DiffexpLM's loss: the LM head inside the loss
        loss(hidden, model.lm_head.weight, tokens[:, 1:]).mean()
    parameters = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    return parameters, sum(saved.values())


def _measure(arch, micro_batch: int, seq_len: int, dtype: torch.dtype, loss: LossFn) -> tuple[int, int, int, int]:
    """(block params, root params, block saved, root saved) from a 1- and a 2-layer copy. Past MEASURED_TOKENS, the
    saved bytes are extrapolated from two lengths: they grow linearly with the tokens (the attention kept as a
    fused kernel keeps it), plus what does not grow (the RoPE table's storage); past MEASURED_ROWS, from smaller
    micro-batches."""
    def at(batch: int, length: int) -> tuple[int, ...]:
        params_1, saved_1 = _measure_layers(arch, 1, batch, length, dtype, loss)
        params_2, saved_2 = _measure_layers(arch, 2, batch, length, dtype, loss)
        block_params, block_saved = params_2 - params_1, saved_2 - saved_1
        return block_params, params_1 - block_params, block_saved, saved_1 - block_saved

    def at_length(batch: int) -> tuple[int, ...]:
        if seq_len <= MEASURED_TOKENS:
            return at(batch, seq_len)
        long, short = at(batch, MEASURED_TOKENS), at(batch, MEASURED_TOKENS // 2)
        grown = [n + (n - m) * (seq_len - MEASURED_TOKENS) // (MEASURED_TOKENS // 2)
                 for n, m in zip(long[2:], short[2:])]
        return (*long[:2], *grown)

    return _linear_in(at_length, micro_batch, start=max(1, MEASURED_ROWS // min(seq_len, MEASURED_TOKENS)))


def estimate_memory(arch, micro_batch: int, seq_len: int, shard_size: int,
                    compute_dtype: torch.dtype = torch.bfloat16,
                    activation_checkpointing: bool = False, *, loss: LossFn) -> MemoryEstimate:
    """Bytes per rank for `arch` (a ModelConfig) trained on micro-batches of micro_batch x seq_len tokens with
    `loss` (the trainer's: diffexp.training.loss.token_losses), its states sharded over shard_size ranks (the world
    size, or the GPUs of a node under HSDP)."""
    block_params, root_params, block_saved, root_saved = _measure(arch, micro_batch, seq_len, compute_dtype, loss)
    if seq_len <= MEASURED_ROWS:  # the loss's backward grows with its rows: extrapolated past MEASURED_ROWS
        (loss_backward,) = _linear_in(lambda batch: (_loss_backward_bytes(arch, batch, seq_len, compute_dtype, loss),),
                                      micro_batch, start=max(1, MEASURED_ROWS // seq_len))
    else:
        (loss_backward,) = _linear_in(lambda rows: (_loss_backward_bytes(arch, 1, rows, compute_dtype, loss),),
                                      micro_batch * seq_len, start=MEASURED_ROWS)
    total_params = root_params + arch.n_layers * block_params
    compute_bytes = torch.finfo(compute_dtype).bits // 8
    kept, backward = kernel_scratch(arch, micro_batch, seq_len, compute_dtype)
    if activation_checkpointing:  # each block keeps its input; one block's activations are recomputed at a time
        block_input = micro_batch * seq_len * arch.d_model * compute_bytes
        layers = arch.n_layers * block_input + block_saved + kept
    else:
        layers = arch.n_layers * (block_saved + kept)
    return MemoryEstimate(
        # the fp32 shard, plus compute-dtype copies gathered at once: the root and two blocks (running, prefetched)
        parameters=4 * total_params // shard_size + compute_bytes * (root_params + 2 * block_params),
        # the fp32 shard, plus one block's unsharded gradients before their reduce-scatter
        gradients=4 * total_params // shard_size + 4 * block_params,
        optimizer=8 * total_params // shard_size,  # AdamW's two fp32 moments of the shard
        # + the loss's backward, where the step's backward starts
        activations=layers + root_saved + max(loss_backward, backward),
    )


def kernel_scratch(arch, micro_batch: int, seq_len: int, compute_dtype: torch.dtype) -> tuple[int, int]:
    """(kept per layer, one layer's backward) bytes that a fast kernel adds to what the plain path saves: the softmax
    integral's Triton kernel (diffexp.kernels.gpu_dint: a variant reading model.arch.integral, DINT; picked on CUDA
    in half precision) keeps T^2 / 64 floats a head; the meta-device measurement runs the plain path, which keeps
    O(T)."""
    from diffexp.kernels.dint_tiles import scratch_bytes
    from diffexp.model.attention import variant

    reads_integral = any(flag.name == "integral" for flag in variant(arch.attention).flags)
    if not reads_integral or arch.integral != "softmax" or compute_dtype not in (torch.bfloat16, torch.float16):
        return 0, 0
    d = arch.resolved_head_dim
    return scratch_bytes(micro_batch, arch.n_heads, seq_len, d, 2 * d)


def rough_training_bytes(arch, micro_batch: int, seq_len: int) -> int:
    """An upper bound of estimate_memory's total for one process, from the model's sizes alone: AdamW's 16 bytes a
    parameter, 8 an element of its buffers (the RoPE table), 64 floats per token, layer and (d_model + SwiGLU
    width), and 4 of the logits' width per token; plus a fast kernel's scratch in half precision (kernel_scratch)."""
    from diffexp.model import Decoder

    with torch.device("meta"):
        model = Decoder(arch)
    parameters = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    buffers = sum(b.numel() for b in model.buffers())
    per_token = arch.n_layers * 256 * (arch.d_model + arch.resolved_ffn_hidden) + 16 * arch.vocab_size
    kept, backward = kernel_scratch(arch, micro_batch, seq_len, torch.bfloat16)
    return 16 * parameters + 8 * buffers + micro_batch * seq_len * per_token + arch.n_layers * kept + backward


def check_fits(arch, micro_batch: int, seq_len: int, shard_size: int, compute_dtype: torch.dtype,
               activation_checkpointing: bool, available: int | None, estimate: MemoryEstimate | None = None, *,
               loss: LossFn) -> str:
    """The estimate (computed here unless given) as one line; a UserError naming what helps when it exceeds
    FIT_FRACTION of `available` bytes (None: no limit known, e.g. on CPU)."""
    from diffexp.errors import UserError

    if estimate is None:
        estimate = estimate_memory(arch, micro_batch, seq_len, shard_size, compute_dtype, activation_checkpointing,
                                   loss=loss)
    line = (f"memory: {estimate.describe()}, micro-batch {micro_batch} x {seq_len} tokens, states sharded over "
            f"{shard_size}")
    if available is None or estimate.total <= FIT_FRACTION * available:
        return line
    options = []
    if not activation_checkpointing:
        with_ckpt = estimate_memory(arch, micro_batch, seq_len, shard_size, compute_dtype, True, loss=loss)
        options.append(f"trainer.strategy.init_args.activation_checkpointing true: {size(with_ckpt.total)}")
    if micro_batch > 1:
        half = estimate_memory(arch, micro_batch // 2, seq_len, shard_size, compute_dtype, activation_checkpointing,
                               loss=loss)
        options.append(f"data.batch_size {micro_batch // 2} (and trainer.accumulate_grad_batches doubled, for the "
                       f"same tokens per step): {size(half.total)}")
    more = estimate_memory(arch, micro_batch, seq_len, 2 * shard_size, compute_dtype, activation_checkpointing,
                           loss=loss)
    options.append(f"twice the GPUs ({2 * shard_size}): {size(more.total)}")
    raise UserError(f"{line}: more than {FIT_FRACTION:.0%} of the {available / GIB:.1f} GiB of one device, so the "
                    "run would stop out of memory. What helps, each alone:\n  " + "\n  ".join(options))


def host_memory_available() -> int | None:
    """Bytes the host can still give this process: /proc/meminfo's MemAvailable, or less where a cgroup (v2) limit
    leaves less (a container); None where neither can be read."""
    try:
        meminfo = Path("/proc/meminfo").read_text()
        available = int(next(line.split()[1] for line in meminfo.splitlines() if line.startswith("MemAvailable:")))
        available *= 1024
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            available = min(available, max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return available


def free_memory(device: torch.device) -> int | None:
    """Bytes free on `device`: the CUDA driver's count on a GPU, the host's (host_memory_available) elsewhere."""
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else host_memory_available()


def peak_line(device: torch.device, estimated: int | None = None) -> str | None:
    """The CUDA allocator's peak on `device` so far, beside the estimate printed before training (None off CUDA)."""
    if device.type != "cuda":
        return None
    allocated, reserved = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
    line = f"{size(allocated)} allocated, {size(reserved)} reserved (rank 0)"
    if estimated:
        line += f"; estimated {size(estimated)} before training ({allocated / estimated - 1:+.0%})"
    return line

"""`data.batch_size: auto`: on one CUDA device, the largest micro-batch the memory estimate fits, the global batch kept.

`auto` needs global_batch.rows (the sequences of an optimizer step): the micro-batch is the largest divisor of the
rows whose estimate (diffexp.parallel.memory) fits FIT_FRACTION of the device's free memory, and the accumulation
follows (rows / micro-batch), so the tokens per step stay those of the recipe. Elsewhere (CPU, several devices or
nodes) `auto` is refused before any file is written: an estimate per rank against every rank's free memory would
have to be agreed before launch. The chosen number replaces `auto` in the parsed config, so the run's config.yaml
and checkpoints hold it; a resume takes the checkpoint's number and never estimates again.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

import torch

from diffexp.errors import invalid
from diffexp.parallel.launch import strategy_class
from diffexp.parallel.memory import FIT_FRACTION, estimate_memory, size
from diffexp.training.loss import token_losses
from diffexp.training.values import to_builtin

AUTO = "auto"


def is_auto(config) -> bool:
    return _data_args(config).get("batch_size") == AUTO


def choose_micro_batch(arch, seq_len: int, free_bytes: int, rows: int, compute_dtype: torch.dtype = torch.bfloat16,
                       activation_checkpointing: bool = False) -> tuple[int, int]:
    """(micro-batch, accumulation) for one device with free_bytes free: the largest divisor of `rows` whose
    estimated training memory is within FIT_FRACTION of free_bytes, and rows / that divisor."""
    def fits(micro_batch: int) -> bool:
        estimate = estimate_memory(arch, micro_batch, seq_len, 1, compute_dtype, activation_checkpointing,
                                   loss=token_losses)
        return estimate.total <= FIT_FRACTION * free_bytes

    divisors = [d for d in range(1, rows + 1) if rows % d == 0]
    if not fits(1):
        needed = estimate_memory(arch, 1, seq_len, 1, compute_dtype, activation_checkpointing, loss=token_losses)
        raise invalid("data.batch_size", AUTO, f"even a micro-batch of 1 x {seq_len} tokens needs "
                      f"{needed.describe().replace(' per rank', '')}, more than {FIT_FRACTION:.0%} of the "
                      f"{size(free_bytes)} free on the GPU; lower data.seq_len or the model's size, or turn on "
                      "trainer.strategy.init_args.activation_checkpointing")
    low, high = 0, len(divisors) - 1  # divisors[low] fits; the memory grows with the micro-batch
    while low < high:
        middle = (low + high + 1) // 2
        if fits(divisors[middle]):
            low = middle
        else:
            high = middle - 1
    return divisors[low], rows // divisors[low]


def resolve_auto_batch(config, checkpoint: dict[str, Any] | None = None) -> None:
    """Replace data.batch_size auto in the parsed config by a number: the checkpoint's on a resume, else
    choose_micro_batch's on the one CUDA device. Refuses where auto cannot be decided (UserError)."""
    if not is_auto(config):
        return
    if checkpoint is not None:
        from diffexp.training.global_batch import saved_layout

        saved = saved_layout(checkpoint)
        micro_batch = saved[0] if saved else (checkpoint.get("datamodule_hyper_parameters") or {}).get("batch_size")
        if not isinstance(micro_batch, int):
            raise invalid("data.batch_size", AUTO, "the checkpoint does not record the micro-batch its run chose; "
                          "give the number (data.batch_size) it was trained with")
        _set_batch_size(config, micro_batch)
        print(f"data.batch_size auto: {micro_batch}, the resumed run's", file=sys.stderr)
        return
    trainer = to_builtin(config.get("trainer") or {})
    rows = to_builtin(config.get("global_batch") or {}).get("rows")
    device = _single_cuda_device(trainer)
    if rows is None:
        raise invalid("data.batch_size", AUTO, "auto needs global_batch.rows (the sequences per optimizer step), so "
                      "that the accumulation follows from the chosen micro-batch and the tokens per step stay; set "
                      "global_batch.rows or give data.batch_size a number")
    from diffexp.training.preflight import model_sections

    arch = model_sections(config)[0]
    data = _data_args(config)
    if data.get("tokenizer") == "bpe" and isinstance(data.get("bpe_vocab_size"), int):
        arch = replace(arch, vocab_size=max(arch.vocab_size, data["bpe_vocab_size"]))  # linked at build time
    seq_len = int(data.get("seq_len") or arch.max_seq_len)
    dtype, checkpointing = _compute(trainer)
    free = torch.cuda.mem_get_info(device)[0]
    micro_batch, accumulate = choose_micro_batch(arch, seq_len, free, int(rows), dtype, checkpointing)
    _set_batch_size(config, micro_batch)
    print(f"data.batch_size auto: {micro_batch} (the largest divisor of global_batch.rows {rows} whose memory "
          f"estimate fits {FIT_FRACTION:.0%} of the {size(free)} free on cuda:{device}), accumulating {accumulate} "
          f"micro-batch(es) per step: {rows} x {seq_len} tokens per step, as the recipe's", file=sys.stderr)


def _single_cuda_device(trainer: dict[str, Any]) -> int:
    """The index of the one CUDA device this run trains on; refuses CPU runs and several devices or nodes."""
    accelerator = str(trainer.get("accelerator") or "auto")
    if accelerator not in ("auto", "gpu", "cuda") or not torch.cuda.is_available():
        raise invalid("data.batch_size", AUTO, "auto sizes the micro-batch from one CUDA device's free memory, and "
                      "this run trains on CPU; give data.batch_size a number")
    devices, nodes = trainer.get("devices", "auto"), int(trainer.get("num_nodes") or 1)
    if isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        devices = int(devices)
    if isinstance(devices, str) and "," in devices:
        devices = [int(d) for d in devices.split(",") if d.strip()]
    if devices in ("auto", -1):
        devices = torch.cuda.device_count()
    count = len(devices) if isinstance(devices, (list, tuple)) else devices
    if count != 1 or nodes != 1:
        raise invalid("data.batch_size", AUTO, f"auto is decided on one GPU, and this run trains on {count * nodes} "
                      "(trainer.devices x trainer.num_nodes); give data.batch_size a number (the memory printed "
                      "before training, and `diffexp params --memory`, say what fits)")
    return devices[0] if isinstance(devices, (list, tuple)) else 0


def _compute(trainer: dict[str, Any]) -> tuple[torch.dtype, bool]:
    """(compute dtype, activation checkpointing) of the run on a GPU."""
    strategy = trainer.get("strategy")
    if "fsdp2" in (strategy_class(trainer) or "").lower():
        init_args = (strategy.get("init_args") or {}) if isinstance(strategy, dict) else {}
        precision = init_args.get("mixed_precision", "auto")
        return (torch.float32 if precision == "fp32" else torch.bfloat16), bool(init_args.get(
            "activation_checkpointing"))
    precision = str(trainer.get("precision") or "")
    return (torch.bfloat16 if "bf16" in precision or "16" in precision else torch.float32), False


def _data_args(config) -> dict[str, Any]:
    from diffexp.training.values import data_init_args

    return data_init_args(config)[1]


def _set_batch_size(config, micro_batch: int) -> None:
    data = config.get("data")
    target = data.init_args if "class_path" in data else data
    target.batch_size = micro_batch


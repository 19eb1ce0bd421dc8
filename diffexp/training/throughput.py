"""Tokens/s, FLOPs/s and MFU through Lightning's ThroughputMonitor, with a peak the user can set."""

from __future__ import annotations

import time
import warnings

import torch
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities import rank_zero_only

from diffexp import lightning_internals as internals
from diffexp.errors import UserError
from diffexp.gpu_peaks import peak_flops
from diffexp.training.step_logs import VITALS, write_to_loggers


def _tokens(batch) -> int:
    tokens = batch["tokens"] if isinstance(batch, dict) else batch
    return tokens[:, :-1].numel()


def precision_dtype(precision: str) -> torch.dtype:
    """The compute dtype of a Trainer's `precision` setting ("bf16-mixed", "16-true", "32-true", ...)."""
    text = str(precision)
    if text.startswith("bf16"):
        return torch.bfloat16
    if text.startswith("16"):
        return torch.float16
    if text.startswith("64"):
        return torch.float64
    return torch.float32


def _rows(batch) -> int:
    tokens = batch["tokens"] if isinstance(batch, dict) else batch
    return tokens.shape[0]


class Throughput(internals.ThroughputInternals):
    """ThroughputMonitor for diffexp batches; FLOPs come from DiffexpLM.flops_per_batch (per variant).

    Args:
        peak_tflops: peak dense TFLOP/s of one device for MFU, for GPUs Lightning does not know
            (e.g. 989 for an H100/H200 SXM in bf16). None: the device's (diffexp.gpu_peaks; none on CPU).
        window_size: optimizer steps averaged in each reading.

    One reading per optimizer step, not per micro-batch; the micro-batches still count in batches, samples and
    lengths, and their FLOPs in the step's reading. Only a reading that is logged waits for the GPU
    (cuda.synchronize): the others take the time the host reaches them, which the step's one read from the device
    (its losses and gradient norm, DiffexpLM.on_before_optimizer_step) keeps within one optimizer update of the GPU.
    A logged rate spans window_size steps whose last reading waited, so it is off by at most one optimizer update's
    time over the window.
    """

    def __init__(self, peak_tflops: float | None = None, window_size: int = 20) -> None:
        if peak_tflops is not None and peak_tflops <= 0:
            raise UserError(f"throughput.peak_tflops={peak_tflops!r} is invalid: expected a positive number")
        super().__init__(batch_size_fn=_rows, length_fn=_tokens, window_size=window_size)
        self.peak_tflops = peak_tflops
        self._step_flops = 0.0  # the FLOPs of the step's micro-batches before its last

    @rank_zero_only
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, *args) -> None:
        if internals.should_accumulate(trainer):
            self.count(trainer.state.stage, samples=_rows(batch), lengths=_tokens(batch))
            self._step_flops += getattr(pl_module, "flops_per_batch", 0.0)
            return
        flops, earlier, self._step_flops = getattr(pl_module, "flops_per_batch", None), self._step_flops, 0.0
        if flops is not None:  # Lightning's reading takes flops_per_batch as the FLOPs since the last reading
            pl_module.flops_per_batch = flops + earlier
        try:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, *args)
        finally:
            if flops is not None:
                pl_module.flops_per_batch = flops

    @torch.inference_mode()
    def read(self, trainer, pl_module, batch, iter_num: int) -> None:
        """Lightning's reading, which waits for the GPU at every reading; here only where the reading is logged
        (every evaluation reading, the training steps Lightning logs)."""
        stage = trainer.state.stage
        logged = stage != RunningStage.TRAINING or internals.logs_this_step(trainer)
        if logged and trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - self.started_at(stage)
        self.count(stage, samples=self.batch_size_fn(batch), lengths=self.length_fn(batch))
        samples, lengths, batches = self.counts(stage)
        has_flops = self.module_has_flops(pl_module)
        self.stage_throughput(stage).update(time=elapsed, batches=batches, samples=samples, lengths=lengths,
                                            flops=pl_module.flops_per_batch if has_flops else None)

    def setup(self, trainer, pl_module, stage: str) -> None:
        flops = self.peak_flops(trainer)
        with warnings.catch_warnings():  # Lightning's own lookup, which misses names such as "NVIDIA H200"
            warnings.filterwarnings("ignore", message="FLOPs not found")
            super().setup(trainer, pl_module, stage)
        self.available_flops = flops
        for throughput in self.all_throughputs():  # built by super().setup with Lightning's peak
            throughput.available_flops = flops

    def peak_flops(self, trainer) -> float | None:
        """peak_tflops, else the device's dense FLOP/s at the compute dtype (FSDP2's bf16 under 32-true too)."""
        if self.peak_tflops is not None:
            return self.peak_tflops * 1e12
        dtype = getattr(trainer.strategy, "compute_dtype", None) or precision_dtype(trainer.precision)
        return peak_flops(trainer.strategy.root_device, dtype)

    #: Lightning's running counts (the x-axis of a chart already): not written
    COUNTS = ("time", "batches", "samples", "lengths")

    def write(self, trainer, iter_num: int | None = None) -> None:
        """The training readings (the rates; no running counts) under vitals/throughput/, at the step axis every
        training metric shares. The rates without `device/` are summed over ranks: what one process with the whole
        batch logs. Validation and test are timed (a validation's time is taken out of the training rate) but not
        written: their x would count evaluation batches."""
        stage = trainer.state.stage
        if stage != RunningStage.TRAINING or not internals.logs_this_step(trainer):
            return
        metrics = {k: v for k, v in self.stage_throughput(stage).compute().items() if k not in self.COUNTS}
        if metrics:
            write_to_loggers(trainer, {f"{VITALS}throughput/{k}": v for k, v in metrics.items()})

"""Tokens/s, FLOPs/s and MFU through Lightning's ThroughputMonitor, with a peak the user can set."""

from __future__ import annotations

import time
import warnings

import torch
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities import rank_zero_only

from diffexp.errors import UserError
from diffexp.gpu_peaks import peak_flops
from diffexp.training.step_logs import VITALS, logged_step


def _tokens(batch) -> int:
    tokens = batch["tokens"] if isinstance(batch, dict) else batch
    return tokens[:, :-1].numel()


def _rows(batch) -> int:
    tokens = batch["tokens"] if isinstance(batch, dict) else batch
    return tokens.shape[0]


#: ThroughputMonitor's state that Throughput._update reads and updates
LIGHTNING_STATE = ("_t0s", "_lengths", "_samples", "_batches", "_throughputs", "_module_has_flops")


class Throughput(ThroughputMonitor):
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
        if trainer.fit_loop._should_accumulate():
            stage = trainer.state.stage
            self._samples[stage] += _rows(batch)
            self._lengths[stage] += _tokens(batch)
            self._batches[stage] += 1
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
    def _update(self, trainer, pl_module, batch, iter_num: int) -> None:
        """Lightning's reading, which waits for the GPU at every reading; here only where the reading is logged
        (every evaluation reading, the training steps Lightning logs). It reads Lightning's internals (checked
        against 2.6); a Lightning without them gets its own reading."""
        if not all(hasattr(self, name) for name in LIGHTNING_STATE) or not hasattr(trainer, "_logger_connector"):
            return super()._update(trainer, pl_module, batch, iter_num)
        stage = trainer.state.stage
        logged = stage != RunningStage.TRAINING or trainer._logger_connector.should_update_logs
        if logged and trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - self._t0s[stage]
        self._lengths[stage] += self.length_fn(batch)
        if self._module_has_flops is None:
            self._module_has_flops = hasattr(pl_module, "flops_per_batch")
        self._samples[stage] += self.batch_size_fn(batch)
        self._batches[stage] += 1
        self._throughputs[stage].update(time=elapsed, batches=self._batches[stage], samples=self._samples[stage],
                                        lengths=self._lengths[stage],
                                        flops=pl_module.flops_per_batch if self._module_has_flops else None)

    def setup(self, trainer, pl_module, stage: str) -> None:
        flops = self.peak_flops(trainer)
        with warnings.catch_warnings():  # Lightning's own lookup, which misses names such as "NVIDIA H200"
            warnings.filterwarnings("ignore", message="FLOPs not found")
            super().setup(trainer, pl_module, stage)
        self.available_flops = flops
        for throughput in self._throughputs.values():  # built by super().setup with Lightning's peak
            throughput.available_flops = flops

    def peak_flops(self, trainer) -> float | None:
        """peak_tflops, else the device's dense FLOP/s at the compute dtype (FSDP2's bf16 under 32-true too)."""
        if self.peak_tflops is not None:
            return self.peak_tflops * 1e12
        from lightning.pytorch.callbacks.throughput_monitor import _plugin_to_compute_dtype

        dtype = getattr(trainer.strategy, "compute_dtype", None) or _plugin_to_compute_dtype(trainer.precision_plugin)
        return peak_flops(trainer.strategy.root_device, dtype)

    #: Lightning's running counts (the x-axis of a chart already): not written
    COUNTS = ("time", "batches", "samples", "lengths")

    def _compute(self, trainer, iter_num: int | None = None) -> None:
        """The training readings (the rates; no running counts) under vitals/throughput/, at the step axis every
        training metric shares. The rates without `device/` are summed over ranks: what one process with the whole
        batch logs. Validation and test are timed (a validation's time is taken out of the training rate) but not
        written: their x would count evaluation batches."""
        stage = trainer.state.stage
        if stage != RunningStage.TRAINING or not trainer._logger_connector.should_update_logs:
            return
        metrics = {k: v for k, v in self._throughputs[stage].compute().items() if k not in self.COUNTS}
        if metrics:
            trainer._logger_connector.log_metrics({f"{VITALS}throughput/{k}": v for k, v in metrics.items()},
                                                  step=logged_step(trainer))

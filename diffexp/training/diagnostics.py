"""Training diagnostics the DIFF papers and blog discuss, cheap enough to leave on.

Every `every_n_steps`, hooks on the training step's own forward (no extra forward: it works under FSDP and
activation checkpointing) record per layer the largest |activation|, the hidden states' kurtosis, the largest
attention logit, the context RMS and what a variant records; the attention-sink score takes one extra forward
without gradients. Every optimizer step: gradient-norm and loss spikes, the largest gradient norm, divergence.

Under model.compile the observed micro-batch (the sink forward, its forward and backward) runs eagerly: the hooks
and host reads stay out of the compiled blocks, which then hold one graph with no diagnostics in it, never broken
or recompiled by them.
"""

from __future__ import annotations

import contextlib
import math

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from diffexp.errors import UserError
from diffexp.model.attention.base import AttentionBase
from diffexp.model.blocks import DecoderBlock
from diffexp.model.compile import eagerly
from diffexp.training.nonfinite import NonFiniteError
from diffexp.training.stability import ContextRMS, LossSpikes, attention_sinks, divergence_threshold
from diffexp.training.step_logs import VITALS, logs_this_step, write_to_loggers

#: the prefix of the per-layer (and per-head) diagnostics
PER_LAYER = f"{VITALS}layer_"


def kurtosis(x: torch.Tensor) -> float:
    """Excess-free (Pearson) kurtosis of all entries: 3 for a Gaussian, large with outliers."""
    x = x.double().flatten()
    centered = x - x.mean()
    var = centered.pow(2).mean()
    return float(centered.pow(4).mean() / var.pow(2).clamp_min(1e-30))


class Diagnostics(L.Callback):
    """Args:
    every_n_steps: interval of the activation/attention diagnostics (0 turns them off).
    sample_rows: rows of the batch the diagnostics forward uses.
    spike_factor: a step's gradient norm above this multiple of the running mean is a spike.
    spike_warmup: steps before gradient and loss spikes are counted (the first steps move fast).
    loss_spike_factor: k: a step's train loss above k x the running median is a loss spike.
    loss_spike_window: N: the running median is over the previous N steps' train losses.
    divergence_factor: a train loss above this multiple of ln(vocab_size) (a uniform guess's loss) stops
        the run as diverged, as a non-finite loss or gradient norm does; 0 keeps only the non-finite test.
    attention_sink: at the diagnostics steps, also measure the attention-sink score (one extra forward
        without gradients on sample_rows rows, with the eager attention maps).
    """

    def __init__(self, every_n_steps: int = 50, sample_rows: int = 1, spike_factor: float = 3.0,
                 spike_warmup: int = 20, loss_spike_factor: float = 1.5, loss_spike_window: int = 50,
                 divergence_factor: float = 1.5, attention_sink: bool = True) -> None:
        if every_n_steps < 0 or sample_rows < 1 or spike_factor <= 1:
            raise UserError(f"diagnostics: every_n_steps={every_n_steps} (>= 0), sample_rows={sample_rows} (>= 1), "
                             f"spike_factor={spike_factor} (> 1) expected")
        if loss_spike_factor <= 1 or loss_spike_window < 1 or spike_warmup < 0:
            raise UserError(f"diagnostics: loss_spike_factor={loss_spike_factor} (> 1), loss_spike_window="
                            f"{loss_spike_window} (>= 1), spike_warmup={spike_warmup} (>= 0) expected")
        if divergence_factor < 0:
            raise UserError(f"diagnostics: divergence_factor={divergence_factor} (>= 0, 0 turns the loss "
                            "threshold off) expected")
        self.every_n_steps, self.sample_rows = every_n_steps, sample_rows
        self.spike_factor, self.spike_warmup = spike_factor, spike_warmup
        self.divergence_factor, self.attention_sink = divergence_factor, attention_sink
        self.spikes = 0
        self.loss_spikes = LossSpikes(loss_spike_factor, loss_spike_window, spike_warmup)
        self.grad_norm_max: float | None = None
        #: {"step": int, "reason": str} once the run diverged (see diverged_at)
        self.divergence: dict | None = None
        self._observed_step: int | None = None
        self._recorder: LayerStats | None = None
        self._eager = contextlib.ExitStack()  # holds model.compile off while a step is observed
        self._sinks: dict[str, float] = {}
        self._norm_mean: float | None = None
        self._norms_seen = 0
        self._step_seen: int | None = None

    def state_dict(self) -> dict:
        return {"spikes": self.spikes, "norm_mean": self._norm_mean, "norms_seen": self._norms_seen,
                "loss_spikes": self.loss_spikes.state_dict(), "grad_norm_max": self.grad_norm_max}

    def load_state_dict(self, state: dict) -> None:
        self.spikes, self._norm_mean, self._norms_seen = state["spikes"], state["norm_mean"], state["norms_seen"]
        if "loss_spikes" in state:  # checkpoints from before loss spikes were counted start afresh
            self.loss_spikes.load_state_dict(state["loss_spikes"])
        self.grad_norm_max = state.get("grad_norm_max")

    def on_train_start(self, trainer, pl_module) -> None:
        self._step_seen = trainer.global_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        step = trainer.global_step  # the same for every micro-batch of an accumulated step: observe the first
        if self.every_n_steps and step % self.every_n_steps == 0 and step != self._observed_step:
            self._observed_step = step
            self._eager.enter_context(eagerly())
            if self.attention_sink and _model_callable_directly(trainer.strategy):
                tokens = batch["tokens"] if isinstance(batch, dict) else batch
                model = getattr(pl_module, "model", pl_module)
                with trainer.precision_plugin.forward_context():
                    self._sinks = attention_sinks(model, tokens[: self.sample_rows, :-1])
            self._recorder = LayerStats(pl_module, self.sample_rows).start()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._recorder is not None:
            recorder, self._recorder = self._recorder, None
            stats, self._sinks = {**recorder.stop(), **self._sinks}, {}
            self._eager.close()
            # at the step they were measured (self.log would hold them to the next logging step and repeat them at
            # each one after); dozens of values: see write_to_loggers
            write_to_loggers(trainer, stats)
            for name, value in stats.items():
                if not name.startswith(PER_LAYER):  # the run-wide ones are sweep results and objectives
                    trainer.callback_metrics[name] = torch.tensor(float(value))
        if trainer.global_step == self._step_seen:  # accumulating gradients: the step is not over yet
            return
        self._step_seen = trainer.global_step
        self._count_spike(pl_module)
        # the step's micro-batch losses (each the mean over ranks), brought to the host with its finite check
        losses = getattr(pl_module, "step_losses", None)
        if losses:
            step_loss = sum(losses) / len(losses)
            self.loss_spikes.update(step_loss)
            self._check_divergence(trainer, pl_module, step_loss)
        # counted every step, logged at the steps Lightning writes (and at a stop, which it writes too)
        if not logs_this_step(trainer):
            return
        pl_module.log("vitals/grad_spikes", float(self.spikes))
        if self.grad_norm_max is not None:
            pl_module.log("vitals/grad_norm_max", self.grad_norm_max)
        if self.loss_spikes.seen:
            pl_module.log("vitals/loss_spikes", float(self.loss_spikes.count))

    def _check_divergence(self, trainer, pl_module, loss: float) -> None:
        vocab_size = getattr(getattr(pl_module, "arch", None), "vocab_size", None)
        threshold = divergence_threshold(self.divergence_factor, vocab_size)
        if threshold is None or self.divergence is not None or not loss > threshold:
            return
        step = trainer.global_step - 1  # the step whose loss this is (the optimizer step is done)
        self.divergence = {"step": step, "reason": f"train/loss {loss:.4g} > {threshold:.4g} "
                                                   f"({self.divergence_factor:g} x ln {vocab_size})"}
        pl_module.log("vitals/diverged_step", float(step))
        trainer.should_stop = True
        rank_zero_warn(f"diverged at step {step}: {self.divergence['reason']} "
                       "(diagnostics.divergence_factor); training stops here, recorded as diverged")

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._eager.close()
        if isinstance(exception, NonFiniteError) and self.divergence is None:
            self.divergence = exception.divergence

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._eager.close()

    def _count_spike(self, pl_module) -> None:
        norm = getattr(pl_module, "last_grad_norm", None)
        if norm is None or not math.isfinite(norm):
            return
        self.grad_norm_max = norm if self.grad_norm_max is None else max(self.grad_norm_max, norm)
        if self._norm_mean is not None and self._norms_seen >= self.spike_warmup \
                and norm > self.spike_factor * self._norm_mean:
            self.spikes += 1
        self._norms_seen += 1
        # running mean over the recent past (EMA), so slow drifts are not spikes
        self._norm_mean = norm if self._norm_mean is None else 0.95 * self._norm_mean + 0.05 * norm

    @staticmethod
    @torch.no_grad()
    def measure(model: nn.Module, idx: torch.Tensor) -> dict[str, float]:
        """One extra eval-mode forward, observed: the same statistics for a model outside training."""
        recorder = LayerStats(model, rows=idx.shape[0]).start()
        was_training = model.training
        try:
            model.eval()
            model(idx)
        finally:
            model.train(was_training)
            stats = recorder.stop()
        return stats


def diverged_at(trainer: L.Trainer, exception: BaseException | None = None) -> dict | None:
    """{"step", "reason"} when this run diverged: a NonFiniteError, or what the Diagnostics callback saw."""
    if isinstance(exception, NonFiniteError):
        return exception.divergence
    for callback in trainer.callbacks:
        if isinstance(callback, Diagnostics) and callback.divergence is not None:
            return callback.divergence
    return None


def _model_callable_directly(strategy) -> bool:
    """The sink forward calls the model outside the strategy's wrapper: where no rank holds a shard, or under
    FSDP2, whose sharded blocks gather their weights in any forward (every rank runs this one)."""
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy

    from diffexp.parallel import FSDP2Strategy

    if isinstance(strategy, FSDP2Strategy):
        return True
    return isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)) and not isinstance(strategy, DeepSpeedStrategy)


class LayerStats:
    """Observe the next forward of every decoder block: activation outliers, attention logits, context RMS,
    lambda.

    Blocks and attention layers are found with `modules()`, which reaches inside FSDP units; a block
    run again (activation checkpointing recomputes it in backward) is recorded once.
    """

    def __init__(self, model: nn.Module, rows: int) -> None:
        self.blocks = [m for m in model.modules() if isinstance(m, DecoderBlock)]
        self.attention = [m for m in model.modules() if isinstance(m, AttentionBase)]
        self.rows = rows
        self.hidden: dict[int, torch.Tensor] = {}
        self.hooks: list = []
        self.context = ContextRMS(model, rows)

    def start(self) -> LayerStats:
        self.context.start()
        for i, block in enumerate(self.blocks):
            self.hooks.append(block.register_forward_hook(self._keep(i)))
        for attn in self.attention:
            attn.record_stats, attn.stats_rows, attn.stats = True, self.rows, {}
        return self

    def _keep(self, i: int):
        def hook(module, inputs, output) -> None:
            if i not in self.hidden:
                self.hidden[i] = output[0][: self.rows].detach()
        return hook

    def stop(self) -> dict[str, float]:
        for hook in self.hooks:
            hook.remove()
        for attn in self.attention:
            attn.record_stats, attn.stats_rows = False, None
        out: dict[str, float] = self.context.stop()
        for i, h in sorted(self.hidden.items()):
            out[f"vitals/layer_{i:02d}/act_max_abs"] = float(h.abs().max())
            out[f"vitals/layer_{i:02d}/act_kurtosis"] = kurtosis(h)
        for i, attn in enumerate(self.attention):
            for key, value in attn.stats.items():
                out[f"vitals/layer_{i:02d}/{key}"] = value
        if not self.hidden:
            return out
        out["vitals/act_max_abs"] = max(v for k, v in out.items() if k.endswith("act_max_abs"))
        logit_maxes = [v for k, v in out.items() if k.endswith("attn_logit_max")]
        if logit_maxes:
            out["vitals/attn_logit_max"] = max(logit_maxes)
        return out

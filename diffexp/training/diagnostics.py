"""Training diagnostics the DIFF papers and blog discuss, cheap enough to leave on.

Every `every_n_steps`, the training step's own forward is observed (hooks, no extra forward, so it works
unchanged under FSDP and activation checkpointing) on the first `sample_rows` rows of the batch, per layer:
the largest |activation| and the kurtosis of the hidden states (outliers, DIFF V1 section 3.8), the
largest attention logit, and statistics a variant records (DIFF V2: its token-wise lambda). Every step,
gradient-norm spikes (norm above `spike_factor` x the running mean of the previous norms, the DIFF V2
blog's instability signal) are counted. Lambda traces are logged by the LightningModule.
"""

from __future__ import annotations

import lightning as L
import torch
from torch import nn

from diffexp.errors import UserError
from diffexp.model.attention.base import AttentionBase
from diffexp.model.blocks import DecoderBlock


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
    spike_warmup: steps before spikes are counted (the first steps' norms move fast).
    """

    def __init__(self, every_n_steps: int = 50, sample_rows: int = 1, spike_factor: float = 3.0,
                 spike_warmup: int = 20) -> None:
        if every_n_steps < 0 or sample_rows < 1 or spike_factor <= 1:
            raise UserError(f"diagnostics: every_n_steps={every_n_steps} (>= 0), sample_rows={sample_rows} (>= 1), "
                             f"spike_factor={spike_factor} (> 1) expected")
        self.every_n_steps, self.sample_rows = every_n_steps, sample_rows
        self.spike_factor, self.spike_warmup = spike_factor, spike_warmup
        self.spikes = 0
        self._observed_step: int | None = None
        self._recorder: LayerStats | None = None
        self._norm_mean: float | None = None
        self._norms_seen = 0

    def state_dict(self) -> dict:
        return {"spikes": self.spikes, "norm_mean": self._norm_mean, "norms_seen": self._norms_seen}

    def load_state_dict(self, state: dict) -> None:
        self.spikes, self._norm_mean, self._norms_seen = state["spikes"], state["norm_mean"], state["norms_seen"]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        step = trainer.global_step  # the same for every micro-batch of an accumulated step: observe the first
        if self.every_n_steps and step % self.every_n_steps == 0 and step != self._observed_step:
            self._observed_step = step
            self._recorder = LayerStats(pl_module, self.sample_rows).start()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._count_spike(pl_module)
        pl_module.log("diag/grad_spikes", float(self.spikes))
        if self._recorder is not None:
            recorder, self._recorder = self._recorder, None
            for name, value in recorder.stop().items():
                pl_module.log(name, value)

    def _count_spike(self, pl_module) -> None:
        norm = getattr(pl_module, "last_grad_norm", None)
        if norm is None or not torch.isfinite(torch.tensor(norm)):
            return
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


class LayerStats:
    """Observe the next forward of every decoder block: activation outliers, attention logits, lambda.

    Blocks and attention layers are found with `modules()`, which reaches inside FSDP units; a block
    run again (activation checkpointing recomputes it in backward) is recorded once.
    """

    def __init__(self, model: nn.Module, rows: int) -> None:
        self.blocks = [m for m in model.modules() if isinstance(m, DecoderBlock)]
        self.attention = [m for m in model.modules() if isinstance(m, AttentionBase)]
        self.rows = rows
        self.hidden: dict[int, torch.Tensor] = {}
        self.hooks: list = []

    def start(self) -> LayerStats:
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
        out: dict[str, float] = {}
        for i, h in sorted(self.hidden.items()):
            out[f"diag/layer_{i:02d}/act_max_abs"] = float(h.abs().max())
            out[f"diag/layer_{i:02d}/act_kurtosis"] = kurtosis(h)
        for i, attn in enumerate(self.attention):
            for key, value in attn.stats.items():
                out[f"diag/layer_{i:02d}/{key}"] = value
        if not self.hidden:
            return out
        out["diag/act_max_abs"] = max(v for k, v in out.items() if k.endswith("act_max_abs"))
        logit_maxes = [v for k, v in out.items() if k.endswith("attn_logit_max")]
        if logit_maxes:
            out["diag/attn_logit_max"] = max(logit_maxes)
        return out

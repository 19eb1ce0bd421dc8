"""The LightningModule: next-token training of a Decoder, with the logs the papers compare."""

from __future__ import annotations

import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden

from diffexp.data.tokenizer import tokenizer_state
from diffexp.errors import UserError
from diffexp.model import Decoder
from diffexp.model.config import ModelConfig
from diffexp.parallel import FSDP2Strategy, full_value
from diffexp.training.global_batch import resumed_layout
from diffexp.training.loss import token_losses
from diffexp.training.loss_slices import ar_hit_mask, frequent_bigrams
from diffexp.training.nonfinite import any_rank_stops, stop_with_last_finite
from diffexp.training.options import ARHitConfig, OptimConfig
from diffexp.training.preemption import note_agreement
from diffexp.training.step_logs import VITALS, logs_this_step, note_fit_start, write_to_loggers


def _shard_replicas(strategy) -> int:
    """Under FSDP, how many full copies of the gradient the ranks' shards make up together (0: not sharded).

    FULL_SHARD / SHARD_GRAD_OP split every gradient across all ranks (1 copy); the hybrid strategies shard
    within a node and replicate across nodes (num_nodes copies).
    """
    from lightning.pytorch.strategies import FSDPStrategy

    if not isinstance(strategy, FSDPStrategy) or strategy.world_size == 1:
        return 0
    kind = getattr(strategy.sharding_strategy, "name", str(strategy.sharding_strategy))
    if kind in ("FULL_SHARD", "SHARD_GRAD_OP"):
        return 1
    if kind in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"):
        return strategy.num_nodes
    return 0


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Multiplier of the peak lr at `step`."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def adamw_kernel(device: torch.device) -> dict[str, bool]:
    """AdamW's implementation: one fused kernel over all parameters on CUDA, the multi-tensor (foreach) one
    elsewhere. Both keep the same state_dict, so a run resumes exactly under either."""
    return {"fused": True} if device.type == "cuda" else {"foreach": True}


def _tokens(batch) -> torch.Tensor:
    return batch["tokens"] if isinstance(batch, dict) else batch


def _batch_size(batch) -> int:
    return _tokens(batch).shape[0]


def _masked_mean(losses: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The mean of the per-target losses over the targets the mask selects (all of them without a mask)."""
    if mask is None:
        return losses.mean()
    mask = mask.to(losses.dtype)
    return (losses * mask).sum() / mask.sum().clamp_min(1.0)


def attached_trainer(module: L.LightningModule) -> L.Trainer | None:
    """The trainer a module is attached to, or None (`module.trainer` raises when there is none)."""
    try:
        return module.trainer
    except RuntimeError:
        return None


class DiffexpLM(L.LightningModule):
    """Causal language model around `Decoder`; batches are (B, T + 1) token ids.

    Args:
        arch: the decoder and its attention variant.
        optim: optimizer and schedule.
        vocab_size: linked from the data module; overrides arch.vocab_size.
        ar_hit: the AR-Hit / Others split of the validation loss.
        compile: torch.compile each decoder block (before FSDP wraps them), as torchtitan does.
        init_from: start a new run from this checkpoint's weights (a checkpoint, or a run or experiment
            directory: its newest last.ckpt), with a fresh optimizer and lr schedule; max_seq_len and
            rope_theta may differ from the checkpoint's (long-context extension, diffexp.training.warm_start).
    """

    def __init__(self, arch: ModelConfig = ModelConfig(), optim: OptimConfig = OptimConfig(),
                 vocab_size: int | None = None, ar_hit: ARHitConfig = ARHitConfig(), compile: bool = False,
                 init_from: str | None = None) -> None:
        super().__init__()
        ar_hit = ARHitConfig(**ar_hit) if isinstance(ar_hit, dict) else ar_hit
        # checkpoints store plain dicts (see save_hyperparameters below)
        arch = ModelConfig(**arch) if isinstance(arch, dict) else arch
        optim = OptimConfig(**optim) if isinstance(optim, dict) else optim
        if vocab_size is not None:
            arch = ModelConfig(**{**asdict(arch), "vocab_size": vocab_size})
        self.arch, self.optim, self.ar_hit = arch, optim, ar_hit
        # plain dicts, so checkpoints load with torch.load(weights_only=True), and lists, not tuples, so
        # hparams.yaml loads with yaml.safe_load
        optim_hparams = {**asdict(optim), "betas": list(optim.betas)}
        self.save_hyperparameters({"arch": asdict(arch), "optim": optim_hparams, "vocab_size": arch.vocab_size,
                                   "ar_hit": asdict(ar_hit), "init_from": init_from})
        self.model = Decoder(arch)
        self.init_from = init_from
        self.compile_blocks = compile
        self.last_grad_norm: float | None = None
        self.last_train_loss: torch.Tensor | None = None  # the last micro-batch's, the mean over ranks
        #: the last optimizer step's micro-batch losses (each the mean over ranks) on the host, read with the step's
        #: finite check: the Diagnostics' loss spikes and divergence
        self.step_losses: list[float] = []
        #: the last of them: what the progress bar shows
        self.shown_train_loss: float | None = None
        self.validated_step: int | None = None  # the global step of the last validation, kept in checkpoints
        self._last_step_time: float | None = None
        self._tokens_since_log = 0
        self._flops_cache: dict[int, float] = {}
        self._frequent_bigrams: torch.Tensor | None = None
        self._split_sums = torch.zeros(4, dtype=torch.float64)  # ar-hit loss, count, others loss, count
        #: this optimizer step's micro-batch losses on the device: this rank's and the mean over ranks
        self._step_losses: list[tuple[torch.Tensor, torch.Tensor]] = []

    def setup(self, stage: str) -> None:
        # before FSDP wraps the model and before a resume restores its own weights (which then win)
        if stage == "fit" and self.init_from and self.trainer.ckpt_path is None:
            from diffexp.training.warm_start import load_initial_weights

            datamodule = getattr(self.trainer, "datamodule", None)
            tokenizer = tokenizer_state(getattr(datamodule, "tokenizer", None))
            rank_zero_info(load_initial_weights(self, self.init_from, tokenizer))

    def configure_model(self) -> None:
        if self.compile_blocks and not getattr(self, "_compiled", False):
            from diffexp.model.compile import compile_blocks

            reason = compile_blocks(self.model.blocks, self.device)
            if reason is not None:
                rank_zero_warn(f"model.compile: torch.compile cannot run here ({reason}); training without it")
            self._compiled = True
        strategy = attached_trainer(self).strategy if attached_trainer(self) is not None else None
        from lightning.pytorch.strategies import ModelParallelStrategy

        if isinstance(strategy, FSDP2Strategy):  # after compile, as torchtitan does
            datamodule = getattr(self.trainer, "datamodule", None)
            micro_batch = int(getattr(datamodule, "batch_size", 1))
            rank_zero_info(strategy.check_memory(self.arch, micro_batch, getattr(datamodule, "seq_len", None)
                                                 or self.arch.max_seq_len, token_losses))
            strategy.shard(self.model)
        elif isinstance(strategy, ModelParallelStrategy):
            raise UserError(f"trainer.strategy={type(strategy).__name__}: diffexp shards with its subclass "
                            "diffexp.parallel.FSDP2Strategy (FSDP2 per decoder block); use that class_path")

    # -- steps -----------------------------------------------------------------------------------
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def _token_losses(self, batch: torch.Tensor | dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-target losses (B, T) and the optional (B, T) loss_mask of a dict batch."""
        tokens, mask = (batch["tokens"], batch.get("loss_mask")) if isinstance(batch, dict) else (batch, None)
        hidden = self.model(tokens[:, :-1], head=False)  # lm_head is applied per chunk of rows (training.loss)
        return token_losses(hidden, self.model.lm_head.weight, tokens[:, 1:]), mask

    def _loss(self, batch: torch.Tensor | dict[str, torch.Tensor]) -> torch.Tensor:
        """Next-token loss. A batch is (B, T + 1) token ids, or a dict with "tokens" and an optional
        (B, T) "loss_mask" that selects the targets that count (synthetic tasks score answers only)."""
        return _masked_mean(*self._token_losses(batch))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        # the mean over every rank's rows, as one process with the whole batch would log it
        self.last_train_loss = self.trainer.strategy.reduce(loss.detach(), reduce_op="mean")
        # read and checked once per optimizer step, before it (on_before_optimizer_step): no host sync per micro-batch
        self._step_losses.append((loss.detach(), self.last_train_loss))
        if logs_this_step(self.trainer):  # not prog_bar: Lightning would read it from the device at every redraw
            self.log("train/loss", self.last_train_loss)  # the bar shows shown_train_loss (training.progress)
            self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"])
            # The x of every training metric: the optimizer steps done once this one is (10 for the 10th step), as
            # validation logs its metrics after that many steps (on_validation_epoch_end): one step axis for both.
            # Lightning reads a "step" key as the step to log at and writes no "epoch" beside it.
            self.log("step", float(self.global_step + 1))
        self._log_step_extras(batch)
        return loss

    def _log_step_extras(self, batch) -> None:
        """tokens/s, logged here rather than at batch end so that it is among the step's metrics a last.ckpt
        of this step carries (see training.checkpointing). Only at the steps Lightning writes to the loggers:
        a self.log is costly next to a small model's step."""
        now, logs = time.perf_counter(), logs_this_step(self.trainer)
        if self._last_step_time is not None:  # the whole steps since the last reading, callbacks included
            self._tokens_since_log += _batch_size(batch) * (_tokens(batch).shape[1] - 1) * self.trainer.world_size
            if logs:
                rate = self._tokens_since_log / max(now - self._last_step_time, 1e-9)
                self.log(f"{VITALS}throughput/tokens_per_s", rate)
        if self._last_step_time is None or logs:
            self._last_step_time, self._tokens_since_log = now, 0

    def _write_traces(self) -> None:
        """Each layer's lambda (and DINT's learned gamma), as this step's update is about to change them."""
        traces = {}
        for i, block in enumerate(self.model.blocks):
            if hasattr(block.attn, "lambda_"):  # under FSDP2 from sharded vectors: every rank computes it
                traces[f"{VITALS}lambda/layer_{i:02d}"] = float(full_value(block.attn.lambda_().detach()))
            if isinstance(getattr(block.attn, "gamma", None), torch.nn.Parameter):  # DINT's learned gamma
                traces[f"{VITALS}gamma/layer_{i:02d}"] = float(full_value(block.attn.gamma.detach()))
        write_to_loggers(self.trainer, traces)  # one per layer: see write_to_loggers

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        losses, mask = self._token_losses(batch)
        loss = _masked_mean(losses, mask)
        if mask is None and self.ar_hit.enabled:
            self._accumulate_ar_hit(batch, losses.detach())
        self.log("val/loss", loss, prog_bar=True, sync_dist=True, batch_size=_batch_size(batch))

    def _accumulate_ar_hit(self, tokens: torch.Tensor, losses: torch.Tensor) -> None:
        threshold = self.ar_hit.threshold()
        if self._frequent_bigrams is None and threshold is not None:
            rows = getattr(getattr(self.trainer, "datamodule", None), "train_rows", None)
            if rows is None:
                raise UserError("model.ar_hit: leaving frequent bigrams out of the AR-Hits needs the training "
                                "split's bigram counts, and this data module has no train_rows; set "
                                "model.ar_hit.exclude_frequent false (every repeated bigram is a hit) or "
                                "model.ar_hit.enabled false")
            self._frequent_bigrams = frequent_bigrams(rows, self.arch.vocab_size, **threshold)
        hits = ar_hit_mask(tokens, self.arch.vocab_size, self._frequent_bigrams)
        losses = losses.double().cpu()
        hits = hits.cpu()
        self._split_sums += torch.stack([losses[hits].sum(), hits.sum(), losses[~hits].sum(), (~hits).sum()]).double()

    def on_validation_epoch_start(self) -> None:
        self._split_sums.zero_()

    def test_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        loss = self._loss(batch)
        self.log("test/loss", loss, sync_dist=True, batch_size=_batch_size(batch))

    def on_validation_epoch_end(self) -> None:
        if not self.trainer.sanity_checking:
            self.validated_step = self.global_step
            # The x of every validation metric: the optimizer steps done, as the CLI prints it ("step 30"), not
            # Lightning's default (the steps done before the one being run: 29). Lightning reads a "step" key as
            # the step to log at and does not write it as a metric.
            self.log("step", float(self.global_step), sync_dist=True)
        val_loss = self.trainer.callback_metrics.get("val/loss")
        if val_loss is not None:
            self.log("val/ppl", torch.exp(val_loss.float()), sync_dist=True)
        # the values below are the same on every rank (sync_dist only keeps Lightning from warning otherwise)
        sums = self.trainer.strategy.reduce(self._split_sums.to(self.device), reduce_op="sum").cpu()
        hit_loss, hits, other_loss, others = sums.tolist()
        if hits + others > 0:
            if hits:
                self.log("val/loss_ar_hit", hit_loss / hits, sync_dist=True)
            self.log("val/loss_others", other_loss / max(others, 1), sync_dist=True)
            self.log("val/share_ar_hit", hits / (hits + others), sync_dist=True)

    def on_test_epoch_end(self) -> None:
        test_loss = self.trainer.callback_metrics.get("test/loss")
        if test_loss is not None:
            self.log("test/ppl", torch.exp(test_loss.float()), sync_dist=True)

    def needs_final_validation(self) -> bool:
        """True when the weights of the last step were never validated (max_steps off the validation grid, or
        a run resumed from a checkpoint written before its final validation)."""
        trainer = self.trainer
        datamodule = getattr(trainer, "datamodule", None)
        has_val_data = datamodule is not None and is_overridden("val_dataloader", datamodule, L.LightningDataModule)
        return (self.validated_step != self.global_step and not trainer.interrupted and self.global_step > 0
                and trainer.limit_val_batches != 0 and has_val_data)

    def schedule_steps(self) -> int:
        """Steps the warmup + cosine spans: model.optim.schedule_steps, else the trainer's planned steps."""
        if self.optim.schedule_steps is not None:
            return self.optim.schedule_steps
        return int(self.trainer.estimated_stepping_batches)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["diffexp_validated_step"] = self.validated_step
        # what a resume must repeat to continue this run exactly (checked by diffexp.training.preflight.check_resume)
        trainer = attached_trainer(self)
        if trainer is None:  # saved outside a Trainer: no run to continue
            return
        datamodule = getattr(trainer, "datamodule", None)
        # the tokenizer travels with the weights: `diffexp generate` decodes without the data cache
        tokenizer = tokenizer_state(getattr(datamodule, "tokenizer", None))
        if tokenizer is not None:
            checkpoint["diffexp_tokenizer"] = tokenizer
        checkpoint["diffexp_run"] = {
            "max_steps": trainer.max_steps, "schedule_steps": self.schedule_steps(),
            "accumulate_grad_batches": trainer.accumulate_grad_batches,
            "gradient_clip_val": trainer.gradient_clip_val, "world_size": trainer.world_size,
            "batch_size": getattr(datamodule, "batch_size", None),  # with the two above: the global batch
            "data_class": None if datamodule is None else f"{type(datamodule).__module__}.{type(datamodule).__name__}",
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.validated_step = checkpoint.get("diffexp_validated_step")
        scalar_moments_as_vectors(checkpoint)
        trainer = attached_trainer(self)
        if trainer is not None and trainer.state.fn == "fit":
            # the preflight check of the global batch, for launches whose size only the machine knew (devices auto
            # or -1); another world size or data.batch_size with the same global batch moves the batch counters
            resumed_layout(checkpoint, trainer)

    # -- logs that need the step boundaries -------------------------------------------------------
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The step's checks before it changes the weights, on one read from the device (the step's one host sync):
        its micro-batch losses, whether any rank's is NaN/inf (an all-reduce on the device, so that every rank stops
        and saves together) and the gradient norm. A non-finite loss stops the run, then a non-finite norm."""
        norm = self._gradient_norm(optimizer)
        losses, self._step_losses = self._step_losses, []
        parts, n = [], len(losses)
        if losses:
            own = torch.stack([own for own, _ in losses])
            parts += [any_rank_stops(self.trainer, own), own, torch.stack([mean for _, mean in losses])]
        if norm is not None:
            parts.append(norm.reshape(1))
        # one copy to the host, in the widest dtype among them (every value exact)
        values = torch.cat(parts).tolist() if parts else []
        if losses:
            stops, signalled = values[0], values[1]
            own_values, self.step_losses = values[2:n + 2], values[n + 2:2 * n + 2]
            note_agreement(signalled)  # a stop signal on any rank: every rank stops after this step
            self.shown_train_loss = self.step_losses[-1]
            if stops:  # this rank's first non-finite loss (another rank's when all of this rank's are finite)
                value = next((v for v in own_values if not math.isfinite(v)), own_values[-1])
                stop_with_last_finite(self.trainer, self, "train/loss", value, self.optim.lr)
        if norm is not None:  # before clipping: spikes are what we want to see
            self.last_grad_norm = values[-1]
            # identical on every rank (DDP averages gradients, FSDP reduces the norm); fp16's GradScaler
            # expects inf gradients now and then and skips those steps itself
            fp16_scaled = getattr(self.trainer.precision_plugin, "scaler", None) is not None
            if not math.isfinite(self.last_grad_norm) and not fp16_scaled:
                stop_with_last_finite(self.trainer, self, "vitals/grad_norm", self.last_grad_norm, self.optim.lr)
            if logs_this_step(self.trainer):
                self.log("vitals/grad_norm", norm)
        if logs_this_step(self.trainer):  # once per optimizer step, after every micro-batch's forward
            self._write_traces()

    def _gradient_norm(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        """The total norm of the gradients on the device (None without any); kept for the clipping where it can
        clip with it (configure_gradient_clipping)."""
        # in the optimizer's order, as clip_grad_norm_ sums them: the same norm to the last bit
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not grads:
            return None
        norm = full_value(torch.nn.utils.get_total_norm(grads))  # FSDP2: an all-reduce of the shards' norms
        replicas = _shard_replicas(self.trainer.strategy)
        if replicas:  # each rank holds a shard: sum the squares over ranks, once per replica of the shards
            norm = (self.trainer.strategy.reduce(norm.pow(2), reduce_op="sum") / replicas).sqrt()
        self._unclipped_norm = norm if not replicas and norm.__class__ is torch.Tensor else None
        return norm

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Clip by the norm on_before_optimizer_step just computed, instead of computing it again (the same
        result as clip_grad_norm_, one pass over the gradients less; under FSDP2 the full norm, the all-reduce of
        its shards', as torchtitan clips); FSDP1-sharded, fp16-scaled or value clipping go through Lightning."""
        norm, self._unclipped_norm = getattr(self, "_unclipped_norm", None), None
        clips_here = getattr(self.trainer.precision_plugin, "scaler", None) is None and gradient_clip_algorithm in (
            None, "norm")
        if not gradient_clip_val or norm is None or not clips_here:
            return super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        torch.nn.utils.clip_grads_with_norm_(params, gradient_clip_val, norm)

    def on_train_epoch_start(self) -> None:
        self._last_step_time, self._tokens_since_log = None, 0

    # read by the Throughput callback for FLOPs/s and MFU; training counts forward + backward
    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        tokens = _tokens(batch)
        self.flops_per_batch = tokens.shape[0] * (tokens.shape[1] - 1) * self._flops_per_token(tokens.shape[1] - 1)

    def _flops_per_token(self, seq_len: int) -> float:
        """Decoder.flops_per_token (training), kept per length: it walks every module."""
        cached = self._flops_cache.get(seq_len)
        if cached is None:
            cached = self._flops_cache[seq_len] = self.model.flops_per_token(seq_len, training=True)
        return cached

    def on_validation_batch_start(self, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        tokens = _tokens(batch)
        self.flops_per_batch = tokens.shape[0] * (tokens.shape[1] - 1) * self.model.flops_per_token(
            tokens.shape[1] - 1, training=False)

    def on_train_start(self) -> None:
        note_fit_start(self.trainer)
        if self.trainer.ckpt_path is not None:
            self._apply_configured_optim()

    def _apply_configured_optim(self) -> None:
        """A resumed run trains with model.optim as configured now (e.g. a lower lr after a non-finite
        stop): restoring the optimizer and scheduler states brought back the values of the run that wrote
        the checkpoint."""
        optimizer = self.trainer.optimizers[0]
        old_lr = optimizer.param_groups[0].get("initial_lr")
        for group, weight_decay in zip(optimizer.param_groups, (self.optim.weight_decay, 0.0)):
            group.update(weight_decay=weight_decay, betas=tuple(self.optim.betas), eps=self.optim.eps,
                         initial_lr=self.optim.lr)
        for config in self.trainer.lr_scheduler_configs:
            scheduler = config.scheduler
            scheduler.base_lrs = [self.optim.lr] * len(optimizer.param_groups)
            multiplier = warmup_cosine(scheduler.last_epoch, self.optim.warmup_steps, self.schedule_steps(),
                                       self.optim.min_lr_ratio)
            for group in optimizer.param_groups:
                group["lr"] = self.optim.lr * multiplier
        if old_lr is not None and old_lr != self.optim.lr:
            rank_zero_info(f"resumed with model.optim.lr={self.optim.lr:g} (the checkpoint's run used {old_lr:g})")
            from lightning.pytorch.core.saving import save_hparams_to_yaml

            for logger in self.trainer.loggers:  # the run's recorded hparams follow what it now trains with
                logger.log_hyperparams(self.hparams)
                if getattr(logger, "log_dir", None) and Path(logger.log_dir).is_dir():  # Lightning writes it once
                    save_hparams_to_yaml(Path(logger.log_dir) / "hparams.yaml", dict(self.hparams))

    def on_fit_start(self) -> None:
        report = self.model.parameter_report()
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is not None and hasattr(datamodule, "describe"):
            rank_zero_info(f"data: {datamodule.describe()}")
        if hasattr(self.trainer.strategy, "describe"):  # FSDP2Strategy: mesh, precision, checkpointing
            rank_zero_info(f"parallel: {self.trainer.strategy.describe()}")
        counts = ", ".join(f"{k} {v:,}" for k, v in report.items())
        rank_zero_info(f"model: {self.arch.attention}, parameters {counts}")  # and in the run's HParams row

    # -- optimizer ---------------------------------------------------------------------------------
    def configure_optimizers(self):
        decay, no_decay = [], []
        for _, p in self.named_parameters():
            if p.requires_grad:
                (decay if p.ndim >= 2 else no_decay).append(p)
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.optim.weight_decay},
             {"params": no_decay, "weight_decay": 0.0}],
            lr=self.optim.lr, betas=tuple(self.optim.betas), eps=self.optim.eps, **adamw_kernel(self.device),
        )
        total = self.schedule_steps()
        warmup, min_ratio = self.optim.warmup_steps, self.optim.min_lr_ratio
        schedule = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda step: warmup_cosine(step, warmup, total, min_ratio))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def scalar_moments_as_vectors(checkpoint: dict[str, Any]) -> None:
    """AdamW's moments of a 0-d parameter as shape (1,), in place: DINT's learned gamma was 0-d before FSDP2 (which
    shards no scalar) made it (1,); its weight is reshaped by the attention module's state-dict load."""
    for optimizer in checkpoint.get("optimizer_states") or ():
        for state in optimizer.get("state", {}).values():
            for name in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                if torch.is_tensor(state.get(name)) and state[name].dim() == 0:
                    state[name] = state[name].reshape(1)


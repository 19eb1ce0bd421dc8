"""The training options of DiffexpLM that are plain settings: the optimizer and schedule, the AR-Hit split."""

from __future__ import annotations

from dataclasses import dataclass

from diffexp.errors import UserError, invalid
from diffexp.training.loss_slices import DEFAULT_TOP_PERCENT


@dataclass
class OptimConfig:
    """AdamW with linear warmup then cosine decay to min_lr_ratio * lr.

    Args:
        lr: peak learning rate.
        weight_decay: applied to matrices only (not norms, lambda vectors or other 1-d parameters).
        betas: AdamW betas.
        eps: AdamW epsilon.
        warmup_steps: linear warmup from 0 to lr.
        min_lr_ratio: the cosine ends at this fraction of lr.
        schedule_steps: steps the warmup + cosine spans; null means trainer.max_steps. Set it to a run's
            planned steps to train on past them (a resume with a larger max_steps): the lr then stays at
            min_lr_ratio * lr instead of the whole cosine being stretched.
    """

    lr: float = 1e-3
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    schedule_steps: int | None = None

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)
        if not self.lr > 0:
            raise invalid("model.optim.lr", self.lr, "expected a positive number")
        if not self.weight_decay >= 0:
            raise invalid("model.optim.weight_decay", self.weight_decay, "expected a number >= 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise invalid("model.optim.betas", list(self.betas), "expected two numbers in [0, 1)")
        if not self.eps > 0:
            raise invalid("model.optim.eps", self.eps, "expected a positive number")
        if self.warmup_steps < 0:
            raise invalid("model.optim.warmup_steps", self.warmup_steps, "expected an integer >= 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise invalid("model.optim.min_lr_ratio", self.min_lr_ratio, "expected a number in [0, 1]")
        if self.schedule_steps is not None and self.schedule_steps <= 0:
            raise invalid("model.optim.schedule_steps", self.schedule_steps,
                          "expected a positive number of steps, or null (trainer.max_steps)")


@dataclass
class ARHitConfig:
    """AR-Hit / Others split of the validation loss (docs/evaluations.md).

    A target is an AR-Hit when its bigram already occurred earlier in the sequence and is not frequent in the
    training split; every other target counts as Others (the papers' Table 6, after zoology).

    Args:
        enabled: log val/loss_ar_hit, val/loss_others and val/share_ar_hit on text batches.
        exclude_frequent: leave bigrams frequent in the training split out of the hits (the default, as in
            the papers). Frequent means, unless min_count or top_percent says otherwise, the top 1 % of the
            distinct bigrams of the training split by count (counted over at most 2^25 tokens of evenly
            spaced training rows). false: every repeated bigram is a hit (min_count and top_percent must be
            null), as in checkpoints saved without this option.
        min_count: instead of the top 1 %: a bigram seen at least this often in the training split is frequent.
        top_percent: instead of the top 1 %: the top_percent % most frequent distinct training bigrams.
    """

    enabled: bool = True
    exclude_frequent: bool = True
    min_count: int | None = None
    top_percent: float | None = None

    def __post_init__(self) -> None:
        if self.min_count is not None and self.top_percent is not None:
            raise UserError(f"model.ar_hit.min_count={self.min_count!r} and model.ar_hit.top_percent="
                            f"{self.top_percent!r}: give one of them, not both")
        if not self.exclude_frequent and (self.min_count is not None or self.top_percent is not None):
            given = "min_count" if self.min_count is not None else "top_percent"
            raise UserError(f"model.ar_hit.exclude_frequent=False and model.ar_hit.{given}="
                            f"{getattr(self, given)!r}: a threshold for frequent bigrams needs "
                            "exclude_frequent true; with false every repeated bigram is a hit")
        if self.min_count is not None and self.min_count < 1:
            raise invalid("model.ar_hit.min_count", self.min_count, "expected an integer >= 1")
        if self.top_percent is not None and not 0 < self.top_percent < 100:
            raise invalid("model.ar_hit.top_percent", self.top_percent, "expected a number in (0, 100)")

    def threshold(self) -> dict[str, float] | None:
        """The frequent_bigrams arguments ({"min_count": n} or {"top_percent": p}), None for no exclusion."""
        if not self.exclude_frequent:
            return None
        if self.min_count is not None:
            return {"min_count": self.min_count}
        return {"top_percent": DEFAULT_TOP_PERCENT if self.top_percent is None else self.top_percent}

"""The compute of a recipe's whole run: its tokens, its FLOPs and the wall time they take on H100s.

FLOPs are the model's logical training FLOPs (Decoder.flops_per_token: 3 x forward, causal attention) times the
tokens the run trains on (trainer.max_steps x sequences per step x data.seq_len). The wall time assumes a model
FLOPs utilisation in llm-foundry's published range for GPT-style models on H100s (35-42%) until diffexp has
measured its own, and scales ideally from 1 GPU to 8 (the global batch, so the FLOPs, stay the same).
"""

from __future__ import annotations

from dataclasses import dataclass

#: H100 SXM bf16 dense peak, TFLOP/s (NVIDIA's datasheet, without sparsity)
H100_BF16_TFLOPS = 989.0
#: llm-foundry's measured MFU range for its MPT/GPT models on H100 (bf16): the wall time is given for both ends
MFU_RANGE = (0.42, 0.35)
GPU_COUNTS = (1, 8)
ASSUMPTION = (f"at {MFU_RANGE[0]:.0%}-{MFU_RANGE[1]:.0%} MFU of {H100_BF16_TFLOPS:.0f} TFLOP/s "
              "(H100 bf16 dense; llm-foundry's range)")


@dataclass(frozen=True)
class RunBudget:
    """What one run trains on and what it costs."""

    steps: int
    rows: int  # sequences per optimizer step, all processes together
    seq_len: int
    flops_per_token: float  # training: forward + backward

    @property
    def tokens(self) -> int:
        return self.steps * self.rows * self.seq_len

    @property
    def flops(self) -> float:
        return self.tokens * self.flops_per_token

    def seconds(self, gpus: int, mfu: float) -> float:
        return self.flops / (gpus * mfu * H100_BF16_TFLOPS * 1e12)

    def wall_time(self, gpus: int) -> str:
        """'1.9-2.3 h': the time on `gpus` H100s at the high and the low end of MFU_RANGE."""
        return duration_range(*(self.seconds(gpus, mfu) for mfu in MFU_RANGE))

    def describe(self) -> str:
        times = ", ".join(f"{gpus} H100 {self.wall_time(gpus)}" for gpus in GPU_COUNTS)
        return (f"{self.tokens / 1e9:.2f}B tokens ({self.steps} steps x {self.rows} x {self.seq_len}), "
                f"{self.flops:.3g} FLOPs; {times}")


def duration_range(fast: float, slow: float) -> str:
    """Two durations in seconds in the unit that suits the slower: minutes, hours or days."""
    for unit, seconds in (("min", 60), ("h", 3600), ("d", 86400)):
        if slow / seconds < {"min": 60, "h": 72, "d": float("inf")}[unit]:
            return f"{_number(fast / seconds)}-{_number(slow / seconds)} {unit}"
    raise AssertionError("unreachable")


def _number(value: float) -> str:
    return f"{value:.1f}" if value < 10 else f"{value:.0f}"


def run_budget(config, arch, model=None) -> RunBudget | None:
    """The budget of a parsed fit config whose model is `arch` (a ModelConfig; `model`: its Decoder when one
    is built already); None when the run is not bounded by steps (trainer.max_steps unset or -1). Without
    global_batch.rows a step is data.batch_size x trainer.accumulate_grad_batches rows of one process."""
    import torch

    from diffexp.model import Decoder
    from diffexp.training.preflight import data_init_args
    from diffexp.training.values import to_builtin

    trainer = to_builtin(config.get("trainer") or {})
    steps = trainer.get("max_steps")
    if steps is None or steps <= 0:
        return None
    data = data_init_args(config)[1]
    rows = to_builtin(config.get("global_batch") or {}).get("rows")
    if rows is None:
        rows = int(data.get("batch_size") or 1) * int(trainer.get("accumulate_grad_batches") or 1)
    seq_len = int(data.get("seq_len") or arch.max_seq_len)
    if model is None:
        with torch.device("meta"):
            model = Decoder(arch)
    flops_per_token = model.flops_per_token(seq_len, training=True)
    return RunBudget(int(steps), int(rows), seq_len, flops_per_token)



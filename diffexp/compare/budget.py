"""The compute of a recipe's whole run: its tokens, its FLOPs and its wall time, priced by a measured fit.

FLOPs are the model's logical training FLOPs (Decoder.flops_per_token: 3 x forward, causal attention) times the
tokens the run trains on (trainer.max_steps x sequences per step x data.seq_len). The wall time divides them by
the FLOP rate per GPU that a real `diffexp fit` reached: the last record of bench/fits.json (what ran, machine,
commit, model, tokens/s), its FLOPs per token counted the same way. Another size or variant is so priced at the
measured fit's FLOP/s (a variant whose kernels run faster or slower than the measured one's is off by that
ratio), and 8 GPUs at 8 times one GPU's rate (the global batch, so the FLOPs, stay the same).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

#: the measured fits, newest last (a source checkout's bench/; an installed package has none: no times then)
FITS = Path(__file__).resolve().parents[2] / "bench" / "fits.json"
GPU_COUNTS = (1, 8)


@dataclass(frozen=True)
class MeasuredFit:
    """One record of bench/fits.json: a `diffexp fit` whose tokens/s prices every estimate."""

    name: str  # short, for the lines that cite it
    what: str  # in full: recipe, settings, data, steps
    machine: str
    software: str
    gpu: str  # the GPU's short name, for the estimates' column heads: "H100"
    gpus: int
    commit: str
    date: str
    recorded_in: str
    model: tuple[tuple[str, object], ...]  # the ModelConfig fields that differ from the defaults
    seq_len: int
    tokens_per_s: float

    @property
    def flops_per_token(self) -> float:
        return _training_flops_per_token(self.model, self.seq_len)

    @property
    def flops_per_s_per_gpu(self) -> float:
        return self.tokens_per_s * self.flops_per_token / self.gpus

    def basis(self) -> str:
        """What the estimates rest on, in one line."""
        return (f"at {self.flops_per_s_per_gpu / 1e12:.1f} TFLOP/s per GPU, the rate of the measured {self.name} on "
                f"{self.machine} at commit {self.commit} ({self.tokens_per_s:,.0f} tokens/s; bench/fits.json)")


@functools.cache
def _training_flops_per_token(model: tuple[tuple[str, object], ...], seq_len: int) -> float:

    from diffexp.model import Decoder
    from diffexp.model.config import ModelConfig
    from diffexp.model.meta import building_on_meta

    with building_on_meta():
        return Decoder(ModelConfig(**dict(model), backend="sdpa")).flops_per_token(seq_len, training=True)


def measured_fit(path: Path | None = None) -> MeasuredFit | None:
    """The newest measured fit (the last record of `path`, default FITS), or None where the file is absent (an
    installed package)."""
    path = FITS if path is None else path
    if not path.is_file():
        return None
    record = json.loads(path.read_text(encoding="utf-8"))[-1]
    fields = {name: record[name] for name in MeasuredFit.__dataclass_fields__}
    return MeasuredFit(**{**fields, "model": tuple(sorted(record["model"].items())),
                          "tokens_per_s": float(record["tokens_per_s"])})


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

    def seconds(self, gpus: int, fit: MeasuredFit) -> float:
        return self.flops / (gpus * fit.flops_per_s_per_gpu)

    def wall_time(self, gpus: int, fit: MeasuredFit | None) -> str:
        """'7.4 h': the time on `gpus` GPUs of the measured fit's kind ('' without a measured fit)."""
        return "" if fit is None else duration(self.seconds(gpus, fit))

    def describe(self, fit: MeasuredFit | None) -> str:
        times = "" if fit is None else "; " + ", ".join(
            f"{gpus} {fit.gpu} {self.wall_time(gpus, fit)}" for gpus in GPU_COUNTS)
        return (f"{self.tokens / 1e9:.2f}B tokens ({self.steps} steps x {self.rows} x {self.seq_len}), "
                f"{self.flops:.3g} FLOPs{times}")


def duration(seconds: float) -> str:
    """A duration in the unit that suits it: minutes, hours or days."""
    for unit, size in (("min", 60), ("h", 3600), ("d", 86400)):
        if seconds / size < {"min": 60, "h": 72, "d": float("inf")}[unit]:
            return f"{_number(seconds / size)} {unit}"
    raise AssertionError("unreachable")


def _number(value: float) -> str:
    return f"{value:.1f}" if value < 10 else f"{value:.0f}"


def run_budget(config, arch, model=None) -> RunBudget | None:
    """The budget of a parsed fit config whose model is `arch` (a ModelConfig; `model`: its Decoder when one
    is built already); None when the run is not bounded by steps (trainer.max_steps unset or -1). Without
    global_batch.rows a step is data.batch_size x trainer.accumulate_grad_batches rows of one process."""

    from diffexp.model import Decoder
    from diffexp.model.meta import building_on_meta
    from diffexp.training.values import data_init_args, to_builtin

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
        with building_on_meta():
            model = Decoder(arch)
    flops_per_token = model.flops_per_token(seq_len, training=True)
    return RunBudget(int(steps), int(rows), seq_len, flops_per_token)

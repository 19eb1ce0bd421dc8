"""The side-by-side timing scheme every bench kind shares (bench/README.md tells why).

After one untimed run each, the variants take turns run by run in rounds, rotated per round and warmed up first,
so machine noise hits every variant alike. A ratio is the median over runs of the reference's time over the
variant's in the same place of the same round (runs a few apart, so a change in the machine's speed between them is
small); its spread, the range of the per-round medians of those ratios.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from typing import Protocol

from diffexp.bench.memory import measure_peaks
from diffexp.bench.profile import profile_runs
from diffexp.bench.progress import ProgressReporter

#: how add_ratio estimates a ratio, as the results JSON records it; runs before it recorded none used EARLIER
RATIO_ESTIMATOR = "median of paired runs"
EARLIER_RATIO_ESTIMATOR = "median / median"
#: the coverage of a ratio's confidence interval
CONFIDENCE = 0.95

#: samples[runner][measure][round] = the seconds of each timed run
Samples = dict[str, dict[str, list[list[float]]]]


class Runner(Protocol):
    def run(self) -> None:
        """One untimed run, synchronised (first run and warm-up)."""

    def timed(self) -> dict[str, float]:
        """One timed run: seconds per named measure."""


class Stopwatch:
    """Wall and process CPU seconds between synchronised points (CUDA work is waited for)."""

    def __init__(self, device) -> None:
        self.device = device
        self.wall = self.cpu = 0.0

    def sync(self) -> None:
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)

    def start(self) -> None:
        self.sync()
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def lap(self) -> tuple[float, float]:
        """(wall, CPU) seconds since start or the previous lap."""
        self.sync()
        wall, cpu = time.perf_counter(), time.process_time()
        elapsed = (wall - self.wall, cpu - self.cpu)
        self.wall, self.cpu = wall, cpu
        return elapsed


def runs_per_variant(args) -> int:
    """Runs `measure` makes per runner (for the progress total): interleaved, plus one for memory and one for
    --profile."""
    return 1 + args.rounds * (args.warmup + args.steps) + (0 if args.no_memory else 1) + (1 if args.profile else 0)


def rotated(items: list[str], r: int) -> list[str]:
    r %= len(items)
    return items[r:] + items[:r]


def interleaved(runners: Mapping[str, Runner], args, progress: ProgressReporter, label: str,
                headline: str, on_round: Callable[[Samples], None] | None = None) -> Samples:
    """First run, then args.rounds rounds of args.warmup untimed and args.steps timed runs per runner,
    interleaved run by run and rotated per round. `headline` is the measure logged after each round; on_round,
    called after each round with the samples of the rounds finished, lets a run stopped later keep them."""
    names = list(runners)
    for name in names:
        runners[name].run()
        progress.advance(f"{label} first step {name}")
    samples: Samples = {name: {} for name in names}
    for r in range(args.rounds):
        order = rotated(names, r)
        with collector_paused():
            round_samples = _round(runners, order, args, progress, f"{label} round {r + 1}/{args.rounds}")
        for name, measures in round_samples.items():
            for measure, seconds in measures.items():
                samples[name].setdefault(measure, [[] for _ in range(args.rounds)])[r].extend(seconds)
        summary = ", ".join(f"{name} {_milliseconds(statistics.median(samples[name][headline][r]))}" for name in order)
        progress.log(f"{label} round {r + 1}/{args.rounds} median ms: {summary}")
        if on_round is not None and r + 1 < args.rounds:
            on_round({name: {measure: rounds[:r + 1] for measure, rounds in measures.items()}
                      for name, measures in samples.items()})
    return samples


def _milliseconds(seconds: float) -> str:
    """Two decimals below 10 ms (a CPU decoding step takes 1-3 ms), whole milliseconds above."""
    ms = seconds * 1e3
    return f"{ms:.2f}" if ms < 10 else f"{ms:.0f}"


@contextmanager
def collector_paused():
    """Python's garbage collector off for a round, as timeit does: a collection that lands inside one variant's
    run would charge it a pause that has nothing to do with its model. A full collection first."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _round(runners: Mapping[str, Runner], order: list[str], args, progress: ProgressReporter,
           label: str) -> dict[str, dict[str, list[float]]]:
    """One round: args.warmup untimed runs, then args.steps timed runs, each interleaved run by run in `order`."""
    samples: dict[str, dict[str, list[float]]] = {name: {} for name in order}
    for _ in range(args.warmup):
        for name in order:
            runners[name].run()
            progress.advance(f"{label} warm-up {name}")
    for s in range(args.steps):
        for name in order:
            for measure, seconds in runners[name].timed().items():
                samples[name].setdefault(measure, []).append(seconds)
            progress.advance(f"{label} step {s + 1} {name}")
    return samples


def measure(runners: Mapping[str, Runner], args, progress: ProgressReporter, label: str,
            headline: str, on_round: Callable[[Samples], None] | None = None
            ) -> tuple[Samples, dict[str, int | None], dict[str, dict]]:
    """`interleaved` timing, then each runner's peak memory (None without memory runs) and, with --profile, where
    one run's time goes (diffexp.bench.profile; empty without)."""
    samples = interleaved(runners, args, progress, label, headline, on_round)
    peaks = measure_peaks(runners, not args.no_memory, progress, label)
    if not args.profile:
        return samples, peaks, {}
    import torch

    return samples, peaks, profile_runs(runners, args.profile, torch.device(args.device), progress, label)


def add_ratio(entry: dict, base: dict, times: str, median: str, ratio: str) -> None:
    """Median of entry[times] (all rounds) and per round, and the ratio to the reference's times, in place.

    The ratio pairs each of the variant's runs with the reference's run in the same place of the same round, and
    takes the median of reference / variant over all pairs. A pooled median / pooled median would mix runs from
    before and after a change in the machine's speed; a pair's runs are a few runs apart.
    Sets entry[median], entry["round_" + median], entry[ratio], entry["round_" + ratio + "s"],
    entry[ratio + "_min"] and entry[ratio + "_max"] (the spread of the per-round ratios), and entry[ratio + "_ci"],
    the CONFIDENCE interval of the pairs' median (None for fewer than 6 pairs).
    """
    paired = [[b / x for b, x in zip(base_round, own_round, strict=True)]
              for base_round, own_round in zip(base[times], entry[times], strict=True)]
    round_ratios = [statistics.median(rnd) for rnd in paired]
    entry[median] = statistics.median(t for rnd in entry[times] for t in rnd)
    entry[f"round_{median}"] = [statistics.median(rnd) for rnd in entry[times]]
    entry[ratio] = statistics.median(r for rnd in paired for r in rnd)
    entry[f"round_{ratio}s"] = round_ratios
    entry[f"{ratio}_min"] = min(round_ratios)
    entry[f"{ratio}_max"] = max(round_ratios)
    entry[f"{ratio}_ci"] = median_interval([r for rnd in paired for r in rnd])


def median_interval(values: list[float], confidence: float = CONFIDENCE) -> list[float] | None:
    """A distribution-free interval for the median of what `values` sample: order statistics k and n + 1 - k
    (1-based), k the largest with P(Binomial(n, 1/2) < k) <= (1 - confidence) / 2. None for too few values
    (fewer than 6 at 95%)."""
    n, ordered = len(values), sorted(values)
    k, below = 0, 0.0  # below: P(Binomial(n, 1/2) < k + 1)
    while True:
        below += math.comb(n, k) / 2 ** n
        if below > (1 - confidence) / 2:
            break
        k += 1
    return None if k == 0 else [ordered[k - 1], ordered[n - k]]


def add_flop_rate_ratio(entry: dict, base: dict, flops: str, ratio: str) -> None:
    """entry["flop_rate_ratio"] = the variant's FLOPs/s over the reference's: speed ratio x FLOPs ratio (same
    tokens per step), overall and per round, with the per-round spread; set after `add_ratio`."""
    work = entry[flops] / base[flops]
    entry["flop_rate_ratio"] = entry[ratio] * work
    entry["round_flop_rate_ratios"] = [r * work for r in entry[f"round_{ratio}s"]]
    entry["flop_rate_ratio_min"] = min(entry["round_flop_rate_ratios"])
    entry["flop_rate_ratio_max"] = max(entry["round_flop_rate_ratios"])


def add_mem_ratio(entry: dict, base: dict) -> None:
    peak, base_peak = entry["peak_bytes"], base["peak_bytes"]
    entry["mem_ratio"] = peak / base_peak if peak and base_peak else None


def throughput(entry: dict, flops: str, seconds: str, peak_flops_per_s: float | None, prefix: str = "") -> None:
    """entry[prefix + "tflops_per_s"] = entry[flops] / entry[seconds] and, with a peak, entry[prefix + "mfu"]."""
    rate = entry[flops] / entry[seconds]
    entry[f"{prefix}tflops_per_s"] = rate / 1e12
    entry[f"{prefix}mfu"] = rate / peak_flops_per_s if peak_flops_per_s else None

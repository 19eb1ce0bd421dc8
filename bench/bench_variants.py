"""Training-step cost of every attention variant relative to the baseline, measured side by side.

One *step* is what training does per batch: forward, cross-entropy on next tokens, backward,
AdamW step (and zero_grad). For each sequence length every variant's model is built once, then
the step time is measured in ``--rounds`` rounds; all variants share one run, one input batch and
one machine state, so the ratios to the baseline stay meaningful on a noisy machine:

* Interleaving: inside a round the variants take turns step by step (baseline, diff_v1, diff_v2,
  shared_diff, dint, baseline, ...), so a burst of load from another process hits every variant
  about equally instead of one variant's whole block.
* Rotation: round r starts the turn order at variant r, so no variant is always first (cold) or
  last.
* Warm-up: each round begins with ``--warmup`` untimed interleaved steps per variant.
* Medians: the step time of a variant is the median of all its timed steps; its ratio is
  ``baseline median / variant median`` (= tokens/s relative to the baseline, as both process the
  same tokens per step). The spread is the min..max of the same ratio computed per round (each
  round's median): a wide spread means the machine was too noisy to trust the digits.

Peak memory is the peak of live tensor bytes during one step, counting the model's persistent
state (parameters, buffers, AdamW moments) plus everything the step allocates (activations,
gradients, optimizer temporaries):

* CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, minus what was
  allocated before the step (the other variants' models live on the device too), plus this
  model's persistent state.
* CPU: there is no allocator statistics API, so one untimed step runs under ``torch.profiler``
  with ``profile_memory=True``; every allocation and free of the CPU allocator is an event with
  a signed byte count, and the running sum's maximum is the step's peak. This is chosen over the
  peak RSS of a fresh subprocess because (1) it measures the same quantity as the CUDA number
  (live tensor bytes), so CPU and GPU memory ratios mean the same thing; (2) it is exact and
  deterministic: it does not depend on glibc's arenas and trim thresholds, on the OpenMP/oneDNN
  thread pools or on the ~300 MiB that importing torch maps, which would swamp a tiny model's
  activations in RSS; (3) it needs no extra process per measurement (importing torch again costs
  seconds on a loaded 2-core machine). What it does not see: memory that libraries allocate
  outside PyTorch's allocator (e.g. oneDNN scratchpads), which is small and the same for all
  variants.

Default batch: on CPU the batch is capped at ``--tokens-per-batch`` (default 2048 = 8 x 256)
tokens, so seq 256 runs at batch 8 and seq 1024 at batch 2; this keeps the default run (5
variants, seq 256 and 1024) within about 10 minutes on 2 cores. On CUDA there is no cap unless
given. Ratios compare variants at the same batch, so the cap does not bias them.

Usage:
    python bench/bench_variants.py                                  # CPU, defaults
    python bench/bench_variants.py --variants baseline dint --seq-lens 512
    python bench/bench_variants.py --device cuda --dtype bf16 --seq-lens 2048 4096 8192 \
        --batch-size 4 --d-model 1024 --n-layers 8 --n-heads 8
    python bench/bench_variants.py --compare bench/results/20250101-120000.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

# Per-variant overrides on top of the shared model shape: the tiny recipes' matched parameter
# budgets (recipes/tiny/*.yaml). Edit here to benchmark other settings.
VARIANT_OVERRIDES: dict[str, dict] = {
    "baseline": {},
    "diff_v1": {},
    "diff_v2": {"n_kv_heads": 2},
    "shared_diff": {"rank": 8},
    "dint": {},
}
BASELINE = "baseline"

DEFAULT_SHAPE = {"d_model": 128, "n_layers": 4, "n_heads": 4, "vocab_size": 256}
DEFAULT_CPU_TOKENS_PER_BATCH = 2048
MIB = 2**20
SEED = 1234


# --------------------------------------------------------------------------------------------------
# arguments
# --------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench_variants.py",
        description="Time and peak memory of one training step per attention variant, relative to "
                    "the baseline measured in the same run.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--variants", nargs="+", default=list(VARIANT_OVERRIDES), metavar="NAME",
                   help=f"variants to measure; the baseline is always added. One of: "
                        f"{', '.join(VARIANT_OVERRIDES)}")
    p.add_argument("--seq-lens", nargs="+", type=int, default=[256, 1024], metavar="T")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--tokens-per-batch", type=int, default=None,
                   help="cap batch so batch*seq <= this (at least 1 sequence); 0 = no cap. "
                        f"Default: {DEFAULT_CPU_TOKENS_PER_BATCH} on cpu, no cap on cuda")
    p.add_argument("--d-model", type=int, default=DEFAULT_SHAPE["d_model"])
    p.add_argument("--n-layers", type=int, default=DEFAULT_SHAPE["n_layers"])
    p.add_argument("--n-heads", type=int, default=DEFAULT_SHAPE["n_heads"])
    p.add_argument("--vocab-size", type=int, default=DEFAULT_SHAPE["vocab_size"])
    p.add_argument("--steps", type=int, default=3, help="timed steps per variant per round")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per variant per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="bf16 = autocast mixed precision (fp32 weights and optimizer state)")
    p.add_argument("--backend", choices=("sdpa", "eager", "flash_attn"), default="sdpa")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's default)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory step")
    p.add_argument("--json", type=Path, default=None, metavar="PATH",
                   help="where to write the results (default: bench/results/<timestamp>.json)")
    p.add_argument("--peak-tflops", type=float, default=None, metavar="TF",
                   help="the device's peak TFLOP/s at --dtype for MFU (default: Lightning's table for known GPUs)")
    p.add_argument("--compare", type=Path, default=None, metavar="PATH",
                   help="JSON of an earlier run: print how the ratios changed")
    return p


def validate_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fail before any work with a message that names the bad value."""
    allowed = ", ".join(VARIANT_OVERRIDES)
    for name in args.variants:
        if name not in VARIANT_OVERRIDES:
            parser.error(f"--variants: unknown variant {name!r}; allowed: {allowed}")
    variants = [BASELINE] + [v for v in dict.fromkeys(args.variants) if v != BASELINE]
    if BASELINE not in args.variants:
        print(f"note: adding {BASELINE!r} to --variants (ratios are relative to it)", file=sys.stderr)
    args.variants = variants

    positive = {"--seq-lens": args.seq_lens, "--batch-size": [args.batch_size], "--d-model": [args.d_model],
                "--n-layers": [args.n_layers], "--n-heads": [args.n_heads], "--vocab-size": [args.vocab_size],
                "--steps": [args.steps], "--rounds": [args.rounds]}
    if args.threads is not None:
        positive["--threads"] = [args.threads]
    for flag, values in positive.items():
        for value in values:
            if value <= 0:
                parser.error(f"{flag}: expected a positive integer, got {value}")
    if args.warmup < 0:
        parser.error(f"--warmup: expected 0 or more, got {args.warmup}")
    if args.tokens_per_batch is not None and args.tokens_per_batch < 0:
        parser.error(f"--tokens-per-batch: expected 0 (no cap) or more, got {args.tokens_per_batch}")
    args.seq_lens = sorted(dict.fromkeys(args.seq_lens))

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device cuda: CUDA is not available to this torch ({torch.__version__}, "
                     f"built with CUDA {torch.version.cuda}); use --device cpu")
    if args.device == "cuda" and args.dtype == "bf16" and not torch.cuda.is_bf16_supported():
        parser.error("--dtype bf16: this GPU does not support bfloat16")
    if args.backend == "flash_attn":
        if args.device != "cuda":
            parser.error("--backend flash_attn needs --device cuda")
        try:
            import flash_attn  # noqa: F401
        except ImportError:
            parser.error("--backend flash_attn: the flash-attn package is not installed "
                         "(pip install 'diffexp[flash]'); use --backend sdpa")
    if args.peak_tflops is not None and args.peak_tflops <= 0:
        parser.error(f"--peak-tflops: expected a positive number, got {args.peak_tflops}")
    if args.tokens_per_batch is None:
        args.tokens_per_batch = DEFAULT_CPU_TOKENS_PER_BATCH if args.device == "cpu" else 0

    # every variant's config must be valid for the chosen shape
    from diffexp import ModelConfig

    for variant in args.variants:
        try:
            model_config(args, variant)
        except (ValueError, TypeError) as err:
            parser.error(f"variant {variant!r} with --d-model {args.d_model} --n-heads {args.n_heads}: {err}")
        _ = ModelConfig  # imported above to fail early if the package is broken

    if args.compare is not None:
        try:
            args.compare_data = load_results(args.compare)
        except (OSError, ValueError, KeyError) as err:
            parser.error(f"--compare {args.compare}: cannot read an earlier result: {err}")
    else:
        args.compare_data = None
    if args.json is None:
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        args.json = REPO_ROOT / "bench" / "results" / f"{stamp}.json"
    try:
        args.json.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        parser.error(f"--json {args.json}: cannot create its folder: {err}")


def model_config(args: argparse.Namespace, variant: str):
    from diffexp import ModelConfig

    fields = {"d_model": args.d_model, "n_layers": args.n_layers, "n_heads": args.n_heads,
              "vocab_size": args.vocab_size, "max_seq_len": max(args.seq_lens), "backend": args.backend}
    fields.update(VARIANT_OVERRIDES[variant])
    return ModelConfig(attention=variant, **fields)


def batch_for(seq_len: int, args: argparse.Namespace) -> int:
    if not args.tokens_per_batch:
        return args.batch_size
    return max(1, min(args.batch_size, args.tokens_per_batch // seq_len))


# --------------------------------------------------------------------------------------------------
# one variant's model, optimizer and step
# --------------------------------------------------------------------------------------------------
class StepRunner:
    def __init__(self, args: argparse.Namespace, variant: str, tokens, device) -> None:
        import torch

        from diffexp import Decoder

        torch.manual_seed(SEED)
        self.torch = torch
        self.variant = variant
        self.device = device
        self.cfg = model_config(args, variant)
        self.model = Decoder(self.cfg).to(device)
        self.model.train()
        self.params = self.model.parameter_report()
        # model FLOPs of one training step (forward + backward, causal attention counted once)
        self.flops_per_step = tokens.shape[0] * (tokens.shape[1] - 1) * self.model.flops_per_token(
            tokens.shape[1] - 1, training=True)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.1)
        self.inputs, self.targets = tokens[:, :-1], tokens[:, 1:]
        self.autocast = args.dtype == "bf16"

    def step(self) -> None:
        torch = self.torch
        ctx = (torch.autocast(self.device.type, dtype=torch.bfloat16) if self.autocast
               else contextlib.nullcontext())
        with ctx:
            logits = self.model(self.inputs)
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                 self.targets.reshape(-1))
        loss.backward()
        self.opt.step()
        # at the end, so no gradient outlives the step (the CPU memory count starts from none)
        self.opt.zero_grad(set_to_none=True)

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def timed_step(self) -> tuple[float, float]:
        """(wall seconds, process CPU seconds) of one synchronised step."""
        self.sync()
        wall0, cpu0 = time.perf_counter(), time.process_time()
        self.step()
        self.sync()
        return time.perf_counter() - wall0, time.process_time() - cpu0

    def state_bytes(self) -> int:
        """Bytes that live across steps: parameters, buffers, optimizer state."""
        tensors = {}
        for t in list(self.model.parameters()) + list(self.model.buffers()):
            tensors[id(t)] = t
        for state in self.opt.state.values():
            for value in state.values():
                if self.torch.is_tensor(value):
                    tensors[id(value)] = value
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def peak_bytes(self) -> int | None:
        """Peak live tensor bytes during one (untimed) step, persistent state included."""
        torch = self.torch
        if self.device.type == "cuda":
            self.sync()
            gc.collect()
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
            self.step()
            self.sync()
            extra = torch.cuda.max_memory_allocated(self.device) - before
            return self.state_bytes() + max(0, extra)
        extra = cpu_step_peak_extra(self.step)
        return None if extra is None else self.state_bytes() + extra


def cpu_step_peak_extra(fn) -> int | None:
    """Max of the running sum of CPU allocator events (+alloc / -free) while fn runs."""
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    with _drop_kineto_log_lines(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    try:
        events = prof.profiler.kineto_results.events()
    except AttributeError:  # internal API moved: report n/a rather than a wrong number
        return None
    mem = sorted((e.start_ns(), e.nbytes()) for e in events
                 if e.name() == "[memory]" and str(e.device_type()).endswith("CPU"))
    live = peak = 0
    for _, nbytes in mem:
        live += nbytes
        peak = max(peak, live)
    return peak


@contextlib.contextmanager
def _drop_kineto_log_lines():
    """Kineto writes "USDT: ... profiler_start/stop" to fd 2 on every profile; pass the rest through."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    import tempfile

    with tempfile.TemporaryFile(mode="w+b") as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            for line in capture.read().decode(errors="replace").splitlines():
                if not line.startswith("USDT:"):
                    print(line, file=sys.stderr)


# --------------------------------------------------------------------------------------------------
# progress on stderr
# --------------------------------------------------------------------------------------------------
class ProgressReporter:
    """A rich progress bar when stderr is a terminal, else one line per round / measurement."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.start = total, 0, time.perf_counter()
        self.bar = None
        if sys.stderr.isatty():
            try:
                from rich.console import Console
                from rich.progress import (
                    BarColumn,
                    Progress,
                    TextColumn,
                    TimeElapsedColumn,
                    TimeRemainingColumn,
                )

                self.bar = Progress(TextColumn("{task.description:<40}"), BarColumn(),
                                    TextColumn("{task.completed}/{task.total} steps"),
                                    TimeElapsedColumn(), TimeRemainingColumn(),
                                    console=Console(file=sys.stderr), transient=True)
                self.task = self.bar.add_task("starting", total=total)
                self.bar.start()
            except ImportError:
                self.bar = None

    def advance(self, description: str, n: int = 1) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(self.task, advance=n, description=description)

    def log(self, message: str) -> None:
        elapsed = time.perf_counter() - self.start
        eta = elapsed / self.done * (self.total - self.done) if self.done else float("nan")
        line = f"[{_fmt_s(elapsed)} elapsed, ~{_fmt_s(eta)} left] {message}"
        if self.bar is not None:
            self.bar.console.print(line, highlight=False)
        else:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _fmt_s(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"


# --------------------------------------------------------------------------------------------------
# the measurement
# --------------------------------------------------------------------------------------------------
def rotated(items: list[str], r: int) -> list[str]:
    r %= len(items)
    return items[r:] + items[:r]


def run_benchmark(args: argparse.Namespace) -> dict:
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    variants = args.variants
    n_mem = 0 if args.no_memory else 1
    per_variant_steps = 1 + args.rounds * (args.warmup + args.steps) + n_mem
    progress = ProgressReporter(total=len(args.seq_lens) * len(variants) * per_variant_steps)
    results: dict[str, dict] = {}
    try:
        for seq_len in args.seq_lens:
            batch = batch_for(seq_len, args)
            gen = torch.Generator().manual_seed(SEED + seq_len)
            tokens = torch.randint(0, args.vocab_size, (batch, seq_len + 1), generator=gen).to(device)
            progress.log(f"seq {seq_len}, batch {batch}: building {len(variants)} models")
            runners = {v: StepRunner(args, v, tokens, device) for v in variants}
            for v in variants:  # first step: AdamW allocates its state, kernels initialise
                runners[v].step()
                runners[v].sync()
                progress.advance(f"seq {seq_len} first step {v}")
            times = {v: [[] for _ in range(args.rounds)] for v in variants}
            cpu_times = {v: [[] for _ in range(args.rounds)] for v in variants}
            for r in range(args.rounds):
                order = rotated(variants, r)
                gc.collect()
                for _ in range(args.warmup):
                    for v in order:
                        runners[v].step()
                        runners[v].sync()
                        progress.advance(f"seq {seq_len} round {r + 1}/{args.rounds} warm-up {v}")
                for s in range(args.steps):
                    for v in order:
                        wall, cpu = runners[v].timed_step()
                        times[v][r].append(wall)
                        cpu_times[v][r].append(cpu)
                        progress.advance(f"seq {seq_len} round {r + 1}/{args.rounds} step {s + 1} {v}")
                summary = ", ".join(f"{v} {statistics.median(times[v][r]) * 1e3:.0f}" for v in order)
                progress.log(f"seq {seq_len} round {r + 1}/{args.rounds} median ms: {summary}")
            peaks = {}
            for v in variants:
                if args.no_memory:
                    peaks[v] = None
                    continue
                peaks[v] = runners[v].peak_bytes()
                progress.advance(f"seq {seq_len} memory {v}")
                shown = "n/a" if peaks[v] is None else f"{peaks[v] / MIB:.1f} MiB"
                progress.log(f"seq {seq_len} peak memory {v}: {shown}")
            for v in variants:
                results[f"{v}@{seq_len}"] = {
                    "variant": v, "seq_len": seq_len, "batch_size": batch,
                    "tokens_per_step": batch * seq_len,
                    "overrides": VARIANT_OVERRIDES[v], "params": runners[v].params,
                    "flops_per_step": runners[v].flops_per_step,
                    "times_s": times[v], "cpu_times_s": cpu_times[v],
                    "peak_bytes": peaks[v],
                }
            del runners, tokens
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        progress.close()
    summarise(results, variants, args.seq_lens, peak_flops(args))
    return results


def peak_flops(args: argparse.Namespace) -> float | None:
    """Peak FLOP/s for MFU: --peak-tflops, else Lightning's table for the GPU and dtype (None on CPU)."""
    if args.peak_tflops is not None:
        return args.peak_tflops * 1e12
    if args.device != "cuda":
        return None
    import torch
    from lightning.fabric.utilities.throughput import get_available_flops

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    return get_available_flops(torch.device("cuda"), dtype)


def summarise(results: dict, variants: list[str], seq_lens: list[int], peak_flops_per_s: float | None = None) -> None:
    """Medians, ratios to the baseline and their per-round spread, added to each entry in place."""
    for seq_len in seq_lens:
        base = results[f"{BASELINE}@{seq_len}"]
        base_all = statistics.median(t for rnd in base["times_s"] for t in rnd)
        base_rounds = [statistics.median(rnd) for rnd in base["times_s"]]
        for v in variants:
            entry = results[f"{v}@{seq_len}"]
            med = statistics.median(t for rnd in entry["times_s"] for t in rnd)
            rounds = [statistics.median(rnd) for rnd in entry["times_s"]]
            round_ratios = [b / x for b, x in zip(base_rounds, rounds, strict=True)]
            entry["median_step_s"] = med
            entry["round_median_step_s"] = rounds
            entry["speed_ratio"] = base_all / med
            entry["round_speed_ratios"] = round_ratios
            entry["speed_ratio_min"] = min(round_ratios)
            entry["speed_ratio_max"] = max(round_ratios)
            entry["tokens_per_s"] = entry["tokens_per_step"] / med
            entry["tflops_per_s"] = entry["flops_per_step"] / med / 1e12
            entry["mfu"] = entry["flops_per_step"] / med / peak_flops_per_s if peak_flops_per_s else None
            peak, base_peak = entry["peak_bytes"], base["peak_bytes"]
            entry["mem_ratio"] = peak / base_peak if peak and base_peak else None


# --------------------------------------------------------------------------------------------------
# environment, JSON, tables
# --------------------------------------------------------------------------------------------------
def git_info() -> dict:
    def git(*cmd: str) -> str | None:
        try:
            out = subprocess.run(["git", *cmd], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "dirty": None if status is None else bool(status)}


def environment(args: argparse.Namespace) -> dict:
    import torch

    env = {
        "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
        "device": args.device, "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "git": git_info(),
        "loadavg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    if args.device == "cuda":
        env["device_name"] = torch.cuda.get_device_name(0)
        env["cuda"] = torch.version.cuda
    else:
        env["device_name"] = platform.processor() or platform.machine()
    return env


def load_results(path: Path) -> dict:
    data = json.loads(Path(path).read_text())
    if "results" not in data or "config" not in data:
        raise ValueError("not a bench_variants.py result (no 'results'/'config')")
    return data


def _ratio_cell(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def result_rows(data: dict) -> list[list[str]]:
    rows = []
    cfg = data["config"]
    for seq_len in cfg["seq_lens"]:
        for v in cfg["variants"]:
            e = data["results"][f"{v}@{seq_len}"]
            peak = e["peak_bytes"]
            rows.append([
                v, str(seq_len), str(e["batch_size"]), f"{e['params']['non_embedding']:,}",
                f"{e['median_step_s'] * 1e3:.0f}", _ratio_cell(e["speed_ratio"]),
                f"{e['speed_ratio_min']:.2f}-{e['speed_ratio_max']:.2f}",
                "n/a" if peak is None else f"{peak / MIB:.1f}", _ratio_cell(e["mem_ratio"]),
                f"{e['tflops_per_s']:.3g}", "n/a" if e.get("mfu") is None else f"{100 * e['mfu']:.1f}%",
            ])
    return rows


RESULT_HEADERS = ["variant", "seq", "batch", "params (non-emb)", "step ms (median)",
                  "tokens/s vs base", "ratio spread (rounds)", "peak mem MiB", "mem vs base", "TFLOP/s", "MFU"]


def print_table(title: str, headers: list[str], rows: list[list[str]], caption: str = "") -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
        print(title)
        print("  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)))
        print("  ".join("-" * w for w in widths))
        for row in rows:
            print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
        if caption:
            print(caption)
        return
    table = Table(title=title, caption=caption, caption_justify="left")
    for i, h in enumerate(headers):
        table.add_column(h, justify="left" if i == 0 else "right")
    previous_seq = None
    for row in rows:
        if previous_seq is not None and row[1] != previous_seq:
            table.add_section()
        previous_seq = row[1]
        table.add_row(*row)
    Console(file=sys.stdout, width=max(140, Console().width), highlight=False).print(table)


def compare(old: dict, new: dict) -> None:
    """Ratio changes between an earlier run and this one, per (variant, seq) present in both."""
    keys = ("device", "device_name", "threads", "torch")
    diffs = [f"{k}: {old['env'].get(k)} -> {new['env'].get(k)}" for k in keys
             if old["env"].get(k) != new["env"].get(k)]
    for k in ("dtype", "backend", "d_model", "n_layers", "n_heads", "vocab_size", "variant_overrides"):
        if old["config"].get(k) != new["config"].get(k):
            diffs.append(f"{k}: {old['config'].get(k)} -> {new['config'].get(k)}")
    rows = []
    for key, e in new["results"].items():
        o = old["results"].get(key)
        if o is None:
            continue
        if o["batch_size"] != e["batch_size"]:
            diffs.append(f"batch at seq {e['seq_len']}: {o['batch_size']} -> {e['batch_size']}")

        def change(a: float | None, b: float | None) -> str:
            return "n/a" if not a or b is None else f"{(b / a - 1) * 100:+.1f}%"

        rows.append([e["variant"], str(e["seq_len"]), _ratio_cell(o["speed_ratio"]),
                     _ratio_cell(e["speed_ratio"]), change(o["speed_ratio"], e["speed_ratio"]),
                     f"{o['speed_ratio_min']:.2f}-{o['speed_ratio_max']:.2f}",
                     _ratio_cell(o.get("mem_ratio")), _ratio_cell(e.get("mem_ratio")),
                     change(o.get("mem_ratio"), e.get("mem_ratio"))])
    if not rows:
        print(f"\n--compare: no (variant, seq) in common with {new.get('compare_path')}")
        return
    commit = (old["env"].get("git") or {}).get("commit") or "?"
    caption = "A ratio change inside the old run's spread is noise, not a regression."
    if diffs:
        caption += "\nWARNING, the runs differ in: " + "; ".join(dict.fromkeys(diffs))
    print()
    print_table(f"Change vs {new.get('compare_path')} (commit {commit[:10]}, {old.get('created')})",
                ["variant", "seq", "old tok/s ratio", "new tok/s ratio", "change", "old spread",
                 "old mem ratio", "new mem ratio", "mem change"], rows, caption)


def main(argv: list[str] | None = None) -> int:
    if str(REPO_ROOT) not in sys.path:  # runnable from a checkout without `pip install -e .`
        sys.path.insert(0, str(REPO_ROOT))
    parser = build_parser()
    args = parser.parse_args(argv)
    validate_args(parser, args)
    env = environment(args)

    started = time.perf_counter()
    results = run_benchmark(args)
    env["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    env["wall_s"] = round(time.perf_counter() - started, 1)

    data = {
        "created": _dt.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name, *(sys.argv[1:] if argv is None else argv)]),
        "env": env,
        "config": {
            "variants": args.variants, "seq_lens": args.seq_lens, "batch_size": args.batch_size,
            "tokens_per_batch": args.tokens_per_batch, "d_model": args.d_model, "n_layers": args.n_layers,
            "n_heads": args.n_heads, "vocab_size": args.vocab_size, "steps": args.steps,
            "warmup": args.warmup, "rounds": args.rounds, "dtype": args.dtype, "backend": args.backend,
            "peak_flops": peak_flops(args),
            "variant_overrides": {v: VARIANT_OVERRIDES[v] for v in args.variants},
            "memory_method": None if args.no_memory else (
                "cuda max_memory_allocated" if args.device == "cuda"
                else "torch.profiler CPU allocator events"),
        },
        "results": results,
    }
    args.json.write_text(json.dumps(data, indent=1))

    threads, load = env["threads"], env["loadavg_start"]
    title = (f"Training step vs {BASELINE}: {args.device} ({env['device_name']}), {args.dtype}, "
             f"backend {args.backend}, {threads} threads, d_model {args.d_model}, {args.n_layers} layers, "
             f"{args.n_heads} heads; {args.rounds} rounds x {args.steps} steps")
    peak = data["config"]["peak_flops"]
    caption = ("tokens/s vs base = baseline median step time / variant median (>1 = faster than the "
               "baseline); spread = min-max of the same ratio per round; peak mem = live tensor bytes "
               "(state + step); TFLOP/s = model FLOPs (Decoder.flops_per_token, training) / step time; MFU = "
               f"that / the peak ({'n/a' if not peak else f'{peak / 1e12:g}'} TFLOP/s). "
               f"Wall time {env['wall_s']:.0f} s. Results: {args.json}")
    if load and env["loadavg_end"] and max(load[0], env["loadavg_end"][0]) > (env["cpu_count"] or 1):
        caption += (f"\nNOTE: load average {load[0]:.1f} -> {env['loadavg_end'][0]:.1f} on "
                    f"{env['cpu_count']} CPUs: other processes competed; trust ratios only within "
                    "their spread.")
    print_table(title, RESULT_HEADERS, result_rows(data), caption)
    if args.compare_data is not None:
        data["compare_path"] = str(args.compare)
        compare(args.compare_data, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())

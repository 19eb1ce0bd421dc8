"""`diffexp bench trainer`: what `diffexp fit` adds to a training step, against a plain loop of the same model.

Both sides train the model `diffexp fit` builds from the same recipe, on the same batches, each side of each round
in a fresh process; the overhead is the median over rounds of fit / plain - 1, with a distribution-free 95%
interval. Details: bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from diffexp.bench import report
from diffexp.bench.progress import ProgressReporter
from diffexp.bench.timing import median_interval
from diffexp.errors import UserError

NAME = "trainer"
ABOUT = "what diffexp fit (Lightning, callbacks, logging) adds to a plain training loop of the same model"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="diffexp bench trainer", description=ABOUT,
                                epilog="Arguments after `--` go to `diffexp fit` (e.g. -- --config recipe.yaml "
                                       "--model.arch.d_model 256).")
    p.add_argument("--steps", type=int, default=50,
                   help="timed steps per side and round (default 50: one diagnostics.every_n_steps interval, so the "
                        "diagnostics step counts at its real rate)")
    p.add_argument("--warmup", type=int, default=12,
                   help="untimed steps first, per side and round (default 12: past the first logging step at "
                        "trainer.log_every_n_steps 10, whose first-time costs are no per-step overhead)")
    p.add_argument("--rounds", type=int, default=6, help="rounds; the order of the sides alternates (default 6)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json", type=Path, default=None, help="results file (default bench/results/trainer-<time>.json)")
    p.add_argument("--profile", action="store_true", help="also one fit under SimpleProfiler: its slowest hooks")
    return p


def fit_parts(fit_args: list[str], steps: int, save_dir: str):
    """(module, data module, trainer) as `diffexp fit FIT_ARGS` builds them, training `steps` steps."""
    from diffexp.training.cli import build_fit

    return build_fit([*fit_args, "--trainer.max_steps", str(steps), "--trainer.limit_val_batches", "0",
                      "--trainer.logger.init_args.save_dir", save_dir])


class _StepClock:
    """Batch-start times of a Lightning fit (a callback)."""

    def __new__(cls):
        import lightning as L

        class StepClock(L.Callback):
            def __init__(self) -> None:
                self.starts: list[float] = []

            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
                self.starts.append(time.perf_counter())

            def on_train_end(self, trainer, pl_module) -> None:
                self.starts.append(time.perf_counter())

        return StepClock()


def mean_step(starts: list[float], warmup: int, steps: int) -> float:
    """Mean time from the start of batch `warmup` to the start of batch `warmup + steps`."""
    return (starts[warmup + steps] - starts[warmup]) / steps


def time_fit(fit_args: list[str], steps: int, warmup: int, save_dir: str, profiler=None) -> float:
    module, datamodule, trainer = fit_parts(fit_args, warmup + steps + 1, save_dir)  # + 1: the last timed step's end
    clock = _StepClock()
    trainer.callbacks.append(clock)
    if profiler is not None:
        trainer.profiler = profiler
    trainer.fit(module, datamodule)
    return mean_step(clock.starts, warmup, steps)


def time_plain(fit_args: list[str], steps: int, warmup: int, save_dir: str) -> float:
    import torch

    module, datamodule, trainer = fit_parts(fit_args, warmup + steps + 1, save_dir)
    datamodule.prepare_data()
    datamodule.setup("fit")
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in module.parameters() if p.ndim >= 2], "weight_decay": module.optim.weight_decay},
         {"params": [p for p in module.parameters() if p.ndim < 2], "weight_decay": 0.0}],
        lr=module.optim.lr, betas=tuple(module.optim.betas), eps=module.optim.eps)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 50))
    clip = trainer.gradient_clip_val
    starts = []
    batches = iter(datamodule.train_dataloader())
    module.train()
    for _ in range(warmup + steps + 1):
        starts.append(time.perf_counter())
        loss = module._loss(next(batches))
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
    return mean_step(starts, warmup, steps)


_RESULT = "diffexp-bench-trainer-step-s:"


def time_side(side: str, fit_args: list[str], steps: int, warmup: int, save_dir: str, threads: int | None) -> float:
    """One side's mean step, measured in a fresh Python process, as a real `diffexp fit` runs (bench/README.md)."""
    spec = json.dumps({"side": side, "fit_args": fit_args, "steps": steps, "warmup": warmup, "save_dir": save_dir,
                       "threads": threads})
    env = {**os.environ, "TTY_INTERACTIVE": "1", "TTY_COMPATIBLE": "1"}  # the bar renders as in a terminal
    # the spec on stdin: LightningCLI warns about arguments in sys.argv
    done = subprocess.run([sys.executable, "-c", f"from {__name__} import side_main; side_main()"], input=spec,
                          capture_output=True, text=True, env=env)
    found = [line.split(_RESULT)[-1].split()[0] for line in done.stdout.splitlines() if _RESULT in line]
    if done.returncode != 0 or not found:  # the bar's cursor codes may share the result's line
        raise RuntimeError(f"the {side} side of diffexp bench trainer failed (exit {done.returncode}):\n"
                           f"{done.stderr[-3000:]}")
    return float(found[-1])


def side_main() -> None:
    """The child process of `time_side`: time one side (its spec on stdin), print the mean step."""
    spec = json.loads(sys.stdin.read())
    if spec["threads"] is not None:
        import torch

        torch.set_num_threads(spec["threads"])
    timer = time_plain if spec["side"] == "plain" else time_fit
    step_s = timer(spec["fit_args"], spec["steps"], spec["warmup"], spec["save_dir"])
    print(f"\n{_RESULT}{step_s!r}", flush=True)


def run(args: argparse.Namespace, fit_args: list[str]) -> dict:
    fit_s, plain_s = [], []
    with tempfile.TemporaryDirectory() as save_dir:
        fit_parts(fit_args, args.warmup + args.steps + 1, save_dir)  # bad fit arguments stop here, before any work
    with tempfile.TemporaryDirectory() as save_dir, ProgressReporter(total=2 * args.rounds) as progress:
        for r in range(args.rounds):
            for side in (("plain", "fit") if r % 2 == 0 else ("fit", "plain")):
                step_s = time_side(side, fit_args, args.steps, args.warmup, save_dir, args.threads)
                (plain_s if side == "plain" else fit_s).append(step_s)
                progress.advance(f"round {r + 1}/{args.rounds}: {side}")
        profile = None
        if args.profile:
            from lightning.pytorch.profilers import SimpleProfiler

            profiler = SimpleProfiler(dirpath=save_dir, filename="profile")
            time_fit(fit_args, args.steps, args.warmup, save_dir, profiler)
            profile = slowest_hooks(profiler)
    overheads = [f / p - 1 for f, p in zip(fit_s, plain_s)]
    return {"plain_step_s": plain_s, "fit_step_s": fit_s, "overhead_per_round": overheads,
            "overhead": statistics.median(overheads), "overhead_interval_95": median_interval(overheads),
            "profile": profile}


def slowest_hooks(profiler, top: int = 12) -> list[dict]:
    """The hooks with the most total time, per call and in all (SimpleProfiler's records)."""
    rows = [{"hook": name, "calls": len(times), "mean_ms": 1e3 * statistics.fmean(times), "total_s": sum(times)}
            for name, times in profiler.recorded_durations.items() if times and "run_training_epoch" not in name
            and "run_training_batch" not in name and not name.startswith("[_TrainingEpochLoop]")]
    return sorted(rows, key=lambda row: -row["total_s"])[:top]


def main(argv: list[str]) -> int:
    own, fit_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = build_parser().parse_args(own)
    for flag in ("steps", "rounds"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag}: expected a positive integer, got {getattr(args, flag)}")
    if args.warmup < 1:
        raise UserError(f"--warmup: expected at least 1 (the first step allocates AdamW's state), got {args.warmup}")
    if args.threads is not None and args.threads < 1:
        raise UserError(f"--threads: expected a positive integer, got {args.threads}")
    from diffexp.bench.options import output_path

    output_path(args, NAME)
    env, results = report.recorded_run("cpu", args.threads, lambda: run(args, fit_args))
    data = {"kind": NAME, "command": " ".join(["diffexp", "bench", NAME, *argv]), "env": env,
            "config": {"steps": args.steps, "warmup": args.warmup, "rounds": args.rounds, "fit_args": fit_args},
            "results": results}
    report.write_results(args.json, data)
    rows = [[str(r + 1), f"{1e3 * p:.2f}", f"{1e3 * f:.2f}", f"{100 * o:+.1f}%"] for r, (p, f, o) in
            enumerate(zip(results["plain_step_s"], results["fit_step_s"], results["overhead_per_round"]))]
    interval = results["overhead_interval_95"]
    spread = ("" if interval is None else
              f" (95% interval of the median: {100 * interval[0]:+.1f}% to {100 * interval[1]:+.1f}%)")
    caption = (f"Median overhead {100 * results['overhead']:+.1f}%{spread} (diffexp fit / plain loop - 1, per round). "
               f"{env['threads']} threads, wall {env['wall_s']:.0f} s. Results: {args.json}" + report.load_note(env))
    report.print_table("diffexp fit vs a plain loop of the same model (mean step, ms)",
                       ["round", "plain", "diffexp fit", "overhead"], rows, caption)
    for row in results["profile"] or []:
        print(f"  {row['total_s']:8.3f} s  {row['calls']:5d} x {row['mean_ms']:8.3f} ms  {row['hook']}",
              file=sys.stdout)
    return 0

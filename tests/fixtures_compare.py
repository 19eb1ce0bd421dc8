"""Synthetic sweep run directories (sweep.json, trial.json, real TensorBoard events) for the compare tests."""

from __future__ import annotations

import json
from pathlib import Path

from diffexp.sweep.layout import trial_dir as trial_dir_of

VAL_STEPS = (100, 200, 300, 400)


def write_events(trial_dir: Path, scalars: dict[str, list[tuple[int, float]]], walltime: float = 1.0e9) -> None:
    """One events file in `trial_dir` with the given (step, value) series, as Lightning's logger writes them."""
    from torch.utils.tensorboard import SummaryWriter

    trial_dir.mkdir(parents=True, exist_ok=True)
    writer = SummaryWriter(log_dir=str(trial_dir))
    try:
        for tag, points in scalars.items():
            for i, (step, value) in enumerate(points):
                writer.add_scalar(tag, value, step, walltime=walltime + step + i * 1e-3)
    finally:
        writer.close()


def val_curve(final: float, seed: int = 0, steps=VAL_STEPS) -> list[tuple[int, float]]:
    """A decreasing val/loss curve ending at `final`."""
    last = steps[-1]
    return [(s, final + 0.4 * (last - s) / last + 0.01 * seed * (s != last)) for s in steps]


def write_sweep(study_dir: Path, cases: list[tuple[str, str]], seeds: list[int], metric: str = "val/loss",
                direction: str = "minimize", study: str | None = None, n_trials: int | None = None) -> None:
    study_dir.mkdir(parents=True, exist_ok=True)
    sweep = {"study": study or study_dir.name, "spec": f"sweeps/{study or study_dir.name}.yaml",
             "cases": [{"name": name, "slug": slug, "overrides": {"model.arch.attention": slug}}
                       for name, slug in cases],
             "seeds": seeds, "objective": {"metric": metric, "direction": direction}}
    if n_trials is not None:
        sweep["n_trials"] = n_trials
    (study_dir / "sweep.json").write_text(json.dumps(sweep))


def write_trial(study_dir: Path, case: str, slug: str, seed: int, metrics: dict[str, float], *,
                state: str = "complete", params: int = 920_000, tokens_per_s: float = 10_000.0,
                global_step: int = 400, curve: list[tuple[int, float]] | None = None, draw: int = 0) -> Path:
    """trial.json plus an events file whose val/loss curve ends at metrics['val/loss'] (or `curve`),
    in the directory the sweep runner gives that trial."""
    trial_dir = trial_dir_of(study_dir, slug, seed, draw)
    if curve is None and "val/loss" in metrics:
        curve = [p for p in val_curve(metrics["val/loss"], seed) if p[0] <= global_step]
    scalars = {"train/loss": [(s, 3.0 - s / 400) for s in range(0, global_step + 1, 50)], "params/total": [(0, params)]}
    if curve:
        scalars["val/loss"] = curve
    write_events(trial_dir, scalars)
    (trial_dir / "trial.json").write_text(json.dumps({
        "study": study_dir.name, "case": case, "case_slug": slug, "seed": seed,
        "overrides": {"model.arch.attention": slug, "seed_everything": seed},
        "params": {"total": params, "non_embedding": params - 67_000, "attention": 263_000, "ffn": 590_000},
        "metrics": metrics, "tokens_per_s": tokens_per_s, "state": state, "global_step": global_step,
        "wall_s": 90.0 + seed}))
    return trial_dir


CASES = [("Transformer", "transformer"), ("DIFF", "diff"), ("DIFF -GroupNorm", "diff-groupnorm"),
         ("DIFF lambda 0.8", "diff-lambda-0-8")]


def make_study(root: Path, name: str = "table6") -> Path:
    """A partly finished study with known values.

    transformer: seeds 0, 1, 2 complete, val/loss 1.90, 1.92, 1.94 (mean 1.92, std 0.02);
                 seed 1 was resumed: two events files, step 200 logged twice (the second value, 2.11, wins)
    diff:        seeds 0, 1 complete (1.85, 1.87), seed 2 pruned at step 200 (val/loss 2.5)
    diff-groupnorm: seed 0 complete (1.88); seed 1 has events but no trial.json (running); seed 2 not started
    diff-lambda-0-8: nothing at all
    """
    study = root / name
    write_sweep(study, CASES, [0, 1, 2])
    for seed, loss in enumerate((1.90, 1.92, 1.94)):
        metrics = {"val/loss": loss, "val/ppl": 2.718281828 ** loss, "train/loss": loss - 0.1,
                   "val/loss_ar_hit": 0.9 + seed / 10}
        write_trial(study, "Transformer", "transformer", seed, metrics, params=1_000_000, tokens_per_s=12_000 + seed)
    resumed = study / "transformer" / "seed1"
    write_events(resumed, {"val/loss": [(200, 2.11)]}, walltime=2.0e9)  # the resumed run's events file
    for seed, loss in enumerate((1.85, 1.87)):
        write_trial(study, "DIFF", "diff", seed, {"val/loss": loss, "val/ppl": 2.718281828 ** loss,
                                                  "train/loss": loss - 0.1}, params=990_000, tokens_per_s=9_000)
    write_trial(study, "DIFF", "diff", 2, {"val/loss": 2.5, "train/loss": 2.6}, state="pruned", global_step=200,
                params=990_000, tokens_per_s=1.0)
    write_trial(study, "DIFF -GroupNorm", "diff-groupnorm", 0, {"val/loss": 1.88, "val/ppl": 6.55, "train/loss": 1.8},
                params=989_000, tokens_per_s=9_100)
    write_events(study / "diff-groupnorm" / "seed1", {"val/loss": val_curve(2.0)[:2], "train/loss": [(250, 2.2)]})
    return study


def write_loss_table(study_dir: Path, losses: dict[tuple[str, str], dict[int, float | None]], seeds: list[int],
                     metric: str = "val/loss", direction: str = "minimize") -> Path:
    """A study whose case (name, slug) has, per seed, the given final `metric` (a complete trial), None (a pruned
    trial) or nothing (no trial yet): for tests that need exact per-seed values, such as paired differences."""
    write_sweep(study_dir, list(losses), seeds, metric=metric, direction=direction)
    for (name, slug), per_seed in losses.items():
        for seed, loss in per_seed.items():
            if loss is None:
                write_trial(study_dir, name, slug, seed, {metric: 9.9}, state="pruned", global_step=200)
            else:
                write_trial(study_dir, name, slug, seed, {metric: loss})
    return study_dir

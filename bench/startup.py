"""Start-up time of each diffexp subcommand, side by side with `python -c "import torch"`.

    python bench/startup.py                      # every subcommand's --help, `variants`, `params RECIPE`
    python bench/startup.py --rounds 7 --checkpoint runs/tiny/diff_v1/version_0/checkpoints/last.ckpt \
        --runs runs/table6 --prepared data/corpus    # and real generate, export, compare and data inspect runs

Each command is a fresh interpreter, as a user's shell starts it. The commands take turns in rounds (the order
rotated each round), so a change in the machine's load hits them alike; a command's figure is the median of its
wall times, its ratio the median over rounds of its time over `import torch`'s in the same round. One more run of
each under `python -X importtime`, untimed, says whether it imports Lightning and which packages take the most of
its import time. The result is a Markdown table on stdout (bench/README.md, "Start-up"), after the machine, the
commit and the load average.
"""

from __future__ import annotations

import argparse
import collections
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REFERENCE = "import torch"
#: the packages that take a second or more to import on a loaded machine; the table names those a command imports
HEAVY = ("lightning", "optuna", "scipy", "matplotlib", "transformers", "datasets", "tensorboard", "jsonargparse",
         "rich", "sympy", "triton")
GOAL = 1.5  # every subcommand that trains nothing starts within this ratio of `import torch`


def commands(args) -> list[tuple[str, list[str]]]:
    """(label, argv after `python`) of each command, the reference first."""
    diffexp = ["-m", "diffexp"]
    rows = [(f'python -c "{REFERENCE}"', ["-c", REFERENCE]), ("diffexp --help", [*diffexp, "--help"]),
            ("diffexp variants", [*diffexp, "variants"])]
    rows += [(f"diffexp {sub} --help", [*diffexp, sub, "--help"])
             for sub in ("params", "compare", "sweep", "generate", "export", "eval", "data", "bench")]
    rows += [("diffexp data inspect --help", [*diffexp, "data", "inspect", "--help"]),
             (f"diffexp params {args.recipe}", [*diffexp, "params", args.recipe])]
    if args.runs:
        rows.append((f"diffexp compare {args.runs} --no-plots",
                     [*diffexp, "compare", args.runs, "--no-plots", "--out", "{tmp}/compare"]))
    if args.prepared:
        rows.append((f"diffexp data inspect {args.prepared}", [*diffexp, "data", "inspect", args.prepared]))
    if args.checkpoint:
        rows += [("diffexp generate CKPT --max-new-tokens 8 --device cpu",
                  [*diffexp, "generate", args.checkpoint, "--prompt", "The", "--max-new-tokens", "8", "--device",
                   "cpu"]),
                 ("diffexp export CKPT OUT", [*diffexp, "export", args.checkpoint, "{tmp}/export"])]
    return rows


def run_once(argv: list[str], importtime: bool = False) -> tuple[float, str]:
    """(wall seconds, stderr) of one fresh interpreter; a failure stops the benchmark with its message."""
    with tempfile.TemporaryDirectory(prefix="diffexp-startup-") as tmp:
        argv = [arg.replace("{tmp}", tmp) for arg in argv]
        flags = ["-X", "importtime"] if importtime else []
        start = time.perf_counter()
        done = subprocess.run([sys.executable, *flags, *argv], cwd=REPO, stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (
                                  str(REPO), os.environ.get("PYTHONPATH"))))})
        seconds = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"python {' '.join(argv)} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return seconds, done.stderr


def import_profile(stderr: str) -> tuple[set[str], list[tuple[str, float]]]:
    """(the top-level packages imported, the largest (package, self seconds) totals) of -X importtime's lines."""
    own: collections.Counter = collections.Counter()
    for line in stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        self_us, _, name = line.split(":", 1)[1].split("|")
        own[name.strip().split(".")[0]] += int(self_us) / 1e6
    return set(own), own.most_common(3)


def cpu_model() -> str:
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines()
        return next(line.split(":", 1)[1].strip() for line in lines if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or platform.machine()


def commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.strip()
        return head + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/startup.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed runs of each command (default 5)")
    parser.add_argument("--recipe", default="recipes/tiny/diff_v1.yaml", help="the recipe `params` reads")
    parser.add_argument("--checkpoint", help="a checkpoint: adds real `generate` and `export` runs")
    parser.add_argument("--runs", help="a sweep's runs directory: adds a real `compare` run")
    parser.add_argument("--prepared", help="a `diffexp data prepare` directory: adds a real `data inspect` run")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds={args.rounds} is invalid: expected a positive integer")
    for flag in ("checkpoint", "runs", "prepared"):
        if getattr(args, flag) and not Path(getattr(args, flag)).exists():
            parser.error(f"--{flag}={getattr(args, flag)!r} is invalid: no such file or directory")
    rows = commands(args)
    load_before = os.getloadavg()
    profiles = {label: import_profile(run_once(argv, importtime=True)[1]) for label, argv in rows}  # also warms up
    times: dict[str, list[float]] = {label: [] for label, _ in rows}
    for round_ in range(args.rounds):
        turn = rows[round_ % len(rows):] + rows[:round_ % len(rows)]
        for label, argv in turn:
            times[label].append(run_once(argv)[0])
        print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr)
    load_after = os.getloadavg()

    reference = rows[0][0]
    print(f"machine: {cpu_model()}, {os.cpu_count()} logical CPUs; Python {platform.python_version()}; "
          f"commit {commit()}")
    print(f"load average (1, 5, 15 min): {' '.join(f'{x:.2f}' for x in load_before)} before, "
          f"{' '.join(f'{x:.2f}' for x in load_after)} after; {args.rounds} rounds, interleaved\n")
    print("| command | median s | ratio to `import torch` | imports Lightning? | other heavy imports | "
          "largest imports (self s) |")
    print("|---|---:|---:|---|---|---|")
    over = []
    for label, _ in rows:
        ratio = statistics.median(t / r for t, r in zip(times[label], times[reference]))
        packages, largest = profiles[label]
        heavy = "yes" if "lightning" in packages else "no"
        others = ", ".join(name for name in HEAVY[1:] if name in packages) or "-"
        print(f"| `{label}` | {statistics.median(times[label]):.2f} | {ratio:.2f} | {heavy} | {others} | "
              + ", ".join(f"{name} {seconds:.2f}" for name, seconds in largest) + " |")
        if label != reference and ratio > GOAL:
            over.append(label)
    print(f"\nover {GOAL}x `import torch`: " + (", ".join(f"`{label}`" for label in over) or "none"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What verifying a checkpoint costs: a 125m-size checkpoint (the recipes/gpu 125m DIFF V1 model with its AdamW
state, about 1.5 GB) written by diffexp's own save (AtomicCheckpointIO), then read back side by side, interleaved,
a few rounds: torch.load alone (no check), verify_checkpoint alone (every zip record's CRC-32), read_checkpoint
(the check, then the load, as every command reads), the cheap read of the resume checks (weights=False: the check,
then a memory-mapped load), and for comparison the SHA-256 of the whole file (the cost a checksum file would have).

    python bench/checkpoint_verify.py [--dir DIR] [--rounds 3] [--keep]

DIR (default: a temporary directory) must hold about 1.6 GB. The file is read from the page cache after the first
round (it was just written); a cold read from disk adds the disk's read time to every variant alike. Prints one
Markdown table of medians and writes nothing else.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parent.parent
RECIPES = ("recipes/gpu/base.yaml", "recipes/gpu/size/125m.yaml", "recipes/gpu/variant/diff_v1.yaml")


def recipe_arch() -> dict:
    """model.arch of the 125m DIFF V1 recipe (base, size and variant files merged in that order)."""
    arch: dict = {}
    for name in RECIPES:
        arch.update(((yaml.safe_load((REPO / name).read_text()) or {}).get("model") or {}).get("arch") or {})
    return arch


def write_checkpoint(path: Path) -> None:
    """The model and a stepped AdamW's state (both moments), saved as fit saves last.ckpt."""
    from diffexp.training.module import DiffexpLM
    from diffexp.training.runs import AtomicCheckpointIO

    module = DiffexpLM(recipe_arch())
    optimizer = torch.optim.AdamW(module.parameters(), lr=3e-4)
    for parameter in module.parameters():
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    checkpoint = {"state_dict": module.state_dict(), "optimizer_states": [optimizer.state_dict()],
                  "hyper_parameters": dict(module.hparams), "global_step": 0, "epoch": 0}
    AtomicCheckpointIO().save_checkpoint(checkpoint, path)


def timed(fn) -> float:
    gc.collect()
    start = time.perf_counter()
    result = fn()
    elapsed = time.perf_counter() - start
    del result
    return elapsed


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=None, help="where to write the checkpoint (about 1.6 GB)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint file")
    args = parser.parse_args(argv)

    from diffexp import checkpoint_io
    from diffexp.checkpoint_io import file_sha256, read_checkpoint, verify_checkpoint

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "last.ckpt"
        write_checkpoint(path)
        size = path.stat().st_size

        def fresh(fn):  # the per-process memory of what was verified, forgotten: each round checks again
            def call():
                checkpoint_io._VERIFIED.clear()
                return fn()
            return call

        variants = {
            "torch.load (no check)": lambda: torch.load(path, map_location="cpu", weights_only=True),
            "verify_checkpoint (CRC-32 of every record)": fresh(lambda: verify_checkpoint(path)),
            "read_checkpoint (check + load)": fresh(lambda: read_checkpoint(path)),
            "read_checkpoint, weights=False (check + mmap load)": fresh(lambda: read_checkpoint(path, weights=False)),
            "SHA-256 of the file (a checksum file's cost)": lambda: file_sha256(path),
        }
        times: dict[str, list[float]] = {name: [] for name in variants}
        for round_ in range(args.rounds):
            names = list(variants)
            names = names[round_ % len(names):] + names[:round_ % len(names)]  # rotated: none always first
            for name in names:
                times[name].append(timed(variants[name]))
        if args.keep:
            kept = (args.dir or Path.cwd()) / "checkpoint_verify.ckpt"
            path.replace(kept)
            print(f"kept {kept}", file=sys.stderr)
    base = statistics.median(times["torch.load (no check)"])
    print(f"checkpoint: {size / 2**30:.2f} GiB ({size:,} bytes), {args.rounds} rounds, median (min-max)\n")
    print("| read | seconds | GB/s | vs torch.load |\n|---|---|---|---|")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.2f} ({min(values):.2f}-{max(values):.2f}) | {size / median / 1e9:.2f} | "
              f"{median / base:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

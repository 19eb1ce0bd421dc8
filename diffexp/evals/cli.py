"""`diffexp eval <task> CKPT ...`: the papers' evaluations on a trained checkpoint.

Results go to files (default <run>/eval/) and into the run's own TensorBoard at the checkpoint's step.
Tasks: needle (retrieval grid + attention-to-answer table), and the ones registered below.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch


def eval_output(checkpoint: str, out: str | None):
    """(output dir, SummaryWriter on the run dir or None, the checkpoint's global step)."""
    ckpt = Path(checkpoint)
    if not ckpt.is_file():
        raise SystemExit(f"error: checkpoint {checkpoint!r}: no such file")
    run_dir = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else None
    if out:
        directory = Path(out)
    else:
        directory = run_dir / "eval" if run_dir else ckpt.with_name(ckpt.stem + "-eval")
    directory.mkdir(parents=True, exist_ok=True)
    step = int(torch.load(ckpt, map_location="cpu", weights_only=True).get("global_step", 0))
    writer = None
    if run_dir is not None:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(log_dir=str(run_dir))
    return directory, writer, step


def _tasks():
    from diffexp.evals import needle

    tasks = {"needle": needle.main}
    try:
        from diffexp.evals import icl, mqar

        tasks.update({name: module.main for name, module in (("icl", icl), ("mqar", mqar)) if hasattr(module, "main")})
    except ImportError:
        pass
    return tasks


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    tasks = _tasks()
    if not argv or argv[0] not in tasks:
        given = repr(argv[0]) if argv else "nothing"
        print(f"usage: diffexp eval {{{','.join(tasks)}}} CKPT [options]\nerror: got {given}; expected one of "
              f"{', '.join(tasks)}", file=sys.stderr)
        return 2
    return tasks[argv[0]](argv[1:])

"""`diffexp eval NAME CKPT ...`: the papers' evaluations on a trained checkpoint.

Every evaluation is a registered entry (diffexp.evals.registry, one file each in diffexp/evals/tasks/); this
command lists them and hands the rest of the command line to the generic runner (diffexp.evals.run). Results
go to files (default <run>/eval/) and into the run's own TensorBoard at the checkpoint's step. A bad checkpoint
or option is a UserError, found before the model is built or any output exists.
"""

from __future__ import annotations

import sys

from diffexp.errors import UserError
from diffexp.evals.registry import evaluation, evaluations


def usage() -> str:
    entries = evaluations()
    width = max(len(entry.name) for entry in entries)
    lines = ["usage: diffexp eval NAME CKPT [options]", "",
             "Evaluate a trained checkpoint (CKPT: a .ckpt file, a sharded checkpoint directory or a `diffexp",
             "export` directory). Results go to <run>/eval/ (or --out) and into the run's TensorBoard at the",
             "checkpoint's step.", "", "evaluations:"]
    lines += [f"  {entry.name:<{width}}  {entry.summary}" for entry in entries]
    lines += ["", "`diffexp eval NAME --help` lists the options of one; the same options score during a fit",
              "(trainer.callbacks: diffexp.evals.Evaluate, docs/evaluations.md)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(usage())
        return 0
    if not argv or argv[0].startswith("-"):
        given = f"{argv[0]!r}" if argv else "no evaluation"
        names = ", ".join(entry.name for entry in evaluations())
        raise UserError(f"diffexp eval NAME: got {given}; expected one of {names} "
                        "(`diffexp eval --help` describes them)")
    from diffexp.evals.run import run

    return run(evaluation(argv[0]), argv[1:])

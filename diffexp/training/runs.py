"""Run directories: where a run logs, and which run `--ckpt_path last` resumes.

Layout: <save_dir>/<name>/<version>/ holds the TensorBoard events, config.yaml and checkpoints/.
A new run always gets a new version; a resumed run appends to the version it resumes.
"""

from __future__ import annotations

from pathlib import Path


def find_last_checkpoint(experiment_dir: Path) -> Path | None:
    """The most recently written checkpoints/last.ckpt among the runs of one experiment."""
    candidates = list(experiment_dir.glob("*/checkpoints/last.ckpt"))
    return max(candidates, key=lambda p: p.stat().st_mtime) if candidates else None


def resolve_resume(ckpt_path: str, save_dir: str, name: str) -> tuple[Path, str | None]:
    """Map --ckpt_path (a file or "last") to (checkpoint file, version of the run it belongs to).

    The version is None when the checkpoint lies outside <save_dir>/<name>: the resumed run then
    starts a new version rather than writing into someone else's directory.
    """
    experiment_dir = Path(save_dir) / name
    if ckpt_path == "last":
        found = find_last_checkpoint(experiment_dir)
        if found is None:
            raise ValueError(
                f"--ckpt_path last: no run under {experiment_dir}/ has checkpoints/last.ckpt; "
                "pass the path of a .ckpt file, or start a new run without --ckpt_path"
            )
        path = found
    else:
        path = Path(ckpt_path)
        if not path.is_file():
            raise ValueError(f"--ckpt_path {ckpt_path!r}: no such file; expected a .ckpt file or 'last'")
    run_dir = path.parent.parent
    in_experiment = path.parent.name == "checkpoints" and run_dir.parent.resolve() == experiment_dir.resolve()
    return path, run_dir.name if in_experiment else None

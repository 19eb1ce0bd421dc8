"""Where a sweep's trials live on disk: the one naming of run directories, for the runner and diffexp.sweep.runs.

    runs/<study>/sweep.json                          the table: cases, seeds, draws, objective
    runs/<study>/<case_slug>/seed<k>/                a trial (search draw 0)
    runs/<study>/<case_slug>/seed<k>-draw<d>/        search draw d > 0 of that case and seed
"""

from __future__ import annotations

import re
from pathlib import Path

SWEEP_FILE = "sweep.json"
TRIAL_FILE = "trial.json"
_RUN_NAME = re.compile(r"^seed(\d+)(?:-draw([1-9]\d*))?$")


def run_name(seed: int, draw: int = 0) -> str:
    """The directory name of a trial: `seed3`, or `seed3-draw2` for search draw 2."""
    return f"seed{seed}" + (f"-draw{draw}" if draw else "")


def parse_run_name(name: str) -> tuple[int, int] | None:
    """(seed, draw) of a trial directory name, or None when the name is not one `run_name` makes."""
    match = _RUN_NAME.match(name)
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2) or 0)


def trial_dir(study_dir: Path, slug: str, seed: int, draw: int = 0) -> Path:
    return Path(study_dir) / slug / run_name(seed, draw)


def trial_dirs(study_dir: Path) -> list[Path]:
    """Every directory under study_dir that is named like a trial's (whatever sweep.json lists)."""
    return sorted(p for p in Path(study_dir).glob("*/seed*") if p.is_dir() and parse_run_name(p.name) is not None)

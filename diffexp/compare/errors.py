"""The one error of `diffexp compare` (a bad study directory is diffexp.sweep.runs.LayoutError)."""

from __future__ import annotations

from diffexp.errors import UserError


class CompareError(UserError):
    """Bad input to compare: unknown --metric, an unusable --out, an Optuna study without runs_dir, bad flags;
    a UserError, so `diffexp compare` prints it as `error: ...` and exits 2."""

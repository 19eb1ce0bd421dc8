"""Ablation sweeps: specs as data, trials as `fit` processes, an Optuna study as the shared ledger."""

from diffexp.sweep.spec import SpecError, SweepSpec, load_spec, parse_spec

__all__ = ["SpecError", "SweepSpec", "load_spec", "parse_spec"]

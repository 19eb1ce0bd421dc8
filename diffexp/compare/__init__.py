"""`diffexp compare RUNS_DIR`: one table (and plots) of a sweep's cases, mean ± std over seeds.

Input: a study's run directory as the sweep runner lays it out (diffexp.sweep.layout; read by diffexp.sweep.runs),
or an Optuna study (`--study NAME --storage URL`) whose user attribute runs_dir points there. Output (default
runs/<study>/compare/): compare.md, compare.csv, val_loss_curves.png, objective_bars.png, the table printed; a
scaling study adds scaling.csv and scaling.png (diffexp.compare.scaling), `diffexp eval harness` results harness.csv.
"""

from diffexp.compare.cli import build_parser, compare, main
from diffexp.compare.errors import CompareError
from diffexp.compare.plots import plot_objective_bars, plot_val_curves
from diffexp.compare.render import format_params, metric_label, print_report, render_markdown, write_csv
from diffexp.compare.scaling import PowerLaw, ScalingReport, fit_power_law, scaling_report
from diffexp.compare.stats import CaseSummary, Stat, best_case, check_metrics, issues, summarize
from diffexp.compare.study import runs_dir_from_optuna
from diffexp.sweep.runs import Case, LayoutError, StudyRuns, TrialRun, load_curves, load_study_runs

__all__ = [
    "Case", "CaseSummary", "CompareError", "LayoutError", "Stat", "StudyRuns", "TrialRun", "best_case",
    "build_parser", "check_metrics", "compare", "format_params", "issues", "load_curves", "load_study_runs",
    "main", "metric_label", "plot_objective_bars", "plot_val_curves", "PowerLaw", "fit_power_law",
    "print_report", "render_markdown", "runs_dir_from_optuna", "ScalingReport", "scaling_report", "summarize",
    "write_csv",
]

"""`diffexp compare RUNS_DIR`: one table (and plots) of a sweep's cases, mean ± std over seeds.

Input is a study's run directory as the sweep runner writes it (diffexp.sweep.layout names it,
diffexp.sweep.runs reads it)::

    runs/<study>/sweep.json                              cases (table order), seeds, objective
    runs/<study>/<case_slug>/seed<k>/trial.json          written when a trial ends (complete or pruned)
    runs/<study>/<case_slug>/seed<k>/events.out.tfevents.*   its TensorBoard scalars
    runs/<study>/<case_slug>/seed<k>-draw<d>/...         search draw d > 0

or an Optuna study (`--study NAME --storage URL`) whose user attribute ``runs_dir`` points there.

One module per concern:

* ``stats``  per-case numbers (mean, sample std, 95% CI over complete seeds) and what is missing;
* ``render`` the terminal tables (rich), compare.md and compare.csv;
* ``plots``  val_loss_curves.png and objective_bars.png;
* ``study``  the run directory of an Optuna study;
* ``cli``    the arguments and the order of the steps (`compare`, `main`).

Outputs (default ``runs/<study>/compare/``): ``compare.md``, ``compare.csv``, ``val_loss_curves.png``,
``objective_bars.png``; the table is also printed with rich.
"""

from diffexp.compare.cli import build_parser, compare, main
from diffexp.compare.errors import CompareError
from diffexp.compare.plots import plot_objective_bars, plot_val_curves
from diffexp.compare.render import format_params, metric_label, print_report, render_markdown, write_csv
from diffexp.compare.stats import CaseSummary, Stat, best_case, check_metrics, issues, summarize
from diffexp.compare.study import runs_dir_from_optuna
from diffexp.sweep.runs import Case, LayoutError, StudyRuns, TrialRun, load_curves, load_study_runs

__all__ = [
    "Case", "CaseSummary", "CompareError", "LayoutError", "Stat", "StudyRuns", "TrialRun", "best_case",
    "build_parser", "check_metrics", "compare", "format_params", "issues", "load_curves", "load_study_runs",
    "main", "metric_label", "plot_objective_bars", "plot_val_curves", "print_report", "render_markdown",
    "runs_dir_from_optuna", "summarize", "write_csv",
]

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
* ``scaling`` the fit loss = a N^-b + c (scipy curve_fit, or log-linear with c fixed) and its inverse;
* ``scaling_study`` which runs form size series per variant, their fits, the parameter ratios to the
  reference (only for a study with several sizes per variant);
* ``scaling_render``, ``scaling_plot`` that section as text (table, compare.md, scaling.csv) and scaling.png;
* ``study``  the run directory of an Optuna study;
* ``cli``    the arguments and the order of the steps (`compare`, `main`).

Outputs (default ``runs/<study>/compare/``): ``compare.md``, ``compare.csv``, ``val_loss_curves.png``,
``objective_bars.png``; the table is also printed with rich. A scaling study adds a section to the
printout and compare.md, ``scaling.csv`` and ``scaling.png``.
"""

from diffexp.compare.cli import build_parser, compare, main
from diffexp.compare.errors import CompareError
from diffexp.compare.plots import plot_objective_bars, plot_val_curves
from diffexp.compare.render import format_params, metric_label, print_report, render_markdown, write_csv
from diffexp.compare.scaling import PowerLaw, fit_power_law
from diffexp.compare.scaling_study import ScalingReport, scaling_report
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

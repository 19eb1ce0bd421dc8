"""The comparison as text: the terminal report (rich tables), compare.md and compare.csv.

Metric columns come in StudyRuns.metric_names' order (the objective, val/*, test/*, train/*, the rest), vitals/* under
_DIAGNOSTIC_LABELS; "Variant" and "Diverged" (from trial.json's `diverged_step`) only where the runs record them.
With a PairedReport (diffexp.compare.paired), each case's paired difference to the reference case, its interval
and verdict: columns after the objective in compare.md and compare.csv, a table of their own in the terminal
(the main table is wide already), with the power statement below.
"""

from __future__ import annotations

import csv
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diffexp.compare import markdown
from diffexp.compare.paired import POWER_DELTAS, REFERENCE, TOO_FEW, PairedDiff, PairedReport
from diffexp.compare.stats import DIAGNOSTIC_PREFIX, EMPTY, CaseSummary, best_case, issues
from diffexp.sweep import layout
from diffexp.sweep.runs import StudyRuns

_PREFIX_LABELS = {"val": "Valid", "test": "Test", "train": "Train"}
#: training diagnostics (diffexp.training.diagnostics) as a table shows them
_DIAGNOSTIC_LABELS = {"loss_spikes": "Loss spikes", "grad_spikes": "Grad spikes", "grad_norm_max": "Max grad norm",
                      "context_rms": "Context RMS", "attn_sink": "Attn sink", "act_max_abs": "Max |act|",
                      "attn_logit_max": "Max attn logit"}

SECTION_TITLES = {
    "missing": "Missing trials (no trial.json)",
    "no completed seed": "Cases with no completed seed (shown as —)",
    "diverged": "Diverged trials (counted in Diverged, excluded from the loss and result means)",
    "pruned": "Pruned trials (counted in Seeds, excluded from the means)",
    "failed": "Failed trials (excluded from the means)",
    "unexpected": "Unexpected run directories",
}

NOTE = ("mean ± sample std (ddof=1) over the complete seeds; std is n/a with a single complete seed; "
        "pruned trials are counted in Seeds but excluded from the means")
DIVERGED_NOTE = ("a diverged trial (non-finite loss or gradient norm, or a loss over the divergence threshold) "
                 "counts in Diverged (diverged/total) and is excluded from the loss and result means; the "
                 "training diagnostics (Loss spikes, Max grad norm, Context RMS, Attn sink, ...) average over "
                 "the complete and diverged trials; Context RMS and Attn sink are the last measured values")


def note(rows: Sequence[CaseSummary]) -> str:
    return NOTE + ("; " + DIVERGED_NOTE if shows_divergence(rows) else "")


def format_params(n: int | None) -> str:
    """Paper style: 920_000 -> '0.92M', 1_003_000 -> '1.00M', 830_000_000 -> '830M', 1.4e9 -> '1.40B'."""
    if n is None:
        return EMPTY
    for scale, suffix in ((1e9, "B"), (1e5, "M"), (1e3, "K")):
        if abs(n) >= scale:
            value = n / (1e6 if suffix == "M" else scale)
            return f"{value:.0f}{suffix}" if abs(value) >= 100 else f"{value:.{1 if abs(value) >= 10 else 2}f}{suffix}"
    return str(n)


def format_tokens_per_s(value: float | None) -> str:
    return EMPTY if value is None else f"{value:,.0f}"


def metric_label(name: str) -> str:
    """'val/loss' -> 'Valid loss', 'train/loss' -> 'Train loss'; other names unchanged."""
    head, sep, tail = name.partition("/")
    if sep and head in _PREFIX_LABELS:
        return f"{_PREFIX_LABELS[head]} {tail}"
    if name.startswith(DIAGNOSTIC_PREFIX) and tail in _DIAGNOSTIC_LABELS:
        return _DIAGNOSTIC_LABELS[tail]
    return name


def arrow(direction: str) -> str:
    return "↓" if direction == "minimize" else "↑"


def shows_variant(rows: Sequence[CaseSummary]) -> bool:
    """A Variant column only when some case's runs name their attention (older runs may not)."""
    return any(row.variant is not None for row in rows)


def shows_divergence(rows: Sequence[CaseSummary]) -> bool:
    """A Diverged column when the runs record whether they diverged (older runs do not), or some did."""
    return any(row.tracks_divergence or row.diverged for row in rows)


# -- paired differences ---------------------------------------------------------------------------------
VERDICT_STYLES = {"better": "green", "worse": "red", TOO_FEW: "yellow", REFERENCE: "bold"}


def level_text(level: float) -> str:
    """0.95 -> '95%', 0.975 -> '97.5%'."""
    return f"{level * 100:g}%"


def format_diff(x: float | None) -> str:
    """A signed difference: '+0.0612', '-0.0040'; below 0.001 in three significant digits ('-4.21e-05'), so that
    a small quantity (a rounding error) does not read as '-0.0000'; EMPTY for none."""
    if x is None:
        return EMPTY
    if abs(x) >= 1000:
        return f"{x:+,.1f}"
    return f"{x:+.2e}" if 0 < abs(x) < 1e-3 else f"{x:+.4f}"


def paired_headers(paired: PairedReport) -> list[str]:
    return [f"Δ vs {paired.reference.case.name}", f"{level_text(paired.level)} CI", "Paired seeds", "Verdict"]


def paired_cells(diff: PairedDiff | None) -> list[str]:
    """Δ (mean), interval, paired seeds, verdict of one case; the reference case (no diff) says so."""
    if diff is None:
        return [EMPTY, EMPTY, EMPTY, REFERENCE]
    interval = EMPTY if diff.n < 2 else f"[{format_diff(diff.low)}, {format_diff(diff.high)}]"
    return [format_diff(diff.mean), interval, str(diff.n), diff.verdict]


def paired_note(runs: StudyRuns, paired: PairedReport) -> str:
    """How to read the paired columns, and which case is the reference and why."""
    ref, better = paired.reference.case.name, "below" if runs.direction == "minimize" else "above"
    return (f"Δ: case − {ref} in {runs.objective} on each seed both finished (paired: the same initial weights "
            f"and batches per seed), mean and {level_text(paired.level)} confidence interval (Student t, n − 1 "
            f"df); better / worse: the interval excludes 0 ({better} 0 is better: {runs.objective} is "
            f"{runs.direction}d); within seed noise: it holds 0; too few seeds: fewer than 2 paired seeds. "
            f"Reference: {ref}, " + ("given by --reference." if paired.chosen_by == "--reference" else
                                     f"{paired.chosen_by} (--reference CASE picks another)."))


def power_lines(runs: StudyRuns, paired: PairedReport) -> list[str]:
    """The power statement: what the study's seed count resolves and what some differences need."""
    power = paired.power
    if power is None:
        return ["Power: no case has 2 paired seeds yet, so the spread of the differences (and the seeds a "
                "difference needs) is unknown."]
    unit = " nats" if runs.objective.endswith("loss") else ""
    counts = {delta: power.seeds_for(delta) for delta in POWER_DELTAS}
    needs = ", ".join(f"{delta:g}{unit} needs {'more than 100,000' if n is None else n} seeds"
                      for delta, n in counts.items())
    plural = "s" if power.seeds != 1 else ""
    basis = (f"  (sd {power.sd:.3g} of the paired differences, pooled over {power.cases} case"
             f"{'s' if power.cases != 1 else ''}, taken as the true sd; a two-sided paired t test at "
             f"{level_text(power.level)} with {power.power:.0%} power, from the noncentral t with n − 1 df)")
    if not power.priced:
        return [f"Power: {power.seeds} seed{plural} are too few to price a difference: a paired t test on them has "
                f"{power.seeds - 1} degree{'s' if power.seeds != 2 else ''} of freedom, so its "
                f"{level_text(power.level)} intervals are as wide as the table shows and only a difference of "
                f"{power.resolvable():.3g}{unit} or more in {runs.objective} would be detected; a difference of "
                f"{needs}.", basis]
    return [f"Power: with {power.seeds} seed{plural} this study resolves differences of {power.resolvable():.3g}"
            f"{unit} or more in {runs.objective}; a difference of {needs}.", basis]


def print_paired(console, runs: StudyRuns, rows: Sequence[CaseSummary], paired: PairedReport, view: str = "") -> None:
    """The paired differences as a table of their own (light box), its note and the power statement."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    ref = paired.reference.case.name
    shown_view = ", " + view if view and not ref.endswith(view) else ""  # a grid point is in its row's name already
    title = f"Paired differences vs {ref}{shown_view}: {runs.objective}, case − reference per seed"
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("Case", overflow="fold")
    for header in paired_headers(paired):
        table.add_column(header, justify="left" if header == "Verdict" else "right", overflow="fold")
    for row in rows:
        cells = paired_cells(paired.of(row))
        table.add_row(Text(row.case.name), *cells[:-1], Text(cells[-1], style=VERDICT_STYLES.get(cells[-1], "")))
    console.print(table)
    for line in [paired_note(runs, paired), *power_lines(runs, paired)]:
        console.print(Text(line), soft_wrap=True)


# -- compare.md -----------------------------------------------------------------------------------------
def render_markdown(runs: StudyRuns, rows: Sequence[CaseSummary], metrics: Sequence[str],
                    paired: PairedReport | None = None) -> str:
    """The table (the paired columns after the objective's, with `paired`), its notes and the issue sections."""
    best = best_case(runs, rows)
    variant, divergence = shows_variant(rows), shows_divergence(rows)
    header = ["Case", "Params", "Non-emb. params"]
    for m in metrics:
        header.append(f"{metric_label(m)} {arrow(runs.direction)}" if m == runs.objective else metric_label(m))
        if m == runs.objective and paired is not None:
            header += paired_headers(paired)
    header += ["Seeds"] + (["Diverged"] if divergence else []) + ["Tokens/s"] + (["Variant"] if variant else [])
    lines = [f"# {runs.study}: comparison", ""]
    meta = f"Objective: `{runs.objective}` ({runs.direction})"
    if runs.spec:
        meta += f". Spec: `{runs.spec}`"
    meta += f". Seeds: {', '.join(map(str, runs.seeds))}."
    align = ["left"] + ["left" if h in ("Verdict", "Variant") else "right" for h in header[1:]]  # text left
    body = []
    for row in rows:
        cells = [row.case.name, format_params(row.params_total), format_params(row.params_non_embedding)]
        for m in metrics:
            text = row.stats[m].format()
            cells.append(f"**{text}**" if m == runs.objective and row is best else text)
            if m == runs.objective and paired is not None:
                cells += paired_cells(paired.of(row))
        cells += [row.seeds_text] + ([row.diverged_text] if divergence else [])
        cells += [format_tokens_per_s(row.tokens_per_s)]
        if variant:
            cells.append(row.variant or EMPTY)
        body.append(cells)
    lines += [meta, "", *markdown.table(header, body, align), "",
              f"Values: {note(rows)}. Best objective in bold. Params: total and non-embedding counts.", ""]
    if paired is not None:
        lines += [paired_note(runs, paired), "", *(line.strip() for line in power_lines(runs, paired)), ""]
    for key, items in issues(runs, rows).items():
        lines += [f"## {SECTION_TITLES[key]}", ""] + [f"- {markdown.cell(item)}" for item in items] + [""]
    return "\n".join(lines)


# -- compare.csv ----------------------------------------------------------------------------------------
def _run_ids(trials) -> str:
    """'0;0-draw1;1': each trial's run directory name without its 'seed' prefix."""
    return ";".join(layout.run_name(t.seed, t.draw).removeprefix("seed") for t in trials)


PAIRED_FIELDS = ["paired_reference", "paired_level", "paired_n", "paired_seeds", "paired_diffs", "paired_diff_mean",
                 "paired_diff_sd", "paired_diff_low", "paired_diff_high", "paired_verdict"]


def paired_record(paired: PairedReport, row: CaseSummary) -> dict[str, Any]:
    """The PAIRED_FIELDS of one case: the objective's paired difference to the reference (empty for itself)."""
    diff = paired.of(row)
    record: dict[str, Any] = {"paired_reference": paired.reference.case.name, "paired_level": paired.level,
                              "paired_verdict": REFERENCE if diff is None else diff.verdict}
    if diff is not None:
        record.update({"paired_n": diff.n, "paired_seeds": ";".join(map(str, diff.seeds)),
                       "paired_diffs": ";".join(repr(d) for d in diff.diffs), "paired_diff_mean": diff.mean,
                       "paired_diff_sd": diff.sd, "paired_diff_low": diff.low, "paired_diff_high": diff.high})
    return record


def write_csv(path: str | Path, runs: StudyRuns, rows: Sequence[CaseSummary], metrics: Sequence[str],
              paired: PairedReport | None = None) -> None:
    """One row per case; for each metric `<metric>_mean`, `<metric>_std` and `<metric>_ci95` (95% CI
    half-width; both empty with < 2 seeds), `<metric>_n`. Diverged trials: `n_diverged`, `seeds_diverged`
    and `diverged_steps` (in the same order, `;`-separated). With `paired`, PAIRED_FIELDS: the objective's
    paired difference to the reference case (seeds and per-seed differences `;`-separated, the interval's
    bounds at `paired_level`, the verdict)."""
    fields = ["case", "slug", "variant", "overrides", "n_expected", "n_complete", "n_pruned", "n_diverged",
              "n_failed", "n_missing", "seeds_complete", "seeds_pruned", "seeds_diverged", "diverged_steps",
              "params_total", "params_non_embedding", "tokens_per_s_mean", "wall_s_mean"]
    for m in metrics:
        fields += [f"{m}_mean", f"{m}_std", f"{m}_ci95", f"{m}_n"]
    fields += PAIRED_FIELDS if paired is not None else []
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            record: dict[str, Any] = {
                "case": row.case.name, "slug": row.case.slug, "variant": row.variant,
                "overrides": json.dumps(row.case.overrides),
                "n_expected": row.n_expected, "n_complete": len(row.complete), "n_pruned": len(row.pruned),
                "n_diverged": len(row.diverged), "n_failed": len(row.failed), "n_missing": len(row.missing),
                "seeds_complete": _run_ids(row.complete), "seeds_pruned": _run_ids(row.pruned),
                "seeds_diverged": _run_ids(row.diverged),
                "diverged_steps": ";".join(str((t.record or {}).get("diverged_step")) for t in row.diverged),
                "params_total": row.params_total, "params_non_embedding": row.params_non_embedding,
                "tokens_per_s_mean": row.tokens_per_s, "wall_s_mean": row.wall_s,
            }
            for m in metrics:
                stat = row.stats[m]
                record.update({f"{m}_mean": stat.mean, f"{m}_std": stat.std, f"{m}_ci95": stat.ci95,
                               f"{m}_n": stat.n})
            if paired is not None:
                record.update(paired_record(paired, row))
            writer.writerow({k: "" if v is None else v for k, v in record.items()})


# -- terminal -------------------------------------------------------------------------------------------
@dataclass
class _Column:
    label: str
    cells: list  # rich Text, one per row
    bold: bool = False


def _columns(runs: StudyRuns, rows: Sequence[CaseSummary], metrics: Sequence[str]) -> list[_Column]:
    """In print order: what a paper's table shows (objective, parameters, seeds, tokens/s, variant), then
    the other recorded metrics."""
    from rich.text import Text

    best = best_case(runs, rows)

    def metric(m: str) -> _Column:
        objective = m == runs.objective
        label = metric_label(m) + (f" {arrow(runs.direction)}" if objective else "")
        cells = [Text(row.stats[m].format(), style="green" if objective and row is best else "") for row in rows]
        return _Column(label, cells, bold=objective)

    def text(label: str, values: Sequence[str], styles: Sequence[str] | None = None) -> _Column:
        return _Column(label, [Text(v, style=styles[i] if styles else "") for i, v in enumerate(values)])

    head = [metric(m) for m in metrics if m == runs.objective] + [
        text("Params", [format_params(r.params_total) for r in rows]),
        text("Non-emb.", [format_params(r.params_non_embedding) for r in rows]),
        text("Seeds", [r.seeds_text for r in rows],
             ["" if len(r.complete) == r.n_expected else "yellow" for r in rows]),
    ]
    if shows_divergence(rows):
        head.append(text("Diverged", [r.diverged_text for r in rows], ["red" if r.diverged else "" for r in rows]))
    head += [text("Tokens/s", [format_tokens_per_s(r.tokens_per_s) for r in rows])]
    if shows_variant(rows):
        head.append(text("Variant", [r.variant or EMPTY for r in rows]))
    return head + [metric(m) for m in metrics if m != runs.objective]


def _table(title: str, rows: Sequence[CaseSummary], columns: Sequence[_Column]):
    """One rich table: the Case column, then `columns`. Cells fold rather than end in an ellipsis, so a
    narrow terminal wraps a number onto two lines instead of hiding its digits."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title=title, title_justify="left")
    table.add_column("Case", overflow="fold")
    for column in columns:
        table.add_column(column.label, justify="right", overflow="fold", style="bold" if column.bold else None)
    for r, row in enumerate(rows):
        table.add_row(Text(row.case.name), *(column.cells[r] for column in columns))
    return table


def _natural_width(console, table) -> int:
    """The width rich would draw `table` at with nothing wrapped."""
    from rich.measure import Measurement

    return Measurement.get(console, console.options.update_width(sys.maxsize // 4), table).maximum


def _split(console, rows: Sequence[CaseSummary], columns: Sequence[_Column]) -> list[list[_Column]]:
    """Columns, in order, into as many tables as keep each one unwrapped within the console width;
    every table holds at least one column (rich folds its cells when even that does not fit)."""
    groups: list[list[_Column]] = []
    for column in columns:
        if groups and _natural_width(console, _table("", rows, [*groups[-1], column])) <= console.width:
            groups[-1].append(column)
        else:
            groups.append([column])
    return groups


def print_report(console, runs: StudyRuns, rows: Sequence[CaseSummary], metrics: Sequence[str],
                 paired: PairedReport | None = None) -> None:
    """The table, split into as many tables as the console width needs; each repeats the Case column.

    The first holds what a paper's table shows (the objective, parameters, seeds, tokens/s); the other
    recorded metrics follow in order, so every column stays readable instead of squeezed to an ellipsis.
    With `paired`, the paired differences to the reference and the power statement follow the table's note.
    """
    from rich.text import Text

    groups = _split(console, rows, _columns(runs, rows, metrics))
    for n, columns in enumerate(groups):
        title = f"{runs.study}: objective {runs.objective} ({runs.direction})"
        if len(groups) > 1:
            title += f" [{n + 1}/{len(groups)}]"
        console.print(_table(title, rows, columns))
    # plain lines hold paths and case names: never wrapped inside them, whatever the console width
    console.print(Text(note(rows)), soft_wrap=True)
    if paired is not None:
        print_paired(console, runs, rows, paired)
    for key, items in issues(runs, rows).items():
        console.print(Text(SECTION_TITLES[key] + ":", style="bold" if key in ("pruned", "diverged") else "bold yellow"),
                      soft_wrap=True)
        for item in items:
            console.print(Text("  - " + item), soft_wrap=True)

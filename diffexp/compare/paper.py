"""The paper's numbers beside ours: per metric, the measured mean and the published value of each row the
sweep's `paper:` block lists, and whether each difference between two rows has the paper's direction.

At tiny scale the absolute numbers cannot match a paper's; what a reproduction checks is the sign of each
difference (is DINT's loss below DIFF's, as in the paper?) and the ranking. The sign is read from the paired
difference of the two rows seed by seed (diffexp.compare.paired): it agrees or disagrees with the paper only
when its interval excludes 0, and is inconclusive within seed noise or with fewer than 2 paired seeds. A pair
whose paper values are equal, or whose measured means are equal, has no direction and is left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from diffexp.compare import markdown
from diffexp.compare.paired import (
    AGREES,
    DISAGREES,
    INCONCLUSIVE,
    LEVEL,
    PairedDiff,
    paired_difference,
    paper_agreement,
)
from diffexp.compare.render import format_diff, level_text
from diffexp.compare.stats import CaseSummary, format_number
from diffexp.sweep.runs import StudyRuns


@dataclass
class PairCheck:
    first: str
    second: str
    paper_diff: float  # first - second
    measured_diff: float  # of the means
    paired: PairedDiff  # first - second seed by seed

    @property
    def means_agree(self) -> bool:
        return (self.paper_diff > 0) == (self.measured_diff > 0)

    @property
    def verdict(self) -> str:
        """agrees / disagrees (the paired interval excludes 0 with the paper's sign / the other), inconclusive."""
        return paper_agreement(self.paper_diff, self.paired)

    def describe(self) -> str:
        """'A < B in the paper, Δ +0.0500 [+0.0400, +0.0600] measured (2 paired seeds)'."""
        paper_sign = ">" if self.paper_diff > 0 else "<"
        d = self.paired
        interval = f" [{format_diff(d.low)}, {format_diff(d.high)}]" if d.n > 1 else ""
        return (f"{self.first} {paper_sign} {self.second} in the paper; measured {self.first} − {self.second} "
                f"{format_diff(d.mean)}{interval} ({d.n} paired seeds)")


@dataclass
class PaperCheck:
    """One metric: rows with both a paper value and a measured mean, and every pair of them."""

    metric: str
    rows: list[tuple[str, float, float]]  # (case, measured mean, paper value)
    missing: list[str]  # rows the paper reports that have no measured mean (yet)
    pairs: list[PairCheck]

    def count(self, verdict: str) -> int:
        return sum(p.verdict == verdict for p in self.pairs)

    @property
    def means_agreeing(self) -> int:
        return sum(p.means_agree for p in self.pairs)

    @property
    def rank_correlation(self) -> float | None:
        """Kendall's tau between the measured and the paper's order (1: same ranking); None below 3 rows."""
        if len(self.rows) < 3:
            return None
        from scipy.stats import kendalltau

        tau = kendalltau([m for _, m, _ in self.rows], [p for _, _, p in self.rows]).statistic
        return None if tau != tau else float(tau)  # NaN when one side is constant


def paper_checks(runs: StudyRuns, rows: Sequence[CaseSummary], level: float = LEVEL) -> list[PaperCheck]:
    """One check per metric the paper block reports, in the order metrics first appear in it; each pair's paired
    difference at `level`."""
    if not runs.paper:
        return []
    values: dict[str, dict[str, float]] = runs.paper["values"]
    metrics = paper_metrics(runs)
    by_name = {row.case.name: row for row in rows}
    checks = []
    for metric in metrics:
        measured, missing = [], []
        for case, per_row in values.items():
            if metric not in per_row:
                continue
            stat = by_name[case].stats.get(metric) if case in by_name else None
            if stat is None or stat.mean is None:
                missing.append(case)
            else:
                measured.append((case, stat.mean, per_row[metric]))
        pairs = [PairCheck(a, b, pa - pb, ma - mb, paired_difference(runs, by_name[a], by_name[b], metric, level))
                 for i, (a, ma, pa) in enumerate(measured) for b, mb, pb in measured[i + 1:] if pa != pb and ma != mb]
        checks.append(PaperCheck(metric, measured, missing, pairs))
    return checks


def summary_lines(check: PaperCheck) -> list[str]:
    """The verdict of one metric, as plain lines."""
    if not check.pairs:
        return [f"{check.metric}: no pair of rows with a measured and a published difference yet"]
    tau = check.rank_correlation
    ranking = "" if tau is None else f"; rank correlation (Kendall's tau) {tau:+.2f}"
    level = level_text(check.pairs[0].paired.level)
    lines = [f"{check.metric}, {len(check.pairs)} pairs of rows, paired by seed at {level}: "
             f"{check.count(AGREES)} agree with the paper's direction, {check.count(DISAGREES)} disagree, "
             f"{check.count(INCONCLUSIVE)} inconclusive (within seed noise or fewer than 2 paired seeds); "
             f"the means alone have its direction in {check.means_agreeing} of {len(check.pairs)}{ranking}"]
    for verdict in (DISAGREES, INCONCLUSIVE):
        lines += [f"  {verdict}: {pair.describe()}" for pair in check.pairs if pair.verdict == verdict]
    if check.missing:
        lines.append(f"  not measured yet: {', '.join(check.missing)}")
    return lines


def _cells(checks: Sequence[PaperCheck], case: str) -> list[str]:
    cells = []
    for check in checks:
        found = next(((m, p) for c, m, p in check.rows if c == case), None)
        cells += [format_number(found[0]), format_number(found[1])] if found else ["—", "—"]
    return cells


def _cases(checks: Sequence[PaperCheck]) -> list[str]:
    return list(dict.fromkeys(case for check in checks for case, _, _ in check.rows))


def paper_metrics(runs: StudyRuns) -> list[str]:
    """The metrics the paper block reports."""
    if not runs.paper:
        return []
    return list(dict.fromkeys(m for per_row in runs.paper["values"].values() for m in per_row))


def print_paper(console, runs: StudyRuns, checks: Sequence[PaperCheck]) -> None:
    from rich.table import Table
    from rich.text import Text

    if not checks:
        return
    table = Table(title=f"Paper: {runs.paper['source']}", title_justify="left")
    table.add_column("Case", overflow="fold")
    for check in checks:
        table.add_column(f"{check.metric} ours", justify="right", overflow="fold")
        table.add_column("paper", justify="right", overflow="fold")
    for case in _cases(checks):
        table.add_row(Text(case), *_cells(checks, case))
    console.print(table)
    for check in checks:
        for line in summary_lines(check):
            console.print(Text(line), soft_wrap=True)


def paper_markdown(runs: StudyRuns, checks: Sequence[PaperCheck]) -> str:
    if not checks:
        return ""
    header = ["Case"] + [h for check in checks for h in (f"{check.metric} ours", "paper")]
    rows = [[case, *_cells(checks, case)] for case in _cases(checks)]
    lines = [f"## Paper: {runs.paper['source']}", "", *markdown.table(header, rows), ""]
    for check in checks:
        lines += [f"- {line.strip()}" for line in summary_lines(check)]
    return "\n".join(lines) + "\n"

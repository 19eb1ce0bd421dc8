"""Activation outliers: the largest and the median |attention logit| and |hidden state| on held-out rows, per
layer and pooled over layers (DIFF V1's outlier table). The rows are diffexp.evals.held_out's.
"""

from __future__ import annotations

from dataclasses import dataclass

from diffexp.evals.held_out import HeldOutOptions
from diffexp.evals.registry import Context, Evaluation, register


@dataclass
class OutliersOptions(HeldOutOptions):
    pass


def inputs(options: OutliersOptions, context: Context):
    from diffexp.evals.held_out import held_out_rows

    return held_out_rows(options, context)


def score(model, rows_and_source, options: OutliersOptions, context: Context):
    from diffexp.evals.held_out import variant_of
    from diffexp.evals.outliers import OutlierResults, measure

    rows, source = rows_and_source
    found = measure(model, rows, options.batch_size, context.device)
    return OutlierResults.from_pools(found, variant_of(context), source, len(rows), len(rows[0]) - 1)


OUTLIERS = register(Evaluation(
    name="outliers",
    summary="top-1/2/3 and median |attention logit| (every map) and |hidden state| on held-out rows, per layer",
    paper="DIFF V1 (arXiv 2410.05258), Activation Outliers Analysis: the largest activation values per variant.",
    options=OutliersOptions, inputs=inputs, score=score, tags=("outliers/",), reads_text=True,
))

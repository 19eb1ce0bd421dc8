"""Attention rounding error: each head's output as FlashAttention computes it in bf16 and fp16 against float64, on
the model's own q, k and v for held-out rows (diffexp.evals.rounding); a differential head's maps each rounded, then
subtracted.
"""

from __future__ import annotations

from dataclasses import dataclass

from diffexp.evals.held_out import HeldOutOptions
from diffexp.evals.registry import Context, Evaluation, register


@dataclass
class RoundingOptions(HeldOutOptions):
    pass


def inputs(options: RoundingOptions, context: Context):
    from diffexp.evals.held_out import held_out_rows

    return held_out_rows(options, context)


def score(model, rows_and_source, options: RoundingOptions, context: Context):
    from diffexp.evals.held_out import variant_of
    from diffexp.evals.rounding import RoundingResults, measure

    rows, source = rows_and_source
    sums = measure(model, rows, options.batch_size, context.device)
    return RoundingResults.from_sums(sums, variant_of(context), source, len(rows), len(rows[0]) - 1)


ROUNDING = register(Evaluation(
    name="rounding",
    summary="bf16/fp16 attention output error vs float64 per head (relative RMS and bias), FlashAttention's rounding",
    paper="The DIFF V2 blog (Miscellaneous), after Qiu and Yao (arXiv 2510.04212): biased rounding in P V.",
    options=RoundingOptions, inputs=inputs, score=score, tags=("rounding/",), reads_text=True,
))

"""Low-bit attention logits: the held-out loss (and LM-Eval tasks, --tasks) with every map's logits quantized to b
bits per layer, head and row (dynamic absmax, diffexp.evals.quantize), at each --bits width.
"""

from __future__ import annotations

from dataclasses import dataclass

from diffexp.errors import UserError
from diffexp.evals.held_out import HeldOutOptions
from diffexp.evals.registry import Context, Evaluation, option, register

MAX_BITS = 24  # the logits are fp32: past its 24-bit significand a width rounds nothing more
#: why --tasks takes no generation task
GENERATION = "a generation task decodes on the KV cache, which the quantized logits do not reach"


@dataclass
class QuantizeOptions(HeldOutOptions):
    bits: list[int] = option([16, 8, 6, 4], "widths of the quantized logits, in bits (16 stands for unquantized in "
                                            "the paper)", minimum=2)
    tasks: list[str] | None = option(None, "LM-Eval tasks scored at each width too (log-likelihood tasks, e.g. "
                                           "hellaswag; 'table2' for the papers' seven)")
    include_path: list[str] = option([], "directories of local task YAMLs")
    num_fewshot: int | None = option(None, "default: each task's own", minimum=0)
    limit: float | None = option(None, "documents per task (a fraction if < 1): for quick checks, not for reporting")
    bootstrap_iters: int = option(1000, "bootstrap resamples for the tasks' standard errors (0: none)", minimum=0)
    seed: int = option(1234, "the harness's sampling and few-shot seed")


def harness_options(options: QuantizeOptions):
    from diffexp.evals.tasks.harness import HarnessOptions

    return HarnessOptions(tasks=options.tasks, include_path=options.include_path, num_fewshot=options.num_fewshot,
                          limit=options.limit, batch_size=options.batch_size, bootstrap_iters=options.bootstrap_iters,
                          seed=options.seed)


def inputs(options: QuantizeOptions, context: Context):
    from diffexp.evals.held_out import held_out_rows
    from diffexp.evals.tasks.harness import HARNESS

    for bits in options.bits:
        if bits > MAX_BITS:
            raise UserError(f"{context.flag('bits')}={bits} is invalid: expected widths from 2 to {MAX_BITS} bits "
                            "(the logits are fp32)")
    harness = None
    if options.tasks is not None:
        harness = HARNESS.inputs(harness_options(options), context, likelihood_only=GENERATION)
    elif options.include_path or options.num_fewshot is not None or options.limit is not None:
        raise UserError(f"{context.flag('include_path')}, {context.flag('num_fewshot')} and {context.flag('limit')} "
                        f"set how {context.flag('tasks')} are scored: give {context.flag('tasks')} too")
    return held_out_rows(options, context), harness


def score(model, prepared, options: QuantizeOptions, context: Context):
    from diffexp.evals.held_out import variant_of
    from diffexp.evals.quantize import QuantizeResults, QuantizeTap, held_out_loss
    from diffexp.evals.tasks.harness import HARNESS
    from diffexp.model.heads import taps

    (rows, source), harness = prepared
    widths = list(dict.fromkeys(options.bits))
    unquantized = held_out_loss(model, rows, options.batch_size, context.device, None)
    losses = {bits: held_out_loss(model, rows, options.batch_size, context.device, bits) for bits in widths}
    metrics = {}
    for bits in widths if harness is not None else []:  # log-likelihood tasks only (inputs refused the others)
        with taps.tapping(QuantizeTap(bits)):
            metrics[bits] = HARNESS.score(model, harness, harness_options(options), context).results["tasks"]
    return QuantizeResults(unquantized, losses, metrics, variant_of(context), source, len(rows), len(rows[0]) - 1)


QUANTIZE = register(Evaluation(
    name="quantize",
    summary="held-out loss (and --tasks) with the attention logits quantized to --bits bits (absmax, per head)",
    paper="DIFF V1 (arXiv 2410.05258), Activation Outliers Analysis: HellaSwag with 16/8/6/4-bit attention logits.",
    options=QuantizeOptions, inputs=inputs, score=score, tags=("quantize/",), reads_text=True,
))

"""Attention to the answer vs noise: where the query's attention goes in multi-needle sequences (DIFF V1's
Table 5), per layer and answer depth, and the share of negative effective attention weights.

The sequences are the needle evaluation's (diffexp.data.needle), at one context length and one (N, R) cell.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from diffexp.errors import UserError
from diffexp.evals.registry import Context, Evaluation, option, register


@dataclass
class AttentionOptions:
    context_len: int = option(512, "tokens per sequence (question and answers included)", minimum=1)
    depths: list[float] = option([0.0, 0.25, 0.5, 0.75, 1.0], "answer depths, fractions of the haystack")
    nr: str = option("6,2", "the cell: N needles, R queried (N,R)")
    samples: int = option(16, "sequences per depth", minimum=1)
    haystack: Literal["corpus", "synthetic"] = option("corpus", "the filler text around the needles")
    batch_size: int = option(8, "rows per forward pass", minimum=1)
    seed: int = option(0, "seeds the sequences (the same at every evaluation)")


@dataclass
class AttentionResults:
    rows: list[dict]
    negative: float
    context_len: int
    n: int
    r: int
    variant: str | None = None
    name: str = field(default="attention")

    def table(self) -> str:
        from diffexp.evals.attention import attention_table

        return attention_table(self.rows, self.variant)

    def scalars(self) -> dict[str, float]:
        overall = [row for row in self.rows if row["layer"] == "all"]
        return {"attention/answer": sum(row["answer"] for row in overall) / len(overall),
                "attention/noise": sum(row["noise"] for row in overall) / len(overall),
                "attention/negative_fraction": self.negative}

    def summary(self) -> str:
        return (f"attention from the query (context {self.context_len}, N={self.n}, R={self.r}):\n{self.table()}")

    def save(self, directory) -> Path:
        path = Path(directory) / "attention.md"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.table() + "\n")
        return path


def parse_nr(pair: str, flag: str) -> tuple[int, int]:
    try:
        n, r = (int(x) for x in str(pair).split(","))
    except ValueError:
        raise UserError(f"{flag}={pair!r} is invalid: expected N,R pairs such as 4,2") from None
    if not 1 <= r <= n:
        raise UserError(f"{flag}={pair!r} is invalid: expected 1 <= R <= N")
    return n, r


def check_cells(context_lens: list[int], depths: list[float], nr: list[tuple[int, int]], context: Context,
                lens_flag: str) -> None:
    """Context lengths within the model and long enough for each cell; depths within [0, 1]."""
    from diffexp.data.needle import min_context_len
    from diffexp.evals.common import at_most_max_seq_len

    at_most_max_seq_len(context.flag(lens_flag), context_lens, context.arch)
    for context_len in context_lens:
        for n, r in nr:
            if context_len < min_context_len(n, r):
                raise UserError(f"{context.flag(lens_flag)}={context_len} is invalid: too short for N={n}, R={r} "
                                f"({context.flag('nr')}); expected >= {min_context_len(n, r)}")
    for depth in depths:
        if not 0.0 <= depth <= 1.0:
            raise UserError(f"{context.flag('depths')}={depth} is invalid: expected fractions in [0, 1]")


def needle_sequences(context_len: int, depths: list[float], n: int, r: int, samples: int, haystack: str, seed: int,
                     tokenizer):
    from diffexp.evals.needle import samples_by_depth

    return samples_by_depth(context_len, depths, n, r, samples, haystack, seed, tokenizer)


def inputs(options: AttentionOptions, context: Context):
    n, r = parse_nr(options.nr, context.flag("nr"))
    check_cells([options.context_len], options.depths, [(n, r)], context, "context_len")
    tokenizer = context.tokenizer()
    return needle_sequences(options.context_len, options.depths, n, r, options.samples, options.haystack,
                            options.seed, tokenizer), (n, r)


def allocation(model, by_depth, cell: tuple[int, int], context_len: int, batch_size: int, device) -> AttentionResults:
    import torch

    from diffexp.evals.attention import attention_by_depth, negative_fraction

    rows = attention_by_depth(model, by_depth, device=device, batch_size=batch_size)
    decoder = getattr(model, "model", model)
    first = next(iter(by_depth.values()))[0]
    was_training = decoder.training
    decoder.eval()
    with torch.no_grad():
        _, maps = decoder(first.tokens[None, :-1].to(device), need_weights=True)
    decoder.train(was_training)
    variant = getattr(getattr(model, "arch", None), "attention", None)
    return AttentionResults(rows, negative_fraction(maps), context_len, *cell, variant=variant)


def score(model, prepared, options: AttentionOptions, context: Context) -> AttentionResults:
    by_depth, cell = prepared
    return allocation(model, by_depth, cell, options.context_len, options.batch_size, context.device)


ATTENTION = register(Evaluation(
    name="attention",
    summary="attention to the answer vs noise in needle sequences, per layer and depth (and negative weights)",
    paper="DIFF V1 (arXiv 2410.05258), Table 5: the attention score allocated to the answer and to noise.",
    options=AttentionOptions, inputs=inputs, score=score, tags=("attention/",), reads_text=True,
))

"""Needle: multi-needle retrieval (Needle-in-a-Haystack) over context length x depth x (N needles, R queried),
scored by the greedy answer's exact match and by the best-ranked number, with the attention-to-answer table
(the `attention` evaluation) of the last cell.

DIFF V1's Figures 3-4, Shared DIFF's and DINT's retrieval tables; diffexp.data.needle makes the sequences.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from diffexp.evals.registry import Context, Evaluation, option, register
from diffexp.evals.tasks.attention import AttentionResults, allocation, check_cells, needle_sequences, parse_nr

Method = Literal["greedy", "rank"]


@dataclass
class NeedleOptions:
    context_lens: list[int] = option([512], "context lengths in the model's tokens", minimum=1)
    depths: list[float] = option([0.0, 0.25, 0.5, 0.75, 1.0], "answer depths, fractions of the haystack")
    nr: list[str] = option(["1,1", "2,2", "4,2", "6,2"], "N,R pairs: N needles, R of them queried")
    samples: int = option(50, "sequences per cell (50, as the papers)", minimum=1)
    haystack: Literal["corpus", "synthetic"] = option("corpus", "the filler text around the needles")
    methods: list[Method] = option(["greedy", "rank"], "exact match of the greedy answer; the best-ranked number")
    batch_size: int = option(16, "rows per forward pass", minimum=1)
    seed: int = option(0, "seeds the sequences (the same at every evaluation)")
    attention: bool = option(True, "also the attention-to-answer table of the last context length and N,R")
    attention_samples: int = option(16, "sequences per depth of that table", minimum=1)


@dataclass
class NeedleReport:
    """The retrieval grid (diffexp.evals.needle.NeedleResults) and the attention table."""

    retrieval: object
    attention: AttentionResults | None
    name: str = "needles"

    def scalars(self) -> dict[str, float]:
        scalars = {f"needle/{method}/N{n}R{r}": value
                   for (method, n, r), value in self.retrieval.mean_by_nr().items()}
        return scalars | (self.attention.scalars() if self.attention else {})

    def summary(self) -> str:
        return self.retrieval.table() + (f"\n\n{self.attention.summary()}" if self.attention else "")

    def save(self, directory) -> list[Path]:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        paths = [self.retrieval.to_csv(directory / "needles.csv"), *self.retrieval.heatmaps(directory / "needles")]
        (directory / "needles.md").write_text(self.retrieval.table() + "\n")
        return paths + [directory / "needles.md"] + ([self.attention.save(directory)] if self.attention else [])

    def log_to_tensorboard(self, writer, step: int) -> None:
        self.retrieval.log_to_tensorboard(writer, step)
        for tag, value in (self.attention.scalars() if self.attention else {}).items():
            writer.add_scalar(tag, value, step)


def inputs(options: NeedleOptions, context: Context):
    nr = [parse_nr(pair, context.flag("nr")) for pair in options.nr]
    check_cells(options.context_lens, options.depths, nr, context, "context_lens")
    tokenizer = context.tokenizer()
    if context.command == "eval":
        print(f"tokenizer: {tokenizer.identity} ({tokenizer.vocab_size} ids); {context.flag('context_lens')} "
              "count its tokens")
    by_depth = None
    if options.attention:
        n, r = nr[-1]
        by_depth = needle_sequences(options.context_lens[-1], options.depths, n, r, options.attention_samples,
                                    options.haystack, options.seed, tokenizer)
    return nr, tokenizer, by_depth


def score(model, prepared, options: NeedleOptions, context: Context) -> NeedleReport:
    from diffexp.evals.needle import evaluate_needles

    nr, tokenizer, by_depth = prepared
    retrieval = evaluate_needles(model, options.context_lens, options.depths, nr, options.samples, options.haystack,
                                 options.seed, context.device, options.methods, options.batch_size,
                                 progress=context.command == "eval", tokenizer=tokenizer)
    attention = None
    if by_depth is not None:
        attention = allocation(model, by_depth, nr[-1], options.context_lens[-1], max(1, options.batch_size // 2),
                               context.device)
    return NeedleReport(retrieval, attention)


NEEDLE = register(Evaluation(
    name="needle",
    summary="multi-needle retrieval (context length x depth x N,R) and attention to the answer vs noise",
    paper="DIFF V1 (arXiv 2410.05258), multi-needle retrieval (Figures 3-4) and Table 5; Shared DIFF and DINT.",
    options=NeedleOptions, inputs=inputs, score=score, tags=("needle/", "attention/"), reads_text=True,
))

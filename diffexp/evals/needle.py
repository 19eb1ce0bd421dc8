"""Multi-needle retrieval (the papers' Needle-in-a-Haystack figure and N/R table), zero-shot on any tokenizer:
the grid of (context length, answer depth, N needles, R queries) cells on held-out cities and numbers, scored
by greedy decoding and by ranking the numbers in the context; its results, the training-time callback, and
`diffexp eval needle CKPT`. The samples are diffexp.data.needle's.
"""

from __future__ import annotations

import csv
import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from diffexp.data.needle import NeedleSample, make_sample, min_context_len
from diffexp.data.tokenizer import ByteTokenizer, TextTokenizer
from diffexp.evals import plots
from diffexp.evals.scoring import (
    as_logits_fn,
    best_candidates,
    continuation_logprobs,
    evaluating,
    greedy_continuations,
    model_max_seq_len,
)

METHODS = ("greedy", "rank")  # exact match of the greedy answer; the best-ranked number in the context
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
DEFAULT_NR = ((1, 1), (2, 2), (4, 2), (6, 2))


# ----------------------------------------------------------------------------- results


@dataclass
class NeedleResults:
    """Accuracies per cell and method (long format) plus the per-question records.

    ``rows``: one dict per (context_len, depth, n_needles, n_queries, method) with ``accuracy``,
    ``correct``, ``asked`` (questions scored), ``samples`` and ``chance``.
    ``records``: one dict per (cell, sample, query): the answer, the greedy output and the ranked choice.
    """

    rows: list[dict] = field(default_factory=list)
    records: list[dict] = field(default_factory=list)

    @property
    def context_lens(self) -> list[int]:
        return sorted({r["context_len"] for r in self.rows})

    @property
    def depths(self) -> list[float]:
        return sorted({r["depth"] for r in self.rows})

    @property
    def nr(self) -> list[tuple[int, int]]:
        return sorted({(r["n_needles"], r["n_queries"]) for r in self.rows})

    @property
    def methods(self) -> list[str]:
        return [m for m in METHODS if any(r["method"] == m for r in self.rows)]

    def accuracy(self, method: str, context_len: int, depth: float, n: int, r: int) -> float:
        for row in self.rows:
            if (row["method"], row["context_len"], row["depth"], row["n_needles"], row["n_queries"]) == (
                    method, context_len, depth, n, r):
                return row["accuracy"]
        raise KeyError((method, context_len, depth, n, r))

    def mean_by_nr(self) -> dict[tuple[str, int, int], float]:
        """Mean accuracy over every (context length, depth) cell, per (method, N, R)."""
        out: dict[tuple[str, int, int], float] = {}
        for method in self.methods:
            for n, r in self.nr:
                cells = [row["accuracy"] for row in self.rows
                         if row["method"] == method and (row["n_needles"], row["n_queries"]) == (n, r)]
                out[(method, n, r)] = sum(cells) / len(cells)
        return out

    def grid(self, method: str, n: int, r: int) -> list[list[float]]:
        """Accuracy matrix: rows are context lengths, columns depths (NaN where not evaluated)."""
        values = {(row["context_len"], row["depth"]): row["accuracy"] for row in self.rows
                  if row["method"] == method and (row["n_needles"], row["n_queries"]) == (n, r)}
        return [[values.get((c, d), math.nan) for d in self.depths] for c in self.context_lens]

    def table(self) -> str:
        """Markdown table like the papers': mean accuracy per (N, R), one row per method."""
        means = self.mean_by_nr()
        header = "| method | " + " | ".join(f"N={n},R={r}" for n, r in self.nr) + " |"
        lines = [header, "|---" * (len(self.nr) + 1) + "|"]
        for method in self.methods:
            cells = " | ".join(f"{means[(method, n, r)]:.2f}" for n, r in self.nr)
            lines.append(f"| {method} | {cells} |")
        return "\n".join(lines)

    def to_csv(self, path: str | Path) -> Path:
        """Write ``rows`` (long format, one line per cell and method)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        columns = ["method", "context_len", "depth", "n_needles", "n_queries", "accuracy", "correct", "asked",
                   "samples", "chance"]
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            for row in self.rows:
                writer.writerow({k: row[k] for k in columns})
        return path

    def figures(self) -> dict[tuple[str, int, int], object]:
        """One matplotlib heatmap figure (context length x depth) per (method, N, R)."""
        return plots.needle_heatmaps(self)

    def heatmaps(self, path_prefix: str | Path) -> list[Path]:
        """Write ``<prefix>_<method>_N<n>R<r>.png`` per (method, N, R); returns the paths."""
        prefix = Path(path_prefix)
        return [plots.save_figure(fig, prefix.with_name(f"{prefix.name}_{method}_N{n}R{r}.png"), dpi=110)
                for (method, n, r), fig in self.figures().items()]

    def log_to_tensorboard(self, logger_or_writer, step: int = 0) -> None:
        """Heatmaps as images ``needle_heatmap/<method>/N<n>R<r>``, means as scalars ``needle/<method>/N<n>R<r>``.

        Accepts a ``SummaryWriter`` or a Lightning ``TensorBoardLogger`` (its ``experiment``).
        """
        writer = getattr(logger_or_writer, "experiment", logger_or_writer)
        for (method, n, r), fig in self.figures().items():
            writer.add_figure(f"needle_heatmap/{method}/N{n}R{r}", fig, global_step=step, close=True)
        for (method, n, r), value in self.mean_by_nr().items():
            writer.add_scalar(f"needle/{method}/N{n}R{r}", value, global_step=step)
        writer.flush()


# ----------------------------------------------------------------------------- scoring


def greedy_answers(model, prompts: list[list[int]], max_new: list[int], device="cpu", batch_size: int = 16,
                   tokenizer: TextTokenizer | None = None) -> list[str]:
    """Greedy decoding after each prompt until the text holds a "." or ``max_new`` tokens; returns the text
    before the ".". A row that stops without a "." returns its text followed by "<no stop>"."""
    tokenizer = tokenizer or ByteTokenizer()
    outputs = []
    for tokens in greedy_continuations(model, prompts, max_new, device=device, batch_size=batch_size,
                                       pad_id=tokenizer.eos_id, stop=lambda ids: "." in tokenizer.decode(ids)):
        text = tokenizer.decode(tokens)
        outputs.append(text[: text.index(".")] if "." in text else text + "<no stop>")
    return outputs


def score_samples(model, samples: Sequence[NeedleSample], methods: Sequence[str] = METHODS, device="cpu",
                  batch_size: int = 16, tokenizer: TextTokenizer | None = None) -> list[dict]:
    """Score every asked city of every sample (made with ``tokenizer``); one record per (sample, query).

    greedy: the decoded text up to its "." equals the answer with the prefix its tokens start with. rank: of every
    number in the context, the answer has the highest log-likelihood as the continuation ``<prefix><number>.``,
    each tokenized on its own so that every candidate follows the very same prompt tokens (chance: 1/N)."""
    tokenizer = tokenizer or ByteTokenizer()
    logits_fn, max_len = as_logits_fn(model), model_max_seq_len(model)
    prompts, answers, prefixes, meta = [], [], [], []
    for s_index, sample in enumerate(samples):
        tokens = sample.tokens.tolist()
        for q, positions in enumerate(sample.answer_target_positions):
            prompts.append(tokens[: positions[0]])
            answers.append(sample.answers[q])
            prefixes.append(sample.answer_prefixes[q])
            meta.append((s_index, q))
    greedy: list[str | None] = [None] * len(prompts)
    choices: list[str | None] = [None] * len(prompts)
    with evaluating(getattr(model, "model", model)):
        if "greedy" in methods:
            # a right answer takes at most one token per character of "<prefix><number>.", within the model
            limits = [len(prefix + answer) + 1 for prefix, answer in zip(prefixes, answers)]
            if max_len is not None:
                limits = [min(limit, max_len + 1 - len(prompt)) for limit, prompt in zip(limits, prompts)]
            greedy = greedy_answers(model, prompts, limits, device, batch_size, tokenizer)
        if "rank" in methods:  # every number in the context, as the continuation "<prefix><number>."
            candidates = [samples[s_index].candidates for s_index, _ in meta]
            pair_prompts = [prompt for prompt, cands in zip(prompts, candidates) for _ in cands]
            continuations = [tokenizer.encode(f"{prefix}{c}.") for prefix, cands in zip(prefixes, candidates)
                             for c in cands]
            scores = continuation_logprobs(logits_fn, pair_prompts, continuations, device, batch_size, max_len,
                                           pad_id=tokenizer.eos_id).tolist()
            first = 0
            for i, cands in enumerate(candidates):
                choices[i] = cands[best_candidates([scores[first : first + len(cands)]])[0]]
                first += len(cands)
    records = []
    for i, (s_index, q) in enumerate(meta):
        sample = samples[s_index]
        record = {"sample": s_index, "query": q, "city": sample.cities[q], "answer": answers[i],
                  "n_candidates": len(sample.candidates)}
        if "greedy" in methods:
            output, prefix = greedy[i], prefixes[i]
            record["greedy_output"] = output[len(prefix):] if output.startswith(prefix) else output
            record["greedy_correct"] = output == prefix + answers[i]
        if "rank" in methods:
            record["rank_choice"] = choices[i]
            record["rank_correct"] = choices[i] == answers[i]
        records.append(record)
    return records


def eval_samples(context_len: int, depth: float | None, n: int, r: int, samples: int, haystack: str = "corpus",
                 seed: int = 0, tokenizer: TextTokenizer | None = None) -> list[NeedleSample]:
    """The held-out samples of one cell (deterministic in every argument)."""
    return [make_sample(random.Random(f"needle-eval:{seed}:{context_len}:{depth}:{n}:{r}:{i}"),
                        context_len, n, r, depth, haystack, "val", tokenizer=tokenizer) for i in range(samples)]


def samples_by_depth(context_len: int, depths: Sequence[float], n: int, r: int, samples: int, haystack: str,
                     seed: int, tokenizer: TextTokenizer | None = None) -> dict[float, list[NeedleSample]]:
    """The held-out samples of one (context length, N, R) at every depth: the input of the attention table."""
    return {depth: eval_samples(context_len, depth, n, r, samples, haystack, seed, tokenizer) for depth in depths}


def evaluate_needles(
    model,
    context_lens: Sequence[int],
    depths: Sequence[float] = DEFAULT_DEPTHS,
    nr: Sequence[tuple[int, int]] = DEFAULT_NR,
    samples: int = 50,
    haystack: str = "corpus",
    seed: int = 0,
    device: str | torch.device = "cpu",
    methods: Sequence[str] = METHODS,
    batch_size: int = 16,
    progress: bool = True,
    tokenizer: TextTokenizer | None = None,
) -> NeedleResults:
    """Retrieval accuracy on held-out cities/numbers for every (context_len, depth, N, R) cell.

    Args:
        model: a Decoder, a DiffexpLM, or a causal callable ``(idx (B, T)) -> logits (B, T, vocab)``.
        context_lens: tokens per sequence (question and answers included).
        depths: answer depths, fractions of the haystack region.
        nr: (N needles, R queries) pairs.
        samples: sequences per cell (the papers use 50).
        haystack: "corpus" or "synthetic".
        seed: the samples are a pure function of (seed, cell, index).
        device: where the model runs.
        methods: "greedy" and/or "rank".
        batch_size: rows per forward pass.
        progress: show a progress bar over cells.
        tokenizer: the model's tokenizer (a ByteTokenizer or an HFTokenizer); default bytes.
    """
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"methods={list(methods)!r}: unknown {unknown}; expected some of {', '.join(METHODS)}")
    if samples <= 0:
        raise ValueError(f"samples={samples!r} is invalid: expected a positive integer")
    for context_len, (n, r) in itertools.product(context_lens, nr):
        if not 1 <= r <= n:
            raise ValueError(f"nr=({n}, {r}) is invalid: expected 1 <= R <= N")
        if context_len < min_context_len(n, r):
            raise ValueError(f"context_lens: {context_len} is too short for N={n}, R={r}: "
                             f"expected >= {min_context_len(n, r)}")
    cells = list(itertools.product(context_lens, depths, nr))
    try:
        from tqdm.auto import tqdm

        iterator = tqdm(cells, desc="needle cells", disable=not progress, leave=False)
    except ImportError:  # pragma: no cover
        iterator = cells
    results = NeedleResults()
    with evaluating(getattr(model, "model", model), device):
        for context_len, depth, (n, r) in iterator:
            cell_samples = eval_samples(context_len, depth, n, r, samples, haystack, seed, tokenizer)
            records = score_samples(model, cell_samples, methods, device, batch_size, tokenizer)
            cell = {"context_len": context_len, "depth": float(depth), "n_needles": n, "n_queries": r}
            for method in methods:
                correct = sum(rec[f"{method}_correct"] for rec in records)
                results.rows.append({**cell, "method": method, "accuracy": correct / len(records), "correct": correct,
                                     "asked": len(records), "samples": samples,
                                     "chance": 1.0 / n if method == "rank" else 0.0})
            results.records.extend({**cell, **rec} for rec in records)
    return results

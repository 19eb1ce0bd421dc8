"""Multi-needle retrieval grid (the papers' Needle-in-a-Haystack figure and N/R table).

For every cell (context length, answer depth, N needles, R queries), ``samples`` sequences are drawn
from ``diffexp.data.needle_samples.make_sample`` with held-out cities and numbers (split "val"), and each
asked city is scored two ways:

* ``greedy``: the model decodes greedily after the question prompt (``... what is the magic number of
  <city>? ``) until it emits ``.`` (at most ``len(answer) + 1`` tokens: anything longer is wrong);
  exact match of the decoded digits with the answer. With R > 1, the prompt of query k holds the
  earlier questions with their correct answers.
* ``rank``: the log-likelihood (summed over the digits and the closing ``.``) of every number present
  in the context as the continuation of the prompt; correct when the answer scores highest.
  Chance is 1/N.

Accuracy per cell is the mean over samples and asked cities. ``model`` may be a ``Decoder``, a
``DiffexpLM`` or any callable ``(idx: LongTensor (B, T)) -> logits (B, T, vocab)`` that is causal
(the logits at t depend on idx[:, : t + 1] only); ``NeedleOracle`` is such a callable that copies
the answer from the context (it scores 1.0 with both methods).
"""

from __future__ import annotations

import itertools
import random
import re
from collections.abc import Sequence
from pathlib import Path

import lightning as L
import torch

from diffexp.data.needle_samples import EOS_ID, VOCAB_SIZE, NeedleSample, make_sample, min_context_len
from diffexp.evals import refuse_sharded_model
from diffexp.evals.needle_results import METHODS, NeedleResults
from diffexp.evals.scoring import (
    LogitsFn,
    as_logits_fn,
    best_candidates,
    continuation_logprobs,
    evaluating,
    greedy_continuations,
    model_max_seq_len,
)

DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
DEFAULT_NR = ((1, 1), (2, 2), (4, 2), (6, 2))
DOT = ord(".")


# ----------------------------------------------------------------------------- oracle


class NeedleOracle:
    """A causal "model" that answers every needle question by copying the number from the context.

    At the position right after ``what is the magic number of <city>? `` (and after each correct digit
    so far) it puts ``confidence`` on the next character of ``<number>.`` read from the needle
    ``the magic number of <city> is <number>.`` earlier in the row; everywhere else the logits are 0.
    """

    _question = re.compile(rb"what is the magic number of (\w+)\? ")

    def __init__(self, vocab_size: int = VOCAB_SIZE, confidence: float = 30.0) -> None:
        self.vocab_size, self.confidence = vocab_size, confidence

    def __call__(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        logits = torch.zeros(B, T, self.vocab_size)
        for b in range(B):
            row = bytes(t if t < 256 else 0 for t in idx[b].tolist())
            for match in self._question.finditer(row):
                city = match.group(1)
                needle = re.search(rb"the magic number of " + re.escape(city) + rb" is (\d+)\.", row[: match.start()])
                if needle is None:
                    continue
                answer = needle.group(1) + b"."
                prompt_end = match.end() - 1  # the space after "?"
                for j, char in enumerate(answer):
                    pos = prompt_end + j
                    if pos >= T or row[prompt_end + 1 : pos + 1] != answer[:j]:
                        break
                    logits[b, pos, char] = self.confidence
        return logits.to(idx.device)


# ----------------------------------------------------------------------------- scoring


def greedy_answers(logits_fn: LogitsFn, prompts: list[list[int]], max_new: list[int], device="cpu",
                   batch_size: int = 16) -> list[str]:
    """Greedy decoding after each prompt until "." or ``max_new`` tokens; returns the text before ".".

    A row that stops without a "." returns its text followed by "<no stop>".
    """
    outputs = []
    for tokens in greedy_continuations(logits_fn, prompts, max_new, DOT, device, batch_size, pad_id=EOS_ID):
        text = bytes(t for t in tokens if t < 256).decode("latin-1")
        outputs.append(text[:-1] if tokens and tokens[-1] == DOT else text + "<no stop>")
    return outputs


def score_samples(model, samples: Sequence[NeedleSample], methods: Sequence[str] = METHODS, device="cpu",
                  batch_size: int = 16) -> list[dict]:
    """Score every asked city of every sample; one record per (sample, query)."""
    logits_fn, max_len = as_logits_fn(model), model_max_seq_len(model)
    prompts, answers, meta = [], [], []
    for s_index, sample in enumerate(samples):
        tokens = sample.tokens.tolist()
        for q, (answer, positions) in enumerate(zip(sample.answers, sample.answer_target_positions)):
            prompts.append(tokens[: positions[0]])
            answers.append(answer)
            meta.append((s_index, q))
    greedy: list[str | None] = [None] * len(prompts)
    choices: list[str | None] = [None] * len(prompts)
    with evaluating(getattr(model, "model", model)):
        if "greedy" in methods:
            greedy = greedy_answers(logits_fn, prompts, [len(a) + 1 for a in answers], device, batch_size)
        if "rank" in methods:  # every number in the context, as the continuation "<number>."
            candidates = [samples[s_index].candidates for s_index, _ in meta]
            pair_prompts = [prompt for prompt, cands in zip(prompts, candidates) for _ in cands]
            continuations = [list(f"{c}.".encode()) for cands in candidates for c in cands]
            scores = continuation_logprobs(logits_fn, pair_prompts, continuations, device, batch_size, max_len,
                                           pad_id=EOS_ID).tolist()
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
            record["greedy_output"] = greedy[i]
            record["greedy_correct"] = greedy[i] == answers[i]
        if "rank" in methods:
            record["rank_choice"] = choices[i]
            record["rank_correct"] = choices[i] == answers[i]
        records.append(record)
    return records


def eval_samples(context_len: int, depth: float | None, n: int, r: int, samples: int, haystack: str = "corpus",
                 seed: int = 0) -> list[NeedleSample]:
    """The held-out samples of one cell (deterministic in every argument)."""
    return [make_sample(random.Random(f"needle-eval:{seed}:{context_len}:{depth}:{n}:{r}:{i}"),
                        context_len, n, r, depth, haystack, "val") for i in range(samples)]


def samples_by_depth(context_len: int, depths: Sequence[float], n: int, r: int, samples: int, haystack: str,
                     seed: int) -> dict[float, list[NeedleSample]]:
    """The held-out samples of one (context length, N, R) at every depth: the input of the attention table."""
    return {depth: eval_samples(context_len, depth, n, r, samples, haystack, seed) for depth in depths}


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
            cell_samples = eval_samples(context_len, depth, n, r, samples, haystack, seed)
            records = score_samples(model, cell_samples, methods, device, batch_size)
            cell = {"context_len": context_len, "depth": float(depth), "n_needles": n, "n_queries": r}
            for method in methods:
                correct = sum(rec[f"{method}_correct"] for rec in records)
                results.rows.append({**cell, "method": method, "accuracy": correct / len(records), "correct": correct,
                                     "asked": len(records), "samples": samples,
                                     "chance": 1.0 / n if method == "rank" else 0.0})
            results.records.extend({**cell, **rec} for rec in records)
    return results


# ----------------------------------------------------------------------------- training-time hook and CLI


def _tensorboard_writer(trainer):
    for logger in getattr(trainer, "loggers", []) or []:
        experiment = getattr(logger, "experiment", None)
        if hasattr(experiment, "add_figure"):
            return experiment
    return None


class NeedleEvalCallback(L.Callback):
    """Run the retrieval grid (and the attention-noise table) at the end of validation and log it.

    Configure it under ``trainer.callbacks`` with ``class_path: diffexp.evals.needle.NeedleEvalCallback``.
    Logs the scalars ``needle/<method>/N<n>R<r>``, the heatmaps ``needle_heatmap/...`` and, with
    ``attention``, ``attention/answer``, ``attention/noise`` (mean over layers and depths, from
    (N, R) = ``nr[-1]`` at ``context_lens[-1]``) and ``attention/negative_fraction``; writes
    ``needles-step<N>.csv`` into the run directory. Runs on global rank 0 only, calling the unwrapped
    model: fine for single-device and DDP runs; under FSDP it stops at setup and names the checkpoint
    command instead (``diffexp eval needle CKPT``).

    Args:
        context_lens: context lengths of the grid (each <= model.arch.max_seq_len).
        depths: answer depths.
        nr: (N needles, R queries) pairs.
        samples: sequences per cell (50, as the papers; the CPU recipes use 10).
        haystack: "corpus" or "synthetic".
        every_n_validations: evaluate at every n-th validation (1: each one).
        attention: also log the attention-to-answer / noise shares and the negative fraction.
        methods: "greedy" and/or "rank".
        batch_size: rows per forward pass.
        seed: seeds the evaluation samples (the same at every evaluation).
    """

    def __init__(self, context_lens: list[int] = [512], depths: list[float] = list(DEFAULT_DEPTHS),  # noqa: B006
                 nr: list[tuple[int, int]] = list(DEFAULT_NR), samples: int = 50,  # noqa: B006
                 haystack: str = "corpus", every_n_validations: int = 1, attention: bool = True,
                 methods: list[str] = list(METHODS), batch_size: int = 16, seed: int = 0) -> None:  # noqa: B006
        super().__init__()
        if every_n_validations < 1:
            raise ValueError(f"every_n_validations={every_n_validations!r} is invalid: expected >= 1")
        for context_len, (n, r) in itertools.product(context_lens, nr):
            if context_len < min_context_len(n, r):
                raise ValueError(f"context_lens: {context_len} is too short for N={n}, R={r}: "
                                 f"expected >= {min_context_len(n, r)}")
        self.context_lens, self.depths, self.nr = list(context_lens), list(depths), [tuple(p) for p in nr]
        self.samples, self.haystack, self.every = samples, haystack, every_n_validations
        self.attention, self.methods, self.batch_size, self.seed = attention, list(methods), batch_size, seed
        self._validations = 0

    def setup(self, trainer, pl_module, stage: str) -> None:
        refuse_sharded_model(trainer, "NeedleEvalCallback", "diffexp eval needle <run>/checkpoints/last.ckpt")

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        self._validations += 1
        if (self._validations - 1) % self.every or trainer.global_rank != 0:
            return
        step = trainer.global_step
        results = evaluate_needles(pl_module, self.context_lens, self.depths, self.nr, self.samples,
                                   self.haystack, self.seed, pl_module.device, self.methods, self.batch_size,
                                   progress=False)
        writer = _tensorboard_writer(trainer)
        if writer is not None:
            results.log_to_tensorboard(writer, step)
        # also in callback_metrics, so sweeps can use them as objective or compare column
        scalars = {f"needle/{method}/N{n}R{r}": value for (method, n, r), value in results.mean_by_nr().items()}
        report = [f"## Retrieval at step {step}\n", results.table()]
        if trainer.log_dir is not None:
            results.to_csv(Path(trainer.log_dir) / f"needles-step{step:06d}.csv")
        if self.attention:
            from diffexp.evals.attention import attention_by_depth, attention_table, negative_fraction

            n, r = self.nr[-1]
            by_depth = samples_by_depth(self.context_lens[-1], self.depths, n, r, min(self.samples, 8), self.haystack,
                                        self.seed)
            all_rows = attention_by_depth(pl_module, by_depth, device=pl_module.device,
                                          batch_size=max(1, self.batch_size // 4))
            rows = [row for row in all_rows if row["layer"] == "all"]
            decoder = getattr(pl_module, "model", pl_module)
            with torch.no_grad():
                _, maps = decoder(by_depth[self.depths[0]][0].tokens[None, :-1].to(pl_module.device),
                                  need_weights=True)
            scalars["attention/answer"] = sum(x["answer"] for x in rows) / len(rows)
            scalars["attention/noise"] = sum(x["noise"] for x in rows) / len(rows)
            scalars["attention/negative_fraction"] = negative_fraction(maps)
            report += [f"\n## Attention to answer vs noise (N={n}, R={r}), step {step}\n",
                       attention_table(all_rows, getattr(getattr(pl_module, "arch", None), "attention", None))]
        for name, value in scalars.items():
            trainer.callback_metrics[name] = torch.tensor(float(value))
            if writer is not None and name.startswith("attention/"):
                writer.add_scalar(name, value, step)
        text = "\n".join(report)
        print(text)
        if trainer.log_dir is not None:
            (Path(trainer.log_dir) / f"needles-step{step:06d}.md").write_text(text + "\n")


def _parse_nr(pairs: Sequence[str]) -> list[tuple[int, int]]:
    from diffexp.errors import UserError

    nr = []
    for pair in pairs:
        try:
            n, r = (int(x) for x in pair.split(","))
        except ValueError:
            raise UserError(f"--nr={pair!r} is invalid: expected N,R pairs such as 4,2") from None
        if not 1 <= r <= n:
            raise UserError(f"--nr={pair!r} is invalid: expected 1 <= R <= N")
        nr.append((n, r))
    return nr


def needle_main(argv: list[str]) -> int:
    """Multi-needle retrieval grid (context length x depth x N,R) and the attention-to-answer table."""
    import argparse

    from diffexp.errors import UserError
    from diffexp.evals import common

    parser = argparse.ArgumentParser(prog="diffexp eval needle", description=needle_main.__doc__)
    parser.add_argument("checkpoint", metavar=common.CKPT_KEY,
                        help="a .ckpt file, a sharded checkpoint directory or a `diffexp export` directory")
    parser.add_argument("--context-lens", type=int, nargs="+", default=[512])
    parser.add_argument("--depths", type=float, nargs="+", default=list(DEFAULT_DEPTHS))
    parser.add_argument("--nr", nargs="+", default=[f"{n},{r}" for n, r in DEFAULT_NR], help="N,R pairs")
    parser.add_argument("--samples", type=int, default=50)
    parser.add_argument("--haystack", choices=("corpus", "synthetic"), default="corpus")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None, help="directory for needles.csv, heatmaps and attention.md "
                        "(default: <run>/eval/ beside the checkpoint's checkpoints/)")
    args = parser.parse_args(argv)
    # everything is checked before the model is built and before any output exists
    checkpoint, hparams = common.load_checkpoint(args.checkpoint)
    nr = _parse_nr(args.nr)
    common.positive("--samples", args.samples)
    common.positive("--batch-size", args.batch_size)
    common.positive("--context-lens", args.context_lens)
    common.at_most_max_seq_len("--context-lens", args.context_lens, hparams["arch"])
    for context_len, (n, r) in itertools.product(args.context_lens, nr):
        if context_len < min_context_len(n, r):
            raise UserError(f"--context-lens={context_len} is invalid: too short for N={n}, R={r} (--nr); "
                            f"expected >= {min_context_len(n, r)}")
    for depth in args.depths:
        if not 0.0 <= depth <= 1.0:
            raise UserError(f"--depths={depth} is invalid: expected fractions in [0, 1]")
    common.byte_vocab("needle", hparams["arch"], VOCAB_SIZE)
    common.check_device(args.device)
    common.check_out(args.out)
    from diffexp.evals.attention import attention_by_depth, attention_table

    model = common.load_model(checkpoint, args.checkpoint, args.device)
    results = evaluate_needles(model, args.context_lens, args.depths, nr, args.samples, args.haystack, args.seed,
                               args.device, batch_size=args.batch_size)
    print(results.table())
    n, r = nr[-1]
    by_depth = samples_by_depth(args.context_lens[-1], args.depths, n, r, min(args.samples, 16), args.haystack,
                                args.seed)
    table = attention_table(attention_by_depth(model, by_depth, device=args.device), model.arch.attention)
    print(f"\nattention from the query (context {args.context_lens[-1]}, N={n}, R={r}):\n{table}")
    out, writer, step = common.eval_output(args.checkpoint, args.out, hparams["global_step"])
    results.to_csv(out / "needles.csv")
    results.heatmaps(out / "needles")
    (out / "attention.md").write_text(table + "\n")
    (out / "needles.md").write_text(results.table() + "\n")
    if writer is not None:  # into the run's own TensorBoard, at the checkpoint's step
        results.log_to_tensorboard(writer, step)
        writer.close()
    print(f"wrote {out}/needles.csv, needles.md, needles_*.png, attention.md")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m diffexp.evals.needle CKPT ...``: the same as ``diffexp eval needle CKPT ...``."""
    import sys

    from diffexp.errors import guarded

    return guarded(needle_main, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    raise SystemExit(main())

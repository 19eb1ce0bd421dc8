"""Multi-needle retrieval grid (the papers' Needle-in-a-Haystack figure and N/R table), zero-shot on any
tokenizer.

For every cell (context length, answer depth, N needles, R queries), ``samples`` sequences are drawn
from ``diffexp.data.needle_samples.make_sample`` with held-out cities and numbers (split "val"), rendered
as text and tokenized with the model's tokenizer (bytes by default; lengths count its tokens), and each
asked city is scored two ways:

* ``greedy``: the model decodes greedily (with its KV cache) after the question prompt (``... what is the
  magic number of <city>? `` up to the answer's first token: with a BPE that merges the space into the
  number, up to ``?``) until the decoded text holds a ``.`` (a BPE may merge it into a longer token), at
  most one token per character of the expected continuation (anything longer is wrong); exact match of
  the text before the ``.`` with the answer (and the space the answer's tokens start with). With R > 1,
  the prompt of query k holds the earlier questions with their correct answers.
* ``rank``: the log-likelihood (summed over the tokens of ``<number>.``) of every number present in the
  context as the continuation of the prompt; correct when the answer scores highest. Chance is 1/N.
  Each candidate's continuation (``" 48213."`` when the answer's tokens start with the space) is tokenized
  on its own, not together with the prompt: that way every candidate follows the very same prompt tokens
  (a joint tokenization could merge the prompt's last token with the candidate and change the prompt per
  candidate), and for tokenizers that split text before a number (GPT-2 style pre-tokenizers: ``?`` |
  `` 48213`` | ``.``) it is the tokenization the number would have in running text.

Accuracy per cell is the mean over samples and asked cities. ``model`` may be a ``Decoder``, a
``DiffexpLM`` or any callable ``(idx: LongTensor (B, T)) -> logits (B, T, vocab)`` that is causal
(the logits at t depend on idx[:, : t + 1] only); ``NeedleOracle`` is such a callable that copies
the answer from the context (it scores 1.0 with both methods). ``diffexp eval needle`` is
``diffexp.evals.needle_cli``.
"""

from __future__ import annotations

import bisect
import itertools
import random
import re
from collections.abc import Sequence
from pathlib import Path

import lightning as L
import torch

from diffexp.data.needle_samples import NeedleSample, make_sample, min_context_len
from diffexp.data.tokenizer import ByteTokenizer, TextTokenizer
from diffexp.evals import refuse_sharded_model
from diffexp.evals.needle_results import METHODS, NeedleResults
from diffexp.evals.scoring import (
    as_logits_fn,
    best_candidates,
    continuation_logprobs,
    evaluating,
    greedy_continuations,
    model_max_seq_len,
)

DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
DEFAULT_NR = ((1, 1), (2, 2), (4, 2), (6, 2))


# ----------------------------------------------------------------------------- oracle


class NeedleOracle:
    """A causal "model" that answers every needle question by copying the number from the context.

    After ``what is the magic number of <city>?`` (the prompt: the tokens that end by the answer's digits,
    so the space after "?" too for bytes) and after each correct token so far, it puts ``confidence`` on
    the next token of the continuation ``<number>.`` (tokenized on its own, with whatever the prompt left
    before the digits) read from the needle ``the magic number of <city> is <number>.`` earlier in the
    row; everywhere else the logits are 0. Rows are read as text through ``tokenizer`` (default bytes).
    """

    _question = re.compile(r"what is the magic number of (\w+)\?")

    def __init__(self, tokenizer: TextTokenizer | None = None, confidence: float = 30.0,
                 vocab_size: int | None = None) -> None:
        self.tokenizer = tokenizer or ByteTokenizer()
        self.vocab_size = vocab_size or self.tokenizer.vocab_size
        self.confidence = confidence
        self._texts: dict[int, str] = {}

    def _text(self, token: int) -> str:
        if token not in self._texts:  # at least one character: the end-of-document id (padding too) is "\0"
            self._texts[token] = self.tokenizer.decode([token]) or "\0"
        return self._texts[token]

    def __call__(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        logits = torch.zeros(B, T, self.vocab_size)
        for b in range(B):
            row = idx[b].tolist()
            pieces = [self._text(t) for t in row]
            ends = list(itertools.accumulate(len(piece) for piece in pieces))  # text offset after each token
            text = "".join(pieces)
            for match in self._question.finditer(text):
                city = match.group(1)
                needle = re.search(rf"the magic number of {re.escape(city)} is (\d+)\.", text[: match.start()])
                if needle is None:
                    continue
                mark = match.end() - 1  # the "?"
                last = bisect.bisect_right(ends, mark + 2) - 1  # the prompt's last token: the last to end by the digits
                while not "? ".startswith(text[mark : ends[last]]):  # padding after a prompt that ends at "?"
                    last -= 1
                # the continuation: what the prompt leaves of "? " (the space, with a BPE), the number and "."
                answer = self.tokenizer.encode("? "[ends[last] - mark :] + needle.group(1) + ".")
                for j, token in enumerate(answer):
                    pos = last + j
                    if pos >= T or row[last + 1 : pos + 1] != answer[:j]:
                        break
                    logits[b, pos, token] = self.confidence
        return logits.to(idx.device)


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
    """Score every asked city of every sample (made with ``tokenizer``); one record per (sample, query)."""
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


# ----------------------------------------------------------------------------- training-time hook


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
    The samples are tokenized with the data module's tokenizer (bytes when it has none), so a run trained
    on text with a BPE is scored zero-shot as well as one trained on the needle task.

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
        tokenizer = getattr(getattr(trainer, "datamodule", None), "tokenizer", None) or ByteTokenizer()
        results = evaluate_needles(pl_module, self.context_lens, self.depths, self.nr, self.samples,
                                   self.haystack, self.seed, pl_module.device, self.methods, self.batch_size,
                                   progress=False, tokenizer=tokenizer)
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
                                        self.seed, tokenizer)
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



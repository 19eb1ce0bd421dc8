"""A diffexp model as an EleutherAI LM-Eval harness model (``lm_eval.api.model.LM``): the checkpoint's own
tokenizer, batched scoring through ``diffexp.evals.scoring`` and decoding with the KV cache.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from lm_eval.api.model import LM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from diffexp.evals.scoring import as_logits_fn, continuation_scores, greedy_continuations
from diffexp.generate.decode import generate
from diffexp.generate.sampling import Sampling

DEFAULT_MAX_GEN_TOKS = 256  # the harness's Hugging Face default


class DiffexpHarnessLM(LM):
    """``model``: a diffexp ``Decoder`` (or a ``DiffexpLM``); ``tokenizer``: a diffexp ``TextTokenizer``."""

    def __init__(self, model, tokenizer, batch_size: int = 16, device: str = "cpu", seed: int = 0,
                 progress: bool = True, compile: bool = False) -> None:
        super().__init__()
        self.model = getattr(model, "model", model).to(device).eval()
        self.compile = compile  # generate through the compiled decoding step
        self.tokenizer, self.batch_size, self.progress = tokenizer, batch_size, progress
        self._device = torch.device(device)
        self.max_length = self.model.cfg.max_seq_len
        self.generator = torch.Generator(device=device).manual_seed(seed)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    # -- log-likelihoods -------------------------------------------------------------------------------
    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context ids, continuation ids) as the harness's Hugging Face models make them: the context's trailing
        spaces move to the continuation and the pair is encoded whole, so a merge across the boundary is kept."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        if not context:
            return [self.eot_token_id], self.tokenizer.encode(continuation)
        whole = self.tokenizer.encode(context + continuation)
        context_ids = self.tokenizer.encode(context)
        return context_ids, whole[len(context_ids):]

    def _score_pairs(self, pairs: list[tuple[list[int], list[int]]], what: str) -> tuple[torch.Tensor, list[bool]]:
        if not pairs:
            return torch.empty(0, dtype=torch.float64), []
        with torch.inference_mode():
            return continuation_scores(as_logits_fn(self.model), [p for p, _ in pairs], [c for _, c in pairs],
                                       self._device, self.batch_size, self.max_length, self.eot_token_id,
                                       progress=what if self.progress else None)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [self.encode_pair(*request.args) for request in requests]
        scores, greedy = self._score_pairs(pairs, "loglikelihood")
        results = [(float(score), is_greedy) for score, is_greedy in zip(scores.tolist(), greedy)]
        for request, result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", request.args, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """log p(text) from disjoint windows of at most max_seq_len predicted tokens, each with as much preceding
        context as fits (the first after the end-of-document token)."""
        windows, owner = [], []
        for index, request in enumerate(requests):
            ids = self.tokenizer.encode(request.args[0])
            for window in get_rolling_token_windows(ids, self.eot_token_id, self.max_length, 1):
                windows.append(make_disjoint_window(window))
                owner.append(index)
        scores, _ = self._score_pairs(windows, "loglikelihood_rolling")
        totals = [0.0] * len(requests)
        for index, score in zip(owner, scores.tolist()):
            totals[index] += score
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # -- generation ------------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Decoding until a stop string, the end-of-document token or max_gen_toks; greedy unless a task samples."""
        prompts, limits = [], []
        groups: dict[tuple, list[int]] = defaultdict(list)  # one decoding call per group
        for index, request in enumerate(requests):
            context, kwargs = request.args
            settings = _generation_settings(kwargs)
            ids = self.tokenizer.encode(context) or [self.eot_token_id]
            # the prompt loses its first tokens only as far as needed to leave room for max_gen_toks new ones
            # (at most half the model's length); the last new token is never fed back
            reserve = min(settings["max_new"], self.max_length // 2)
            prompts.append(ids[-(self.max_length - reserve + 1):])
            limits.append(min(settings["max_new"], self.max_length - len(prompts[-1]) + 1))
            sampling = settings["sampling"]
            # greedy rows of any lengths share batches (scoring.greedy_continuations); sampled ones need equal
            # prompt lengths and budgets (generate.decode.generate)
            shape = None if sampling.temperature == 0 else (len(prompts[-1]), limits[-1])
            groups[(tuple(settings["until"]), sampling, shape)].append(index)
        outputs: list[str | None] = [None] * len(requests)
        work = list(groups.items())
        if self.progress:
            from tqdm.auto import tqdm

            work = tqdm(work, desc="generate_until", unit="group")
        for (until, sampling, shape), indices in work:
            if shape is None:
                texts = self._greedy_texts([prompts[i] for i in indices], [limits[i] for i in indices], until)
            else:
                texts = []
                for first in range(0, len(indices), self.batch_size):
                    chunk = indices[first : first + self.batch_size]
                    texts += self._sampled_texts([prompts[i] for i in chunk], limits[chunk[0]], sampling, until)
            for index, text in zip(indices, texts):
                outputs[index] = text
                self.cache_hook.add_partial("generate_until", requests[index].args, text)
        return outputs

    def _greedy_texts(self, prompts: list[list[int]], limits: list[int], until: tuple[str, ...]) -> list[str]:
        def reached(tokens: list[int]) -> bool:
            return any(stop in self.tokenizer.decode(tokens) for stop in until)

        with torch.inference_mode():
            generated = greedy_continuations(self.model, prompts, limits, self.eot_token_id, self._device,
                                             self.batch_size, self.eot_token_id, reached, compile=self.compile)
        return [_cut_at_stops(self.tokenizer.decode([t for t in ids if t != self.eot_token_id]), until)
                for ids in generated]

    @torch.inference_mode()
    def _sampled_texts(self, prompts: list[list[int]], max_new: int, sampling: Sampling,
                       until: tuple[str, ...]) -> list[str]:
        prompt = torch.tensor(prompts, device=self._device)
        generated: list[list[int]] = [[] for _ in prompts]
        done = [False] * len(prompts)
        for tokens in generate(self.model, prompt, max_new, sampling, self.eot_token_id, self.generator,
                               compile=self.compile):
            for row, token in enumerate(tokens.tolist()):
                if done[row]:
                    continue
                if token == self.eot_token_id:
                    done[row] = True
                    continue
                generated[row].append(token)
                done[row] = any(stop in self.tokenizer.decode(generated[row]) for stop in until)
            if all(done):
                break
        return [_cut_at_stops(self.tokenizer.decode(ids), until) for ids in generated]


def _generation_settings(kwargs: dict | None) -> dict:
    """The harness's generation kwargs as diffexp's: stop strings, new tokens at most, and sampling (greedy
    unless do_sample)."""
    kwargs = dict(kwargs or {})
    until = kwargs.pop("until", None) or []
    until = [until] if isinstance(until, str) else list(until)
    max_new = int(kwargs.pop("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
    temperature = float(kwargs.get("temperature", 0.0) or 0.0)
    sampling = Sampling(temperature, kwargs.get("top_k"), kwargs.get("top_p")) \
        if kwargs.get("do_sample") and temperature > 0 else Sampling(0.0)
    return {"until": until, "max_new": max(1, max_new), "sampling": sampling}


def _cut_at_stops(text: str, until: list[str]) -> str:
    for stop in until:
        if stop:
            text = text.split(stop, 1)[0]
    return text

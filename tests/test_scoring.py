"""The shared scoring layer (diffexp.evals.scoring), checked against hand computations."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from diffexp.evals.scoring import (
    argmax_matches,
    as_logits_fn,
    attention_shares,
    attention_to_span,
    best_candidates,
    candidate_logprobs,
    continuation_logprobs,
    evaluating,
    greedy_continuations,
    model_max_seq_len,
    span_logprobs,
)

# a bigram "model" over 4 tokens: the logits at t depend on idx[:, t] only, so it is causal
BIGRAM = torch.tensor([[2.0, 0.0, -1.0, 0.5],
                       [0.0, 3.0, 1.0, -2.0],
                       [1.0, 1.0, 1.0, 1.0],
                       [-1.0, 0.0, 4.0, 0.0]])


def bigram(idx: torch.Tensor) -> torch.Tensor:
    return BIGRAM[idx]


def log_softmax_by_hand(row: list[float], k: int) -> float:
    return row[k] - math.log(sum(math.exp(x) for x in row))


def continuation_by_hand(prompt: list[int], continuation: list[int]) -> float:
    row = prompt + continuation
    return sum(log_softmax_by_hand(BIGRAM[row[t - 1]].tolist(), row[t]) for t in range(len(prompt), len(row)))


def test_span_logprob_is_the_sum_of_log_softmax_values():
    logits = torch.tensor([[[1.0, 2.0, 0.0], [0.5, -1.0, 3.0], [0.0, 0.0, 0.0]]])  # (1, T=3, V=3)
    tokens = torch.tensor([[0, 1, 2, 0]])  # logits[0, t] predicts tokens[0, t + 1]
    expected = (log_softmax_by_hand([0.5, -1.0, 3.0], 2)  # tokens[2] from logits[1]
                + log_softmax_by_hand([0.0, 0.0, 0.0], 0))  # tokens[3] from logits[2]
    scores = span_logprobs(logits, tokens, [(2, 4)])
    assert scores.dtype == torch.float64 and scores.shape == (1,)
    assert float(scores[0]) == pytest.approx(expected, abs=1e-6)
    assert float(span_logprobs(logits, tokens, [(1, 2)])[0]) == pytest.approx(log_softmax_by_hand([1.0, 2.0, 0.0], 1))
    assert float(span_logprobs(logits, tokens, [(2, 2)])[0]) == 0.0
    with pytest.raises(ValueError, match="span"):
        span_logprobs(logits, tokens, [(0, 2)])  # token 0 has no prediction


def test_continuation_logprobs_match_hand_sums_whatever_the_batching():
    prompts = [[0], [1, 2, 3], [2, 2], [3]]
    continuations = [[1, 1, 2], [0], [3, 2], [2, 0, 0, 1]]
    expected = [continuation_by_hand(p, c) for p, c in zip(prompts, continuations)]
    for batch_size in (1, 3, 16):
        scores = continuation_logprobs(bigram, prompts, continuations, batch_size=batch_size, pad_id=3)
        assert scores.tolist() == pytest.approx(expected, abs=1e-6)
    # rows over max_len inputs drop their first tokens; a bigram model needs only the last prompt token
    cut = continuation_logprobs(bigram, [[1, 2, 3]], [[0, 1]], max_len=2)
    assert float(cut[0]) == pytest.approx(continuation_by_hand([1, 2, 3], [0, 1]), abs=1e-6)


def test_candidate_logprobs_score_every_candidate_after_every_prompt():
    prompts, candidates = [[0, 1], [3]], [[2], [1, 1], [0, 3, 3]]
    scores = candidate_logprobs(bigram, prompts, candidates, batch_size=2)
    assert scores.shape == (2, 3)
    for i, p in enumerate(prompts):
        for j, c in enumerate(candidates):
            assert float(scores[i, j]) == pytest.approx(continuation_by_hand(p, c), abs=1e-6)


def test_best_candidates_pick_the_argmax_and_the_first_on_ties():
    assert best_candidates([[0.0, 2.0, 1.0], [-1.0, -3.0, -2.0], [5.0, 5.0, 1.0]]) == [1, 0, 0]
    assert best_candidates(torch.tensor([[1.0, 9.0]])) == [1]
    with pytest.raises(ValueError, match="prompts, candidates"):
        best_candidates([1.0, 2.0])


def test_argmax_matches_count_only_masked_positions():
    logits = torch.tensor([[[0.0, 1.0], [3.0, 0.0], [0.0, 2.0]]])  # argmax 1, 0, 1
    targets = torch.tensor([[1, 1, 1]])
    assert argmax_matches(logits, targets) == (2, 3)
    assert argmax_matches(logits, targets, torch.tensor([[False, True, True]])) == (1, 2)


def test_greedy_continuations_follow_the_argmax_chain_and_stop():
    # argmax of BIGRAM rows: 0 -> 0, 1 -> 1, 2 -> 0 (first of ties), 3 -> 2
    assert greedy_continuations(bigram, [[3], [1, 2]], [3, 2]) == [[2, 0, 0], [0, 0]]
    assert greedy_continuations(bigram, [[3], [1]], [5, 2], stop_id=0, batch_size=1) == [[2, 0], [1, 1]]
    assert greedy_continuations(bigram, [[3]], [0]) == [[]]


def test_attention_shares_on_a_hand_built_row():
    # heads x keys, query position 2: key 3 is in the future and must not count
    rows = torch.tensor([[0.5, -0.25, 0.25, 0.9],
                         [0.0, 0.0, 0.0, 0.7]])
    first, middle, future = (torch.tensor(m) for m in ([True, False, False, False], [False, True, True, False],
                                                       [False, False, False, True]))
    shares = attention_shares(rows, 2, [first, middle, future])
    assert shares.shape == (2, 3)
    # |0.5| + |-0.25| + |0.25| = 1.0: the shares are 0.5, 0.25 + 0.25, 0
    assert shares[0].tolist() == pytest.approx([0.5, 0.5, 0.0])
    assert torch.isnan(shares[1]).all()  # nothing causal to share


def test_attention_to_span_reads_each_query_row():
    attention = torch.tensor([[1.0, 0.0, 0.0, 0.0],
                              [0.5, 0.5, 0.0, 0.0],
                              [0.1, 0.6, 0.3, 0.0],
                              [0.2, 0.2, 0.2, 0.4]])
    shares = attention_to_span(attention[None], [2, 3], [(1, 3)])  # a batch of one
    assert shares.shape == (1, 2)
    assert shares[0].tolist() == pytest.approx([0.6 + 0.3, 0.2 + 0.2])


class Wrapped(nn.Module):
    """A DiffexpLM-like wrapper around a module returning (logits, extras)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Tupled()
        self.arch = type("Arch", (), {"max_seq_len": 64})()


class Tupled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))

    def forward(self, idx):
        return BIGRAM[idx], ["maps"]


def test_model_adapters():
    wrapped = Wrapped()
    assert torch.equal(as_logits_fn(wrapped)(torch.tensor([[1, 2]])), BIGRAM[torch.tensor([[1, 2]])])
    assert as_logits_fn(bigram) is bigram
    assert model_max_seq_len(wrapped) == 64 and model_max_seq_len(bigram) is None
    wrapped.train()
    with pytest.raises(RuntimeError), evaluating(wrapped, "cpu"):
        assert not wrapped.training
        raise RuntimeError("a failing evaluation")
    assert wrapped.training  # restored on error too


@pytest.mark.parametrize("attention", ["diff_v2", "dint", "without a cache"])
def test_cached_greedy_decoding_gives_the_tokens_of_rereading_the_prefix(attention):
    from diffexp.model import Decoder
    from diffexp.model.config import ModelConfig

    torch.manual_seed(0)
    variant = "diff_v2" if attention == "without a cache" else attention
    decoder = Decoder(ModelConfig(attention=variant, vocab_size=50, d_model=32, n_layers=2, n_heads=2,
                                  max_seq_len=64)).double().eval()  # float64: no near-tie flips the argmax
    if attention == "without a cache":  # as a variant without cached decoding answers: the fallback decodes
        def new_cache():
            raise ValueError("attention 'x' has no decoding with a cache")

        decoder.new_cache = new_cache
    with_cache = []
    decoder.register_forward_pre_hook(lambda module, args, kwargs: with_cache.append(kwargs.get("cache") is not None),
                                      with_kwargs=True)
    prompts = [torch.randint(0, 50, (n,)).tolist() for n in (5, 1, 12, 5, 9, 20, 3)]
    max_new = [6, 4, 0, 8, 5, 7, 3]

    def reread(idx):  # a plain callable: the old decoding, the whole prefix at every step
        return decoder(idx)

    expected = greedy_continuations(reread, prompts, max_new, batch_size=3)
    assert [len(tokens) for tokens in expected] == max_new and not any(with_cache)
    assert greedy_continuations(decoder, prompts, max_new, batch_size=3) == expected
    assert any(with_cache) == (attention != "without a cache")
    # stopping at a token, and at a condition on the tokens so far, the same way
    stop_id = expected[0][2]
    stopped = greedy_continuations(decoder, prompts, max_new, stop_id, batch_size=4)
    assert stopped == greedy_continuations(reread, prompts, max_new, stop_id, batch_size=4)
    assert stopped[0] == expected[0][: expected[0].index(stop_id) + 1]
    assert (greedy_continuations(decoder, prompts, max_new, stop=lambda tokens: sum(tokens) > 40)
            == greedy_continuations(reread, prompts, max_new, stop=lambda tokens: sum(tokens) > 40))

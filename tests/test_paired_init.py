"""Paired comparisons start from the same weights and see the same batches: under one seed, every weight that two
variants share by name and shape starts bit for bit equal, and building a model leaves the run's random stream
(and so everything drawn after it) as it was."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from diffexp import Decoder, ModelConfig
from diffexp.model.attention import variant_names
from tests.helpers import run_cli, write_recipe

SIZES = dict(vocab_size=61, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)


def build(name: str, seed: int) -> Decoder:
    torch.manual_seed(seed)
    return Decoder(ModelConfig(attention=name, **SIZES))


def shared_weights(a: Decoder, b: Decoder) -> list[str]:
    """Names of the parameters both models have, at the same shape."""
    theirs = dict(b.named_parameters())
    return [name for name, p in a.named_parameters() if name in theirs and theirs[name].shape == p.shape]


@pytest.mark.parametrize("first, second", list(itertools.combinations(variant_names(), 2)))
def test_weights_two_variants_share_start_equal(first, second):
    a, b = build(first, 7), build(second, 7)
    names = shared_weights(a, b)
    params = dict(b.named_parameters())
    for name in names:
        assert torch.equal(dict(a.named_parameters())[name], params[name]), name
    always = {"embed.weight", "final_norm.weight", "blocks.1.ffn.down_proj.weight", "blocks.0.ffn.gate_proj.weight",
              "blocks.0.attn_norm.weight", "blocks.1.attn.o_proj.weight"}
    assert always <= set(names)


def test_the_baseline_and_diff_v1_share_every_projection():
    """At matched parameters DIFF V1's Q, K, V and O have the baseline's shapes: all of them start equal."""
    names = set(shared_weights(build("baseline", 3), build("diff_v1", 3)))
    for layer in range(SIZES["n_layers"]):
        assert {f"blocks.{layer}.attn.{p}_proj.weight" for p in "qkvo"} <= names


def test_different_seeds_give_different_weights():
    a, b = build("diff_v1", 1), build("diff_v1", 2)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        if p.std() > 0:  # norms start at ones
            assert not torch.equal(p, q), name


def test_building_a_model_leaves_the_random_stream_as_it_was():
    draws = []
    for name in (None, "baseline", "dint", "shared_diff"):
        torch.manual_seed(11)
        if name is not None:
            build_without_reseeding = Decoder(ModelConfig(attention=name, **SIZES))
            assert build_without_reseeding is not None
        draws.append(torch.rand(5))
    assert all(torch.equal(draws[0], d) for d in draws[1:])


def test_a_checkpoints_weights_load_over_any_init():
    saved = build("shared_diff", 5)
    loaded = build("shared_diff", 6)
    loaded.load_state_dict(saved.state_dict())
    idx = torch.randint(0, SIZES["vocab_size"], (2, 9))
    assert torch.equal(saved(idx), loaded(idx))


def test_a_lambda_vector_is_shared_by_the_two_map_variants():
    """DIFF V1, Shared DIFF and DINT name their lambda vectors alike: they start equal too."""
    models = [build(name, 9) for name in ("diff_v1", "shared_diff", "dint")]
    vectors = [dict(m.named_parameters())["blocks.1.attn.lambda_.lambda_q2"] for m in models]
    assert torch.equal(vectors[0], vectors[1]) and torch.equal(vectors[0], vectors[2])


RECORD = '--trainer.callbacks+={{"class_path": "tests.helpers.RecordBatches", "init_args": {{"path": "{}"}}}}'


def batch_checksums(tmp_path, attention: str, steps: int) -> list[int]:
    """The checksum of every training batch of a tiny `diffexp fit` of `attention` under the recipe's seed."""
    directory = tmp_path / attention
    directory.mkdir()
    recipe = write_recipe(directory, attention=attention, max_steps=steps)
    run_cli(["fit", "--config", str(recipe), RECORD.format(directory / "batches.jsonl")], directory)
    lines = (directory / "batches.jsonl").read_text().splitlines()
    return [json.loads(line)["checksum"] for line in lines]


@pytest.mark.slow
def test_two_variants_of_one_seed_train_on_the_same_batches(tmp_path):
    checksums = {attention: batch_checksums(tmp_path, attention, 6) for attention in ("baseline", "dint")}
    assert len(checksums["baseline"]) == 6 and checksums["baseline"] == checksums["dint"]


@pytest.mark.heavy
def test_every_variant_of_one_seed_trains_on_the_same_batches(tmp_path):
    """Every pair of variants: equal to the baseline's, batch for batch."""
    checksums = {attention: batch_checksums(tmp_path, attention, 4) for attention in variant_names()}
    assert len(checksums["baseline"]) == 4 and len(set(checksums["baseline"])) == 4  # distinct batches
    for attention, sums in checksums.items():
        assert sums == checksums["baseline"], attention

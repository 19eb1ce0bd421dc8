"""Every recipe parses and builds its model; flags in YAML reach the built modules."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import torch

from diffexp import Decoder, ModelConfig
from diffexp.cli import DiffexpCLI, main, parse_config
from diffexp.data import TextDataModule
from diffexp.training import DiffexpLM

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "recipes").rglob("*.yaml"))
TINY = sorted((REPO / "recipes" / "tiny").glob("*.yaml"))


def arch_of(path: Path) -> ModelConfig:
    return ModelConfig(**parse_config(["--config", str(path)]).model.arch.as_dict())


def test_recipes_exist_for_every_variant():
    names = {p.stem for p in TINY}
    assert names == {"baseline", "diff_v1", "diff_v2", "shared_diff", "dint"}
    gpu = {p.stem.split("-")[0] for p in (REPO / "recipes" / "gpu").glob("*.yaml")}
    assert gpu == names


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: str(p.relative_to(REPO / "recipes")))
def test_recipe_parses_and_builds(path):
    arch = arch_of(path)
    with torch.device("meta"):  # paper sizes cost no memory here
        model = Decoder(arch)
    assert model.num_parameters() > 0
    if path.parent.name != "mqar":
        assert path.stem.split("-")[0] == arch.attention


def test_tiny_recipes_have_matched_parameter_budgets():
    counts = {p.stem: Decoder(arch_of(p)).num_parameters(exclude_embeddings=True) for p in TINY}
    for name, count in counts.items():
        assert abs(count / counts["baseline"] - 1) < 0.05, (name, count, counts["baseline"])


def test_gpu_recipes_are_bf16_fsdp():
    for path in (REPO / "recipes" / "gpu").glob("*.yaml"):
        trainer = parse_config(["--config", str(path)]).trainer
        assert trainer.precision == "bf16-mixed"
        assert trainer.strategy.class_path.endswith("FSDPStrategy")
        assert any(cls.__name__ == "DecoderBlock" for cls in trainer.strategy.init_args.auto_wrap_policy)


def test_yaml_flag_reaches_the_built_module(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text((REPO / "recipes/tiny/shared_diff.yaml").read_text()
                      .replace("head_norm: true", "head_norm: false").replace("rank: 8", "rank: 3"))
    cli = DiffexpCLI(DiffexpLM, TextDataModule, run=False, auto_configure_optimizers=False,
                     args=["--config", str(recipe), "--data.max_chars", "20000",
                           "--model.arch.lambda_init", "0.5", "--data.cache_dir", str(tmp_path / "cache")])
    attn = cli.model.model.blocks[0].attn
    assert isinstance(attn.head_norm, torch.nn.Identity)  # from the YAML
    assert attn.q_proj.up.shape[2] == 3                   # from the YAML
    assert attn.lambda_init == 0.5                        # from a dotted override
    assert cli.model.model.embed.num_embeddings == cli.datamodule.vocab_size  # linked


def test_print_config_is_complete_and_reusable(tmp_path):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(["fit", "--config", str(REPO / "recipes/tiny/dint.yaml"), "--print_config"])
    printed = out.getvalue()
    for key in ("attention: dint", "integral: softmax", "lambda_init: depth", "max_steps: 400", "seq_len:",
                "every_n_train_steps:", "TensorBoardLogger"):
        assert key in printed, key
    saved = tmp_path / "config.yaml"
    saved.write_text(printed)
    again = parse_config(["--config", str(saved)])
    assert again.model.arch.as_dict() == parse_config(
        ["--config", str(REPO / "recipes/tiny/dint.yaml")]).model.arch.as_dict()

"""Every recipe parses and builds its model; flags in YAML reach the built modules.

The GPU recipes are a base plus deltas, applied in this order by repeated --config flags:
recipes/gpu/base.yaml (every training number), recipes/gpu/size/<size>.yaml (the model's size),
recipes/gpu/variant/<variant>.yaml (the attention variant and its flags), and for a variant delta with
size-dependent values (heads, head_dim, ffn_hidden) recipes/gpu/variant/<variant>/<size>.yaml last. A variant
delta is named after its attention variant, or `<variant>-<what>` for a comparison (baseline-v2kv.yaml)."""

from __future__ import annotations

import contextlib
import functools
import io
import itertools
import re
from pathlib import Path

import pytest
import torch
import yaml

from diffexp import Decoder, ModelConfig
from diffexp.cli import DiffexpCLI, main, parse_config
from diffexp.data import TextDataModule
from diffexp.training import DiffexpLM
from tests.helpers import REPO, added_on_purpose

GPU = REPO / "recipes" / "gpu"
#: recipes that are one file each (the GPU ones are base + size + variant, below)
RECIPES = sorted(p for p in (REPO / "recipes").rglob("*.yaml") if GPU not in p.parents)
TINY = sorted((REPO / "recipes" / "tiny").glob("*.yaml"))
GPU_SIZES = sorted(p.stem for p in (GPU / "size").glob("*.yaml"))
GPU_VARIANTS = sorted(p.stem for p in (GPU / "variant").glob("*.yaml"))
GPU_COMBOS = list(itertools.product(GPU_SIZES, GPU_VARIANTS))
#: a size's name as a parameter count: 830m -> 830e6, 1.4b -> 1.4e9
SCALE = {"m": 1e6, "b": 1e9}
#: combinations whose count misses the name beyond the tolerance with the papers' published shapes (the shape
#: is not refitted to the name), and why. The count is checked against the name first: one listed here that
#: meets the tolerance passes like any other.
BEYOND_TOLERANCE = {
    ("3b", v): "the DIFF paper's 3B shape (d_model 3072, 28 layers) with the recipes' 32,768-token vocabulary: "
               "3.37B, 12.4% over its name (3.17B without embeddings)"
    for v in ("baseline", "diff_v1", "dint", "softmax_sink", "gated", "softpick", "ssmax")
}


def gpu_files(size: str, variant: str) -> list[Path]:
    """The --config files of a GPU run, in the order README.md and docs/gpu.md give them: base, size, variant, and the
    variant's size part when it has one (variant/<variant>/<size>.yaml)."""
    files = [GPU / "base.yaml", GPU / "size" / f"{size}.yaml", GPU / "variant" / f"{variant}.yaml"]
    size_part = GPU / "variant" / variant / f"{size}.yaml"
    return files + [size_part] if size_part.is_file() else files


def gpu_args(size: str, variant: str) -> list[str]:
    """The --config flags of a GPU run (gpu_files)."""
    return [arg for path in gpu_files(size, variant) for arg in ("--config", str(path))]


@functools.cache
def gpu_config(size: str, variant: str):
    """The parsed config of a GPU run (parsed once: several tests read each combination; none changes it)."""
    return parse_config(gpu_args(size, variant))


def gpu_arch(size: str, variant: str) -> ModelConfig:
    return ModelConfig(**gpu_config(size, variant).model.arch.as_dict())


def attention_of(variant_file: str) -> str:
    """The attention variant a delta's name promises: its name up to the first '-' (diff_v2-ffn: diff_v2)."""
    return variant_file.split("-")[0]


def arch_of(args: list[str] | Path) -> ModelConfig:
    args = ["--config", str(args)] if isinstance(args, Path) else args
    return ModelConfig(**parse_config(args).model.arch.as_dict())


def dotted_keys(path: Path) -> set[str]:
    """The keys a YAML file sets, dotted (model.arch.d_model); class_path/init_args kept as written."""
    def walk(node, prefix):
        if isinstance(node, dict):
            for key, value in node.items():
                yield from walk(value, f"{prefix}{key}.")
        else:
            yield prefix[:-1]
    return set(walk(yaml.safe_load(path.read_text()), ""))


def test_recipes_exist_for_every_variant():
    from diffexp.model.attention.registry import variant_names

    names = {p.stem for p in TINY}
    assert names == set(variant_names())  # each registered variant has its tiny recipe, named after it
    assert names <= set(GPU_VARIANTS)  # every variant has a tiny recipe and a GPU delta of its name
    assert {attention_of(v) for v in GPU_VARIANTS} == names  # the others are comparisons: <variant>-<what>
    # the papers' Table 3, DIFF's 3B, and the one-GPU sizes (GPT-2 small and medium shapes)
    assert GPU_SIZES == ["1.4b", "125m", "13.1b", "2.8b", "350m", "3b", "6.8b", "830m"]
    assert sorted(p.name for p in GPU.glob("*.yaml")) == ["base.yaml"]  # no per-combination copies


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: str(p.relative_to(REPO / "recipes")))
def test_recipe_parses_and_builds(path):
    arch = arch_of(path)
    with torch.device("meta"):  # paper sizes cost no memory here
        model = Decoder(arch)
    assert model.num_parameters() > 0
    if path.parent.name != "mqar":
        assert path.stem == arch.attention


@pytest.mark.parametrize("size,variant", GPU_COMBOS, ids=[f"{v}-{s}" for s, v in GPU_COMBOS])
def test_gpu_recipe_has_the_size_in_its_name(size, variant):
    """The papers' sizes (Table 3: 830M = d_model 1536, 1.4B = d_model 2048) count every parameter, embeddings
    and LM head included, so the recipes' counts must be within 12% of the name (a size file with the other
    size's numbers is over 40% off); the comparison deltas (`<variant>-<what>`) change the budget on purpose and
    get 20%. The combinations beyond the tolerance by their published shapes are in BEYOND_TOLERANCE, with why."""
    config = gpu_config(size, variant)
    arch = ModelConfig(**config.model.arch.as_dict())
    assert arch.attention == attention_of(variant)  # the file name's variant prefix is its attention
    with torch.device("meta"):  # 1.4B parameters cost no memory here
        model = Decoder(arch)
    promised = float(size[:-1]) * SCALE[size[-1]]
    count = model.num_parameters() - added_on_purpose(model)  # the gated variant's gate: reported, not matched
    off = count / promised - 1
    tolerance = 0.12 if variant == arch.attention else 0.20
    if abs(off) >= tolerance and (size, variant) in BEYOND_TOLERANCE:
        pytest.xfail(f"{variant}-{size}: {count:,} parameters, {off:+.1%}: {BEYOND_TOLERANCE[size, variant]}")
    assert abs(off) < tolerance, (f"{variant}-{size}", f"{count:,}")
    logger = config.trainer.logger.init_args
    assert (Path(logger.save_dir).name, logger.name) == (size, variant)  # runs/gpu/<size>/<variant>


@pytest.mark.parametrize("size", GPU_SIZES)
def test_gpu_baseline_matches_diff_v1_parameters(size):
    """The baseline's 2h heads of dim d_model/2h match DIFF V1's budget, and DINT (DIFF V1 plus an integral
    term without weights) equals it; only the lambda vectors and per-head norms differ."""
    with torch.device("meta"):
        counts = {v: Decoder(gpu_arch(size, v)).num_parameters() for v in ("baseline", "diff_v1", "dint")}
    for variant, count in counts.items():
        assert abs(count / counts["diff_v1"] - 1) < 1e-3, (variant, count, counts["diff_v1"])


@pytest.mark.parametrize("size", GPU_SIZES)
def test_gpu_heads_follow_the_papers_at_every_size(size):
    """The papers' head dimension d = d_model / 2h at every size (h: the size's n_heads; d = 96 at 830M, 128
    above): DIFF V1, Shared DIFF and DINT have h two-map heads of dim d, the baseline 2h heads of dim d and
    DIFF V2 2h output heads (4h query heads) of dim d over n_heads / 4 KV heads. A variant file that fixed
    its head count would give the wrong head dim at every size but the one it was written for."""
    h = arch_of(["--config", str(GPU / "base.yaml"), "--config", str(GPU / "size" / f"{size}.yaml")]).n_heads
    for variant in GPU_VARIANTS:
        arch = gpu_arch(size, variant)
        assert arch.resolved_head_dim == arch.d_model // (2 * h), (variant, arch.n_heads, arch.resolved_head_dim)
        heads = {"baseline-2x-heads": 4 * h, "baseline-1.5x-heads": 3 * h}.get(variant)
        expected = heads or (h if arch.attention in ("diff_v1", "shared_diff", "dint") else 2 * h)
        assert arch.n_heads == expected, (variant, arch.n_heads)
        if variant != "baseline":  # every V2 comparison keeps V2's KV heads
            assert arch.kv_heads == (arch.n_heads if arch.attention != "diff_v2" and "-" not in variant
                                     else 2 * h // 4), (variant, arch.kv_heads)


#: the GPU deltas that take DIFF V2's differences from the baseline apart (docs/gpu.md, "Comparison recipes")
V2_COMPARISONS = ("baseline-v2kv", "baseline-2x-heads", "baseline-1.5x-heads", "diff_v2-ffn")


@pytest.mark.parametrize("size", GPU_SIZES)
def test_gpu_v2_comparisons_hold_what_their_headers_say(size):
    from diffexp.model.attention import variant

    archs = {v: gpu_arch(size, v) for v in ("baseline", "diff_v2", *V2_COMPARISONS)}
    with torch.device("meta"):
        report = {v: Decoder(arch).parameter_report() for v, arch in archs.items()}
    base, v2 = archs["baseline"], archs["diff_v2"]
    d, layers, lam = v2.resolved_head_dim, v2.n_layers, v2.n_layers * v2.d_model * v2.n_heads  # lam: W_lam
    for name in V2_COMPARISONS:  # each keeps V2's KV heads and the head dim of the baseline and V2
        assert (archs[name].kv_heads, archs[name].resolved_head_dim) == (v2.kv_heads, d), name
    assert base.resolved_head_dim == d and v2.kv_heads < base.kv_heads  # what the comparisons take apart
    # same KV heads as V2, the baseline's query heads
    assert archs["baseline-v2kv"].n_heads == base.n_heads
    # V2's query heads: the same attention FLOPs; V2 has half its W_O and adds W_lam
    wide = archs["baseline-2x-heads"]
    assert wide.n_heads == 2 * v2.n_heads
    assert variant(wide.attention).attention_flops(wide, 1024) == variant(v2.attention).attention_flops(v2, 1024)
    assert report["baseline-2x-heads"]["attention"] - report["diff_v2"]["attention"] == \
        layers * v2.n_heads * d * v2.d_model - lam
    # 1.5x heads: V2's parameters but W_lam
    assert 2 * archs["baseline-1.5x-heads"].n_heads == 3 * base.n_heads
    assert report["diff_v2"]["total"] - report["baseline-1.5x-heads"]["total"] == lam
    # V2 + FFN: V2's attention; total = baseline-2x-heads' to the nearest multiple of 64 hidden units
    ffn = archs["diff_v2-ffn"]
    assert report["diff_v2-ffn"]["attention"] == report["diff_v2"]["attention"]
    assert ffn.ffn_hidden % 64 == 0 and ffn.ffn_hidden > v2.resolved_ffn_hidden
    step = 3 * ffn.d_model * 64 * layers
    assert abs(report["diff_v2-ffn"]["total"] - report["baseline-2x-heads"]["total"]) <= step / 2


def test_gpu_numbers_live_in_one_file():
    """base.yaml holds every training number; a size delta only the model's size (and, for the one-GPU sizes,
    its token budget, trainer.max_steps), a variant delta only the attention variant and its flags (plus each
    one's part of the run directory, runs/gpu/<size>/<variant>)."""
    base = dotted_keys(GPU / "base.yaml")
    size_keys = {"model.arch.d_model", "model.arch.n_layers", "model.arch.n_heads",
                 "trainer.logger.init_args.save_dir"}
    budget = {"trainer.max_steps"}
    for path in (GPU / "size").glob("*.yaml"):
        assert size_keys <= dotted_keys(path) <= size_keys | budget, path.name
    for path in (GPU / "variant").glob("*.yaml"):
        keys = dotted_keys(path)
        assert "model.arch.attention" in keys and "trainer.logger.init_args.name" in keys, path.name
        extra = {k for k in keys - {"trainer.logger.init_args.name"} if not k.startswith("model.arch.")}
        assert not extra, (path.name, extra)
        assert not keys & size_keys, path.name  # heads too: a variant with 2h heads sets them in its size parts
    # a variant's size parts: one per size, only the model.arch values that depend on the size
    for folder in (p for p in (GPU / "variant").iterdir() if p.is_dir()):
        assert folder.name in GPU_VARIANTS, folder.name
        assert sorted(p.stem for p in folder.glob("*.yaml")) == GPU_SIZES, folder.name
        for path in folder.glob("*.yaml"):
            keys = dotted_keys(path)
            assert keys and all(k.startswith("model.arch.") for k in keys), (path, keys)
            # a part may replace the size's h by the variant's head count (2h, 3h, 4h), nothing else of the size
            assert not keys & (size_keys - {"model.arch.n_heads"}), path
            assert not keys & dotted_keys(GPU / "variant" / f"{folder.name}.yaml"), path
    for key in ("model.optim.lr", "model.optim.warmup_steps", "model.optim.weight_decay", "trainer.max_steps",
                "global_batch.rows", "trainer.precision", "data.seq_len", "data.batch_size"):
        assert key in base, key
    run_dir = {"trainer.logger.init_args.save_dir", "trainer.logger.init_args.name"}  # base's placeholders
    for path in [*(GPU / "size").glob("*.yaml"), *(GPU / "variant").rglob("*.yaml")]:
        assert not dotted_keys(path) & (base - run_dir - budget), path.name


def test_gpu_recipes_are_bf16_fsdp2():
    for size, variant in GPU_COMBOS:
        trainer = gpu_config(size, variant).trainer
        assert trainer.precision == "32-true"  # mixed precision is FSDP2's own
        assert trainer.strategy.class_path == "diffexp.parallel.FSDP2Strategy"
        assert trainer.strategy.init_args.mixed_precision == "auto"  # bf16 on GPUs


def test_no_recipe_names_a_flag_its_variant_does_not_read():
    """Such a flag would change nothing, and `diffexp fit` refuses it; no recipe names one, not even at its default.
    A size-dependent flag of one variant (Shared DIFF's rank) lives in that variant's size parts."""
    def named(files: list[Path]) -> set[str]:
        return {key.split(".")[-1] for path in files for key in dotted_keys(path) if key.startswith("model.arch.")}

    unused = {path.name: arch_of(path).unused_settings(named([path])) for path in RECIPES}
    unused |= {(size, variant): gpu_arch(size, variant).unused_settings(named(gpu_files(size, variant)))
               for size, variant in GPU_COMBOS}
    assert {combo: found for combo, found in unused.items() if found} == {}
    assert {gpu_arch(size, "shared_diff").rank for size in GPU_SIZES} != {ModelConfig.rank}


def test_documented_recipe_paths_exist():
    """Every recipes/... path the README and docs show (commands users copy) names a file."""
    for doc in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        for path in re.findall(r"recipes/[\w./-]+\.yaml", doc.read_text()):
            assert (REPO / path).is_file(), (doc.name, path)


def test_documented_gpu_command_prints_the_merged_recipe():
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(["fit", *gpu_args("830m", "diff_v1"), "--print_config"])
    printed = yaml.safe_load(out.getvalue())
    assert printed["model"]["arch"]["d_model"] == 1536 and printed["model"]["arch"]["attention"] == "diff_v1"
    assert printed["model"]["optim"]["lr"] == 3.0e-4 and printed["trainer"]["precision"] == "32-true"
    assert printed["trainer"]["logger"]["init_args"]["save_dir"] == "runs/gpu/830m"


def test_tiny_recipes_have_matched_parameter_budgets():
    """Within 5% of the baseline's non-embedding parameters; Shared DIFF, with fewer Q/K parameters by design
    (tests/test_recipe_params.py), is 4.8% under; the gated variant's gate (+7.7% here) is reported, not matched."""
    models = {p.stem: Decoder(arch_of(p)) for p in TINY}
    counts = {name: model.num_parameters(exclude_embeddings=True) - added_on_purpose(model)
              for name, model in models.items()}
    for name, count in counts.items():
        assert abs(count / counts["baseline"] - 1) < 0.05, (name, count, counts["baseline"])


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

"""Every recipe states the parameter counts of the model it trains, and they are right; `diffexp params` shows them.

Header formats (N: a plain integer):
    single-file recipes:      # parameters: total=N non_embedding=N attention=N
    GPU variant files:        # parameters[<size>]: total=N non_embedding=N attention=N   (one per size file)
    GPU size files:           # run[<variant>]: <tokens>, <FLOPs>; <GPU times>           (one per variant file)
Every recipe found by glob is checked, so new recipes and variants are covered without touching this file.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from diffexp import Decoder, ModelConfig
from diffexp.cli import main
from diffexp.compare.budget import measured_fit, run_budget
from diffexp.compare.params import (
    Recipe,
    all_recipes,
    expand,
    linked_vocab_size,
    model_config,
    run_header,
    run_header_line,
)
from diffexp.data.tokenizer import ByteTokenizer
from diffexp.training.cli import parse_config
from tests.helpers import REPO, added_on_purpose, stdout_of

RECIPES = REPO / "recipes"
GPU = RECIPES / "gpu"
SINGLE = sorted(p for p in RECIPES.rglob("*.yaml") if GPU not in p.parents)
GPU_SIZES = sorted(p.stem for p in (GPU / "size").glob("*.yaml"))
GPU_VARIANTS = sorted(p.stem for p in (GPU / "variant").glob("*.yaml"))
HEADER = re.compile(r"^# parameters(?:\[([^\]]+)\])?: total=(\d+) non_embedding=(\d+) attention=(\d+)$", re.M)


def params_stdout(args: list[str]) -> str:
    return stdout_of(["params", *args])


def stated(path: Path) -> dict[str | None, dict[str, int]]:
    """size (None for single-file recipes) -> the counts the header states."""
    found = {}
    for size, total, non_embedding, attention in HEADER.findall(path.read_text()):
        key = size or None
        assert key not in found, f"{path.name}: two header lines for {key or 'the recipe'}"
        found[key] = {"total": int(total), "non_embedding": int(non_embedding), "attention": int(attention)}
    return found


def built(configs: list[Path], attention: str | None = None) -> dict[str, int]:
    """parameter_report of the model the configs train (vocabulary as the data module links it), on meta."""
    key = (tuple(Path(p).resolve() for p in configs), attention)
    if key not in _BUILT:
        _BUILT[key] = _build(configs, attention)
    return dict(_BUILT[key])


#: each recipe's count, built once for the module (a 13B model costs a second even on meta)
_BUILT: dict[tuple, dict[str, int]] = {}


def _build(configs: list[Path], attention: str | None) -> dict[str, int]:
    args = [a for path in configs for a in ("--config", str(path))]
    args += ["--model.arch.attention", attention] if attention else []
    config = parse_config(args)
    arch = ModelConfig(**{**config.model.arch.as_dict(), "vocab_size": linked_vocab_size(config),
                          "backend": "sdpa"})
    with torch.device("meta"):
        model = Decoder(arch)
    return {"attention_variant": arch.attention, **model.parameter_report(), "run": run_budget(config, arch, model),
            "added_on_purpose": added_on_purpose(model)}


def gpu_configs(size: str, variant: str) -> list[Path]:
    """base, size, variant, and the variant's size part (variant/<variant>/<size>.yaml) when it has one."""
    files = [GPU / "base.yaml", GPU / "size" / f"{size}.yaml", GPU / "variant" / f"{variant}.yaml"]
    size_part = GPU / "variant" / variant / f"{size}.yaml"
    return files + [size_part] if size_part.is_file() else files


@pytest.mark.parametrize("path", SINGLE, ids=lambda p: str(p.relative_to(RECIPES)))
def test_single_file_recipe_states_its_counts(path):
    headers = stated(path)
    assert list(headers) == [None], f"{path.name}: expected one '# parameters: total=N non_embedding=N attention=N'"
    report = built([path])
    assert headers[None] == {k: report[k] for k in ("total", "non_embedding", "attention")}, path.name


@pytest.mark.parametrize("variant", GPU_VARIANTS)
def test_gpu_variant_file_states_its_counts_at_every_size(variant):
    path = GPU / "variant" / f"{variant}.yaml"
    headers = stated(path)
    assert sorted(headers) == GPU_SIZES, f"{path.name}: expected one '# parameters[<size>]: ...' per size file"
    for size in GPU_SIZES:
        report = built(gpu_configs(size, variant))
        assert headers[size] == {k: report[k] for k in ("total", "non_embedding", "attention")}, (variant, size)


@pytest.mark.parametrize("size", GPU_SIZES)
def test_gpu_size_file_states_each_variants_whole_run(size):
    """The size file's `# run[<variant>]:` lines (diffexp params --headers) are what diffexp computes now."""
    path = GPU / "size" / f"{size}.yaml"
    lines = [line for line in path.read_text().splitlines() if line.startswith("# run[")]
    fit = measured_fit()
    assert run_header(fit) in path.read_text().splitlines(), f"{path.name}: the line that names the measured fit"
    expected = [run_header_line(variant, built(gpu_configs(size, variant))["run"], fit) for variant in GPU_VARIANTS]
    assert lines == expected, path.name


#: the variants' own deltas (the papers' shapes); the comparison deltas change the budget on purpose
PAPER_VARIANTS = ("baseline", "diff_v1", "diff_v2", "shared_diff", "dint", "softmax_sink", "gated", "softpick", "ssmax")
ONE_GPU_SIZES = {"125m": 125e6, "350m": 350e6}


@pytest.mark.parametrize("size", ONE_GPU_SIZES)
def test_one_gpu_sizes_count_their_names_within_ten_percent(size):
    """GPT-2 small and medium shapes with the recipes' untied 32,768-token vocabulary: every variant within
    10% of the size's name (the comparison deltas, which add or drop heads or FFN on purpose, within 12%), less
    what a variant adds by design (the gated variant's gate, which diffexp params reports)."""
    for variant in GPU_VARIANTS:
        report = built(gpu_configs(size, variant))
        off = (report["total"] - report["added_on_purpose"]) / ONE_GPU_SIZES[size] - 1
        assert abs(off) < (0.10 if variant in PAPER_VARIANTS else 0.12), (size, variant, f"{off:+.1%}")


def baseline_flops_per_token(arch, seq_len: int) -> float:
    """A baseline decoder's training FLOPs per token, from its shape: 2 per weight of each matmul (Q, K, V, O,
    the SwiGLU's three, the LM head) and, per layer, Q K^T and A V over seq_len / 2 keys on average; x 3."""
    d, layers, kv = arch.d_model, arch.n_layers, arch.kv_heads * arch.resolved_head_dim
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * arch.resolved_ffn_hidden
    forward = 2 * (layers * per_layer + d * arch.vocab_size) + layers * 2 * 2 * (seq_len / 2) * d
    return 3 * forward


@pytest.mark.parametrize("size", ONE_GPU_SIZES)
def test_one_gpu_sizes_print_their_flops_and_gpu_time(size, monkeypatch):
    """`diffexp params` and the size file give the whole run's tokens, FLOPs and wall time on 1 and 8 GPUs;
    here they are recomputed from the recipe's numbers, the model's shape and bench/fits.json's measured fit."""
    monkeypatch.chdir(REPO)
    configs = gpu_configs(size, "baseline")
    config = parse_config([a for p in configs for a in ("--config", str(p))])
    arch = ModelConfig(**{**config.model.arch.as_dict(), "vocab_size": linked_vocab_size(config)})
    steps, rows, seq_len = config.trainer.max_steps, config.global_batch.rows, config.data.init_args.seq_len
    tokens = steps * rows * seq_len
    assert (steps, rows, seq_len) == ({"125m": 10000, "350m": 27000}[size], 128, 2048)
    assert abs(tokens / {"125m": 2.5e9, "350m": 7e9}[size] - 1) < 0.06  # the budgets
    flops = tokens * baseline_flops_per_token(arch, seq_len)
    printed = params_stdout([f"recipes/gpu/variant/baseline/{size}.yaml", "--headers"])
    row = next(line for line in printed.splitlines() if f"gpu/{size} + baseline" in line and "H100" not in line
               and f"{steps} x {rows} x {seq_len}" in line)
    assert f"{flops:.3g}" in row
    prefix = f"recipes/gpu/size/{size}.yaml: "
    line = next(line for line in printed.splitlines() if line.startswith(prefix + "# run[baseline]"))
    line = line.removeprefix(prefix)
    assert line in (GPU / "size" / f"{size}.yaml").read_text().splitlines()  # the size file's own line
    assert f"{tokens / 1e9:.2f}B tokens ({steps} steps x {rows} x {seq_len}), {flops:.3g} FLOPs" in line
    record = json.loads((REPO / "bench" / "fits.json").read_text())[-1]
    with torch.device("meta"):
        measured = Decoder(ModelConfig(**record["model"])).flops_per_token(record["seq_len"], training=True)
    rate = record["tokens_per_s"] * measured / record["gpus"]  # the measured fit's FLOP/s per GPU
    times = re.findall(r"(\d+) H100 ([\d.]+) (min|h|d)", line)
    assert [int(gpus) for gpus, *_ in times] == [1, 8] and record["gpu"] == "H100"
    for gpus, shown, unit in times:
        expected = flops / (int(gpus) * rate) / {"min": 60, "h": 3600, "d": 86400}[unit]
        assert abs(float(shown) - expected) <= (0.05 if expected < 10 else 0.5), (gpus, shown, expected, unit)
        assert f"{shown} {unit}" in row  # the table's column says the same


def shared_diff_runs() -> list[tuple[str, list[Path]]]:
    """Every shipped recipe (and GPU size) that trains Shared DIFF."""
    runs = [(str(p.relative_to(RECIPES)), [p]) for p in SINGLE
            if parse_config(["--config", str(p)]).model.arch.attention == "shared_diff"]
    if "shared_diff" in GPU_VARIANTS:
        runs += [(f"gpu/{size}", gpu_configs(size, "shared_diff")) for size in GPU_SIZES]
    return runs


def test_shared_diff_has_fewer_qk_parameters_than_diff_v1_in_every_recipe():
    """The comparison the spec asks for: Shared DIFF spends fewer Q/K parameters than DIFF V1 of the same
    recipe (same width, heads and everything else) at every shipped size: tiny, needle, 830m, 1.4b."""
    runs = shared_diff_runs()
    assert {"tiny/shared_diff.yaml", "needle/shared_diff.yaml", "gpu/830m", "gpu/1.4b"} <= {n for n, _ in runs}
    for name, configs in runs:
        shared = built(configs)
        diff = built(configs, attention="diff_v1")
        assert shared["qk_projections"] < diff["qk_projections"], (name, shared, diff)
        assert shared["total"] < diff["total"], name
        arch = parse_config([a for p in configs for a in ("--config", str(p))]).model.arch
        assert (arch.lowrank_scope, arch.base_sharing) == ("layer", "maps"), name  # the spec's comparison


def test_qk_projections_count_the_query_and_key_modules():
    arch = ModelConfig(attention="shared_diff", d_model=64, n_heads=2, n_layers=3, rank=4)
    model = Decoder(arch)
    qk = sum(p.numel() for b in model.blocks for m in (b.attn.q_proj, b.attn.k_proj) for p in m.parameters())
    h, d, r = 2, 16, 4  # layer scope, a base per head: h d + 2 (d_model r + h d r) each for Q and K
    assert model.parameter_report()["qk_projections"] == qk == 3 * 2 * (64 * h * d + 2 * (64 * r + h * d * r))
    baseline = Decoder(ModelConfig(d_model=64, n_heads=2, n_layers=3))
    assert baseline.parameter_report()["qk_projections"] == 3 * 2 * 64 * 64


def test_linked_vocab_size_is_what_the_data_module_links():
    byte = parse_config(["--config", str(RECIPES / "tiny/baseline.yaml")])
    assert linked_vocab_size(byte) == ByteTokenizer.vocab_size == 257
    assert linked_vocab_size(parse_config(["--config", str(RECIPES / "mqar/diff_v1.yaml")])) == 512
    assert linked_vocab_size(parse_config(["--config", str(RECIPES / "needle/diff_v1.yaml")])) == 257
    gpu = parse_config([a for p in gpu_configs("830m", "diff_v1") for a in ("--config", str(p))])
    assert linked_vocab_size(gpu) == gpu.model.arch.vocab_size == 32768  # the prepared directory's, as stated


def test_a_variants_size_parts_are_given_last(tmp_path):
    """variant/<variant>/<size>.yaml (size-dependent values of a variant) follows the variant file."""
    gpu = tmp_path / "gpu"
    for path in ("base.yaml", "size/830m.yaml", "size/1.4b.yaml", "variant/wide.yaml", "variant/wide/830m.yaml",
                 "variant/plain.yaml"):
        (gpu / path).parent.mkdir(parents=True, exist_ok=True)
        (gpu / path).write_text("{}\n")
    part = expand(gpu / "variant/wide/830m.yaml", tmp_path)
    assert [r.configs[-1] for r in part] == [gpu / "variant/wide/830m.yaml"] and part[0].size == "830m"
    assert part[0].header_file == gpu / "variant/wide.yaml"
    wide = expand(gpu / "variant/wide", tmp_path)
    assert [len(r.configs) for r in wide] == [3, 4]  # 1.4b has no size part, 830m has one
    assert len(expand(gpu, tmp_path)) == 4 and len(expand(gpu / "variant/plain.yaml", tmp_path)) == 2


def test_recipe_arguments_expand_as_documented():
    names = lambda target: [r.name for r in expand(target, RECIPES)]  # noqa: E731
    assert names(RECIPES / "tiny/dint.yaml") == ["tiny/dint.yaml"]
    assert names(GPU / "variant/dint.yaml") == [f"gpu/{s} + dint" for s in GPU_SIZES]
    assert names(GPU / "size/830m.yaml") == [f"gpu/830m + {v}" for v in GPU_VARIANTS]
    assert len(names(GPU)) == len(GPU_SIZES) * len(GPU_VARIANTS)
    for recipe in expand(GPU, RECIPES):  # the files README's GPU command gives, size parts included
        size, variant = recipe.name.split("/", 1)[1].split(" + ")
        assert list(recipe.configs) == gpu_configs(size, variant) and recipe.header_file.stem == variant
    everything = all_recipes(RECIPES)
    assert len(everything) == len(SINGLE) + len(GPU_SIZES) * len(GPU_VARIANTS)
    assert model_config(Recipe("x", (RECIPES / "tiny/shared_diff.yaml",))).vocab_size == 257


def test_diffexp_params_prints_the_table(monkeypatch):
    monkeypatch.chdir(REPO)
    printed = params_stdout(["recipes/tiny/shared_diff.yaml", "recipes/gpu/variant/shared_diff.yaml", "--headers"])
    tiny = built([RECIPES / "tiny/shared_diff.yaml"])
    for header in ("total", "non-embedding", "attention", "Q/K projections"):
        assert header in printed, header
    row = next(line for line in printed.splitlines() if "tiny/shared_diff.yaml" in line and "│" in line)
    for key in ("total", "non_embedding", "attention", "qk_projections"):
        assert f"{tiny[key]:,}" in row, key
    big = built(gpu_configs("1.4b", "shared_diff"))
    assert f"{big['qk_projections']:,}" in printed
    stated_line = next(line for line in (RECIPES / "tiny/shared_diff.yaml").read_text().splitlines()
                       if line.startswith("# parameters:"))
    assert stated_line in printed  # --headers prints the recipe's own header line


def test_diffexp_params_without_arguments_covers_every_recipe(monkeypatch):
    """Every recipe gets a row. Counting is tested above (test_diffexp_params_prints_the_table runs the real
    report); here the counts come from the module's cache, so the row for each recipe is the only question."""
    import diffexp.compare.params as params

    monkeypatch.chdir(REPO)
    monkeypatch.setattr(params, "report", lambda recipe: built(list(recipe.configs)))
    monkeypatch.setattr(params, "budget", lambda recipe: built(list(recipe.configs))["run"])
    printed = params_stdout([])
    for path in SINGLE:
        assert str(path.relative_to(RECIPES)) in printed, path
    for size in GPU_SIZES:
        for variant in GPU_VARIANTS:
            assert f"gpu/{size} + {variant}" in printed


def test_diffexp_params_refuses_a_missing_recipe(capsys):
    with pytest.raises(SystemExit) as done:
        main(["params", "recipes/tiny/nope.yaml"])
    assert done.value.code == 2
    assert "recipes/tiny/nope.yaml" in capsys.readouterr().err


@pytest.mark.parametrize("extra", [{}, {"n_kv_heads": 1}, {"tie_embeddings": True}, {"head_dim": 16},
                                   {"max_seq_len": 4096, "rope_theta": 640000.0}],
                         ids=["default", "gqa", "tied", "head_dim", "long"])
def test_params_builds_on_meta_what_torch_device_meta_builds(extra):
    """params and the budget build on the meta device without the arithmetic that imports torch._dynamo
    (diffexp.model.meta): every variant gets the same parameters and buffers (names, shapes, dtypes, whether
    they train), parameter report and FLOPs as under torch.device("meta")."""
    from diffexp.model.attention import variant_names
    from diffexp.model.meta import building_on_meta

    for attention in variant_names():
        cfg = ModelConfig(attention=attention, d_model=64, n_layers=2, n_heads=2, **extra)
        with building_on_meta():
            ours = Decoder(cfg)
        with torch.device("meta"):
            theirs = Decoder(cfg)
        for name, (a, b) in {"parameters": (ours.named_parameters(), theirs.named_parameters()),
                             "buffers": (ours.named_buffers(), theirs.named_buffers())}.items():
            layout = lambda tensors: {n: (t.shape, t.dtype, t.requires_grad, t.is_meta) for n, t in tensors}  # noqa: E731
            assert layout(a) == layout(b), (attention, name)
        assert ours.parameter_report() == theirs.parameter_report(), attention
        assert ours.flops_per_token(256, training=True) == theirs.flops_per_token(256, training=True), attention

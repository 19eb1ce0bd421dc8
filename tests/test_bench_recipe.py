"""`diffexp bench train --recipe`, `diffexp bench probe` and bench/gpu.sh: the GPU recipes' own shapes, the SDPA
backend each call took, and the one GPU script's wiring, all on CPU."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from diffexp.bench import options, probe, profile, recipe_shape, train_step
from diffexp.bench.cli import main
from diffexp.errors import UserError
from tests.helpers import REPO, require_cpu_kernel


@pytest.fixture
def tiny_recipes(tmp_path) -> Path:
    """A copy of recipes/gpu with a tiny size (and the size parts of the variants that have them)."""
    gpu = tmp_path / "gpu"
    shutil.copytree(REPO / "recipes/gpu", gpu)
    (gpu / "size/tiny.yaml").write_text("model:\n  arch:\n    d_model: 64\n    n_layers: 1\n    n_heads: 2\n"
                                        "    rank: 4\n    max_seq_len: 64\n")
    for variant in ("baseline", "softmax_sink", "gated", "softpick", "ssmax"):  # the single-map variants at 2h heads
        (gpu / f"variant/{variant}/tiny.yaml").write_text("model:\n  arch:\n    n_heads: 4\n")
    (gpu / "variant/diff_v2/tiny.yaml").write_text("model:\n  arch:\n    n_heads: 4\n    n_kv_heads: 1\n")
    return gpu


def recipe_args(*argv: str):
    args = train_step.build_parser().parse_args(list(argv))
    options.validate(args)
    recipe_shape.load(args)
    return args


def test_a_recipe_shape_is_each_variants_model_as_its_recipe_files_define_it():
    """125m: GPT-2 small's width and depth; the baseline, DIFF V2 and the softmax-constraint variants at 2h = 12
    heads (V2 over 3 KV heads), the two-map variants at h = 6, Shared DIFF's rank 48, the recipes' 32K vocabulary,
    seq 2048 and micro-batch 8."""
    args = recipe_args("--recipe", "125m")
    archs = args.recipe_archs
    assert {cfg.d_model for cfg in archs.values()} == {768} and {cfg.n_layers for cfg in archs.values()} == {12}
    assert {cfg.vocab_size for cfg in archs.values()} == {32768}
    heads = {name: (cfg.n_heads, cfg.kv_heads, cfg.resolved_head_dim) for name, cfg in archs.items()}
    assert heads == {"baseline": (12, 12, 64), "diff_v1": (6, 6, 64), "diff_v2": (12, 3, 64),
                     "shared_diff": (6, 6, 64), "dint": (6, 6, 64), "softmax_sink": (12, 12, 64),
                     "gated": (12, 12, 64), "softpick": (12, 12, 64), "ssmax": (12, 12, 64)}
    assert archs["shared_diff"].rank == 48
    assert args.seq_lens == [2048] and args.batch_size == 8
    assert recipe_shape.shapes(args)["diff_v2"]["n_kv_heads"] == 3
    assert "rank" not in recipe_shape.shapes(args)["diff_v1"]  # a field the variant does not read is not recorded


def test_a_recipe_shape_takes_given_lengths_and_another_vocabulary():
    args = recipe_args("--recipe", "125m", "--seq-lens", "512", "--batch-size", "2", "--vocab-size", "257")
    assert args.seq_lens == [512] and args.batch_size == 2
    assert {cfg.vocab_size for cfg in args.recipe_archs.values()} == {257}


@pytest.mark.parametrize("argv, message", [
    (["--recipe", "999m"], "--recipe '999m': no such size"),
    (["--recipe", "125m", "--recipe-dir", "recipes/tiny"], "not a GPU recipe directory"),
])
def test_a_bad_recipe_is_refused_before_any_model_is_built(argv, message):
    with pytest.raises(UserError, match=message):
        recipe_args(*argv)


def test_recipe_dir_without_recipe_is_refused(tmp_path):
    with pytest.raises(UserError, match="--recipe-dir: only read with --recipe"):
        main(["train", "--recipe-dir", "recipes/gpu", "--json", str(tmp_path / "r.json")])


@pytest.mark.parametrize("op, expected", [
    ("aten::_scaled_dot_product_flash_attention", ("flash", "fwd")),
    ("aten::_scaled_dot_product_flash_attention_backward", ("flash", "bwd")),
    ("aten::_scaled_dot_product_cudnn_attention_backward", ("cudnn", "bwd")),
    ("aten::_scaled_dot_product_efficient_attention", ("efficient", "fwd")),
    ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", ("cpu_flash", "bwd")),
    ("aten::_scaled_dot_product_attention_math", ("math", "fwd")),
    ("aten::mm", None),
])
def test_each_fused_sdpa_operator_is_named_by_its_backend(op, expected):
    assert profile.sdpa_backend(op) == expected


def test_a_recipe_bench_reports_each_variants_heads_and_the_attention_it_ran(tiny_recipes, tmp_path):
    """The baseline's attention is one SDPA call per layer, forward and backward; DIFF V1's heads run on the door's
    CPU kernel; the table shows each variant's own heads (DIFF V2's 4 output heads over 1 KV head)."""
    out = tmp_path / "train.json"
    assert main(["train", "--recipe", "tiny", "--recipe-dir", str(tiny_recipes), "--seq-lens", "32",
                 "--batch-size", "1", "--steps", "1", "--warmup", "0", "--rounds", "1", "--no-memory",
                 "--variants", "baseline", "diff_v2", "diff_v1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["config"]["recipe"] == "tiny" and data["config"]["vocab_size"] == 32768
    base = data["results"]["baseline@32"]
    assert base["attention_ops"] == {"cpu_flash": {"fwd": 1.0, "bwd": 1.0}}
    assert data["results"]["diff_v2@32"]["overrides"]["n_kv_heads"] == 1
    _, headers, rows, _ = train_step.table(data)
    assert rows[1][headers.index("heads (kv)")] == "4 (1)"
    # DIFF V1's two-map heads ran on the door's CPU kernel, once per layer, and the table says so
    require_cpu_kernel()
    layers = data["config"]["n_layers"]
    assert data["results"]["diff_v1@32"]["attention_ops"]["cpu_native"] == {"fwd": float(layers), "bwd": None}
    assert f"cpu_native {layers}" in rows[2][headers.index("attention calls")]


def test_the_probe_computes_each_formulation_of_a_head_alike(tiny_recipes, tmp_path):
    """Every formulation of DIFF V1's and DIFF V2's heads, and of Shared DIFF's Q projection, gives the first one's
    output; the math backend takes every call, and the markdown names each."""
    out = tmp_path / "probe.json"
    assert main(["probe", "--recipe", "tiny", "--recipe-dir", str(tiny_recipes), "--device", "cpu", "--dtype", "fp32",
                 "--seq-len", "16", "--batch-size", "1", "--steps", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert len(result["formulations"]) == 8
    for entry in result["formulations"].values():
        assert entry["max_rel_diff_to_first"] < 1e-5
    assert all(row["math"]["ok"] for row in result["backends"].values())
    text = out.with_suffix(".md").read_text()
    assert "diff_v1: 1 call over 2h heads, V at 2d" in text and "diff_v2: 1 GQA call" in text
    assert "shared_diff: Q projection, X (W + A B^T), one GEMM" in text


def test_the_gpu_script_commands_parse():
    """bench/gpu.sh runs only on a GPU; each of its bench commands' flags parse here."""
    script = (REPO / "bench/gpu.sh").read_text()
    assert "bench train" in script and "bench probe" in script and " fit " in script
    assert probe.build_parser().parse_args(["--json", "x.json"]).device == "cuda"


def test_the_gpu_wheels_are_what_the_gpu_script_installs():
    """bench/gpu_wheels.sh downloads (it needs the registry, so it is not run here) exactly the packages bench/gpu.sh
    checks for before installing from .whl/, and those are what diffexp's fit imports beyond the GPU image's
    packages (torch, lightning, tensorboard, ...): LightningCLI's jsonargparse[signatures]."""
    import re

    wheels = (REPO / "bench/gpu_wheels.sh").read_text()
    downloaded = re.search(r"pip download[^\n]*-d \.whl \\\n\s*(.+)", wheels).group(1)
    names = {re.split(r"[<>=\"]", word.strip('"'))[0].replace("-", "_") for word in downloaded.split()}
    checked = re.search(r'import (jsonargparse[^"]*)"', (REPO / "bench/gpu.sh").read_text()).group(1)
    assert names == {name.strip() for name in checked.split(",")} == {"jsonargparse", "docstring_parser",
                                                                     "typeshed_client"}


def gpu_script(out: Path, tiny_recipes: Path, work: Path, timeout: int, **settings) -> None:
    env = {**os.environ, "DIFFEXP_GPU_SH_SMOKE": "1", "DIFFEXP_GPU_SIZE": "tiny",
           "DIFFEXP_GPU_RECIPE_DIR": str(tiny_recipes), "DIFFEXP_GPU_WORK": str(work), **settings}
    subprocess.run(["bash", "bench/gpu.sh", str(out)], cwd=REPO, env=env, check=True, timeout=timeout,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def results_of(out: Path) -> dict[str, dict]:
    """The JSONs in OUT/results.tar, by name."""
    import tarfile

    with tarfile.open(out / "results.tar") as tar:
        return {member.name: json.load(tar.extractfile(member)) for member in tar.getmembers()
                if member.name.endswith(".json")}


def test_a_bench_run_stopped_part_way_keeps_the_rounds_it_finished(tmp_path):
    """bench train saves after each round, ratios computed: a run interrupted as a step's time cap does (SIGINT)
    leaves a JSON whose rows the summary draws, marked as stopped part-way."""
    import signal
    import sys
    import time

    from diffexp.bench import summary

    path = tmp_path / "results" / "train-compiled-diff_v1.json"
    path.parent.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "diffexp", "bench", "train", "--device", "cpu", "--d-model", "32",
                             "--n-layers", "1", "--n-heads", "2", "--seq-lens", "32", "--batch-size", "1", "--rounds",
                             "100000", "--steps", "1", "--warmup", "0", "--no-memory", "--variants", "baseline",
                             "diff_v1", "--json", str(path)], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not path.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        time.sleep(1)  # a few more rounds
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    data = json.loads(path.read_text())
    assert data["complete"] is False and data["env"]["device"] == "cpu"
    rounds = len(data["results"]["diff_v1@32"]["round_speed_ratios"])
    assert rounds >= 1 and data["results"]["diff_v1@32"]["flop_rate_ratio"] > 0
    assert data["results"]["diff_v1@32"]["attention_ops"]  # the kernel door's pick, from the first step
    page = summary.summarise(path.parent)
    assert "(stopped part-way: the rounds it finished)" in page
    assert page.count("| diff_v1 | 32 |") == 1 and page.count("| baseline | 32 |") == 1


def test_the_gpu_script_keeps_a_step_stopped_at_its_cap_in_its_out_folder(tiny_recipes, tmp_path):
    """A step stopped at its cap leaves the rows it finished in OUT_DIR (results.tar, summary.md) and says so in
    failed.txt; the script itself goes on (the steps after it run or are skipped for the budget)."""
    out = tmp_path / "out"
    gpu_script(out, tiny_recipes, tmp_path / "work", timeout=300, DIFFEXP_GPU_STEPS="train-compiled",
               DIFFEXP_GPU_COMPILE="0", DIFFEXP_GPU_VARIANTS="diff_v1", DIFFEXP_GPU_ROUNDS="100000",
               DIFFEXP_GPU_CAP_PERCENT="40", DIFFEXP_GPU_BUDGET_S="120")
    assert sorted(p.name for p in out.iterdir()) == ["failed.txt", "gpu.log", "results.tar", "summary.md"]
    assert (out / "failed.txt").read_text() == "train-compiled-diff_v1: exit 124, stopped at its 28 s limit\n"
    data = results_of(out)["train-compiled-diff_v1.json"]
    assert data["complete"] is False and {"baseline@32", "diff_v1@32"} <= set(data["results"])
    assert "| diff_v1 | 32 |" in (out / "summary.md").read_text()


@pytest.mark.heavy
def test_the_gpu_script_runs_end_to_end_on_cpu_in_smoke_mode(tiny_recipes, tmp_path):
    """DIFFEXP_GPU_SH_SMOKE=1: every step of bench/gpu.sh on the CPU at a tiny size; each writes its JSON, the
    summary has every table, and the compiled and eager tables name the kernel each two-map variant ran (about 10
    minutes on 2 cores: inductor compiles five models)."""
    out = tmp_path / "out"
    gpu_script(out, tiny_recipes, tmp_path / "work", timeout=3000)
    assert (out / "failed.txt").read_text() == ""
    # four files, each replaced whole, so that a copy taken mid-run is never half a file
    assert sorted(p.name for p in out.iterdir()) == ["failed.txt", "gpu.log", "results.tar", "summary.md"]
    results = results_of(out)
    compiled = [f"train-compiled-{v}.json" for v in ("diff_v1", "dint", "diff_v2", "shared_diff")]
    assert set(compiled) | {"probe.json", "train-eager.json", "fit.json"} <= set(results)
    for name in compiled:
        variant = name.removeprefix("train-compiled-").removesuffix(".json")
        if variant != "diff_v2":  # two-map heads: the door's pick, traced into the compiled graph
            assert results[name]["results"][f"{variant}@32"]["attention_ops"]["cpu_native"]["traced"] >= 1
    assert results["train-eager.json"]["results"]["dint@32"]["attention_ops"]["cpu_native"]["fwd"] == 1.0
    summary = (out / "summary.md").read_text()
    assert "SDPA probe" in summary and "compiled, every variant" in summary and "fit / bench step" in summary
    assert "cpu_native (compiled in)" in summary

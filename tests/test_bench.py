"""`diffexp bench train|decode|kernel` run on CPU: every registered variant against the reference, a JSON a
later run compares with, and bad flags refused before any work."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest
import torch

from diffexp import Decoder, ModelConfig
from diffexp.bench import report
from diffexp.bench.cli import main
from diffexp.cli import main as diffexp_main
from diffexp.model.attention import variant_names, variants
from diffexp.model.attention.registry import reference_variant
from diffexp.model.compile import compile_unavailable
from tests.helpers import REPO, exit_code

SHAPE = ["--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--vocab-size", "64", "--seq-lens", "32",
         "--batch-size", "2", "--steps", "1", "--warmup", "0", "--rounds", "2", "--threads", "1"]
TINY = ["train", *SHAPE]
TINY_DECODE = ["decode", *SHAPE, "--batch-size", "1", "--new-tokens", "2", "--modes", "eager"]
TINY_KERNEL = ["kernel", *SHAPE]


@pytest.fixture(autouse=True)
def _keep_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def two_map_variant() -> str:
    return next(v.name for v in variants() if v.maps_per_head == 2)


def test_bench_writes_ratios_flops_and_mfu_and_compares(tmp_path, capsys):
    first = tmp_path / "first.json"
    assert main([*TINY, "--json", str(first), "--peak-tflops", "1.0"]) == 0
    data = json.loads(first.read_text())
    caption = " ".join(capsys.readouterr().out.split())  # the table may wrap it
    assert "the peak (1 TFLOP/s), in two conventions" in caption and "{" not in caption
    assert f"TFLOP/s). Wall time {data['env']['wall_s']:.0f} s" in caption
    results = data["results"]
    assert set(results) == {f"{v}@32" for v in variant_names()}
    base = results[f"{reference_variant().name}@32"]
    assert base["speed_ratio"] == pytest.approx(1.0) and base["mem_ratio"] == pytest.approx(1.0)
    for entry in results.values():
        assert entry["speed_ratio"] > 0 and entry["peak_bytes"] > 0
        assert entry["mfu"] == pytest.approx(entry["tflops_per_s"] / 1.0)
        # PaLM's convention counts all T keys per query: more FLOPs, the same step time
        assert entry["palm_mfu"] == pytest.approx(entry["mfu"] * entry["palm_flops_per_step"] / entry["flops_per_step"])
        assert entry["palm_flops_per_step"] > entry["flops_per_step"]
        # FLOP-rate ratio: the variant's FLOPs/s over the reference's, in the same run (the speed ratio, from
        # paired steps, times the FLOPs ratio), and the speed ratio the median of those pairs
        work = entry["flops_per_step"] / base["flops_per_step"]
        assert entry["flop_rate_ratio"] == pytest.approx(entry["speed_ratio"] * work)
        pairs = [b / x for b_round, x_round in zip(base["times_s"], entry["times_s"], strict=True)
                 for b, x in zip(b_round, x_round, strict=True)]
        assert entry["speed_ratio"] == pytest.approx(statistics.median(pairs))
        assert entry["flop_rate_ratio_min"] <= entry["flop_rate_ratio_max"]
    assert first.with_suffix(".png").stat().st_size > 0 and "plot: " in caption
    # the two-map variants do more attention work per token than the baseline
    assert results[f"{two_map_variant()}@32"]["flops_per_step"] > base["flops_per_step"]
    assert data["kind"] == "train" and data["env"]["threads"] == 1

    # a result written before `diffexp bench` had kinds (no "kind" key) compares as a training-step run
    first.write_text(json.dumps({key: value for key, value in data.items() if key != "kind"}))
    second = tmp_path / "second.json"
    with pytest.raises(SystemExit) as exit_info:  # through the diffexp CLI
        diffexp_main(["bench", *TINY, "--variants", variant_names()[-1], "--no-memory", "--json", str(second),
                      "--compare", str(first)])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "MFU" in out and "old tok/s ratio" in out and "old FLOP/s ratio" in out


def test_bench_decode_uses_the_kv_cache(tmp_path, capsys):
    path = tmp_path / "decode.json"
    assert main([*TINY_DECODE, "--batch-size", "1", "2", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    out = " ".join(capsys.readouterr().out.split())
    assert "Decoding with the KV cache" in out and "rewinds the cache" in out
    assert data["kind"] == "decode" and data["config"]["kv_cache"] is True
    results = data["results"]
    assert set(results) == {f"{v}@32x{b}" for v in variant_names() for b in (1, 2)}
    for batch in (1, 2):
        base = results[f"{reference_variant().name}@32x{batch}"]
        assert base["speed_ratio"] == pytest.approx(1.0) and base["cache_ratio"] == pytest.approx(1.0)
    for entry in results.values():
        assert entry["speed_ratio"] > 0 and entry["peak_bytes"] > 0 and entry["new_tokens"] == 2
        assert entry["tokens_per_s"] == pytest.approx(entry["batch_size"] / entry["median_decode_token_s"])
        # with a cache a token costs one position's forward: the weights once plus its attention over the context
        model = Decoder(ModelConfig(attention=entry["variant"], vocab_size=64, d_model=32, n_layers=1, n_heads=2,
                                    max_seq_len=34, **entry["overrides"]))
        assert entry["decode_flops_per_token"] == entry["batch_size"] * model.decode_flops_per_token(32)
        assert entry["cache_bytes_per_token"] > 0
    assert path.with_suffix(".png").stat().st_size > 0 and "plot: " in out  # the figure beside the JSON
    assert main([*TINY_DECODE, "--no-memory", "--json", str(tmp_path / "again.json"), "--compare", str(path)]) == 0
    assert "old tok/s ratio" in capsys.readouterr().out


@pytest.mark.skipif(compile_unavailable(torch.device("cpu")) is not None, reason="torch.compile cannot run here")
def test_bench_decode_compiled_mode_times_the_compiled_step(tmp_path, capsys):
    torch.compiler.reset()
    path = tmp_path / "decode.json"
    args = [*TINY_DECODE[:-1], "compiled", "eager", "--variants", "diff_v2", "--no-memory", "--json", str(path),
            "--profile", "60"]
    assert main(args) == 0
    results = json.loads(path.read_text())["results"]
    assert set(results) == {f"{v}@32x1{m}" for v in ("baseline", "diff_v2") for m in ("", ":compiled")}
    for key, entry in results.items():
        compiled = key.endswith(":compiled")
        assert entry["mode"] == ("compiled" if compiled else "eager") and (entry["compile_s"] is not None) == compiled
        # every weight once (of the embedding only the batch's row) and the whole cache
        model = Decoder(ModelConfig(attention=entry["variant"], vocab_size=64, d_model=32, n_layers=1, n_heads=2,
                                    max_seq_len=34, **entry["overrides"]))
        weights = 4 * (model.num_parameters() - model.embed.weight.numel() + 32)
        assert entry["bytes_per_step"] == weights + 32 * entry["cache_bytes_per_token"]
        assert entry["bandwidth_fraction"] is None  # no bandwidth bound on CPU
        # --profile shows the compiled step as a compiled region (none in eager mode)
        names = [item["name"] for item in entry["profile"]["top"]]
        assert any("Compiled" in name for name in names) == compiled, names
    assert results["baseline@32x1:compiled"]["speed_ratio"] == pytest.approx(1.0)
    assert "Lowest ratio over the grid: diff_v2 compiled" in " ".join(capsys.readouterr().out.split())
    torch.compiler.reset()


def test_bench_decode_kv_heads_puts_v2_on_the_baselines_cache(tmp_path):
    """The V2 blog's claim in numbers: at the same KV heads V2's cache is the baseline's, byte for byte."""
    path = tmp_path / "decode.json"
    assert main([*TINY_DECODE, "--variants", "diff_v2", "--kv-heads", "1", "--no-memory", "--json", str(path)]) == 0
    results = json.loads(path.read_text())["results"]
    assert results["diff_v2@32x1"]["cache_ratio"] == 1.0
    assert results["diff_v2@32x1"]["overrides"]["n_kv_heads"] == 1
    # but its step reads more: W_Q has 2h query heads. The ratio a memory-bound step would show says how much
    base, v2 = results["baseline@32x1"], results["diff_v2@32x1"]
    assert v2["bytes_per_step"] > base["bytes_per_step"]
    assert v2["memory_bound_ratio"] == pytest.approx(base["bytes_per_step"] / v2["bytes_per_step"])
    assert base["memory_bound_ratio"] == 1.0


def test_bench_decode_bf16_reads_bf16_weights_and_cache(tmp_path):
    """--dtype bf16 decodes as inference does: the weights and the cache in bf16, half the bytes of fp32."""
    runs = {}
    for dtype in ("fp32", "bf16"):
        path = tmp_path / f"{dtype}.json"
        assert main([*TINY_DECODE, "--variants", "diff_v2", "--dtype", dtype, "--no-memory", "--json", str(path)]) == 0
        runs[dtype] = json.loads(path.read_text())["results"]
    for key, fp32 in runs["fp32"].items():
        bf16 = runs["bf16"][key]
        assert bf16["cache_bytes_per_token"] * 2 == fp32["cache_bytes_per_token"]
        assert bf16["bytes_per_step"] * 2 == fp32["bytes_per_step"]


def test_bench_decode_noise_floor_times_a_second_copy_of_the_reference(tmp_path, capsys):
    """--noise-floor: a separately built copy of the reference, timed in the same rotation, with its own ratio."""
    path = tmp_path / "decode.json"
    assert main([*TINY_DECODE, "--variants", "diff_v2", "--no-memory", "--noise-floor", "--steps", "3", "--json",
                 str(path)]) == 0  # 6 paired runs, the fewest that give a 95% interval
    data = json.loads(path.read_text())
    ref = reference_variant().name
    copy = data["results"][f"{ref}#2@32x1"]
    assert copy["variant"] == f"{ref}#2" and copy["speed_ratio"] > 0 and data["config"]["noise_floor"] is True
    assert copy["cache_bytes_per_token"] == data["results"][f"{ref}@32x1"]["cache_bytes_per_token"]
    assert copy["params"] == data["results"][f"{ref}@32x1"]["params"]
    out = " ".join(capsys.readouterr().out.split())
    assert f"Noise floor: {ref}#2" in out and "Lowest ratio over the grid: diff_v2 eager" in out
    for name in ("diff_v2@32x1", f"{ref}#2@32x1"):  # each lowest ratio with its interval, as the JSON holds it
        e = data["results"][name]
        low, high = e["speed_ratio_ci"]
        assert low <= e["speed_ratio"] <= high
        assert f"{e['speed_ratio']:.2f}x (CI {low:.2f}-{high:.2f}" in out
    assert "95% confidence interval" in out


def test_bench_decode_match_params_moves_each_variants_ffn_to_the_references_parameter_count(tmp_path, capsys):
    """--match-params: the V2 blog's parity claim is for a V2 whose extra query parameters are borrowed from the rest
    of the model. Each variant's SwiGLU is resized so that its total is the nearest to the reference's a step of 8
    hidden units allows; the models timed are those resized ones."""
    runs = {}
    for flag in ([], ["--match-params"]):
        path = tmp_path / f"decode{len(flag)}.json"
        assert main([*TINY_DECODE, "--kv-heads", "1", "--no-memory", *flag, "--json", str(path)]) == 0
        runs[bool(flag)] = json.loads(path.read_text())
    ref = reference_variant().name
    half_step = 3 * 32 * 1 * 8 // 2  # SwiGLU: 3 d_model weights per hidden unit, one layer
    for matched in (False, True):
        results = runs[matched]["results"]
        total = {e["variant"]: e["params"]["total"] for e in results.values()}
        assert runs[matched]["config"]["match_params"] is matched
        if matched:
            assert all(abs(n - total[ref]) <= half_step for n in total.values()), total
        else:  # V2's doubled W_Q, unmatched: more than half a step more
            assert total["diff_v2"] - total[ref] > half_step
    bound = {m: runs[m]["results"]["diff_v2@32x1"]["memory_bound_ratio"] for m in runs}
    assert abs(1 - bound[True]) < abs(1 - bound[False]) / 2  # the bytes a step reads come near the reference's
    widths = runs[True]["config"]["variant_overrides"]
    default = ModelConfig(d_model=32).resolved_ffn_hidden
    assert widths["diff_v2"]["ffn_hidden"] < default and "ffn_hidden" not in widths[ref]
    assert runs[True]["results"]["diff_v2@32x1"]["overrides"]["ffn_hidden"] == widths["diff_v2"]["ffn_hidden"]
    out = " ".join(capsys.readouterr().out.split())
    assert "Parameters matched (--match-params)" in out and f"diff_v2 {widths['diff_v2']['ffn_hidden']}" in out


def test_bench_kernel_times_each_backend(tmp_path):
    path = tmp_path / "kernel.json"
    assert main([*TINY_KERNEL, "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["kind"] == "kernel" and data["config"]["backends"] == ["sdpa", "eager"]
    results = data["results"]
    assert set(results) == {f"{v}@32/{b}" for v in variant_names() for b in ("sdpa", "eager")}
    for backend in ("sdpa", "eager"):
        base = results[f"{reference_variant().name}@32/{backend}"]
        assert base["speed_ratio"] == pytest.approx(1.0) and base["forward_speed_ratio"] == pytest.approx(1.0)
        assert results[f"{two_map_variant()}@32/{backend}"]["flops_per_step"] > base["flops_per_step"]
    for entry in results.values():
        assert entry["speed_ratio"] > 0 and entry["forward_speed_ratio"] > 0 and entry["peak_bytes"] > 0


@pytest.mark.parametrize("backend, path", [("sdpa", "native"), ("sdpa-cpu_native", "native"), ("sdpa-plain", None),
                                           ("sdpa-sdpa_joined", "joined")])
def test_bench_kernel_times_the_path_it_names(tmp_path, monkeypatch, backend, path):
    """On CPU, sdpa runs the two-map variants in the compiled kernel, sdpa-plain in one SDPA call per map and
    sdpa-NAME on registered kernel NAME: each backend runs its path and no other."""
    import dataclasses

    from diffexp.kernels import cpu_native, registry
    from tests.helpers import require_cpu_kernel

    require_cpu_kernel()
    calls = []
    real_native, joined = cpu_native.NativeTwoMap.apply, registry._KERNELS["sdpa_joined"]
    monkeypatch.setattr(cpu_native.NativeTwoMap, "apply", lambda *a: calls.append("native") or real_native(*a))
    monkeypatch.setitem(registry._KERNELS, "sdpa_joined", dataclasses.replace(
        joined, head=lambda *a: calls.append("joined") or joined.head(*a)))
    out = tmp_path / f"{backend}.json"
    assert main([*TINY_KERNEL, "--variants", "diff_v1", "--backends", backend, "--no-memory",
                 "--json", str(out)]) == 0
    assert set(calls) == ({path} if path else set())
    assert json.loads(out.read_text())["results"][f"diff_v1@32/{backend}"]["speed_ratio"] > 0


@pytest.mark.parametrize("kind", [TINY, TINY_DECODE, TINY_KERNEL], ids=lambda args: args[0])
def test_bench_records_the_threads_it_ran_with(kind, tmp_path):
    """--threads 1 on a process whose default is 2: every kind records 1, at the start and at the end."""
    torch.set_num_threads(2)
    path = tmp_path / "threads.json"
    assert main([*kind, "--variants", reference_variant().name, "--no-memory", "--json", str(path)]) == 0
    env = json.loads(path.read_text())["env"]
    assert (env["threads"], env["threads_end"]) == (1, 1)
    assert "thread count changed" not in report.load_note(env)
    assert "1 -> 2" in report.load_note({**env, "threads_end": 2})


def test_a_cpu_run_names_the_cpu_model_and_a_comparison_notices_a_change_of_machine(tmp_path):
    """The machines a run lands on differ: a CPU run records its model, not only "x86_64"."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu\n")
    assert report.cpu_name(str(cpuinfo)) == "AMD EPYC 7B13"
    assert report.cpu_name(str(tmp_path / "absent")) != ""  # no /proc: the architecture
    assert "device_name" in report.ENV_KEYS  # compare() lists a changed machine among what differs


def test_the_competition_note_counts_other_processes_not_the_runs_own_threads(tmp_path):
    """A run whose own threads fill the CPUs raises the load average to their number: that is not competition.
    The note counts the CPU time other processes took (from /proc/stat), and falls back to the load average
    where there is none."""
    path = tmp_path / "alone.json"
    assert main([*TINY_KERNEL, "--variants", reference_variant().name, "--no-memory", "--json", str(path)]) == 0
    env = json.loads(path.read_text())["env"]
    if env["cpu_seconds_start"] is not None:
        assert 0 <= env["others_cpu_share"] <= 1
    filled = {"cpu_count": 2, "threads": 2, "loadavg_start": [0.3], "loadavg_end": [2.1], "others_cpu_share": 0.01}
    assert report.load_note(filled) == ""
    assert "other processes took 30% of the 2 CPUs' time" in report.load_note({**filled, "others_cpu_share": 0.3})
    assert "load average 0.3 -> 2.1" in report.load_note({**filled, "others_cpu_share": None})
    start = {"busy": 100.0, "own": 5.0}
    assert report.others_share(start, {"busy": 110.0, "own": 13.0}, 10.0, 2) == pytest.approx(0.1)
    assert report.others_share(start, {"busy": 101.0, "own": 7.0}, 10.0, 2) == 0  # never below 0
    before = report.cpu_seconds()
    if before is not None:  # a process the run starts (a compiler) is the run's own
        busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass"
        subprocess.run([sys.executable, "-c", busy], check=True)
        assert report.cpu_seconds()["own"] - before["own"] >= 0.25


def test_a_bench_stopped_part_way_keeps_the_shapes_it_finished(tmp_path, monkeypatch, capsys):
    """The results JSON is rewritten after each shape: a run stopped in its second shape keeps the first one's runs,
    marked unfinished, and --compare refuses it before any work."""
    from diffexp.bench import timing

    class Stopped(Exception):
        pass

    real, calls = timing.measure, []

    def measure(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise Stopped  # as a kill in the middle of the second shape
        return real(*args, **kwargs)

    monkeypatch.setattr(timing, "measure", measure)
    path = tmp_path / "stopped.json"
    args = [*TINY_DECODE, "--seq-lens", "16", "32", "--no-memory", "--variants", "diff_v1"]
    with pytest.raises(Stopped):
        main([*args, "--json", str(path)])
    data = json.loads(path.read_text())
    assert data["complete"] is False and data["kind"] == "decode" and data["config"]["seq_lens"] == [16, 32]
    assert set(data["results"]) == {"baseline@16x1", "diff_v1@16x1"}
    for entry in data["results"].values():
        assert [len(runs) for runs in entry["decode_token_times_s"]] == [1, 1]  # 2 rounds of 1 timed run
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stopped.json"]  # written whole: no temporary left
    monkeypatch.undo()
    assert exit_code(["bench", *args, "--json", str(tmp_path / "next.json"), "--compare", str(path)]) == 2
    assert "an unfinished run" in capsys.readouterr().err and not (tmp_path / "next.json").exists()


def test_a_bench_that_cannot_write_its_results_measures_on_and_prints_its_table(tmp_path, monkeypatch, capsys):
    """A full disk: the results so far cannot be saved after a shape; the run says so once, measures on, prints
    its table, and then ends with an error naming --json (exit 2), leaving no file behind."""
    import errno
    import pathlib

    real_write = pathlib.Path.write_text

    def full_disk(self, *args, **kwargs):
        if self.name.endswith(".partial"):
            real_write(self, "{")  # a few bytes, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "write_text", full_disk)
    path = tmp_path / "full.json"
    code = exit_code(["bench", *TINY_DECODE, "--seq-lens", "16", "32", "--no-memory", "--variants", "diff_v1",
                      "--json", str(path)])
    out, err = capsys.readouterr()
    assert code == 2 and "Decoding with the KV cache" in out and "diff_v1" in out
    assert err.count("cannot write the results so far") == 1 and "No space left on device" in err
    assert f"--json {path}: cannot write the results" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # no half-written file


@pytest.mark.parametrize("kind", [TINY, TINY_DECODE, TINY_KERNEL], ids=lambda args: args[0])
def test_bench_profile_lists_where_each_variants_time_goes(kind, tmp_path, capsys):
    path = tmp_path / "profile.json"
    assert main([*kind, "--variants", "diff_v1", "--no-memory", "--profile", "40", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["config"]["profile"] == 40 and "Where the time goes (--profile 40)" in capsys.readouterr().out
    unit = "token" if kind is TINY_DECODE else "run"
    names = {}
    for entry in data["results"].values():
        prof = entry["profile"]
        assert prof["unit"] == unit and prof["clock"] == "cpu" and 0 < len(prof["top"]) <= 40
        times = [item["self_us"] for item in prof["top"]]
        assert times == sorted(times, reverse=True) and times[-1] > 0 and sum(times) <= prof["total_us"] * (1 + 1e-9)
        assert all(item["calls"] > 0 for item in prof["top"])
        names[entry["variant"]] = {item["name"] for item in prof["top"]}
    assert set(names) == set(data["config"]["variants"])  # each runner profiled in its own run


@pytest.mark.parametrize("args, message", [
    ([*TINY, "--variants", "diff_v9"], "unknown variant 'diff_v9'"),
    ([*TINY, "--peak-tflops", "0"], "--peak-tflops: expected a positive number"),
    ([*TINY, "--seq-lens", "0"], "--seq-lens: expected a positive integer, got 0"),
    ([*TINY, "--profile", "-1"], "--profile: expected 0 (no profile) or a number of entries per variant, got -1"),
    ([*TINY, "--seq-lens", "2000000000"], "--seq-lens 2000000000 (batch 1)"),  # more than any host holds
    ([*TINY_DECODE, "--variants", "diff_v9"], "unknown variant 'diff_v9'"),
    ([*TINY_DECODE, "--new-tokens", "0"], "--new-tokens: expected a positive integer, got 0"),
    ([*TINY_DECODE, "--kv-heads", "0"], "--kv-heads: expected a positive integer, got 0"),
    ([*TINY_DECODE, "--kv-heads", "3"], "n_kv_heads"),
    ([*TINY_DECODE, "--seq-lens", "2000000000"], "--seq-lens 2000000000 --batch-size"),  # more than any host holds
    ([*TINY_KERNEL, "--variants", "diff_v9"], "unknown variant 'diff_v9'"),
    ([*TINY_KERNEL, "--backends", "flash_attn"], "--backends: invalid choice: 'flash_attn'"),
    ([*TINY_KERNEL, "--backends", "fast"], "--backends: invalid choice: 'fast'"),
    (["fastest", *SHAPE], "diffexp bench KIND: got 'fastest'; expected one of train, decode, kernel"),
])
def test_bench_rejects_bad_flags_before_any_work(args, message, tmp_path, capsys):
    assert exit_code(["bench", *args, "--json", str(tmp_path / "sub" / "out.json")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "sub").exists()  # nothing was created


def test_bench_without_kind_runs_train_and_lists_kinds(tmp_path, capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(kind in out for kind in ("train", "decode", "kernel"))
    path = tmp_path / "default.json"
    assert main([*SHAPE, "--variants", reference_variant().name, "--no-memory", "--json", str(path)]) == 0
    assert json.loads(path.read_text())["kind"] == "train"


def test_a_newly_registered_variant_is_benchmarked(tmp_path):
    from dataclasses import replace

    from diffexp.model.attention import variant_class
    from diffexp.model.attention.registry import register, unregister

    reference = variant_class(reference_variant().name)

    @register
    class ProbeAttention(reference):
        variant = replace(reference.variant, name="bench_probe", reference_variant=False,
                          bench_arch={"n_kv_heads": 1})

    try:
        path = tmp_path / "kernel.json"
        assert main([*TINY_KERNEL, "--backends", "sdpa", "--no-memory", "--json", str(path)]) == 0
        data = json.loads(path.read_text())
        assert "bench_probe@32/sdpa" in data["results"]
        assert data["config"]["variant_overrides"]["bench_probe"] == {"n_kv_heads": 1}
    finally:
        unregister("bench_probe")


def test_bench_names_no_variant():
    for path in (REPO / "diffexp" / "bench").glob("*.py"):  # variants come from the registry only
        text = path.read_text().lower()
        assert not [name for name in variant_names() if name in text], path


def test_plot_draws_a_ratio_outside_its_rounds_range(tmp_path):
    """The headline ratio (median over every step) may fall outside the per-round range; the figure still draws."""
    from diffexp.bench.plot import plot_train

    def entry(speed, flop):
        return {"speed_ratio": speed, "speed_ratio_min": 0.80, "speed_ratio_max": 0.82,
                "flop_rate_ratio": flop, "flop_rate_ratio_min": 0.90, "flop_rate_ratio_max": 0.93}

    data = {"config": {"seq_lens": [512], "variants": ["baseline", "dint"], "dtype": "fp32", "d_model": 64,
                       "n_layers": 2, "n_heads": 2},
            "env": {"device": "cpu", "device_name": "x86_64", "threads": 2},
            "results": {"baseline@512": entry(1.0, 1.0) | {"speed_ratio_min": 1.0, "speed_ratio_max": 1.0,
                                                           "flop_rate_ratio_min": 1.0, "flop_rate_ratio_max": 1.0},
                        "dint@512": entry(0.79, 0.95)}}
    path = plot_train(data, tmp_path / "ratios.png")
    assert path.stat().st_size > 0


def test_timed_rounds_run_with_the_garbage_collector_off_and_every_sample_kept():
    """A collection's pause must not land in one variant's timed run; the collector is back on after the rounds,
    and each round keeps each runner's timed runs in order."""
    import argparse
    import gc

    from diffexp.bench import timing
    from diffexp.bench.progress import ProgressReporter

    class Runner:
        def __init__(self):
            self.collector_on, self.count = [], 0

        def run(self):
            self.collector_on.append(gc.isenabled())

        def timed(self):
            self.collector_on.append(gc.isenabled())
            self.count += 1
            return {"seconds": float(self.count)}

    runners = {"a": Runner(), "b": Runner()}
    args = argparse.Namespace(rounds=2, warmup=1, steps=3)
    assert gc.isenabled()
    total = timing.runs_per_variant(argparse.Namespace(**vars(args), no_memory=True, profile=0)) * 2
    with ProgressReporter(total=total) as p:
        samples = timing.interleaved(runners, args, p, "test", headline="seconds")
    assert gc.isenabled()
    for runner in runners.values():  # the first, untimed run precedes the rounds; every later run is in one
        assert runner.collector_on[0] and not any(runner.collector_on[1:])
    assert samples["a"]["seconds"] == [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]


def test_a_ratio_pairs_runs_so_a_change_in_the_machines_speed_does_not_move_it():
    """Two identical models, and the machine halves its speed one run earlier for the second than for the first:
    the pooled medians would read 0.75; pairs of neighbouring runs read 1, and only the one pair split by the
    change is off."""
    from diffexp.bench import timing

    base = {"t": [[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]]}
    copy = {"t": [[1.0, 1.0, 2.0], [2.0, 2.0, 2.0]]}
    pooled = statistics.median([1.0] * 3 + [2.0] * 3) / statistics.median([1.0] * 2 + [2.0] * 4)
    assert pooled == 0.75
    timing.add_ratio(copy, base, "t", "median_t", "ratio")
    assert copy["ratio"] == 1.0
    assert copy["round_ratios"] == [1.0, 1.0]
    assert copy["median_t"] == 2.0 and copy["round_median_t"] == [1.0, 2.0]

    slower = {"t": [[1.25, 1.25, 2.5], [2.5, 2.5, 2.5]]}  # the copy's times x 1.25: slower, same early slowdown
    timing.add_ratio(slower, base, "t", "median_t", "ratio")
    assert slower["ratio"] == 0.8 and slower["ratio_min"] == slower["ratio_max"] == 0.8


@pytest.mark.parametrize("rounds", [1, 3])
def test_a_ratios_interval_holds_the_true_ratio_and_narrows_with_more_runs(rounds):
    """A variant 0.9x the reference's speed under 10% noise per run: the 95% interval of the paired runs' median
    holds 0.9 and the estimate, and narrows as runs are added; too few pairs give none."""
    import random

    from diffexp.bench import timing

    noise = random.Random(rounds)

    def timed(runs_per_round: int) -> tuple[dict, dict]:
        base = [[1.0 + noise.gauss(0, 0.1) for _ in range(runs_per_round)] for _ in range(rounds)]
        own = [[b / 0.9 * (1.0 + noise.gauss(0, 0.1)) for b in r] for r in base]
        return {"t": own}, {"t": base}

    widths = []
    for runs in (8, 200):
        own, base = timed(runs)
        timing.add_ratio(own, base, "t", "median_t", "ratio")
        low, high = own["ratio_ci"]
        assert low <= 0.9 <= high and low <= own["ratio"] <= high
        widths.append(high - low)
    assert widths[1] < widths[0] / 2
    own, base = {"t": [[1.0] * 5]}, {"t": [[1.0] * 5]}
    timing.add_ratio(own, base, "t", "median_t", "ratio")
    assert own["ratio_ci"] is None


def test_compare_says_when_the_runs_estimated_their_ratios_differently(tmp_path, capsys):
    from diffexp.bench import decode, report, timing

    def run(config_extra):
        entry = {"variant": "baseline", "mode": "compiled", "seq_len": 1024, "batch_size": 1, "speed_ratio": 1.0,
                 "speed_ratio_min": 1.0, "speed_ratio_max": 1.0, "cache_ratio": 1.0, "mem_ratio": None}
        return {"env": {"device": "cpu", "device_name": "x", "threads": 2, "torch": "2"},
                "config": config_extra, "results": {"baseline@1024x1:compiled": entry}}

    report.compare(run({}), run({"ratio_estimator": timing.RATIO_ESTIMATOR}), decode.LAYOUT, tmp_path / "old.json")
    out = capsys.readouterr().out
    assert f"ratio_estimator: {timing.EARLIER_RATIO_ESTIMATOR} -> {timing.RATIO_ESTIMATOR}" in out
    report.compare(run({"ratio_estimator": timing.RATIO_ESTIMATOR}), run({"ratio_estimator": timing.RATIO_ESTIMATOR}),
                   decode.LAYOUT, tmp_path / "old.json")
    assert "ratio_estimator" not in capsys.readouterr().out


def test_the_round_log_shows_a_decoding_steps_milliseconds_with_decimals():
    from diffexp.bench.timing import _milliseconds

    assert _milliseconds(0.00136) == "1.36" and _milliseconds(0.0118) == "12" and _milliseconds(2.5) == "2500"

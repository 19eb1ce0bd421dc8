"""`diffexp bench decode`: decoding with the KV cache, every attention variant against the reference.

Each variant prefills the same random prompt once; a timed run decodes ``--new-tokens`` tokens greedily and
rewinds the cache, so every run decodes at the same context. Details: bench/README.md.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from diffexp.bench import options, report, timing, workload
from diffexp.bench.memory import peak_bytes, release, tensor_bytes
from diffexp.bench.progress import ProgressReporter
from diffexp.errors import UserError
from diffexp.model.attention.registry import reference_variant

NAME = "decode"
ABOUT = "decoding with the KV cache, eager and compiled: tokens/s and bytes read per step, vs the reference"
KV_CACHE = True
MODES = ("eager", "compiled")
COPY = "#2"  # the suffix of the reference's copy (--noise-floor)
LAYOUT = report.Layout(
    labels=(("variant", "variant"), ("mode", "mode"), ("context", "seq_len"), ("batch", "batch_size")),
    ratios=(report.Ratio("speed_ratio", "old tok/s ratio", "new tok/s ratio", "change", "old spread"),
            report.Ratio("cache_ratio", "old cache ratio", "new cache ratio", "cache change"),
            report.Ratio("mem_ratio", "old mem ratio", "new mem ratio", "mem change")),
    config_keys=("dtype", "backend", "d_model", "n_layers", "n_heads", "vocab_size", "variant_overrides",
                 "new_tokens", "kv_cache", "kv_heads"),
)
HEADERS = ["variant", "mode", "context", "batch", "KV cache KiB/token", "cache vs base", "ms/token", "tok/s",
           "tok/s vs base", "ratio spread (rounds)", "MiB read/step", "ratio if memory-bound", "GB/s", "of bound",
           "peak mem MiB"]


def build_parser() -> argparse.ArgumentParser:
    p = options.build_parser(NAME, "Per-token decoding time with the KV cache of each attention variant after a "
                                   "prefill of the context, eager and with the compiled decoding step, relative "
                                   "to the reference variant measured in the same run.",
                             batch_size=[1, 8], seq_lens=[1024, 2048, 4096, 8192],
                             seq_lens_help="context lengths (the prompt prefilled before decoding)",
                             dtype_help="bf16 = the model's weights and KV cache in bf16, as inference runs")
    p.add_argument("--new-tokens", type=int, default=16, help="tokens decoded per timed run, one forward each")
    p.add_argument("--kv-heads", type=int, default=None, metavar="N",
                   help="KV heads of every variant (default: each variant's benchmark setting, `diffexp variants`)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=None, metavar="MODE",
                   help="eager (a growing cache, one forward per token) and/or compiled (a static cache and "
                        "the torch.compile'd step; CUDA graphs on a GPU); default: both where torch.compile runs")
    p.add_argument("--peak-bandwidth", type=float, default=None, metavar="GB_PER_S",
                   help="memory bandwidth for the 'of bound' column (default: the GPU's from a table; none on CPU)")
    p.add_argument("--match-params", action="store_true",
                   help="give every variant the reference's parameter count: each one's SwiGLU width is narrowed "
                        "(or widened) by what its attention adds (or saves), as the DIFF V2 blog's decoding claim "
                        "assumes; the caption lists the widths")
    p.add_argument("--noise-floor", action="store_true",
                   help=f"also time a second, separately built copy of the reference (`<reference>{COPY}`): its "
                        "ratio to the reference is what this machine reads for two identical models")
    options.add_backend(p)
    return p


def validate(args: argparse.Namespace) -> None:
    if args.new_tokens <= 0:
        raise UserError(f"--new-tokens: expected a positive integer, got {args.new_tokens}")
    if args.kv_heads is not None and args.kv_heads <= 0:
        raise UserError(f"--kv-heads: expected a positive integer, got {args.kv_heads}")
    if args.peak_bandwidth is not None and not args.peak_bandwidth > 0:
        raise UserError(f"--peak-bandwidth: expected a positive number of GB/s, got {args.peak_bandwidth}")
    args.batch_size = sorted(dict.fromkeys(args.batch_size))
    workload.check_configs(args, max_seq_len(args), [args.backend])
    if args.match_params:
        args.matched_ffn_hidden = workload.matched_ffn_widths(args, max_seq_len(args), args.backend)
    args.modes = choose_modes(args)
    check_memory(args)


def check_memory(args: argparse.Namespace) -> None:
    """Refuse a grid whose largest shape cannot be held: every variant's model and cache at once (the runs
    interleave), for each mode, plus a rough bound on one prefill's activations, against the device's free memory.
    Sizes come from meta-device models that decode one token, with no real allocation."""
    import torch

    from diffexp.model import Decoder
    from diffexp.parallel.memory import free_memory, size

    device = torch.device(args.device)
    available = free_memory(device)
    if available is None:
        return
    context, batch, capacity = max(args.seq_lens), max(args.batch_size), max_seq_len(args)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    variants = args.variants + ([reference_variant().name] if args.noise_floor else [])
    held = 0
    for name in variants:
        cfg = workload.model_config(args, name, capacity, args.backend)
        with torch.device("meta"):
            model = Decoder(cfg).to(dtype).eval()
        cache = model.new_cache(capacity, static=True)
        with torch.inference_mode():
            model(torch.zeros(batch, 1, dtype=torch.long, device="meta"), cache=cache)
        weights = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
        held += len(args.modes) * (weights + cache.bytes() * capacity)  # one position written so far
    # the prefill's logits, and a layer's transients: SwiGLU's gate, up and product, a few d_model-wide tensors
    prefill = 4 * batch * context * (args.vocab_size + 3 * cfg.resolved_ffn_hidden + 8 * args.d_model)
    if held + prefill <= available:
        return
    raise UserError(f"--seq-lens {context} --batch-size {batch}: the {len(variants)} models' weights and caches "
                    f"({', '.join(args.modes)}) take {size(held)}, and a prefill about {size(prefill)}, more than the "
                    f"{size(available)} free on {device.type}; lower --seq-lens or --batch-size, or measure fewer "
                    "--variants or --modes")


def choose_modes(args: argparse.Namespace) -> list[str]:
    """The modes asked for; compiled only where torch.compile runs (an error when asked for, else a note)."""
    import torch

    from diffexp.model.compile import compile_unavailable

    wanted = list(dict.fromkeys(args.modes or MODES))
    if "compiled" not in wanted:
        return wanted
    device = torch.device(args.device)
    reason = compile_unavailable(device)
    if reason is None:
        return wanted
    if args.modes:
        raise UserError(f"--modes compiled: torch.compile cannot run here ({reason}); use --modes eager")
    print(f"note: measuring eager decoding only; torch.compile cannot run here ({reason})", flush=True)
    return [m for m in wanted if m != "compiled"]


def max_seq_len(args: argparse.Namespace) -> int:
    return max(args.seq_lens) + args.new_tokens


def config(args: argparse.Namespace) -> dict:
    return {**workload.common_config(args), "backend": args.backend, "new_tokens": args.new_tokens,
            "noise_floor": args.noise_floor, "match_params": args.match_params,
            "kv_heads": args.kv_heads, "kv_cache": KV_CACHE, "modes": args.modes,
            "peak_bandwidth": peak_bandwidth(args)}


def peak_bandwidth(args: argparse.Namespace) -> float | None:
    """Bytes/s of --peak-bandwidth, else the GPU's (diffexp.gpu_peaks), else None."""
    if args.peak_bandwidth is not None:
        return args.peak_bandwidth * 1e9
    import torch

    from diffexp.gpu_peaks import peak_bandwidth as device_bandwidth

    return device_bandwidth(torch.device(args.device))


class DecodeRunner:
    """One variant's model and its cache filled with the prompt; `run` decodes --new-tokens tokens, eagerly or
    through the compiled step (static cache)."""

    def __init__(self, args: argparse.Namespace, name: str, prompt, device, mode: str) -> None:
        import torch

        from diffexp.model import Decoder

        torch.manual_seed(workload.SEED)
        self.torch, self.device, self.mode = torch, device, mode
        name = name.removesuffix(COPY)
        self.model = Decoder(workload.model_config(args, name, max_seq_len(args), args.backend)).to(device).eval()
        self.params = self.model.parameter_report()
        self.new_tokens = args.new_tokens
        self.profile_unit = ("token", args.new_tokens)  # --profile: per token, as ms/token
        if args.dtype == "bf16":  # inference runs on bf16 weights and cache, not on autocast's fp32 weights
            self.model.to(torch.bfloat16)
        batch, context = prompt.shape
        compiled = mode == "compiled"
        self.cache = self.model.new_cache(context + args.new_tokens if compiled else None, static=compiled)
        with torch.inference_mode():
            self.first = self.model(prompt, cache=self.cache)[:, -1:].argmax(-1)
        self.cache_bytes_per_token = self.cache.bytes_per_token() / batch  # per sequence
        self.bytes_per_step = step_bytes(self.model, self.cache.bytes(), batch)
        self.prompt_mark = self.cache.mark()
        self.flops_per_token = batch * self.model.decode_flops_per_token(context)
        self.clock = timing.Stopwatch(device)
        self.compile_s = None
        if compiled:
            self.model.compile_decoding()
            self.clock.start()
            self.decode()  # compiles
            self.compile_s = self.clock.lap()[0]

    def decode(self) -> None:
        self.cache.rewind(self.prompt_mark)
        token = self.first
        with self.torch.inference_mode():
            for _ in range(self.new_tokens):
                token = self.model.decode_step(token, self.cache).argmax(-1, keepdim=True)

    def run(self) -> None:
        self.decode()
        self.clock.sync()

    def timed(self) -> dict[str, float]:
        self.clock.start()
        self.decode()
        wall, cpu = self.clock.lap()
        return {"decode_token_times_s": wall / self.new_tokens, "cpu_times_s": cpu}

    def peak_bytes(self) -> int | None:
        held = tensor_bytes([*self.model.parameters(), *self.model.buffers()]) + self.cache.bytes()
        return peak_bytes(self.decode, self.device, held)


def plot(data: dict, json_path) -> str:
    """The figure beside the results JSON (same name, .png): tokens/s ratios across contexts, per mode and batch."""
    from diffexp.bench.plot import plot_decode

    return str(plot_decode(data, Path(json_path).with_suffix(".png")))


def step_bytes(model, cache_bytes: int, batch: int) -> int:
    """Bytes one decoding step must read: every weight once (of the embedding table only the batch's rows) and
    the whole cache."""
    weights = {id(p): p for p in model.parameters()}
    embedding = model.embed.weight
    total = sum(p.numel() * p.element_size() for p in weights.values())
    if model.lm_head.weight is not embedding:
        total -= embedding.numel() * embedding.element_size() - batch * embedding[0].numel() * embedding.element_size()
    return total + cache_bytes


def run(args: argparse.Namespace, save_finished: Callable[[dict], None] = lambda results: None) -> dict:
    import torch

    device = torch.device(args.device)
    modes = args.modes
    variants = args.variants + ([reference_variant().name + COPY] if args.noise_floor else [])
    per_variant = timing.runs_per_variant(args)
    results: dict[str, dict] = {}
    shapes = [(context, batch) for context in args.seq_lens for batch in args.batch_size]
    with ProgressReporter(total=len(shapes) * len(variants) * len(modes) * per_variant) as progress:
        for context, batch in shapes:
            label = f"context {context} batch {batch}"
            prompt = workload.random_tokens(args, batch, context, context, device)
            progress.log(f"{label}: prefilling {len(variants)} models ({', '.join(modes)}), then {args.new_tokens} "
                         "tokens per run" + (" (compiling each step first)" if "compiled" in modes else ""))
            torch.compiler.reset()  # one compiled step per model; the previous shape's models are gone
            runners = {f"{v} {mode}": DecodeRunner(args, v, prompt, device, mode) for mode in modes for v in variants}
            samples, peaks, profiles = timing.measure(runners, args, progress, label,
                                                      headline="decode_token_times_s")
            for key, r in runners.items():
                v, mode = key.split()
                results[result_key(v, mode, context, batch)] = {
                    "variant": v, "mode": mode, "seq_len": context, "batch_size": batch,
                    "new_tokens": args.new_tokens, "kv_cache": KV_CACHE,
                    "overrides": workload.overrides(args)[v.removesuffix(COPY)],
                    "params": r.params, "cache_bytes_per_token": r.cache_bytes_per_token,
                    "bytes_per_step": r.bytes_per_step, "decode_flops_per_token": r.flops_per_token,
                    "compile_s": r.compile_s, **samples[key], "peak_bytes": peaks[key],
                    "profile": profiles.get(key),
                }
            save_finished(results)
            del runners, prompt
            release(device)
    summarise(results, variants, modes, shapes, peak_bandwidth(args))
    return results


def result_key(variant: str, mode: str, context: int, batch: int) -> str:
    return f"{variant}@{context}x{batch}" + ("" if mode == "eager" else f":{mode}")


def summarise(results: dict, variants: list[str], modes: list[str], shapes: list[tuple[int, int]],
              bandwidth: float | None) -> None:
    """Per-token medians, tokens/s, bytes/s and the ratios to the reference in the same mode, added in place."""
    for mode in modes:
        for context, batch in shapes:
            base = results[result_key(reference_variant().name, mode, context, batch)]
            for v in variants:
                entry = results[result_key(v, mode, context, batch)]
                timing.add_ratio(entry, base, "decode_token_times_s", "median_decode_token_s", "speed_ratio")
                entry["tokens_per_s"] = batch / entry["median_decode_token_s"]
                entry["cache_ratio"] = entry["cache_bytes_per_token"] / base["cache_bytes_per_token"]
                entry["bytes_per_s"] = entry["bytes_per_step"] / entry["median_decode_token_s"]
                entry["memory_bound_ratio"] = base["bytes_per_step"] / entry["bytes_per_step"]
                entry["bandwidth_fraction"] = entry["bytes_per_s"] / bandwidth if bandwidth else None
                timing.throughput(entry, "decode_flops_per_token", "median_decode_token_s", None)
                timing.add_mem_ratio(entry, base)


def lowest_entries(results: dict) -> dict[tuple[str, str], dict]:
    """The result with the lowest tok/s ratio to the reference over the grid, per (variant, mode)."""
    lowest: dict[tuple[str, str], dict] = {}
    for e in results.values():
        key = (e["variant"], e.get("mode", "eager"))
        if key not in lowest or e["speed_ratio"] < lowest[key]["speed_ratio"]:
            lowest[key] = e
    return lowest


def _notes(e: dict) -> str:
    """' (CI 0.80-0.91, memory-bound: 0.94x)': the speed ratio's confidence interval, where the results have one,
    and the ratio if memory-bound, where the variant reads more bytes per step than the reference."""
    ci, bound = e.get("speed_ratio_ci"), e.get("memory_bound_ratio")
    notes = ([f"CI {ci[0]:.2f}-{ci[1]:.2f}"] if ci else []) + (
        [f"memory-bound: {bound:.2f}x"] if bound is not None and bound < 0.995 else [])
    return f" ({', '.join(notes)})" if notes else ""


def _matched_note(results: dict, cfg: dict, ref: str) -> str:
    """What --match-params changed: each variant's SwiGLU width, and how far its parameters stay from ref's."""
    totals = {e["variant"]: e["params"]["total"] for e in results.values() if e.get("params")}
    widths = {v: o["ffn_hidden"] for v, o in cfg["variant_overrides"].items() if "ffn_hidden" in o}
    changed = ", ".join(f"{v} {w}" for v, w in widths.items()) or "none changed"
    within = ""
    if ref in totals:
        gap = max(abs(n - totals[ref]) for n in totals.values())
        within = f"; every variant within {gap:,} parameters of {ref}'s {totals[ref]:,}"
    return (f"Parameters matched (--match-params): each variant's SwiGLU width moved by what its attention adds or "
            f"saves, in steps of 8 hidden units ({changed}){within}.")


def table(data: dict) -> tuple[str, list[str], list[list[str]], str]:
    """Title, headers, rows and caption of the results table."""
    cfg, env = data["config"], data["env"]
    ref = cfg["variants"][0]  # the reference variant
    rows = []
    for e in data["results"].values():
        fraction = e.get("bandwidth_fraction")
        rows.append([
            e["variant"], e.get("mode", "eager"), str(e["seq_len"]), str(e["batch_size"]),
            f"{e['cache_bytes_per_token'] / 1024:.2f}", report.ratio_cell(e["cache_ratio"]),
            f"{e['median_decode_token_s'] * 1e3:.2f}", f"{e['tokens_per_s']:.0f}", report.ratio_cell(e["speed_ratio"]),
            report.spread_cell(e, "speed_ratio"), report.mib_cell(e.get("bytes_per_step")),
            report.ratio_cell(e["memory_bound_ratio"]) if "memory_bound_ratio" in e else "n/a",
            f"{e['bytes_per_s'] / 1e9:.1f}" if "bytes_per_s" in e else "n/a",
            "n/a" if fraction is None else f"{fraction:.0%}", report.mib_cell(e["peak_bytes"]),
        ])
    kv = f"{cfg['kv_heads']} KV heads for every variant" if cfg.get("kv_heads") else "each variant's own KV heads"
    title = (f"Decoding with the KV cache vs {ref}: {env['device']} ({env['device_name']}), {cfg['dtype']}, "
             f"backend {cfg['backend']}, {env['threads']} threads, d_model {cfg['d_model']}, {cfg['n_layers']} "
             f"layers, {cfg['n_heads']} heads, {kv}; {cfg['new_tokens']} tokens per run; {cfg['rounds']} rounds x "
             f"{cfg['steps']} runs")
    lowest = lowest_entries(data["results"])
    worst = "; ".join(f"{v} {mode} {e['speed_ratio']:.2f}x" + _notes(e)
                      for (v, mode), e in sorted(lowest.items()) if v not in (ref, ref + COPY))
    floor = "; ".join(f"{mode} {e['speed_ratio']:.2f}x" + _notes(e)
                      for (v, mode), e in sorted(lowest.items()) if v == ref + COPY)
    confidence = (f" CI: the {timing.CONFIDENCE:.0%} confidence interval of the median over the paired runs "
                  "(order statistics).")
    compile_times = [e["compile_s"] for e in data["results"].values() if e.get("compile_s")]
    compiled = (f" Compiling one step took {min(compile_times):.0f}-{max(compile_times):.0f} s per model."
                if compile_times else "")
    caption = (f"After one prefill of the context, each run decodes {cfg['new_tokens']} tokens (one step of one "
               "token each) and rewinds the cache. eager: a growing cache, one forward per step; compiled: a static "
               "cache of the context's size and the torch.compile'd step (CUDA graphs on a GPU). ms/token = run "
               "time / tokens; tok/s counts the whole batch; vs base = the median over paired runs (a few runs apart "
               f"in one round) of {ref}'s time / the variant's, in the same mode (>1 = faster); spread = min-max "
               f"of that ratio per round. KV cache = bytes the filled cache "
               "holds per token of one sequence, all layers (a variant's extra state included). MiB read/step = "
               "the weights and the whole cache, what one step must read; ratio if memory-bound = the reference's "
               "MiB read/step over the variant's, the tok/s ratio of two steps that take the time of their memory "
               "traffic (a variant with more weights reads more); GB/s = MiB read/step / time per token; of bound "
               f"= GB/s over the device's memory bandwidth (GPU only).{compiled} Lowest ratio over the grid: "
               f"{worst}.")
    if any(e.get("speed_ratio_ci") for e in lowest.values()):
        caption += confidence
    if cfg.get("match_params"):
        caption += " " + _matched_note(data["results"], cfg, ref)
    if floor:
        caption += (f" Noise floor: {ref}{COPY}, a second copy of {ref} built and timed the same way, reads as "
                    f"low as {floor} against it; ratios within that of 1 cannot be told from it.")
    return title, HEADERS, rows, caption

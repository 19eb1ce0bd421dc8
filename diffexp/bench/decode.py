"""`diffexp bench decode`: decoding with the KV cache, every attention variant against the reference.

Each variant prefills the same random prompt once; a timed run decodes ``--new-tokens`` tokens greedily and
rewinds the cache, so every run decodes at the same context. Details: bench/README.md.
"""

from __future__ import annotations

import argparse

from diffexp.bench import options, report, timing, workload
from diffexp.bench.memory import peak_bytes, release, tensor_bytes
from diffexp.bench.progress import ProgressReporter
from diffexp.errors import UserError
from diffexp.model.attention.registry import reference_variant

NAME = "decode"
ABOUT = "decoding with the KV cache: tokens/s and cache bytes per token after a prefill, vs the reference"
KV_CACHE = True
LAYOUT = report.Layout(
    labels=(("variant", "variant"), ("context", "seq_len"), ("batch", "batch_size")),
    ratios=(report.Ratio("speed_ratio", "old tok/s ratio", "new tok/s ratio", "change", "old spread"),
            report.Ratio("cache_ratio", "old cache ratio", "new cache ratio", "cache change"),
            report.Ratio("mem_ratio", "old mem ratio", "new mem ratio", "mem change")),
    config_keys=("dtype", "backend", "d_model", "n_layers", "n_heads", "vocab_size", "variant_overrides",
                 "new_tokens", "kv_cache"),
)
HEADERS = ["variant", "context", "batch", "params (non-emb)", "KV cache KiB/token", "cache vs base",
           "ms/token", "tok/s", "tok/s vs base", "ratio spread (rounds)", "peak mem MiB", "mem vs base",
           "TFLOP/s"]


def build_parser() -> argparse.ArgumentParser:
    p = options.build_parser(NAME, "Per-token decoding time with the KV cache and cache bytes per token of each "
                                   "attention variant, after a prefill of the context, relative to the reference "
                                   "variant measured in the same run.",
                             batch_size=[1, 8], seq_lens=[1024, 2048, 4096, 8192],
                             seq_lens_help="context lengths (the prompt prefilled before decoding)")
    p.add_argument("--new-tokens", type=int, default=16, help="tokens decoded per timed run, one forward each")
    p.add_argument("--kv-heads", type=int, default=None, metavar="N",
                   help="KV heads of every variant (default: each variant's benchmark setting, `diffexp variants`)")
    options.add_backend(p)
    return p


def validate(args: argparse.Namespace) -> None:
    if args.new_tokens <= 0:
        raise UserError(f"--new-tokens: expected a positive integer, got {args.new_tokens}")
    if args.kv_heads is not None and args.kv_heads <= 0:
        raise UserError(f"--kv-heads: expected a positive integer, got {args.kv_heads}")
    args.batch_size = sorted(dict.fromkeys(args.batch_size))
    workload.check_configs(args, max_seq_len(args), [args.backend])


def max_seq_len(args: argparse.Namespace) -> int:
    return max(args.seq_lens) + args.new_tokens


def config(args: argparse.Namespace) -> dict:
    return {**workload.common_config(args), "backend": args.backend, "new_tokens": args.new_tokens,
            "kv_heads": args.kv_heads, "kv_cache": KV_CACHE}


class DecodeRunner:
    """One variant's model and its cache filled with the prompt; `run` decodes --new-tokens tokens."""

    def __init__(self, args: argparse.Namespace, name: str, prompt, device) -> None:
        import torch

        from diffexp.model import Decoder

        torch.manual_seed(workload.SEED)
        self.torch, self.device = torch, device
        self.model = Decoder(workload.model_config(args, name, max_seq_len(args), args.backend)).to(device).eval()
        self.params = self.model.parameter_report()
        self.new_tokens = args.new_tokens
        self.autocast = lambda: workload.autocast(args, device)
        self.cache = self.model.new_cache()
        with torch.inference_mode(), self.autocast():
            self.first = self.model(prompt, cache=self.cache)[:, -1:].argmax(-1)
        batch, context = prompt.shape
        self.cache_bytes_per_token = self.cache.bytes() / (batch * context)  # per sequence
        self.prompt_mark = self.cache.mark()
        self.flops_per_token = batch * self.model.decode_flops_per_token(context)
        self.clock = timing.Stopwatch(device)

    def decode(self) -> None:
        self.cache.rewind(self.prompt_mark)
        token = self.first
        with self.torch.inference_mode(), self.autocast():
            for _ in range(self.new_tokens):
                token = self.model(token, cache=self.cache)[:, -1:].argmax(-1)

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


def run(args: argparse.Namespace) -> dict:
    import torch

    device = torch.device(args.device)
    variants = args.variants
    per_variant = timing.runs_per_variant(args)
    results: dict[str, dict] = {}
    shapes = [(context, batch) for context in args.seq_lens for batch in args.batch_size]
    with ProgressReporter(total=len(shapes) * len(variants) * per_variant) as progress:
        for context, batch in shapes:
            label = f"context {context} batch {batch}"
            prompt = workload.random_tokens(args, batch, context, context, device)
            progress.log(f"{label}: prefilling {len(variants)} models, then {args.new_tokens} tokens per run")
            runners = {v: DecodeRunner(args, v, prompt, device) for v in variants}
            samples, peaks = timing.measure(runners, args, progress, label, headline="decode_token_times_s")
            for v in variants:
                r = runners[v]
                results[result_key(v, context, batch)] = {
                    "variant": v, "seq_len": context, "batch_size": batch, "new_tokens": args.new_tokens,
                    "kv_cache": KV_CACHE, "overrides": workload.overrides(args)[v], "params": r.params,
                    "cache_bytes_per_token": r.cache_bytes_per_token, "decode_flops_per_token": r.flops_per_token,
                    **samples[v], "peak_bytes": peaks[v],
                }
            del runners, prompt
            release(device)
    summarise(results, variants, shapes)
    return results


def result_key(variant: str, context: int, batch: int) -> str:
    return f"{variant}@{context}x{batch}"


def summarise(results: dict, variants: list[str], shapes: list[tuple[int, int]]) -> None:
    """Per-token medians, tokens/s and the ratios to the reference, added in place."""
    for context, batch in shapes:
        base = results[result_key(reference_variant().name, context, batch)]
        for v in variants:
            entry = results[result_key(v, context, batch)]
            timing.add_ratio(entry, base, "decode_token_times_s", "median_decode_token_s", "speed_ratio")
            entry["tokens_per_s"] = batch / entry["median_decode_token_s"]
            entry["cache_ratio"] = entry["cache_bytes_per_token"] / base["cache_bytes_per_token"]
            timing.throughput(entry, "decode_flops_per_token", "median_decode_token_s", None)
            timing.add_mem_ratio(entry, base)


def table(data: dict) -> tuple[str, list[str], list[list[str]], str]:
    """Title, headers, rows and caption of the results table."""
    cfg, env = data["config"], data["env"]
    ref = cfg["variants"][0]  # the reference variant
    rows = []
    for e in data["results"].values():
        rows.append([
            e["variant"], str(e["seq_len"]), str(e["batch_size"]), f"{e['params']['non_embedding']:,}",
            f"{e['cache_bytes_per_token'] / 1024:.2f}", report.ratio_cell(e["cache_ratio"]),
            f"{e['median_decode_token_s'] * 1e3:.2f}", f"{e['tokens_per_s']:.0f}", report.ratio_cell(e["speed_ratio"]),
            report.spread_cell(e, "speed_ratio"), report.mib_cell(e["peak_bytes"]),
            report.ratio_cell(e["mem_ratio"]), f"{e['tflops_per_s']:.3g}",
        ])
    kv = f"{cfg['kv_heads']} KV heads for every variant" if cfg.get("kv_heads") else "each variant's own KV heads"
    title = (f"Decoding with the KV cache vs {ref}: {env['device']} ({env['device_name']}), {cfg['dtype']}, "
             f"backend {cfg['backend']}, {env['threads']} threads, d_model {cfg['d_model']}, {cfg['n_layers']} "
             f"layers, {cfg['n_heads']} heads, {kv}; {cfg['new_tokens']} tokens per run; {cfg['rounds']} rounds x "
             f"{cfg['steps']} runs")
    caption = (f"After one prefill of the context, each run decodes {cfg['new_tokens']} tokens (one forward of one "
               "token each) and rewinds the cache. ms/token = run time / tokens; tok/s counts the whole batch; vs "
               f"base = {ref} median / variant median (>1 = faster than {ref}); spread = min-max of that ratio per "
               "round. KV cache = bytes the filled cache holds per token of one sequence, all layers (a "
               "variant's extra state included). peak mem = live tensor bytes of one run, weights and cache included; "
               "TFLOP/s = Decoder.decode_flops_per_token x batch / time per token.")
    return title, HEADERS, rows, caption

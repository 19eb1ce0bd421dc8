"""`diffexp bench decode`: generation cost of every attention variant relative to the reference, side by side.

WITHOUT A KV CACHE: the decoder has none yet, so this measures generation as it can run today.

* Prefill: one forward over the prompt (``--seq-lens`` prompt lengths); its last logits give the
  first new token.
* Decode: ``--new-tokens`` more tokens, greedily, each by a full forward over the whole sequence so
  far (prompt + tokens generated): token i costs a forward over P + i tokens, so the per-token time
  grows with the position and every layer recomputes every earlier key and value. The reported time
  per token is the mean over the ``--new-tokens`` forwards of one generation.

Variants are interleaved, rotated and warmed up exactly as in the training bench
(diffexp.bench.timing); one timed run is one whole generation, timed in its two parts. Ratios are
``reference median / variant median`` (>1 = faster). FLOPs are `Decoder.flops_per_token` (forward) of
every position each forward recomputes, so TFLOP/s counts the recomputation a KV cache would save.
Peak memory is the live tensor bytes of one untimed generation (parameters and buffers included).
A later KV-cache decoder can be compared against these numbers (`--compare` with this kind's JSON).
"""

from __future__ import annotations

import argparse

from diffexp.bench import options, report, timing, workload
from diffexp.bench.memory import peak_bytes, release, tensor_bytes
from diffexp.bench.progress import ProgressReporter
from diffexp.errors import UserError
from diffexp.model.attention.registry import reference_variant

NAME = "decode"
ABOUT = "generation without a KV cache: prefill and per-token decoding (full forward per token) vs the reference"
KV_CACHE = False
LAYOUT = report.Layout(
    labels=(("variant", "variant"), ("prompt", "seq_len")),
    ratios=(report.Ratio("speed_ratio", "old decode ratio", "new decode ratio", "change", "old spread"),
            report.Ratio("prefill_speed_ratio", "old prefill ratio", "new prefill ratio", "prefill change"),
            report.Ratio("mem_ratio", "old mem ratio", "new mem ratio", "mem change")),
    config_keys=("dtype", "backend", "d_model", "n_layers", "n_heads", "vocab_size", "variant_overrides",
                 "new_tokens", "kv_cache"),
)
HEADERS = ["variant", "prompt", "batch", "params (non-emb)", "prefill ms", "prefill vs base", "decode ms/token",
           "decode tok/s vs base", "ratio spread (rounds)", "peak mem MiB", "mem vs base", "TFLOP/s (decode)"]


def build_parser() -> argparse.ArgumentParser:
    p = options.build_parser(NAME, "Prefill and per-token decoding time of each attention variant, relative to the "
                                   "reference variant measured in the same run. There is no KV cache: every new "
                                   "token is a full forward over the sequence so far.",
                             batch_size=1, seq_lens=[256, 1024], seq_lens_help="prompt lengths")
    p.add_argument("--new-tokens", type=int, default=16,
                   help="tokens generated after the prompt's forward, each by a full forward over the sequence")
    options.add_backend(p)
    return p


def validate(args: argparse.Namespace) -> None:
    if args.new_tokens <= 0:
        raise UserError(f"--new-tokens: expected a positive integer, got {args.new_tokens}")
    workload.check_configs(args, max_seq_len(args), [args.backend])


def max_seq_len(args: argparse.Namespace) -> int:
    return max(args.seq_lens) + args.new_tokens


def config(args: argparse.Namespace) -> dict:
    return {**workload.common_config(args), "backend": args.backend, "new_tokens": args.new_tokens,
            "kv_cache": KV_CACHE}


class GenerationRunner:
    """One variant's model in eval mode and the shared prompt; `run` is one greedy generation."""

    def __init__(self, args: argparse.Namespace, name: str, prompt, device) -> None:
        import torch

        from diffexp.model import Decoder

        torch.manual_seed(workload.SEED)
        self.torch = torch
        self.device = device
        self.model = Decoder(workload.model_config(args, name, max_seq_len(args), args.backend)).to(device).eval()
        self.params = self.model.parameter_report()
        self.prompt, self.new_tokens = prompt, args.new_tokens
        batch, p = prompt.shape
        self.prefill_flops = batch * p * self.model.flops_per_token(p, training=False)
        # forward FLOPs of every position each decoding forward recomputes, per generated token
        self.decode_flops_per_token = sum(batch * t * self.model.flops_per_token(t, training=False)
                                          for t in range(p + 1, p + self.new_tokens + 1)) / self.new_tokens
        self.autocast = lambda: workload.autocast(args, device)
        self.clock = timing.Stopwatch(device)

    def next_token(self, tokens):
        with self.torch.inference_mode(), self.autocast():
            logits = self.model(tokens)[:, -1]
        return self.torch.cat([tokens, logits.argmax(-1, keepdim=True)], dim=1)

    def decode(self, tokens) -> None:
        for _ in range(self.new_tokens):
            tokens = self.next_token(tokens)

    def generate(self) -> None:
        self.decode(self.next_token(self.prompt))

    def run(self) -> None:
        self.generate()
        self.clock.sync()

    def timed(self) -> dict[str, float]:
        self.clock.start()
        tokens = self.next_token(self.prompt)
        prefill, prefill_cpu = self.clock.lap()
        self.decode(tokens)
        decode, decode_cpu = self.clock.lap()
        return {"prefill_times_s": prefill, "decode_token_times_s": decode / self.new_tokens,
                "cpu_times_s": prefill_cpu + decode_cpu}

    def peak_bytes(self) -> int | None:
        return peak_bytes(self.generate, self.device, tensor_bytes([*self.model.parameters(), *self.model.buffers()]))


def run(args: argparse.Namespace) -> dict:
    import torch

    device = torch.device(args.device)
    variants = args.variants
    per_variant = timing.runs_per_variant(args)
    results: dict[str, dict] = {}
    with ProgressReporter(total=len(args.seq_lens) * len(variants) * per_variant) as progress:
        for prompt_len in args.seq_lens:
            label = f"prompt {prompt_len}"
            prompt = workload.random_tokens(args, args.batch_size, prompt_len, prompt_len, device)
            progress.log(f"{label}, batch {args.batch_size}, {args.new_tokens} new tokens without KV cache: "
                         f"building {len(variants)} models")
            runners = {v: GenerationRunner(args, v, prompt, device) for v in variants}
            samples, peaks = timing.measure(runners, args, progress, label, headline="decode_token_times_s")
            for v in variants:
                r = runners[v]
                results[f"{v}@{prompt_len}"] = {
                    "variant": v, "seq_len": prompt_len, "new_tokens": args.new_tokens, "kv_cache": KV_CACHE,
                    "batch_size": args.batch_size, "overrides": workload.overrides(args)[v], "params": r.params,
                    "prefill_flops": r.prefill_flops, "decode_flops_per_token": r.decode_flops_per_token,
                    **samples[v], "peak_bytes": peaks[v],
                }
            del runners, prompt
            release(device)
    summarise(results, variants, args.seq_lens)
    return results


def summarise(results: dict, variants: list[str], seq_lens: list[int]) -> None:
    """Prefill and per-token decode medians and their ratios to the reference, added in place."""
    for prompt_len in seq_lens:
        base = results[f"{reference_variant().name}@{prompt_len}"]
        for v in variants:
            entry = results[f"{v}@{prompt_len}"]
            timing.add_ratio(entry, base, "prefill_times_s", "median_prefill_s", "prefill_speed_ratio")
            timing.add_ratio(entry, base, "decode_token_times_s", "median_decode_token_s", "speed_ratio")
            entry["tokens_per_s"] = entry["batch_size"] / entry["median_decode_token_s"]
            timing.throughput(entry, "decode_flops_per_token", "median_decode_token_s", None)
            timing.add_mem_ratio(entry, base)


def table(data: dict) -> tuple[str, list[str], list[list[str]], str]:
    """Title, headers, rows and caption of the results table."""
    cfg, env = data["config"], data["env"]
    ref = cfg["variants"][0]  # the reference variant
    rows = []
    for prompt_len in cfg["seq_lens"]:
        for v in cfg["variants"]:
            e = data["results"][f"{v}@{prompt_len}"]
            rows.append([
                v, str(prompt_len), str(e["batch_size"]), f"{e['params']['non_embedding']:,}",
                f"{e['median_prefill_s'] * 1e3:.1f}", report.ratio_cell(e["prefill_speed_ratio"]),
                f"{e['median_decode_token_s'] * 1e3:.1f}", report.ratio_cell(e["speed_ratio"]),
                report.spread_cell(e, "speed_ratio"), report.mib_cell(e["peak_bytes"]),
                report.ratio_cell(e["mem_ratio"]), f"{e['tflops_per_s']:.3g}",
            ])
    title = (f"Decoding WITHOUT KV cache vs {ref}: {env['device']} ({env['device_name']}), {cfg['dtype']}, "
             f"backend {cfg['backend']}, {env['threads']} threads, d_model {cfg['d_model']}, {cfg['n_layers']} "
             f"layers, {cfg['n_heads']} heads; {cfg['new_tokens']} new tokens; {cfg['rounds']} rounds x "
             f"{cfg['steps']} generations")
    caption = ("No KV cache: every new token is a full forward over prompt + tokens so far, so decode ms/token "
               f"is the mean over {cfg['new_tokens']} such forwards and grows with the prompt. prefill = one "
               f"forward over the prompt. vs base = {ref} median / variant median (>1 = faster than {ref}); "
               "spread = min-max of the decode ratio per round; peak mem = live tensor bytes of one generation "
               "(weights included); TFLOP/s = forward FLOPs (Decoder.flops_per_token) of every recomputed "
               "position per token / decode time per token.")
    return title, HEADERS, rows, caption

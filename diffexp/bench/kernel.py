"""`diffexp bench kernel`: one layer's attention module alone, per variant and backend, relative to the reference.

A run is a forward under no_grad, then a forward and backward of a fixed output gradient, on a random
(batch, T, d_model) input; ratios are against the reference on the same backend. Details: bench/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable

from diffexp.bench import options, report, timing, workload
from diffexp.bench.memory import peak_bytes, release, tensor_bytes
from diffexp.bench.progress import ProgressReporter
from diffexp.kernels import PLAIN, kernels, use
from diffexp.model.attention.registry import reference_variant

NAME = "kernel"
ABOUT = "one layer's attention module alone: forward and forward+backward per variant and backend vs the reference"
LAYOUT = report.Layout(
    labels=(("variant", "variant"), ("seq", "seq_len"), ("backend", "backend")),
    ratios=(report.Ratio("speed_ratio", "old fwd+bwd ratio", "new fwd+bwd ratio", "change", "old spread"),
            report.Ratio("forward_speed_ratio", "old fwd ratio", "new fwd ratio", "fwd change"),
            report.Ratio("mem_ratio", "old mem ratio", "new mem ratio", "mem change")),
    config_keys=("dtype", "d_model", "n_heads", "variant_overrides"),
)
HEADERS = ["variant", "seq", "backend", "batch", "attn params", "fwd ms", "fwd vs base", "fwd+bwd ms",
           "fwd+bwd vs base", "ratio spread (rounds)", "peak mem MiB", "mem vs base", "TFLOP/s", "MFU"]


#: benchmark-only backends: sdpa with the two-map heads on the plain path, or on one registered kernel (diffexp.kernels)
FORCED_PATHS = {f"sdpa-{PLAIN}": PLAIN, **{f"sdpa-{kernel.name}": kernel.name for kernel in kernels()}}


def build_parser() -> argparse.ArgumentParser:
    p = options.build_parser(NAME, "Time and peak memory of one layer's attention module (forward, and forward + "
                                   "backward) per variant and backend, relative to the reference variant.",
                             batch_size=8, seq_lens=[256, 1024])
    p.add_argument("--backends", nargs="+", choices=(*options.BACKENDS, *FORCED_PATHS), default=None, metavar="NAME",
                   help="attention backends (default: sdpa and eager); of: "
                        f"{', '.join((*options.BACKENDS, *FORCED_PATHS))} (sdpa-plain: the two-map heads with one "
                        "SDPA call per map; sdpa-NAME: on registered kernel NAME where it computes them)")
    options.add_batch_cap(p)
    options.add_peak_tflops(p)
    return p


def validate(args: argparse.Namespace) -> None:
    if args.backends is None:
        args.backends = ["sdpa", "eager"]
    args.backends = list(dict.fromkeys(args.backends))
    workload.check_configs(args, max(args.seq_lens), [_model_backend(b) for b in args.backends])
    args.peak_flops = report.peak_flops(args.device, args.dtype, args.peak_tflops)


def config(args: argparse.Namespace) -> dict:
    return {**workload.common_config(args), "tokens_per_batch": args.tokens_per_batch, "backends": args.backends,
            "peak_flops": args.peak_flops}


def _model_backend(backend: str) -> str:
    return "sdpa" if backend in FORCED_PATHS else backend


class AttentionRunner:
    """One variant's attention module on one backend and the shared input; `run` is forward + forward+backward."""

    def __init__(self, args: argparse.Namespace, name: str, backend: str, x, grad_out, device) -> None:
        import torch
        from torch import nn

        from diffexp.model.attention import build_attention, variant

        torch.manual_seed(workload.SEED)
        self.torch = torch
        self.device = device
        cfg = workload.model_config(args, name, max(args.seq_lens), _model_backend(backend))
        forced = FORCED_PATHS.get(backend)
        self.mode = (lambda: use(forced)) if forced else contextlib.nullcontext
        self.module = build_attention(cfg, 0).to(device).train()
        self.params = sum(p.numel() for p in self.module.parameters())
        batch, t, _ = x.shape
        linear = sum(m.weight.numel() for m in self.module.modules() if isinstance(m, nn.Linear))
        self.flops_forward = batch * t * (2 * linear + variant(name).attention_flops(cfg, t / 2))
        self.flops_per_step = 3 * self.flops_forward
        self.x, self.grad_out = x.detach().clone().requires_grad_(True), grad_out
        self.autocast = lambda: workload.autocast(args, device)
        self.clock = timing.Stopwatch(device)

    def forward(self) -> None:
        with self.torch.no_grad(), self.autocast(), self.mode():
            self.module(self.x)

    def forward_backward(self) -> None:
        with self.autocast(), self.mode():
            out, _ = self.module(self.x)
            out.backward(self.grad_out.to(out.dtype))
        self.module.zero_grad(set_to_none=True)
        self.x.grad = None

    def run(self) -> None:
        self.forward()
        self.forward_backward()
        self.clock.sync()

    def timed(self) -> dict[str, float]:
        self.clock.start()
        self.forward()
        forward, _ = self.clock.lap()
        self.forward_backward()
        wall, cpu = self.clock.lap()
        return {"forward_times_s": forward, "times_s": wall, "cpu_times_s": cpu}

    def peak_bytes(self) -> int | None:
        return peak_bytes(self.forward_backward, self.device,
                          tensor_bytes([*self.module.parameters(), *self.module.buffers()]))


def run(args: argparse.Namespace, save_finished: Callable[[dict], None] = lambda results: None) -> dict:
    import torch

    device = torch.device(args.device)
    pairs = [(v, b) for b in args.backends for v in args.variants]
    per_pair = timing.runs_per_variant(args)
    results: dict[str, dict] = {}
    with ProgressReporter(total=len(args.seq_lens) * len(pairs) * per_pair) as progress:
        for seq_len in args.seq_lens:
            batch = workload.batch_for(seq_len, args)
            gen = torch.Generator().manual_seed(workload.SEED + seq_len)
            x = torch.randn(batch, seq_len, args.d_model, generator=gen).to(device)
            grad_out = torch.randn(batch, seq_len, args.d_model, generator=gen).to(device)
            progress.log(f"seq {seq_len}, batch {batch}: building {len(pairs)} attention modules")
            runners = {f"{v}/{b}": AttentionRunner(args, v, b, x, grad_out, device) for v, b in pairs}
            samples, peaks, profiles = timing.measure(runners, args, progress, f"seq {seq_len}", headline="times_s")
            for v, b in pairs:
                r = runners[f"{v}/{b}"]
                results[f"{v}@{seq_len}/{b}"] = {
                    "variant": v, "seq_len": seq_len, "backend": b, "batch_size": batch,
                    "tokens_per_step": batch * seq_len, "overrides": workload.overrides(args)[v],
                    "params": r.params, "flops_forward": r.flops_forward, "flops_per_step": r.flops_per_step,
                    **samples[f"{v}/{b}"], "peak_bytes": peaks[f"{v}/{b}"], "profile": profiles.get(f"{v}/{b}"),
                }
            save_finished(results)
            del runners, x, grad_out
            release(device)
    summarise(results, pairs, args.seq_lens, args.peak_flops)
    return results


def summarise(results: dict, pairs: list[tuple[str, str]], seq_lens: list[int], peak_flops_per_s: float | None) -> None:
    """Forward and forward+backward medians and their ratios to the reference on the same backend, in place."""
    for seq_len in seq_lens:
        for v, b in pairs:
            base = results[f"{reference_variant().name}@{seq_len}/{b}"]
            entry = results[f"{v}@{seq_len}/{b}"]
            timing.add_ratio(entry, base, "forward_times_s", "median_forward_s", "forward_speed_ratio")
            timing.add_ratio(entry, base, "times_s", "median_step_s", "speed_ratio")
            timing.throughput(entry, "flops_per_step", "median_step_s", peak_flops_per_s)
            timing.add_mem_ratio(entry, base)


def table(data: dict) -> tuple[str, list[str], list[list[str]], str]:
    """Title, headers, rows and caption of the results table."""
    cfg, env = data["config"], data["env"]
    ref = cfg["variants"][0]  # the reference variant
    rows = []
    for seq_len in cfg["seq_lens"]:
        for b in cfg["backends"]:
            for v in cfg["variants"]:
                e = data["results"][f"{v}@{seq_len}/{b}"]
                rows.append([
                    v, str(seq_len), b, str(e["batch_size"]), f"{e['params']:,}",
                    f"{e['median_forward_s'] * 1e3:.2f}", report.ratio_cell(e["forward_speed_ratio"]),
                    f"{e['median_step_s'] * 1e3:.2f}", report.ratio_cell(e["speed_ratio"]),
                    report.spread_cell(e, "speed_ratio"), report.mib_cell(e["peak_bytes"]),
                    report.ratio_cell(e["mem_ratio"]), f"{e['tflops_per_s']:.3g}",
                    "n/a" if e.get("mfu") is None else f"{100 * e['mfu']:.1f}%",
                ])
    title = (f"Attention module alone vs {ref} (same backend): {env['device']} ({env['device_name']}), "
             f"{cfg['dtype']}, {env['threads']} threads, d_model {cfg['d_model']}, {cfg['n_heads']} heads; "
             f"{cfg['rounds']} rounds x {cfg['steps']} steps")
    peak = cfg["peak_flops"]
    caption = (f"vs base = the median over paired runs (a few runs apart in one round) of {ref}'s time / the "
               f"variant's on the same backend (>1 = faster than {ref}); spread = "
               "min-max of the fwd+bwd ratio per round; peak mem = live tensor bytes of one forward+backward "
               "(weights included); TFLOP/s = the layer's attention FLOPs (linear weights + the registry's "
               f"attention_flops, x3) / fwd+bwd time; MFU = that / the peak "
               f"({report.tflops_text(peak)} TFLOP/s).")
    return title, HEADERS, rows, caption

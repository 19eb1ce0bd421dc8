"""`diffexp bench train`: training-step cost of every attention variant relative to the reference, side by side.

A step is forward, cross-entropy, backward and AdamW, as `diffexp fit` takes it (its chunked loss and AdamW
kernel); its time is the median over diffexp.bench.timing's rounds, its peak memory that of one extra untimed
step, state included. On CPU the batch is capped at ``--tokens-per-batch`` tokens (all variants at the same batch).
Details: bench/README.md.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from diffexp.bench import options, report, timing, workload
from diffexp.bench.memory import peak_bytes, release, tensor_bytes
from diffexp.bench.profile import attention_ops, attention_text, door_picks
from diffexp.bench.progress import ProgressReporter
from diffexp.errors import UserError
from diffexp.model.attention.registry import reference_variant

NAME = "train"
ABOUT = "training step (forward, loss, backward, AdamW) per variant vs the reference: time, memory, MFU"
LAYOUT = report.Layout(
    labels=(("variant", "variant"), ("seq", "seq_len")),
    ratios=(report.Ratio("speed_ratio", "old tok/s ratio", "new tok/s ratio", "change", "old spread"),
            report.Ratio("flop_rate_ratio", "old FLOP/s ratio", "new FLOP/s ratio", "FLOP/s change", "old spread"),
            report.Ratio("mem_ratio", "old mem ratio", "new mem ratio", "mem change")),
    config_keys=("dtype", "backend", "d_model", "n_layers", "n_heads", "vocab_size", "variant_overrides"),
)
HEADERS = ["variant", "seq", "batch", "heads (kv)", "params (non-emb)", "step ms (median)", "tokens/s vs base",
           "ratio spread (rounds)", "FLOPs vs base", "FLOP/s vs base", "FLOP/s spread (rounds)", "peak mem MiB",
           "mem vs base", "TFLOP/s", "MFU (PaLM)", "MFU (causal)", "attention calls"]


def build_parser() -> argparse.ArgumentParser:
    p = options.build_parser(NAME, "Time and peak memory of one training step per attention variant, relative "
                                   "to the reference variant measured in the same run.",
                             batch_size=8, seq_lens=[256, 1024])
    options.add_batch_cap(p)
    options.add_backend(p)
    options.add_peak_tflops(p)
    p.add_argument("--recipe", default=None, metavar="SIZE",
                   help="measure the GPU recipes' own models at this size (125m, 350m, ...): each variant as "
                        "`diffexp fit` builds it from base.yaml + size/SIZE.yaml + variant/<variant>.yaml (its heads, "
                        "KV heads, rank, the 32K vocabulary); --seq-lens and --batch-size default to the recipe's. "
                        "--d-model, --n-layers and --n-heads are then ignored; --vocab-size, where given, replaces "
                        "the recipe's vocabulary (to match a fit on another tokenizer)")
    p.add_argument("--recipe-dir", type=Path, default=None, metavar="DIR",
                   help="the GPU recipe directory --recipe reads (default: recipes/gpu)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each decoder block, as model.compile does in training")
    # filled in by validate: the recipe's, or the bench's defaults (256 1024, 8, DEFAULT_SHAPE's vocabulary)
    p.set_defaults(seq_lens=None, batch_size=None, vocab_size=None)
    for action in p._actions:
        if action.dest == "seq_lens":
            action.help = "sequence lengths (default: 256 1024; with --recipe, the recipe's data.seq_len)"
        elif action.dest == "vocab_size":
            action.help = (f"token ids (default: {options.DEFAULT_SHAPE['vocab_size']}; with --recipe, the "
                           "recipe's)")
        elif action.dest == "batch_size":
            action.help = "sequences per batch (default: 8; with --recipe, the recipe's data.batch_size)"
    return p


DEFAULT_SEQ_LENS, DEFAULT_BATCH = [256, 1024], 8


def validate(args: argparse.Namespace) -> None:
    if args.recipe is not None:
        from diffexp.bench.recipe_shape import load

        load(args)
    elif args.recipe_dir is not None:
        raise UserError("--recipe-dir: only read with --recipe SIZE; add --recipe (e.g. --recipe 125m)")
    args.seq_lens = sorted(dict.fromkeys(args.seq_lens or DEFAULT_SEQ_LENS))
    args.batch_size = args.batch_size or DEFAULT_BATCH
    args.vocab_size = args.vocab_size or options.DEFAULT_SHAPE["vocab_size"]
    options.positive("--seq-lens", args.seq_lens)
    options.positive("--batch-size", args.batch_size)
    if args.compile:
        import torch

        from diffexp.model.compile import compile_unavailable

        reason = compile_unavailable(torch.device(args.device))
        if reason is not None:
            raise UserError(f"--compile: torch.compile cannot run on {args.device} here: {reason}")
    workload.check_configs(args, max(args.seq_lens), [args.backend])
    check_memory(args)
    args.peak_flops = report.peak_flops(args.device, args.dtype, args.peak_tflops)


def check_memory(args: argparse.Namespace) -> None:
    """Refuse a sequence length whose models cannot be held: every variant's weights and AdamW states at once (the
    runs interleave), with the largest one step's gradients and activations, as diffexp.parallel.memory estimates
    them for a training run, against the device's free memory."""
    import torch

    from diffexp.parallel.memory import estimate_memory, free_memory, rough_training_bytes, size
    from diffexp.training.loss import token_losses

    device = torch.device(args.device)
    available = free_memory(device)
    if available is None:
        return
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    archs = [workload.model_config(args, name, max(args.seq_lens), args.backend) for name in args.variants]
    for seq_len in args.seq_lens:
        batch = workload.batch_for(seq_len, args)
        if sum(rough_training_bytes(arch, batch, seq_len) for arch in archs) <= available / 4:
            continue
        estimates = [estimate_memory(arch, batch, seq_len, 1, dtype, loss=token_losses) for arch in archs]
        held = sum(e.parameters + e.optimizer for e in estimates)
        step = max(e.gradients + e.activations for e in estimates)
        if held + step > available:
            raise UserError(f"--seq-lens {seq_len} (batch {batch}): the {len(archs)} models' weights and AdamW "
                            f"states take {size(held)}, and one training step about {size(step)} more, beyond the "
                            f"{size(available)} free on {device.type}; lower --seq-lens, --batch-size or "
                            "--tokens-per-batch, or measure fewer --variants")


def config(args: argparse.Namespace) -> dict:
    return {**workload.common_config(args), "tokens_per_batch": args.tokens_per_batch, "backend": args.backend,
            "peak_flops": args.peak_flops, "recipe": args.recipe, "compile": args.compile}


class StepRunner:
    """One variant's model, AdamW and batch; `run` is one training step."""

    def __init__(self, args: argparse.Namespace, name: str, tokens, device) -> None:
        import torch

        from diffexp.model import Decoder

        torch.manual_seed(workload.SEED)
        self.torch = torch
        self.device = device
        self.model = Decoder(workload.model_config(args, name, max(args.seq_lens), args.backend)).to(device)
        self.model.train()
        if args.compile:  # as model.compile does in training: each block, in place
            from diffexp.model.compile import compile_blocks

            compile_blocks(self.model.blocks, device)
        self.params = self.model.parameter_report()
        # model FLOPs of one training step (forward + backward, causal attention counted once)
        self.flops_per_step = tokens.shape[0] * (tokens.shape[1] - 1) * self.model.flops_per_token(
            tokens.shape[1] - 1, training=True)
        # the same under PaLM's convention (all T keys per query), the one nanoGPT, llm-foundry and llm.c report
        self.palm_flops_per_step = tokens.shape[0] * (tokens.shape[1] - 1) * self.model.flops_per_token(
            tokens.shape[1] - 1, training=True, convention="palm")
        from diffexp.training.module import adamw_kernel

        # the step `diffexp fit` takes: its AdamW kernel, its chunked LM head and loss (diffexp.training.loss)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.1,
                                           **adamw_kernel(device))
        self.inputs, self.targets = tokens[:, :-1], tokens[:, 1:]
        self.autocast = lambda: workload.autocast(args, device)
        self.clock = timing.Stopwatch(device)
        self.compiled = args.compile
        self.kernel_picks: dict[str, int] | None = None  # what the kernel door picked in the first step

    def step(self) -> None:
        from diffexp.training.loss import token_losses

        with self.autocast():
            hidden = self.model(self.inputs, head=False)
            loss = token_losses(hidden, self.model.lm_head.weight, self.targets).mean()
        loss.backward()
        self.optimizer.step()
        # at the end, so no gradient outlives the step (the CPU memory count starts from none)
        self.optimizer.zero_grad(set_to_none=True)

    def run(self) -> None:
        if self.kernel_picks is None:  # the first step: where a compiled model is traced
            from diffexp.kernels import recording

            with recording() as picks:
                self.step()
            self.kernel_picks = dict(picks)
        else:
            self.step()
        self.clock.sync()

    def timed(self) -> dict[str, float]:
        self.clock.start()
        self.step()
        wall, cpu = self.clock.lap()
        return {"times_s": wall, "cpu_times_s": cpu}

    def peak_bytes(self) -> int | None:
        """Peak live tensor bytes during one (untimed) step: parameters, buffers, AdamW moments included."""
        state = [t for s in self.optimizer.state.values() for t in s.values() if self.torch.is_tensor(t)]
        return peak_bytes(self.step, self.device,
                          tensor_bytes([*self.model.parameters(), *self.model.buffers(), *state]))


def run(args: argparse.Namespace, save_finished: Callable[[dict], None] = lambda results: None) -> dict:
    """Every variant at each length, side by side. save_finished gets the results so far, ratios computed, after
    each round and each length: a run stopped later keeps them (the kernel door's picks from the first step; the
    SDPA backends, peak memory and profile once a length is done)."""
    import torch

    device = torch.device(args.device)
    variants = args.variants
    per_variant = timing.runs_per_variant(args)
    results: dict[str, dict] = {}
    finished: list[int] = []
    with ProgressReporter(total=len(args.seq_lens) * len(variants) * per_variant) as progress:
        for seq_len in args.seq_lens:
            batch = workload.batch_for(seq_len, args)
            tokens = workload.random_tokens(args, batch, seq_len + 1, seq_len, device)
            progress.log(f"seq {seq_len}, batch {batch}: building {len(variants)} models")
            runners = {v: StepRunner(args, v, tokens, device) for v in variants}

            def entries(samples, peaks=None, profiles=None, attention=None, seq_len=seq_len, batch=batch,
                        runners=runners) -> dict[str, dict]:
                return {f"{v}@{seq_len}": {
                    "variant": v, "seq_len": seq_len, "batch_size": batch, "tokens_per_step": batch * seq_len,
                    "overrides": workload.overrides(args)[v], "params": runners[v].params,
                    "flops_per_step": runners[v].flops_per_step,
                    "palm_flops_per_step": runners[v].palm_flops_per_step, **samples[v],
                    "peak_bytes": (peaks or {}).get(v), "profile": (profiles or {}).get(v),
                    "attention_ops": attention[v] if attention else door_picks(runners[v]),
                } for v in variants}

            def save_rounds(samples, seq_len=seq_len, entries=entries) -> None:
                partial = {**results, **entries(samples)}
                summarise(partial, variants, [*finished, seq_len], args.peak_flops)
                save_finished(partial)

            samples, peaks, profiles = timing.measure(runners, args, progress, f"seq {seq_len}", headline="times_s",
                                                      on_round=save_rounds)
            attention = {v: attention_ops(runner, device) for v, runner in runners.items()}
            results.update(entries(samples, peaks, profiles, attention))
            finished.append(seq_len)
            summarise(results, variants, finished, args.peak_flops)
            save_finished(results)
            del runners, tokens
            release(device)
    return results


def summarise(results: dict, variants: list[str], seq_lens: list[int], peak_flops_per_s: float | None) -> None:
    """Medians, ratios to the reference and their per-round spread, added to each entry in place."""
    for seq_len in seq_lens:
        base = results[f"{reference_variant().name}@{seq_len}"]
        for v in variants:
            entry = results[f"{v}@{seq_len}"]
            timing.add_ratio(entry, base, "times_s", "median_step_s", "speed_ratio")
            timing.add_flop_rate_ratio(entry, base, "flops_per_step", "speed_ratio")
            # the same ratio from process CPU seconds: steadier than wall time when other processes compete
            timing.add_ratio(entry, base, "cpu_times_s", "median_step_cpu_s", "cpu_speed_ratio")
            entry["cpu_flop_rate_ratio"] = entry["cpu_speed_ratio"] * entry["flops_per_step"] / base["flops_per_step"]
            entry["tokens_per_s"] = entry["tokens_per_step"] / entry["median_step_s"]
            timing.throughput(entry, "flops_per_step", "median_step_s", peak_flops_per_s)
            if "palm_flops_per_step" in entry:  # results from before both conventions were recorded have one
                timing.throughput(entry, "palm_flops_per_step", "median_step_s", peak_flops_per_s, prefix="palm_")
            timing.add_mem_ratio(entry, base)


def plot(data: dict, json_path) -> str:
    """The figure beside the results JSON (same name, .png): step-time and FLOP-rate ratios across lengths."""
    from diffexp.bench.plot import plot_train

    return str(plot_train(data, Path(json_path).with_suffix(".png")))


def table(data: dict) -> tuple[str, list[str], list[list[str]], str]:
    """Title, headers, rows and caption of the results table."""
    cfg, env = data["config"], data["env"]
    rows = []
    for seq_len in cfg["seq_lens"]:
        for v in cfg["variants"]:
            e = data["results"].get(f"{v}@{seq_len}")
            if e is None:  # a run stopped before this length
                continue
            rows.append([
                v, str(seq_len), str(e["batch_size"]), heads_cell(e.get("overrides") or {}, cfg),
                f"{e['params']['non_embedding']:,}",
                f"{e['median_step_s'] * 1e3:.0f}", report.ratio_cell(e["speed_ratio"]),
                report.spread_cell(e, "speed_ratio"), report.ratio_cell(e["flop_rate_ratio"] / e["speed_ratio"]),
                report.ratio_cell(e["flop_rate_ratio"]), report.spread_cell(e, "flop_rate_ratio"),
                report.mib_cell(e["peak_bytes"]),
                report.ratio_cell(e["mem_ratio"]), f"{e['tflops_per_s']:.3g}",
                "n/a" if e.get("palm_mfu") is None else f"{100 * e['palm_mfu']:.1f}%",
                "n/a" if e.get("mfu") is None else f"{100 * e['mfu']:.1f}%",
                attention_text(e.get("attention_ops")),
            ])
    ref = cfg["variants"][0]  # the reference variant
    shape = (f"recipe {cfg['recipe']} (d_model {cfg['d_model']}, {cfg['n_layers']} layers, vocab {cfg['vocab_size']})"
             if cfg.get("recipe") else f"d_model {cfg['d_model']}, {cfg['n_layers']} layers, {cfg['n_heads']} heads")
    title = (f"Training step vs {ref}: {env['device']} ({env['device_name']}), {cfg['dtype']}, "
             f"backend {cfg['backend']}, {'compiled' if cfg.get('compile') else 'eager'}, {env['threads']} threads, "
             f"{shape}; {cfg['rounds']} rounds x {cfg['steps']} steps")
    peak = cfg["peak_flops"]
    caption = (f"tokens/s vs base = the median over paired steps (a few steps apart in one round) of {ref}'s "
               f"step time / the variant's (>1 = faster than {ref}); "
               "spread = min-max of the same ratio per round; FLOP/s vs base = the variant's model FLOPs per "
               f"second over {ref}'s (tokens/s ratio x FLOPs ratio; 1 = its extra math costs exactly its extra "
               "FLOPs); peak mem = live tensor bytes (state + step); attention calls = the fused SDPA backend each "
               "attention call took (forward/backward calls per step) and what the kernel door picked for the "
               "two-map heads (a diffexp.kernels kernel, or plain: calls per step; compiled: traced into the "
               "graph); TFLOP/s = model FLOPs (Decoder.flops_per_token, training) / step time; "
               f"MFU = model FLOPs per second / the peak ({report.tflops_text(peak)} TFLOP/s), in two conventions: "
               "PaLM's (6N + 12 L H Q T: each query over all T keys, as nanoGPT, llm-foundry and llm.c report) and "
               "causal (T/2 keys per query on average, the work causal attention does; diffexp's TFLOP/s).")
    return title, HEADERS, rows, caption


def heads_cell(overrides: dict, cfg: dict) -> str:
    """`12 (4)`: the variant's heads and KV heads (its overrides, else the run's shared shape)."""
    heads = overrides.get("n_heads", cfg["n_heads"])
    kv = overrides.get("n_kv_heads") or heads
    return f"{heads} ({kv})"

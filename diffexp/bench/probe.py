"""`diffexp bench probe`: which SDPA backends take the attention shapes of a GPU recipe, and what each formulation
of a differential head costs on them, one attention layer forward and backward.

Two parts, at the recipe's shapes (heads, KV heads, head dim; seq and micro-batch from the recipe unless given):
- backends: each SDPA backend forced (`torch.nn.attention.sdpa_kernel`) on the calls the variants make: the
  reference's (d = dv), DIFF V1's both maps in one call with V at full width (dv = 2d), DIFF V2's GQA call over
  its 2h query heads (`enable_gqa`). A backend that refuses a call says why.
- formulations: the same head computed the ways diffexp could compute it, on PyTorch's own backend choice:
  DIFF V1 as 4 calls at head dim d (V in halves), 2 calls with V at full width, 1 call over 2h heads with V at
  full width; DIFF V2 as 2 calls (one per map) and as 1 GQA call over its 2h query heads; and the low-rank
  variant's Q projection of both maps factored, X W + (X A) B^T, or merged, X (W + A B^T) in one GEMM (more FLOPs,
  fewer kernels: which pays is this measurement's question). The variants are taken from the registry by their
  head's form: the first two-map variant, the first with paired query heads, the first with a `rank` flag. Every
  formulation's output is checked against the first of its group before it is timed.
Times are medians of CUDA-event (or wall-clock on CPU) timings of forward + backward.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from diffexp.bench.options import BenchArgumentParser
from diffexp.errors import UserError

NAME = "probe"
ABOUT = "which SDPA backends take a recipe's attention shapes; each differential formulation's cost, one layer"
BACKENDS = ("flash", "efficient", "cudnn", "math")


def build_parser() -> argparse.ArgumentParser:
    p = BenchArgumentParser(prog="diffexp bench probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="125m", metavar="SIZE", help="the GPU recipe size whose shapes to probe")
    p.add_argument("--recipe-dir", type=Path, default=None, metavar="DIR", help="default: recipes/gpu")
    p.add_argument("--seq-len", type=int, default=None, help="default: the recipe's data.seq_len")
    p.add_argument("--batch-size", type=int, default=None, help="default: the recipe's data.batch_size")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    p.add_argument("--steps", type=int, default=5, help="timed forward+backward runs per formulation")
    p.add_argument("--json", type=Path, required=True, metavar="PATH", help="where to write the results")
    return p


def probed_variants() -> dict[str, str]:
    """role -> registered variant: the reference, the first two-map variant (two d-wide maps over one 2d-wide V,
    DIFF V1's head) and the first differential variant with one map per query head (paired query heads over GQA,
    DIFF V2's)."""
    from diffexp.model.attention import variants
    from diffexp.model.attention.registry import reference_variant

    registered = list(variants())
    return {"reference": reference_variant().name,
            "two_map": next(v.name for v in registered if v.maps_per_head == 2),
            "paired": next(v.name for v in registered if v.differential and v.maps_per_head == 1),
            "low_rank": next(v.name for v in registered if "rank" in v.fields)}


def shapes(args: argparse.Namespace) -> dict[str, dict]:
    """The recipe's attention shapes of each probed role: its variant, heads, KV heads and head dim."""
    from diffexp.bench import recipe_shape

    roles = probed_variants()
    ns = argparse.Namespace(recipe=args.recipe, recipe_dir=args.recipe_dir, variants=list(roles.values()),
                            seq_lens=None if args.seq_len is None else [args.seq_len], batch_size=args.batch_size,
                            vocab_size=None)
    recipe_shape.load(ns)
    out: dict[str, dict] = {}
    for role, name in roles.items():
        cfg = ns.recipe_archs[name]
        out[role] = {"variant": name, "heads": cfg.n_heads, "kv_heads": cfg.kv_heads, "d": cfg.resolved_head_dim,
                     "d_model": cfg.d_model, "rank": getattr(cfg, "rank", None)}
    out["run"] = {"seq_len": ns.seq_lens[0], "batch": ns.batch_size}
    return out


def _timed(fn, device, steps: int) -> float:
    """Median seconds of fn() (forward + backward) over `steps` runs after one warm-up."""
    import torch

    fn()
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _tensors(device, dtype, batch, heads, seq, dim, seed):
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(batch, heads, seq, dim, generator=gen).to(device=device, dtype=dtype).requires_grad_()


def formulations(sh: dict, device, dtype) -> dict[str, dict]:
    """Each formulation: a function returning the head's output (the timed call runs it forward and backward)."""
    import torch
    import torch.nn.functional as F

    B, T = sh["run"]["batch"], sh["run"]["seq_len"]
    v1, v2, base = sh["two_map"], sh["paired"], sh["reference"]
    h, d = v1["heads"], v1["d"]
    q1, q2, k1, k2 = (_tensors(device, dtype, B, h, T, d, s) for s in range(4))
    v = _tensors(device, dtype, B, h, T, 2 * d, 4)
    lam = 0.8

    def sdpa(q, k, val, **kw):
        return F.scaled_dot_product_attention(q, k, val, is_causal=True, **kw)

    def v1_four():
        halves = v.chunk(2, dim=-1)
        a1 = torch.cat([sdpa(q1, k1, part) for part in halves], dim=-1)
        a2 = torch.cat([sdpa(q2, k2, part) for part in halves], dim=-1)
        return a1 - lam * a2

    def v1_two():
        return sdpa(q1, k1, v) - lam * sdpa(q2, k2, v)

    def v1_one():
        out = sdpa(torch.cat([q1, q2], 1), torch.cat([k1, k2], 1), torch.cat([v, v], 1))
        return out[:, :h] - lam * out[:, h:]

    hq, hkv, dv2 = 2 * v2["heads"], v2["kv_heads"], v2["d"]
    q = _tensors(device, dtype, B, hq, T, dv2, 5)
    k, vv = _tensors(device, dtype, B, hkv, T, dv2, 6), _tensors(device, dtype, B, hkv, T, dv2, 7)
    lam2 = torch.sigmoid(_tensors(device, dtype, B, hq // 2, T, 1, 8)).detach()

    def v2_two():
        return sdpa(q[:, 0::2], k, vv, enable_gqa=True) - lam2 * sdpa(q[:, 1::2], k, vv, enable_gqa=True)

    def v2_one():
        out = sdpa(q, k, vv, enable_gqa=True)
        return out[:, 0::2] - lam2 * out[:, 1::2]

    bq, bk, bv = (_tensors(device, dtype, B, base["heads"] if i == 0 else base["kv_heads"], T, base["d"], 9 + i)
                  for i in range(3))

    def reference():
        return sdpa(bq, bk, bv, enable_gqa=base["heads"] != base["kv_heads"])

    low = sh["low_rank"]
    width, rank, d_model = low["heads"] * low["d"], low["rank"], low["d_model"]
    gen = torch.Generator(device="cpu").manual_seed(11)
    x, w, a, b_t = (torch.randn(*shape, generator=gen).mul(0.05).to(device, dtype).requires_grad_()
                    for shape in ((B * T, d_model), (width, d_model), (2 * rank, d_model), (2, rank, width)))

    def factored():  # X W once, plus (X A) B^T per map
        update = torch.einsum("nmr,mrw->nmw", (x @ a.T).view(-1, 2, rank), b_t)
        return (x @ w.T).unsqueeze(1) + update

    def merged():  # X (W + A_m B_m^T): one GEMM over both maps' merged weights
        weights = w.unsqueeze(0) + torch.einsum("mrw,mrd->mwd", b_t, a.view(2, rank, d_model))
        return (x @ weights.reshape(2 * width, d_model).T).view(-1, 2, width)

    one, two, ref, lr = v1["variant"], v2["variant"], base["variant"], low["variant"]
    return {
        f"{ref}: 1 call": {"group": ref, "fn": reference},
        f"{one}: 4 calls, head dim d": {"group": one, "fn": v1_four},
        f"{one}: 2 calls, V at 2d": {"group": one, "fn": v1_two},
        f"{one}: 1 call over 2h heads, V at 2d": {"group": one, "fn": v1_one},
        f"{two}: 2 calls": {"group": two, "fn": v2_two},
        f"{two}: 1 GQA call over 2h query heads": {"group": two, "fn": v2_one},
        f"{lr}: Q projection, X W + (X A) B^T": {"group": f"{lr} projection", "fn": factored},
        f"{lr}: Q projection, X (W + A B^T), one GEMM": {"group": f"{lr} projection", "fn": merged},
    }


def backend_calls(sh: dict, device, dtype) -> dict[str, tuple]:
    """The distinct SDPA calls the variants make: (q heads, kv heads, d, dv)."""
    v1, v2, base = sh["two_map"], sh["paired"], sh["reference"]
    return {
        f"{base['variant']}: {base['heads']} heads, d=dv={base['d']}": (
            base["heads"], base["kv_heads"], base["d"], base["d"]),
        f"{v1['variant']} one call: {2 * v1['heads']} heads, d={v1['d']}, dv={2 * v1['d']}": (
            2 * v1["heads"], 2 * v1["heads"], v1["d"], 2 * v1["d"]),
        f"{v2['variant']} one call: {2 * v2['heads']} q heads over {v2['kv_heads']} kv, d={v2['d']}": (
            2 * v2["heads"], v2["kv_heads"], v2["d"], v2["d"]),
    }


def run(args: argparse.Namespace) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    sh = shapes(args)
    B, T = sh["run"]["batch"], sh["run"]["seq_len"]
    result = {"shapes": sh, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "dtype": args.dtype, "backends": {}, "formulations": {}}
    enums = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
             "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
    for label, (hq, hkv, d, dv) in backend_calls(sh, device, dtype).items():
        q, k, v = (_tensors(device, dtype, B, n, T, width, i) for i, (n, width) in enumerate(((hq, d), (hkv, d),
                                                                                               (hkv, dv))))
        row = {}
        for name, enum in enums.items():
            def call(q=q, k=k, v=v, hq=hq, hkv=hkv):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hq != hkv)
                out.sum().backward()
            try:
                with sdpa_kernel([enum]):
                    row[name] = {"ok": True, "ms": 1e3 * _timed(call, device, args.steps)}
            except (RuntimeError, NotImplementedError) as err:
                row[name] = {"ok": False, "why": (str(err).strip().splitlines() or [type(err).__name__])[0][:200]}
            _release(device)
        result["backends"][label] = row
    reference: dict[str, torch.Tensor] = {}
    for label, entry in formulations(sh, device, dtype).items():
        fn = entry["fn"]
        with torch.no_grad():
            out = fn().float()
        first = reference.setdefault(entry["group"], out)
        scale = first.abs().max().item() or 1.0
        error = (out - first).abs().max().item() / scale

        def step(fn=fn):
            fn().sum().backward()

        result["formulations"][label] = {"group": entry["group"], "ms": 1e3 * _timed(step, device, args.steps),
                                         "max_rel_diff_to_first": error}
        _release(device)
    base_ms = result["formulations"][f"{sh['reference']['variant']}: 1 call"]["ms"]
    for entry in result["formulations"].values():
        entry["vs_reference"] = base_ms / entry["ms"]
    return result


def _release(device) -> None:
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def markdown(result: dict) -> str:
    sh = result["shapes"]
    lines = [f"### SDPA probe: {result['device']}, torch {result['torch']}, {result['dtype']}, batch "
             f"{sh['run']['batch']}, seq {sh['run']['seq_len']}", "",
             "| call | " + " | ".join(BACKENDS) + " |", "|---|" + "---:|" * len(BACKENDS)]
    for label, row in result["backends"].items():
        cells = [f"{row[b]['ms']:.2f} ms" if row[b]["ok"] else f"no: {row[b]['why'][:60]}" for b in BACKENDS]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "| formulation (fwd+bwd, PyTorch's backend choice) | ms | reference's time / this | max rel. diff |",
              "|---|---:|---:|---:|"]
    for label, entry in result["formulations"].items():
        lines.append(f"| {label} | {entry['ms']:.2f} | {entry['vs_reference']:.2f}x | "
                     f"{entry['max_rel_diff_to_first']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    for flag in ("seq_len", "batch_size", "steps"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise UserError(f"--{flag.replace('_', '-')}: expected a positive integer, got {value}")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: CUDA is not available to this torch; use --device cpu")
    import warnings

    with warnings.catch_warnings():  # a refused backend warns before it raises; the table says why
        warnings.simplefilter("ignore")
        result = run(args)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    text = markdown(result)
    args.json.with_suffix(".md").write_text(text)
    print(text)
    return 0

"""The bench's figures, each ratio to the reference with its per-round spread as error bars: the training step's
time and FLOP rate across sequence lengths, and decoding's tokens/s across contexts, one panel per mode and batch.
Drawn on Agg figures (matplotlib imported here only).
"""

from __future__ import annotations

from pathlib import Path

from diffexp.compare.plots import new_figure, series_colors


def _ratio_bars(entries: list[dict], key: str, invert: bool = False) -> tuple[list, list, list]:
    """(ratio, distance down to the round minimum, up to the maximum) per entry; invert: 1 / ratio."""
    values, low, high = [], [], []
    for e in entries:
        mid, lo, hi = e[key], e[f"{key}_min"], e[f"{key}_max"]
        if invert:
            mid, lo, hi = 1 / mid, 1 / hi, 1 / lo
        values.append(mid)
        # the ratio is the median over every pair of runs, the bar the per-round ratios' range: the median can lie
        # just outside it, and matplotlib refuses negative error lengths
        low.append(max(0.0, mid - lo))
        high.append(max(0.0, hi - mid))
    return values, low, high


def _dress(ax, xs: list[int], xlabel: str, title: str) -> None:
    """A ratio panel: the reference's 1.0 dotted, x in powers of two labelled with xs."""
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=10)


def _saved(fig, data: dict, what: str, reference: str, path: str | Path) -> Path:
    """The figure with its title (what was measured, where, on which model) written to path."""
    cfg, env = data["config"], data["env"]
    fig.suptitle(f"{what} vs {reference}: {env['device']} ({env['device_name']}), {cfg['dtype']}, "
                 f"{env['threads']} threads, d_model {cfg['d_model']}, {cfg['n_layers']} layers, "
                 f"{cfg['n_heads']} heads; bars: per-round spread", fontsize=10)
    path = Path(path)
    fig.savefig(path)
    return path


def plot_train(data: dict, path: str | Path) -> Path:
    """Two panels (step time / reference's, FLOP/s / reference's) against sequence length; returns the path."""
    cfg = data["config"]
    seq_lens, variants = cfg["seq_lens"], cfg["variants"]
    fig = new_figure(11, 4.2)
    panels = fig.subplots(1, 2)
    titles = (("speed_ratio", True, "step time / reference's (lower is faster)"),
              ("flop_rate_ratio", False, "FLOP/s / reference's (1 = extra math at the reference's rate)"))
    for ax, (key, invert, title) in zip(panels, titles, strict=True):
        for variant, color in zip(variants, series_colors(len(variants)), strict=True):
            entries = [data["results"][f"{variant}@{seq_len}"] for seq_len in seq_lens]
            values, low, high = _ratio_bars(entries, key, invert)
            ax.errorbar(seq_lens, values, yerr=[low, high], marker="o", capsize=3, color=color, label=variant)
        _dress(ax, seq_lens, "sequence length", title)
    panels[1].legend(fontsize=8)
    return _saved(fig, data, "training step", variants[0], path)


def plot_decode(data: dict, path: str | Path) -> Path:
    """One panel per (mode, batch): tokens/s / reference's against the context, per variant (a second copy of the
    reference, with --noise-floor, shows how far two identical models read apart); returns the path."""
    results = data["results"]
    contexts = data["config"]["seq_lens"]
    variants = list(dict.fromkeys(e["variant"] for e in results.values()))
    panels_at = list(dict.fromkeys((e.get("mode", "eager"), e["batch_size"]) for e in results.values()))
    fig = new_figure(4.2 * len(panels_at) + 1, 4.2)
    panels = fig.subplots(1, len(panels_at), squeeze=False, sharey=True)[0]
    for ax, (mode, batch) in zip(panels, panels_at, strict=True):
        for variant, color in zip(variants, series_colors(len(variants)), strict=True):
            suffix = "" if mode == "eager" else f":{mode}"
            values, low, high = _ratio_bars([results[f"{variant}@{c}x{batch}{suffix}"] for c in contexts],
                                            "speed_ratio")
            ax.errorbar(contexts, values, yerr=[low, high], marker="o", capsize=3, color=color, label=variant,
                        linestyle="--" if variant.endswith("#2") else "-")
        _dress(ax, contexts, "context (tokens)", f"{mode}, batch {batch}: tok/s / reference's (higher is faster)")
    panels[-1].legend(fontsize=8)
    return _saved(fig, data, "decoding with the KV cache", variants[0], path)

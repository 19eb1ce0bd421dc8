"""The training-step figure: step-time ratio and FLOP-rate ratio to the reference per variant, across sequence
lengths, with each ratio's per-round spread as error bars. Drawn on an Agg figure (matplotlib imported here only).
"""

from __future__ import annotations

from pathlib import Path

from diffexp.compare.plots import new_figure, series_colors


def _ratio_series(data: dict, variant: str, key: str, invert: bool = False) -> tuple[list, list, list]:
    """(ratio, distance down to the round minimum, up to the maximum) per sequence length; invert: 1 / ratio."""
    values, low, high = [], [], []
    for seq_len in data["config"]["seq_lens"]:
        e = data["results"][f"{variant}@{seq_len}"]
        mid, lo, hi = e[key], e[f"{key}_min"], e[f"{key}_max"]
        if invert:
            mid, lo, hi = 1 / mid, 1 / hi, 1 / lo
        values.append(mid)
        # the ratio is the median over every pair of runs, the bar the per-round ratios' range: the median can lie
        # just outside it, and matplotlib refuses negative error lengths
        low.append(max(0.0, mid - lo))
        high.append(max(0.0, hi - mid))
    return values, low, high


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
            values, low, high = _ratio_series(data, variant, key, invert)
            ax.errorbar(seq_lens, values, yerr=[low, high], marker="o", capsize=3, color=color, label=variant)
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
        ax.set_xscale("log", base=2)
        ax.set_xticks(seq_lens, [str(s) for s in seq_lens])
        ax.set_xlabel("sequence length")
        ax.set_title(title, fontsize=10)
    panels[1].legend(fontsize=8)
    env = data["env"]
    fig.suptitle(f"training step vs {variants[0]}: {env['device']} ({env['device_name']}), {cfg['dtype']}, "
                 f"{env['threads']} threads, d_model {cfg['d_model']}, {cfg['n_layers']} layers, "
                 f"{cfg['n_heads']} heads; bars: per-round spread", fontsize=10)
    path = Path(path)
    fig.savefig(path)
    return path

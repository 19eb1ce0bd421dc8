"""Activation outliers (DIFF V1, "Activation Outliers Analysis"): the top-1, top-2 and top-3 absolute values and the
median absolute value of the attention logits q.k / sqrt(d) (every map of every head; future keys, and a sink's
own logit, left out) and of the hidden states (each block's output), per layer and pooled over layers.

The largest values are exact. The median is exact while each batch of rows gives a layer at most SAMPLE / batches
values of a kind; past that it is the median of a seeded uniform sample of about SAMPLE of them (the same number
from every batch).
"""

from __future__ import annotations

import csv
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from diffexp.evals.held_out import batches, decoder_of
from diffexp.evals.scoring import evaluating
from diffexp.model.heads import taps

KINDS = ("logits", "hidden")
TOP = 3
#: values per layer and kind the median reads at most
SAMPLE = 1 << 20
#: significant digits the printed table gives the smallest value of a column
DIGITS = 4


class Pool:
    """The top-3 absolute values and a sample for the median, of one layer's values of one kind."""

    def __init__(self, per_batch: int, generator: torch.Generator) -> None:
        self.top = torch.empty(0, dtype=torch.float64)
        self.samples: list[torch.Tensor] = []
        self.count = 0
        self.per_batch, self.generator = per_batch, generator

    def add(self, values: torch.Tensor) -> None:
        """values: the absolute values (any shape) to pool, on any device."""
        values = values.detach().reshape(-1)
        self.count += values.numel()
        self.top = torch.cat((self.top, values.topk(min(TOP, values.numel())).values.double().cpu())).topk(
            min(TOP, self.top.numel() + values.numel())).values
        if values.numel() > self.per_batch:
            pick = torch.randperm(values.numel(), generator=self.generator)[: self.per_batch]
            values = values[pick.to(values.device)]
        self.samples.append(values.float().cpu())

    def sample(self) -> torch.Tensor:
        return torch.cat(self.samples) if self.samples else torch.empty(0)


def summary_row(top: torch.Tensor, sample: torch.Tensor, count: int) -> dict:
    row = {f"top{i + 1}": float(top[i]) if i < top.numel() else float("nan") for i in range(TOP)}
    # the lower median, as torch.median: a value the pool holds
    row.update(median=float(sample.double().median()) if sample.numel() else float("nan"), count=count)
    return row


class OutlierTap(taps.Tap):
    """Pools |logits| of every visible key per layer (taps.Tap: sees each map before its normalisation)."""

    def __init__(self, pools) -> None:
        self.pools = pools

    def logits(self, z, site):
        visible = z[..., 1:] if site.sink else z
        self.pools("logits", site.layer).add(visible[torch.isfinite(visible)].abs())
        return z


@torch.no_grad()
def measure(model, rows: list[list[int]], batch_size: int, device) -> dict[tuple[str, int], Pool]:
    """{(kind, layer): Pool} over the rows' inputs (each row but its last token)."""
    decoder = decoder_of(model)
    n_batches = -(-len(rows) // batch_size)
    generator = torch.Generator().manual_seed(0)
    found: dict[tuple[str, int], Pool] = {}

    def pools(kind: str, layer: int) -> Pool:
        if (kind, layer) not in found:
            found[kind, layer] = Pool(max(1, SAMPLE // n_batches), generator)
        return found[kind, layer]

    def hidden(layer: int):
        def hook(module, args, output):
            pools("hidden", layer).add((output[0] if isinstance(output, tuple) else output).float().abs())
        return hook

    with evaluating(model, device):
        handles = [block.register_forward_hook(hidden(i)) for i, block in enumerate(decoder.blocks)]
        try:
            with taps.tapping(OutlierTap(pools)):
                for batch in batches(rows, batch_size, device):
                    decoder(batch[:, :-1])
        finally:
            for handle in handles:
                handle.remove()
    return found


STATS = ("top1", "top2", "top3", "median")


def column_texts(values: list[float], digits: int = DIGITS) -> list[str]:
    """A table column's cells, all with the decimals that give its smallest nonzero value `digits` significant
    digits, zeros kept: ['6.200', '6.167'], not '6.2' beside '6.167'; ['21.351', '4.781']."""
    finite = [abs(v) for v in values if math.isfinite(v) and v != 0]
    decimals = max(0, digits - 1 - math.floor(math.log10(min(finite)))) if finite else digits - 1
    return [f"{v:.{decimals}f}" if math.isfinite(v) else str(v) for v in values]


@dataclass
class OutlierResults:
    """Per layer and pooled over layers: top-1..3 and median of |logits| and |hidden states|."""

    per_layer: list[dict]
    pooled: dict[str, dict]
    variant: str
    source: str
    documents: int
    context_len: int
    name: str = field(default="outliers")

    @classmethod
    def from_pools(cls, found: dict[tuple[str, int], Pool], variant: str, source: str, documents: int,
                   context_len: int) -> OutlierResults:
        per_layer, pooled = [], {}
        for kind in KINDS:
            layers = sorted(layer for k, layer in found if k == kind)
            for layer in layers:
                pool = found[kind, layer]
                per_layer.append({"kind": kind, "layer": layer, **summary_row(pool.top, pool.sample(), pool.count)})
            top = torch.cat([found[kind, layer].top for layer in layers]).topk(TOP).values
            sample = torch.cat([found[kind, layer].sample() for layer in layers])
            pooled[kind] = summary_row(top, sample, sum(found[kind, layer].count for layer in layers))
        return cls(per_layer, pooled, variant, source, documents, context_len)

    def scalars(self) -> dict[str, float]:
        return {f"outliers/{kind}_{stat}": self.pooled[kind][stat] for kind in KINDS for stat in STATS}

    def table(self) -> str:
        lines = ["| variant | values | top-1 | top-2 | top-3 | median |", "|---|---|---:|---:|---:|---:|"]
        names = {"logits": "attention logits", "hidden": "hidden states"}
        columns = [column_texts([self.pooled[kind][stat] for kind in KINDS]) for stat in STATS]
        for i, kind in enumerate(KINDS):
            lines.append(f"| {self.variant} | {names[kind]} | " + " | ".join(texts[i] for texts in columns) + " |")
        return "\n".join(lines)

    def summary(self) -> str:
        return (f"activation outliers over {self.documents} rows of {self.context_len} tokens of {self.source} "
                f"(pooled over layers; per layer in {self.name}.csv):\n{self.table()}")

    def to_csv(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        with open(path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["kind", "layer", "top1", "top2", "top3", "median", "count"])
            rows = [*self.per_layer, *({"kind": kind, "layer": "all", **self.pooled[kind]} for kind in KINDS)]
            for row in rows:
                writer.writerow([row["kind"], row["layer"], *(f"{row[s]:.6g}" for s in STATS), row["count"]])
        return path

    def save(self, directory: str | os.PathLike) -> dict[str, Path]:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"{self.name}.md").write_text(self.table() + "\n")
        (directory / f"{self.name}.json").write_text(json.dumps(
            {"variant": self.variant, "source": self.source, "rows": self.documents,
             "context_len": self.context_len, "pooled": self.pooled}, indent=2) + "\n")
        return {"csv": self.to_csv(directory / f"{self.name}.csv"), "md": directory / f"{self.name}.md"}

"""Attention rounding error (the DIFF V2 blog, after Qiu and Yao, arXiv 2510.04212): each head's attention output
as FlashAttention computes it in bf16 or fp16, against float64, on the checkpoint's own q, k and v.

The model runs once in float64 (a copy of it) through the taps, which give each head's output as its terms,
out = sum_m w_m P_m V_m. For each map, FlashAttention's form: the row's unnormalised weights P~ = P / max_j P_j
(exp(z - m) for a softmax row), rounded to the low precision, times V rounded to it, the products summed in fp32,
then divided by the row's sum (times max_j P_j, in fp32); a differential head's maps each so, then combined with
their weights in fp32, as its kernel does. Per layer and head, over every row, position and channel:

    rel_error = RMS(out_low - out_64) / RMS(out_64)        bias = mean(out_low - out_64) / RMS(out_64)
"""

from __future__ import annotations

import copy
import csv
import json
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from diffexp.evals.held_out import batches, decoder_of
from diffexp.evals.scoring import evaluating
from diffexp.model.heads import taps

PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16}


@contextmanager
def exact_fp32_matmul():
    """fp32 products summed in fp32 (no TF32 on a GPU), as FlashAttention's accumulator."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def flash_product(probs: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """probs @ v as FlashAttention computes it: (P / rowmax) and V rounded to `dtype`, products summed in fp32,
    times rowmax in fp32. probs: (..., T_q, T_k), v: (..., T_k, dv). Returns fp32."""
    peak = probs.amax(dim=-1, keepdim=True)
    peak = torch.where(peak > 0, peak, torch.ones_like(peak))
    unnormalised = (probs / peak).to(dtype).float()
    return (unnormalised @ v.to(dtype).float()) * peak.float()


def low_precision_output(terms, dtype: torch.dtype) -> torch.Tensor:
    """sum_m w_m P_m V_m, each product as `flash_product`, combined in fp32."""
    out = None
    for term in terms:
        weight = term.weight.float() if torch.is_tensor(term.weight) else float(term.weight)
        product = weight * flash_product(term.probs, term.v, dtype)
        out = product if out is None else out + product
    return out


def exact_output(terms) -> torch.Tensor:
    """sum_m w_m P_m V_m in float64."""
    out = None
    for term in terms:
        weight = term.weight.double() if torch.is_tensor(term.weight) else float(term.weight)
        product = weight * (term.probs.double() @ term.v.double())
        out = product if out is None else out + product
    return out


class Sums:
    """Per head: sum of err^2, of err, of ref^2, and the count, for one layer and precision."""

    def __init__(self, heads: int) -> None:
        self.squares = torch.zeros(heads, dtype=torch.float64)
        self.errors = torch.zeros(heads, dtype=torch.float64)
        self.outputs = torch.zeros(heads, dtype=torch.float64)
        self.count = 0

    def add(self, low: torch.Tensor, exact: torch.Tensor) -> None:
        err = low.double() - exact
        dims = (0, 2, 3)
        self.squares += err.pow(2).sum(dims).cpu()
        self.errors += err.sum(dims).cpu()
        self.outputs += exact.pow(2).sum(dims).cpu()
        self.count += err.numel() // err.shape[1]

    def per_head(self) -> list[dict]:
        rms = (self.outputs / self.count).sqrt()
        rel = (self.squares / self.count).sqrt() / rms
        bias = self.errors / self.count / rms
        return [{"head": h, "rel_error": float(rel[h]), "bias": float(bias[h]), "output_rms": float(rms[h])}
                for h in range(len(rms))]


class RoundingTap(taps.Tap):
    def __init__(self) -> None:
        self.sums: dict[tuple[int, str], Sums] = {}

    def maps(self, site, terms):
        with exact_fp32_matmul():
            exact = exact_output(terms)
            for name, dtype in PRECISIONS.items():
                key = (site.layer, name)
                if key not in self.sums:
                    self.sums[key] = Sums(exact.shape[1])
                self.sums[key].add(low_precision_output(terms, dtype), exact)


@torch.no_grad()
def measure(model, rows: list[list[int]], batch_size: int, device) -> dict[tuple[int, str], Sums]:
    """{(layer, precision): Sums} over the rows' inputs, the model run in float64 (a copy)."""
    with evaluating(model, device):
        decoder = copy.deepcopy(decoder_of(model)).double()
        tap = RoundingTap()
        kind = torch.device(device).type
        with torch.autocast(kind, enabled=False), taps.tapping(tap):  # float64 also inside a mixed-precision fit
            for batch in batches(rows, batch_size, device):
                decoder(batch[:, :-1])
    return tap.sums


@dataclass
class RoundingResults:
    """Per layer and head: the relative RMS error and the relative bias of bf16 and fp16 attention outputs."""

    rows: list[dict]
    variant: str
    source: str
    documents: int
    context_len: int
    name: str = field(default="rounding")

    @classmethod
    def from_sums(cls, sums: dict[tuple[int, str], Sums], variant: str, source: str, documents: int,
                  context_len: int) -> RoundingResults:
        rows = [{"layer": layer, "precision": precision, **head}
                for (layer, precision), s in sorted(sums.items()) for head in s.per_head()]
        return cls(rows, variant, source, documents, context_len)

    def mean(self, precision: str, key: str) -> float:
        values = [row[key] for row in self.rows if row["precision"] == precision]
        return sum(values) / len(values)

    def scalars(self) -> dict[str, float]:
        return {f"rounding/{p}_{stat}": self.mean(p, key) for p in PRECISIONS
                for stat, key in (("rel_error", "rel_error"), ("bias", "bias"))}

    def table(self) -> str:
        lines = ["| variant | precision | relative RMS error | relative bias |", "|---|---|---:|---:|"]
        for p in PRECISIONS:
            lines.append(f"| {self.variant} | {p} | {self.mean(p, 'rel_error'):.3e} | {self.mean(p, 'bias'):+.3e} |")
        return "\n".join(lines)

    def summary(self) -> str:
        return (f"attention output rounding error against float64 (mean over layers and heads; per head in "
                f"{self.name}.csv), {self.documents} rows of {self.context_len} tokens of {self.source}:\n"
                f"{self.table()}")

    def save(self, directory: str | os.PathLike) -> dict[str, Path]:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        with open(directory / f"{self.name}.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["layer", "head", "precision", "rel_error", "bias", "output_rms"])
            writer.writeheader()
            writer.writerows(self.rows)
        (directory / f"{self.name}.json").write_text(json.dumps(
            {"variant": self.variant, "source": self.source, "rows": self.documents,
             "context_len": self.context_len, "scalars": self.scalars()}, indent=2) + "\n")
        (directory / f"{self.name}.md").write_text(self.table() + "\n")
        return {"csv": directory / f"{self.name}.csv", "json": directory / f"{self.name}.json"}

"""Low-bit attention logits (DIFF V1, "Activation Outliers Analysis"): post-training dynamic absmax quantization of
every map's logits before its normalisation, per tensor (per layer, head and batch row),

    q = round(z / a * Q) * a / Q        a = max |z| over the visible keys,  Q = 2^(b-1) - 1,

the future keys staying masked (a softmax with a sink quantizes the sink's logit with its row's: it is one more
logit of the same softmax). The held-out loss is measured at each width b, and unquantized.
"""

from __future__ import annotations

import csv
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from diffexp.evals.held_out import batches, decoder_of
from diffexp.evals.scoring import evaluating
from diffexp.model.heads import taps


def absmax_quantize(z: torch.Tensor, bits: int) -> torch.Tensor:
    """z: (B, h, T_q, T_k), -inf at masked keys; each (batch row, head) tensor rounded to 2^(b-1) - 1 levels of
    its own max |z| on either side of 0. Masked entries stay -inf; an all-zero tensor stays zero."""
    levels = 2 ** (bits - 1) - 1
    visible = torch.isfinite(z)
    a = torch.where(visible, z.abs(), torch.zeros_like(z)).amax(dim=(-2, -1), keepdim=True)
    a = torch.where(a > 0, a, torch.ones_like(a))
    return torch.where(visible, torch.round(z / a * levels) * a / levels, z)


class QuantizeTap(taps.Tap):
    """Every map's logits quantized to `bits` before its normalisation."""

    def __init__(self, bits: int) -> None:
        self.bits = bits

    def logits(self, z, site):
        return absmax_quantize(z, self.bits)


@torch.no_grad()
def held_out_loss(model, rows: list[list[int]], batch_size: int, device, bits: int | None) -> float:
    """The mean next-token loss over every target of the rows, with the logits at `bits` (None: unquantized)."""
    decoder = decoder_of(model)
    total, count = 0.0, 0
    with evaluating(model, device):
        for batch in batches(rows, batch_size, device):
            if bits is None:
                logits = decoder(batch[:, :-1])
            else:
                with taps.tapping(QuantizeTap(bits)):
                    logits = decoder(batch[:, :-1])
            total += float(F.cross_entropy(logits.float().transpose(1, 2), batch[:, 1:], reduction="sum"))
            count += batch[:, 1:].numel()
    return total / count


@dataclass
class QuantizeResults:
    """The held-out loss unquantized and at each width, and the LM-Eval metrics at each width."""

    unquantized: float
    losses: dict[int, float]
    harness: dict[int, dict[str, dict[str, float]]]
    variant: str
    source: str
    documents: int
    context_len: int
    name: str = field(default="quantize")

    def scalars(self) -> dict[str, float]:
        out = {"quantize/loss_unquantized": self.unquantized}
        out.update({f"quantize/loss_b{bits}": loss for bits, loss in self.losses.items()})
        # what the width costs, apart from the model's own loss: designs compare on it whatever their loss
        out.update({f"quantize/loss_increase_b{bits}": loss - self.unquantized for bits, loss in self.losses.items()})
        for bits, tasks in self.harness.items():
            out.update({f"quantize/b{bits}/{task}/{metric}": value for task, metrics in tasks.items()
                        for metric, value in metrics.items() if value is not None and math.isfinite(value)})
        return out

    def rows(self) -> list[dict]:
        widths = [("unquantized", None, self.unquantized), *((str(b), b, loss) for b, loss in self.losses.items())]
        rows = []
        for label, bits, loss in widths:
            row = {"bits": label, "loss": loss}
            for task, metrics in self.harness.get(bits, {}).items():
                row.update({f"{task}/{metric}": value for metric, value in metrics.items()})
            rows.append(row)
        return rows

    def table(self) -> str:
        rows = self.rows()
        columns = list(dict.fromkeys(key for row in rows for key in row))
        lines = ["| variant | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
        for row in rows:
            cells = [row.get(c, "") if c == "bits" else f"{row[c]:.4f}" if isinstance(row.get(c), float) else ""
                     for c in columns]
            lines.append(f"| {self.variant} | " + " | ".join(cells) + " |")
        return "\n".join(lines)

    def summary(self) -> str:
        return (f"attention logits quantized per layer, head and row (absmax), {self.documents} rows of "
                f"{self.context_len} tokens of {self.source}:\n{self.table()}")

    def save(self, directory: str | os.PathLike) -> dict[str, Path]:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        rows = self.rows()
        columns = list(dict.fromkeys(key for row in rows for key in row))
        with open(directory / f"{self.name}.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            writer.writerows(rows)
        (directory / f"{self.name}.json").write_text(json.dumps(
            {"variant": self.variant, "source": self.source, "rows": self.documents,
             "context_len": self.context_len, "scalars": self.scalars()}, indent=2) + "\n")
        (directory / f"{self.name}.md").write_text(self.table() + "\n")
        return {"csv": directory / f"{self.name}.csv", "json": directory / f"{self.name}.json"}

"""Negative log-likelihood by token position on long documents (DIFF V1's long-context figure).

The loss at position p is ``-log P(t_p | t_0 .. t_{p-1})``, no end-of-document token before t_0; ``cumulative[p]``
is the mean over documents of each one's average loss over positions 1..p, the curve DIFF V1 plots.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from diffexp.evals import plots
from diffexp.evals.scoring import as_logits_fn, evaluating

LOSS_CHUNK = 4096  # positions whose float32 log-probabilities are formed at once: bounds memory at long contexts


@torch.no_grad()
def token_nlls(model: Any, rows: Sequence[Sequence[int]], device: str | torch.device = "cpu",
               batch_size: int = 4) -> np.ndarray:
    """(D, L) float64: ``-log P(row[p] | row[:p])`` for p = 1..L, every row holding L + 1 tokens."""
    if len({len(row) for row in rows}) != 1:
        raise ValueError("rows of different lengths: expected every row to hold context_len + 1 tokens")
    out = []
    with evaluating(model, device):
        logits_fn = as_logits_fn(model)
        for first in range(0, len(rows), batch_size):
            batch = torch.tensor([list(r) for r in rows[first:first + batch_size]], dtype=torch.long, device=device)
            logits = logits_fn(batch[:, :-1])
            targets = batch[:, 1:]
            losses = [F.cross_entropy(logits[:, s:s + LOSS_CHUNK].float().transpose(1, 2),
                                      targets[:, s:s + LOSS_CHUNK], reduction="none")
                      for s in range(0, targets.shape[1], LOSS_CHUNK)]
            out.append(torch.cat(losses, dim=1).double().cpu())
    return torch.cat(out).numpy()


def report_positions(context_len: int) -> list[int]:
    """Positions for the table and the scalars: powers of 4 from 16, and the last position."""
    positions, p = [], 16
    while p < context_len:
        positions.append(p)
        p *= 4
    return [*positions, context_len]


@dataclass
class NLLResults:
    """Mean loss per position (1..context_len) and its cumulative average, over ``documents`` documents."""

    context_len: int
    documents: int
    source: str
    per_position: np.ndarray
    cumulative: np.ndarray

    @classmethod
    def from_losses(cls, losses: np.ndarray, source: str) -> NLLResults:
        """From ``token_nlls``' (D, L) matrix."""
        positions = np.arange(1, losses.shape[1] + 1)
        return cls(losses.shape[1], losses.shape[0], source, losses.mean(axis=0),
                   (np.cumsum(losses, axis=1) / positions).mean(axis=0))

    @property
    def name(self) -> str:
        return f"nll-ctx{self.context_len}"

    def at(self, position: int) -> dict[str, float]:
        return {"position": position, "nll": float(self.per_position[position - 1]),
                "cumulative_nll": float(self.cumulative[position - 1])}

    def scalars(self) -> dict[str, float]:
        """TensorBoard scalars: nll/ctx<L>/cumulative_pos<p> at the report positions."""
        return {f"nll/ctx{self.context_len}/cumulative_pos{p}": self.at(p)["cumulative_nll"]
                for p in report_positions(self.context_len)}

    def summary(self) -> str:
        lines = [f"NLL by position: {self.documents} documents of {self.source}, context {self.context_len} tokens",
                 f"{'position':>9} {'nll':>8} {'cumulative':>11}"]
        for p in report_positions(self.context_len):
            row = self.at(p)
            lines.append(f"{p:>9} {row['nll']:8.4f} {row['cumulative_nll']:11.4f}")
        return "\n".join(lines)

    def to_csv(self, path: str | os.PathLike) -> Path:
        """One row per position: position, nll (mean at it), cumulative_nll (mean over 1..position)."""
        path = Path(path)
        with open(path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["position", "nll", "cumulative_nll"])
            for p, (nll, cum) in enumerate(zip(self.per_position, self.cumulative), start=1):
                writer.writerow([p, f"{nll:.6f}", f"{cum:.6f}"])
        return path

    def to_json(self, path: str | os.PathLike) -> Path:
        """The setting and the report positions' values (every position is in the CSV)."""
        path = Path(path)
        path.write_text(json.dumps({"context_len": self.context_len, "documents": self.documents,
                                    "source": self.source,
                                    "positions": [self.at(p) for p in report_positions(self.context_len)]},
                                   indent=2) + "\n")
        return path

    def figure(self):
        return plots.nll_figure(self)

    def save(self, directory: str | os.PathLike) -> dict[str, Path]:
        """``nll-ctx<L>.csv``, ``.json`` and ``.png`` in ``directory``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        stem = directory / self.name
        return {"csv": self.to_csv(f"{stem}.csv"), "json": self.to_json(f"{stem}.json"),
                "png": plots.save_figure(self.figure(), f"{stem}.png")}

    def log_to_tensorboard(self, writer, step: int) -> None:
        for tag, value in self.scalars().items():
            writer.add_scalar(tag, value, step)
        writer.add_figure(f"nll/ctx{self.context_len}/by_position", self.figure(), step, close=True)
        writer.flush()

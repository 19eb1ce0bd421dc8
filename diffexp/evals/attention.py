"""Attention to the answer vs attention noise (Table 5 of the DIFF/DINT papers) and negative attention, on the
effective maps of ``Decoder.forward(idx, need_weights=True)``: one (B, heads, T, T) map per layer, whose entries
may be negative (the differential variants).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from diffexp.evals.scoring import Span, attention_shares, evaluating, span_mask


@dataclass
class AttentionAllocation:
    """Per-layer shares (tensors of shape (n_layers,)); ``distractor`` is None without needle spans."""

    answer: torch.Tensor
    noise: torch.Tensor
    query: torch.Tensor
    distractor: torch.Tensor | None = None

    def overall(self) -> dict[str, float]:
        """Layer means."""
        out = {"answer": self.answer.mean().item(), "noise": self.noise.mean().item(),
               "query": self.query.mean().item()}
        if self.distractor is not None:
            out["distractor"] = self.distractor.mean().item()
        return out

    def per_layer(self) -> list[dict[str, float]]:
        rows = []
        for layer in range(len(self.answer)):
            row = {"layer": layer, "answer": self.answer[layer].item(), "noise": self.noise[layer].item(),
                   "query": self.query[layer].item()}
            if self.distractor is not None:
                row["distractor"] = self.distractor[layer].item()
            rows.append(row)
        return rows


def attention_allocation(
    maps: Sequence[torch.Tensor],
    query_positions: Sequence[Sequence[int]] | Sequence[int],
    answer_spans: Sequence[Sequence[Span]],
    query_starts: Sequence[int] | None = None,
    needle_spans: Sequence[Sequence[Span]] | None = None,
) -> AttentionAllocation:
    """Per-layer shares of the effective attention of each query row q, by magnitude
    (``w_j = |a_j| / sum_{i <= q} |a_i|``), averaged over heads, query rows and samples (a row of no weight skipped).

    Args:
        maps: per layer, the effective attention (B, heads, T, T).
        query_positions: per sample, the query row(s) ``q`` (ints or lists of ints).
        answer_spans: per sample, one ``[start, end)`` span per query row: ``answer`` is the share on it.
        query_starts: per sample, where the query region starts: ``query`` is the share on ``query_start .. q``
            (default: ``q`` alone); ``noise`` is 1 - answer - query.
        needle_spans: per sample, every needle's span: ``distractor`` is the part of noise on the other needles.
    """
    if len(maps) == 0:
        raise ValueError("maps: expected at least one layer")
    B, _, T, _ = maps[0].shape
    rows = [list(q) if isinstance(q, (list, tuple)) else [int(q)] for q in
            (query_positions.tolist() if isinstance(query_positions, torch.Tensor) else query_positions)]
    if len(rows) != B:
        raise ValueError(f"query_positions: expected one entry per sample ({B}), got {len(rows)}")
    if len(answer_spans) != B:
        raise ValueError(f"answer_spans: expected one entry per sample ({B}), got {len(answer_spans)}")
    device = maps[0].device
    # weights per (b, row) of the three regions, as boolean masks over key positions
    region_masks = []  # list of (b, q, answer_mask, query_mask, distractor_mask)
    for b in range(B):
        spans = list(answer_spans[b])
        if len(spans) == 2 and all(isinstance(x, int) for x in spans):
            spans = [tuple(spans)]  # a single span given bare
        if len(spans) == 1 and len(rows[b]) > 1:
            spans = spans * len(rows[b])
        if len(spans) != len(rows[b]):
            raise ValueError(f"answer_spans[{b}]: expected one span per query row ({len(rows[b])}), got {len(spans)}")
        for q, span in zip(rows[b], spans):
            if not 0 <= q < T:
                raise ValueError(f"query position {q} is outside the map (T={T})")
            causal = torch.arange(T, device=device) <= q
            answer = span_mask(T, [span], device) & causal
            start = q if query_starts is None else int(query_starts[b])
            query = (torch.arange(T, device=device) >= start) & causal & ~answer
            distractor = None
            if needle_spans is not None:
                distractor = span_mask(T, needle_spans[b], device) & causal & ~answer & ~query
            region_masks.append((b, q, answer, query, distractor))
    results = {"answer": [], "noise": [], "query": [], "distractor": []}
    for layer_map in maps:
        per_row = {"answer": [], "noise": [], "query": [], "distractor": []}
        for b, q, answer, query, distractor in region_masks:
            regions = [answer, query] if distractor is None else [answer, query, distractor]
            shares = attention_shares(layer_map[b, :, q, :], q, regions)  # (heads, regions)
            shares = shares[~shares[:, 0].isnan()]  # heads with no causal attention at all are skipped
            if len(shares) == 0:
                continue
            a, qu = shares[:, 0], shares[:, 1]
            per_row["answer"].append(a.mean())
            per_row["query"].append(qu.mean())
            per_row["noise"].append((1 - a - qu).clamp_min(0).mean())
            if distractor is not None:
                per_row["distractor"].append(shares[:, 2].mean())
        for key, values in per_row.items():
            if values:
                results[key].append(torch.stack(values).mean())
            elif key != "distractor" or needle_spans is not None:
                results[key].append(torch.tensor(float("nan")))
    return AttentionAllocation(
        answer=torch.stack(results["answer"]).cpu(),
        noise=torch.stack(results["noise"]).cpu(),
        query=torch.stack(results["query"]).cpu(),
        distractor=torch.stack(results["distractor"]).cpu() if needle_spans is not None else None,
    )


def _causal_mask(T: int, device) -> torch.Tensor:
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()


def negative_fraction_by_layer(maps: Sequence[torch.Tensor] | torch.Tensor) -> list[float]:
    """Per layer, the fraction of strictly negative entries among the causal entries (j <= i, diagonal included)."""
    maps = [maps] if isinstance(maps, torch.Tensor) else list(maps)
    out = []
    for m in maps:
        causal = _causal_mask(m.shape[-1], m.device)
        out.append(((m < 0) & causal).sum().item() / (causal.sum().item() * m[..., 0, 0].numel()))
    return out


def negative_fraction(maps: Sequence[torch.Tensor] | torch.Tensor) -> float:
    """Fraction of strictly negative entries among all causal entries (lower triangle with the diagonal),
    pooled over layers, batch and heads (DINT's Figure 1). Entries above the diagonal are not counted."""
    maps = [maps] if isinstance(maps, torch.Tensor) else list(maps)
    negative = total = 0
    for m in maps:
        causal = _causal_mask(m.shape[-1], m.device)
        negative += ((m < 0) & causal).sum().item()
        total += causal.sum().item() * m[..., 0, 0].numel()
    return negative / total


# ----------------------------------------------------------------------------- on a model


def _effective_maps(model, idx: torch.Tensor) -> list[torch.Tensor]:
    decoder = getattr(model, "model", model)  # DiffexpLM -> Decoder
    _, maps = decoder(idx, need_weights=True)
    if any(m is None for m in maps):
        raise ValueError("the model returned no attention map for some layer (need_weights=True unsupported?)")
    return maps


@torch.no_grad()
def attention_by_depth(
    model,
    samples_by_depth: Mapping[float, Sequence],
    span: str = "needle",
    device: str | torch.device = "cpu",
    batch_size: int = 8,
) -> list[dict]:
    """Answer / noise shares per answer depth and layer, from every query row of needle samples
    (``samples_by_depth``: depth -> NeedleSamples of one context length); ``span`` "needle" takes the whole answer
    sentence as the answer, "number" its digits. Rows ``{"depth", "layer", "answer", "noise", "query",
    "distractor"}``, ``layer`` an int or "all" (the layer mean), as ``attention_table`` formats them."""
    if span not in ("needle", "number"):
        raise ValueError(f"span={span!r} is invalid: expected 'needle' or 'number'")
    decoder = getattr(model, "model", model)
    rows = []
    with evaluating(decoder, device):
        for depth, samples in samples_by_depth.items():
            samples = list(samples)
            sums: dict[str, torch.Tensor] = {}
            weight = 0
            for start in range(0, len(samples), batch_size):
                chunk = samples[start : start + batch_size]
                idx = torch.stack([s.tokens[:-1] for s in chunk]).to(device)
                alloc = attention_allocation(
                    _effective_maps(decoder, idx),
                    [s.query_positions for s in chunk],
                    [s.answer_needle_spans if span == "needle" else s.answer_spans for s in chunk],
                    query_starts=[s.query_start for s in chunk],
                    needle_spans=[s.needle_spans for s in chunk],
                )
                for key in ("answer", "noise", "query", "distractor"):
                    value = getattr(alloc, key) * len(chunk)
                    sums[key] = sums[key] + value if key in sums else value
                weight += len(chunk)
            means = {key: value / weight for key, value in sums.items()}
            for layer in range(len(means["answer"])):
                rows.append({"depth": float(depth), "layer": layer,
                             **{key: means[key][layer].item() for key in means}})
            rows.append({"depth": float(depth), "layer": "all",
                         **{key: means[key].mean().item() for key in means}})
    return rows


def attention_table(rows: Sequence[dict], name: str | None = None) -> str:
    """Markdown table like Table 5: one row per layer (and "all"), answer / noise per depth."""
    depths = sorted({r["depth"] for r in rows})
    layers = list(dict.fromkeys(r["layer"] for r in rows))
    value = {(r["depth"], r["layer"]): r for r in rows}
    head = [name or "layer"] + [f"{d:.0%} {k}" for d in depths for k in ("answer ↑", "noise ↓")]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for layer in layers:
        cells = [str(layer)]
        for d in depths:
            r = value.get((d, layer))
            cells += [f"{r['answer']:.3f}", f"{r['noise']:.3f}"] if r else ["", ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)

"""The door through which an evaluation sees each attention map of a forward: its logits (which it may change, as a
quantizer does), its probabilities and the V they multiply, per layer and per map.

    with tapping(tap):            # every attention call of the forward runs here, eagerly
        model(tokens)

Inside the context every call of `AttentionBase` (attend, attend_with_sink, attend_normalised, paired_heads,
two_map_head) is computed by this module on the plain eager path, whatever the layer's backend: the logits
z = q.k / sqrt(d) (future keys -inf; a sink's logit in front as column 0) go through `tap.logits(z, site)` before
the normalisation, and the output's terms through `tap.maps(site, terms)`. Outside it `ACTIVE` is None and the
calls are the usual ones: one attribute check per call. Only whole-sequence forwards are tapped (no cache).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from diffexp.model.heads.single_map import causal_logits, expand_kv

#: the tap of the forward running inside `tapping`, else None
ACTIVE: Tap | None = None


@dataclass(frozen=True)
class Site:
    """Where a map comes from: its layer (0-based) and its name in the layer's head.

    map: "softmax" (one map per head), "sink" (softmax with a sink logit: column 0 of the logits), the name a
    variant gives its own normalisation (attend_normalised), "paired" (DIFF V2's one call over both heads of every
    pair), "map1" / "map2" (the two maps of DIFF V1, Shared DIFF and DINT).
    """

    layer: int
    map: str

    @property
    def sink(self) -> bool:
        """Whether column 0 of the logits is the sink's logit (not a q.k)."""
        return self.map == "sink"


@dataclass(frozen=True)
class Term:
    """One product of the head's output: weight * (probs @ v); the head's output (before any norm or gate the
    variant applies after it) is the sum of its terms. probs: (B, h, T_q, T_k) in fp32 at least; v: (B, h, T_k, dv),
    one V per query head; weight: a number or a tensor broadcasting against (B, h, T_q, dv)."""

    weight: float | torch.Tensor
    probs: torch.Tensor
    v: torch.Tensor
    map: str


class Tap:
    """What an evaluation does with the maps of a tapped forward; this one changes and keeps nothing."""

    def logits(self, z: torch.Tensor, site: Site) -> torch.Tensor:
        """z: (B, h, T_q, T_k [+1 with a sink]), fp32 at least, -inf at future keys. Returns the logits used."""
        return z

    def maps(self, site: Site, terms: tuple[Term, ...]) -> None:
        """The products that make the layer's head output (see `Term`)."""


@contextmanager
def tapping(tap: Tap) -> Iterator[Tap]:
    """Run every attention call inside through `tap`, on the eager path (not nestable)."""
    global ACTIVE
    if ACTIVE is not None:
        raise RuntimeError("a tapped forward is already running: taps do not nest")
    ACTIVE = tap
    try:
        yield tap
    finally:
        ACTIVE = None


def _whole(cache) -> None:
    if cache is not None:
        raise RuntimeError("tapped forwards read whole sequences: run the model without a decoding cache")


def _logits(layer: int, name: str, q, k, sink: torch.Tensor | None = None) -> torch.Tensor:
    z = causal_logits(q, k)
    if sink is not None:
        z = torch.cat((sink.to(z.dtype).view(1, -1, 1, 1).expand(*z.shape[:-1], 1), z), dim=-1)
    return ACTIVE.logits(z, Site(layer, name))


def _output(layer: int, name: str, terms: tuple[Term, ...], dtype: torch.dtype) -> torch.Tensor:
    ACTIVE.maps(Site(layer, name), terms)
    out = None
    for term in terms:
        product = term.probs.to(dtype) @ term.v
        weight = term.weight.to(dtype) if torch.is_tensor(term.weight) else term.weight
        product = product if isinstance(weight, (int, float)) and weight == 1 else weight * product
        out = product if out is None else out + product
    return out


def attend(layer: int, q, k, v, need_weights: bool, cache=None):
    """Causal softmax attention per query head (diffexp.model.heads.attention)."""
    _whole(cache)
    weights = _logits(layer, "softmax", q, k).softmax(dim=-1)
    out = _output(layer, "softmax", (Term(1.0, weights, expand_kv(v, q.shape[1]), "softmax"),), v.dtype)
    return out, weights if need_weights else None


def attend_with_sink(layer: int, q, k, v, sink: torch.Tensor, need_weights: bool, cache=None):
    """Softmax with a sink logit per query head (heads/sink.py); the map returned leaves the sink's column out."""
    _whole(cache)
    weights = _logits(layer, "sink", q, k, sink).softmax(dim=-1)[..., 1:]
    out = _output(layer, "sink", (Term(1.0, weights, expand_kv(v, q.shape[1]), "sink"),), v.dtype)
    return out, weights if need_weights else None


def attend_normalised(layer: int, q, k, v, normalise: Callable[[torch.Tensor], torch.Tensor], name: str, cache=None):
    """Rows `normalise(logits)` (a variant's own row rule), times V; returns the map as the untapped call does."""
    _whole(cache)
    weights = normalise(_logits(layer, name, q, k))
    return _output(layer, name, (Term(1.0, weights, expand_kv(v, q.shape[1]), name),), v.dtype), weights


def paired_heads(layer: int, q, k, v, lam, first: slice, second: slice, need_weights: bool, cache=None):
    """DIFF V2's attn[first] - lambda attn[second], attn one softmax attention over every query head."""
    _whole(cache)
    weights = _logits(layer, "paired", q, k).softmax(dim=-1)
    v_heads = expand_kv(v, q.shape[1])
    lam_maps = lam.to(torch.promote_types(lam.dtype, torch.float32)) if torch.is_tensor(lam) else lam
    terms = (Term(1.0, weights[:, first], v_heads[:, first], "map1"),
             Term(-lam_maps, weights[:, second], v_heads[:, second], "map2"))
    out = _output(layer, "paired", terms, v.dtype)
    return out, weights[:, first] - lam_maps * weights[:, second] if need_weights else None


def two_map_head(layer: int, q1, q2, k1, k2, v, lam, need_weights: bool, cache=None, integral=None):
    """(A1 - lambda A2 [+ gamma A3]) V (diffexp.model.heads.two_map_head); DINT's A3 comes from A1's map."""
    from diffexp.model.heads.per_map import integral_map

    _whole(cache)
    a1 = _logits(layer, "map1", q1, k1).softmax(dim=-1)
    a2 = _logits(layer, "map2", q2, k2).softmax(dim=-1)
    v_heads = expand_kv(v, q1.shape[1])
    lam_maps = lam.to(torch.promote_types(lam.dtype, torch.float32)) if torch.is_tensor(lam) else lam
    terms = [Term(1.0, a1, v_heads, "map1"), Term(-lam_maps, a2, v_heads, "map2")]
    effective = a1 - lam_maps * a2
    if integral is not None:
        a3 = integral_map(a1, integral.kind)
        terms.append(Term(integral.gamma, a3, v_heads, "integral"))
        effective = effective + integral.gamma * a3
    out = _output(layer, "two_map", tuple(terms), v.dtype)
    return out, effective if need_weights else None

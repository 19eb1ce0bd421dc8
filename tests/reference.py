"""Naive references of the registered variants and the cases that exercise their flags, keyed by variant name.

A reference is written from the paper's equations with explicit loops in float64: (module, x) -> (output,
effective maps). It reads the module's weights but none of its code paths (only RoPE is shared), so comparing
the module with it checks the math, not the implementation against itself. A variant added in a test registers
its own reference and cases here (tests/test_variant_registry.py).
"""

from __future__ import annotations

import math

import torch


# -- naive building blocks ----------------------------------------------------------------------
def causal_softmax_rows(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q, k: (T, d) -> A (T, T), one row at a time, over keys 0..n only."""
    t, d = q.shape
    a = torch.zeros(t, t, dtype=torch.float64)
    for n in range(t):
        scores = (k[: n + 1].double() @ q[n].double()) / math.sqrt(d)
        a[n, : n + 1] = torch.softmax(scores, dim=0)
    return a


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def heads(t: torch.Tensor, n: int) -> torch.Tensor:
    """(B, T, n * d) -> (B, n, T, d)."""
    b, tt, _ = t.shape
    return t.view(b, tt, n, -1).transpose(1, 2)


def project(x: torch.Tensor, linear: torch.nn.Linear, n: int) -> torch.Tensor:
    """x W^T split into n heads."""
    return heads(x @ linear.weight.T, n)


def output(out: torch.Tensor, o_proj: torch.nn.Linear) -> torch.Tensor:
    """(B, h, T, dv) heads -> (B, T, d_model) through the output projection, in float64."""
    b, h, t, dv = out.shape
    return out.transpose(1, 2).reshape(b, t, h * dv) @ o_proj.weight.double().T


# -- the variants ----------------------------------------------------------------------------------
def baseline_reference(m, x: torch.Tensor):
    cfg = m.cfg
    h, h_kv = cfg.n_heads, cfg.kv_heads
    q = m.rope.rotate(project(x, m.q_proj, h))
    k = m.rope.rotate(project(x, m.k_proj, h_kv))
    v = project(x, m.v_proj, h_kv).double()
    b, t = x.shape[:2]
    maps = torch.zeros(b, h, t, t, dtype=torch.float64)
    out = torch.zeros(b, h, t, v.shape[-1], dtype=torch.float64)
    for bi in range(b):
        for i in range(h):
            g = i // (h // h_kv)
            a = causal_softmax_rows(q[bi, i], k[bi, g])  # out from `a`, not a view of maps written later
            maps[bi, i] = a
            out[bi, i] = a @ v[bi, g]
    return output(out, m.o_proj), maps


def row_by_row(m, x: torch.Tensor, weights):
    """A plain-projection variant's attention one query row at a time: ``weights(z, head)`` gives row n's weights
    over keys 0..n from its logits ``z_j = q_n . k_j / sqrt(d)`` (float64, n + 1 of them: position n + 1, 1-based)."""
    cfg = m.cfg
    h, h_kv = cfg.n_heads, cfg.kv_heads
    q = m.rope.rotate(project(x, m.q_proj, h))
    k = m.rope.rotate(project(x, m.k_proj, h_kv))
    v = project(x, m.v_proj, h_kv).double()
    b, t = x.shape[:2]
    d = q.shape[-1]
    maps = torch.zeros(b, h, t, t, dtype=torch.float64)
    out = torch.zeros(b, h, t, v.shape[-1], dtype=torch.float64)
    for bi in range(b):
        for i in range(h):
            g = i // (h // h_kv)
            rows = []
            for n in range(t):
                z = (k[bi, g, : n + 1].double() @ q[bi, i, n].double()) / math.sqrt(d)
                rows.append(torch.cat((weights(z, i), z.new_zeros(t - n - 1))))
            a = torch.stack(rows)
            maps[bi, i] = a
            out[bi, i] = a @ v[bi, g]
    return output(out, m.o_proj), maps


def softmax_sink_reference(m, x: torch.Tensor):
    """a_ij = exp(z_ij) / (exp(s_h) + sum_k exp(z_ik)) row by row, s_h = 0 ("zero") or the head's learned logit."""
    sinks = m.sinks.double() if m.cfg.sink == "learned" else torch.zeros(m.cfg.n_heads, dtype=torch.float64)
    return row_by_row(m, x, lambda z, i: torch.exp(z) / (torch.exp(sinks[i]) + torch.exp(z).sum()))


def gated_reference(m, x: torch.Tensor):
    """head_i = sigmoid(x W_g)_i * softmax(Q_i K^T / sqrt(d)) V; the map scaled per row by the head's mean gate."""
    _, maps = baseline_reference(m, x)
    cfg = m.cfg
    h, h_kv = cfg.n_heads, cfg.kv_heads
    gate = torch.sigmoid(project(x, m.gate_proj, h).double())  # (B, h, T, d or 1)
    v = project(x, m.v_proj, h_kv).double()
    heads_out = torch.stack([maps[:, i] @ v[:, i // (h // h_kv)] for i in range(h)], dim=1)
    return output(gate * heads_out, m.o_proj), maps * gate.mean(-1, keepdim=True)


def softpick_reference(m, x: torch.Tensor):
    """a_ij = relu(exp(z_ij - m) - exp(-m)) / (sum_k |exp(z_ik - m) - exp(-m)| + 1e-6) row by row over keys 0..n,
    m the row's largest logit (the authors' stable form of relu(e^z - 1) / sum |e^z - 1|)."""
    def weights(z, head):
        top = z.max()
        e = torch.exp(z - top) - torch.exp(-top)
        return torch.relu(e) / (e.abs().sum() + 1e-6)

    return row_by_row(m, x, weights)


def ssmax_reference(m, x: torch.Tensor):
    """softmax((s_i log n) q_n . k_j / sqrt(d)) over keys j = 1..n of the query at position n (1-based)."""
    s = m.s.double()

    def weights(z, head):
        scale = s[head] * torch.log(torch.tensor(float(len(z)), dtype=torch.float64))
        return torch.softmax(scale * z, dim=0)

    return row_by_row(m, x, weights)


def plain_qk(m, x: torch.Tensor):
    """DIFF V1's projections: interleaved maps, q1 = heads 0, 2, 4, ...; q2 = heads 1, 3, 5, ..."""
    q = project(x, m.q_proj, 2 * m.cfg.n_heads)
    k = project(x, m.k_proj, 2 * m.cfg.kv_heads)
    return q[:, 0::2], q[:, 1::2], k[:, 0::2], k[:, 1::2]


def two_map(m, x: torch.Tensor, qk, extra_map=None, scale_by_lambda_init: bool = True,
                  extra_weight: torch.Tensor | None = None):
    """Final = A1 - lambda A2 (+ w * extra_map(A1), w = extra_weight, or lambda when None);
    head = Norm(Final V) (* (1 - lambda_init))."""
    cfg = m.cfg
    h, h_kv = cfg.n_heads, cfg.kv_heads
    depth = 0.8 - 0.6 * math.exp(-0.3 * m.layer_idx)  # written out again: the reference shares no code
    lam_init = depth if cfg.lambda_init == "depth" else float(cfg.lambda_init)
    lp = m.lambda_
    lam = (torch.exp((lp.lambda_q1 * lp.lambda_k1).sum()) - torch.exp((lp.lambda_q2 * lp.lambda_k2).sum())
           + lam_init).double()
    q1, q2, k1, k2 = (m.rope.rotate(t) for t in qk)
    v = project(x, m.v_proj, h_kv).double()  # 2d wide
    b, t = x.shape[:2]
    maps = torch.zeros(b, h, t, t, dtype=torch.float64)
    out = torch.zeros(b, h, t, v.shape[-1], dtype=torch.float64)
    for bi in range(b):
        for p in range(h):
            g = p // (h // h_kv)
            a1 = causal_softmax_rows(q1[bi, p], k1[bi, g])
            final = a1 - lam * causal_softmax_rows(q2[bi, p], k2[bi, g])
            if extra_map is not None:
                final = final + (lam if extra_weight is None else extra_weight) * extra_map(a1)
            maps[bi, p] = final
            o = final @ v[bi, g]
            if cfg.head_norm:
                o = rmsnorm(o, m.head_norm.weight)
            out[bi, p] = o * (1 - lam_init) if scale_by_lambda_init else o
    return output(out, m.o_proj), maps


def diff_v1_reference(m, x: torch.Tensor):
    return two_map(m, x, plain_qk(m, x))


def low_rank_projection(proj, x: torch.Tensor, n_heads: int, cfg):
    """Q1, Q2 (or K1, K2) from the full d_model x (heads * d) matrices W_map = W_base + updates, built with
    loops over heads: W_base holds each head's base (or the one shared base) in its columns; "layer" adds
    one A B^T over all columns, "head" adds A_i B_i^T to head i's columns."""
    r, d = cfg.rank, cfg.resolved_head_dim
    weight = proj.base.weight.double()
    maps = []
    for map_idx in range(2):
        full = torch.zeros(x.shape[-1], n_heads * d, dtype=torch.float64)
        for i in range(n_heads):
            rows = slice(0, d) if cfg.base_sharing == "heads" else slice(i * d, (i + 1) * d)
            full[:, i * d:(i + 1) * d] = weight[rows].T
        if cfg.lowrank_scope == "layer":
            a = proj.down.weight[map_idx * r:(map_idx + 1) * r].double().T  # (d_model, r)
            b = proj.up[map_idx, 0].double().T                             # (h d, r)
            full = full + a @ b.T
        else:
            for i in range(n_heads):
                first = (map_idx * n_heads + i) * r
                a = proj.down.weight[first:first + r].double().T  # (d_model, r)
                b = proj.up[map_idx, i].double().T                # (d, r)
                full[:, i * d:(i + 1) * d] += a @ b.T
        b_, t, _ = x.shape
        maps.append((x.double() @ full).view(b_, t, n_heads, d).transpose(1, 2))  # (B, heads, T, d)
    return maps


def shared_diff_reference(m, x: torch.Tensor):
    q1, q2 = low_rank_projection(m.q_proj, x, m.cfg.n_heads, m.cfg)
    k1, k2 = low_rank_projection(m.k_proj, x, m.cfg.kv_heads, m.cfg)
    return two_map(m, x, (q1, q2, k1, k2))


def diff_v2_reference(m, x: torch.Tensor):
    cfg = m.cfg
    h, h_kv = cfg.n_heads, cfg.kv_heads
    q = m.rope.rotate(project(x, m.q_proj, 2 * h))
    k = m.rope.rotate(project(x, m.k_proj, h_kv))
    v = project(x, m.v_proj, h_kv).double()
    b, t = x.shape[:2]
    if cfg.lambda_mode == "none":
        lam = torch.ones(b, t, h, dtype=torch.float64)
    else:
        lam = (x @ m.lambda_proj.weight.T).double()
        lam = torch.sigmoid(lam) if cfg.lambda_mode == "sigmoid" else lam
    pairs = [(2 * p, 2 * p + 1) if cfg.pairing == "same" else (p, p + h) for p in range(h)]
    maps = torch.zeros(b, h, t, t, dtype=torch.float64)
    out = torch.zeros(b, h, t, v.shape[-1], dtype=torch.float64)
    for bi in range(b):
        for p, (i1, i2) in enumerate(pairs):
            g1, g2 = i1 // (2 * h // h_kv), i2 // (2 * h // h_kv)
            a1 = causal_softmax_rows(q[bi, i1], k[bi, g1])
            a2 = causal_softmax_rows(q[bi, i2], k[bi, g2])
            lam_col = lam[bi, :, p].unsqueeze(-1)
            maps[bi, p] = a1 - lam_col * a2
            o = a1 @ v[bi, g1] - lam_col * (a2 @ v[bi, g2])
            out[bi, p] = rmsnorm(o, m.pair_norm.weight) if cfg.pair_norm else o
    return output(out, m.o_proj), maps


def integral_term(a1: torch.Tensor, kind: str) -> torch.Tensor:
    """A3 of one head, row by row: the (soft-maxed) mean of A1's rows 0..n over columns 0..n."""
    t = a1.shape[0]
    a3 = torch.zeros_like(a1)
    for n in range(t):
        g = a1[: n + 1, : n + 1].sum(dim=0) / (n + 1)
        a3[n, : n + 1] = g if kind == "mean" else torch.softmax(g, dim=0)
    return a3


def dint_reference(m, x: torch.Tensor):
    gamma = m.gamma.double() if m.cfg.gamma == "learned" else None  # None: the integral weighs lambda
    return two_map(m, x, plain_qk(m, x), extra_map=lambda a1: integral_term(a1, m.cfg.integral),
                         scale_by_lambda_init=False, extra_weight=gamma)


REFERENCES = {"baseline": baseline_reference, "diff_v1": diff_v1_reference, "shared_diff": shared_diff_reference,
              "diff_v2": diff_v2_reference, "dint": dint_reference, "softmax_sink": softmax_sink_reference,
              "gated": gated_reference, "softpick": softpick_reference, "ssmax": ssmax_reference}

TWO_MAP_CASES = {"": {}, "mha": {"n_kv_heads": None}, "nonorm": {"head_norm": False}}
#: named config overrides per variant that exercise every flag ("" is the variant's defaults)
CASES = {
    "baseline": {"": {}, "mha": {"n_kv_heads": None}, "tied": {"tie_embeddings": True}},
    "softmax_sink": {"": {}, "mha": {"n_kv_heads": None}, "learned": {"sink": "learned"},
                     "learned-mha": {"sink": "learned", "n_kv_heads": None}},
    "gated": {"": {}, "mha": {"n_kv_heads": None}, "headwise": {"gate": "headwise"},
              "headwise-mha": {"gate": "headwise", "n_kv_heads": None}},
    "softpick": {"": {}, "mha": {"n_kv_heads": None}},
    "ssmax": {"": {}, "mha": {"n_kv_heads": None}, "init0.43": {"ssmax_init": 0.43},
              "init2-mha": {"ssmax_init": 2.0, "n_kv_heads": None}},
    "diff_v1": {**TWO_MAP_CASES, "lam0.5": {"lambda_init": 0.5}, "lam0.8": {"lambda_init": 0.8}},
    "diff_v2": {"": {}, "mha": {"n_kv_heads": None}, "cross": {"pairing": "cross"}, "none": {"lambda_mode": "none"},
               "raw": {"lambda_mode": "raw"}, "cross-raw": {"pairing": "cross", "lambda_mode": "raw"},
               "pair-norm": {"pair_norm": True}, "pair-norm-cross": {"pair_norm": True, "pairing": "cross"},
               "normal-init": {"lambda_proj_init": "normal"}},
    "shared_diff": {**TWO_MAP_CASES, "heads": {"base_sharing": "heads"}, "rank4": {"rank": 4},
               "head": {"lowrank_scope": "head"}, "head-mha": {"lowrank_scope": "head", "n_kv_heads": None},
               "layer-heads-rank2-lam0.5": {"lowrank_scope": "layer", "base_sharing": "heads", "rank": 2,
                                            "lambda_init": 0.5},
               "head-heads-rank2-lam0.5": {"lowrank_scope": "head", "base_sharing": "heads", "rank": 2,
                                           "lambda_init": 0.5}},
    "dint": {**TWO_MAP_CASES, "mean": {"integral": "mean"},
               "mean-nonorm-lam0.5": {"integral": "mean", "head_norm": False, "lambda_init": 0.5},
               "learned": {"gamma": "learned"},
               "learned-init0.9": {"gamma": "learned", "gamma_init": 0.9},
               "learned-mean-init0.9": {"gamma": "learned", "gamma_init": 0.9, "integral": "mean"}},
}


def reference_attention(m, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Output (B, T, d_model) and effective maps (B, h, T, T) of attention module m on input x."""
    return REFERENCES[m.cfg.attention](m, x)

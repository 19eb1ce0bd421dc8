"""Naive reference implementations of every variant, written from variants.md with explicit loops.

They read a module's weights but none of its code paths (only RoPE is shared), so a test that
compares a module against them checks the math, not the implementation against itself.
"""

from __future__ import annotations

import math

import torch


def naive_causal_softmax(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q, k: (T, d) -> A (T, T), row by row."""
    t, d = q.shape
    a = torch.zeros(t, t, dtype=torch.float64)
    for n in range(t):
        scores = (k[: n + 1].double() @ q[n].double()) / math.sqrt(d)
        a[n, : n + 1] = torch.softmax(scores, dim=0)
    return a


def naive_integral(a1: torch.Tensor, integral: str) -> torch.Tensor:
    t = a1.shape[0]
    a3 = torch.zeros_like(a1)
    for n in range(t):
        g = a1[: n + 1, : n + 1].sum(dim=0) / (n + 1)  # columns j <= n of the cumulative mean
        a3[n, : n + 1] = g if integral == "mean" else torch.softmax(g, dim=0)
    return a3


def naive_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def _heads(t: torch.Tensor, n: int) -> torch.Tensor:
    b, tt, _ = t.shape
    return t.view(b, tt, n, -1).transpose(1, 2)


def reference_attention(m, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Output (B, T, d_model) and effective maps (B, h, T, T) of attention module m on input x."""
    cfg = m.cfg
    h, h_kv, d = cfg.n_heads, cfg.kv_heads, cfg.resolved_head_dim
    b, t, _ = x.shape
    rope = m.rope.rotate
    maps = torch.zeros(b, h, t, t, dtype=torch.float64)

    if cfg.attention == "baseline":
        q = rope(_heads(x @ m.q_proj.weight.T, h))
        k = rope(_heads(x @ m.k_proj.weight.T, h_kv))
        v = _heads(x @ m.v_proj.weight.T, h_kv).double()
        out = torch.zeros(b, h, t, d, dtype=torch.float64)
        for bi in range(b):
            for i in range(h):
                g = i // (h // h_kv)
                a = naive_causal_softmax(q[bi, i], k[bi, g])
                maps[bi, i] = a
                out[bi, i] = a @ v[bi, g]

    elif cfg.attention == "diff_v2":
        q = rope(_heads(x @ m.q_proj.weight.T, 2 * h))
        k = rope(_heads(x @ m.k_proj.weight.T, h_kv))
        v = _heads(x @ m.v_proj.weight.T, h_kv).double()
        if cfg.lambda_mode == "none":
            lam = torch.ones(b, t, h, dtype=torch.float64)
        else:
            lam = (x @ m.lambda_proj.weight.T).double()
            lam = torch.sigmoid(lam) if cfg.lambda_mode == "sigmoid" else lam
        pairs = [(2 * p, 2 * p + 1) if cfg.pairing == "same" else (p, p + h) for p in range(h)]
        out = torch.zeros(b, h, t, d, dtype=torch.float64)
        for bi in range(b):
            for p, (i1, i2) in enumerate(pairs):
                g1, g2 = i1 // (2 * h // h_kv), i2 // (2 * h // h_kv)
                a1 = naive_causal_softmax(q[bi, i1], k[bi, g1])
                a2 = naive_causal_softmax(q[bi, i2], k[bi, g2])
                lam_col = lam[bi, :, p].unsqueeze(-1)
                maps[bi, p] = a1 - lam_col * a2
                out[bi, p] = a1 @ v[bi, g1] - lam_col * (a2 @ v[bi, g2])

    else:  # the two-map family: diff_v1, shared_diff, dint
        lam_init = (0.8 - 0.6 * math.exp(-0.3 * m.layer_idx)) if cfg.lambda_init == "depth" \
            else float(cfg.lambda_init)
        lp = m.lambda_
        lam = (torch.exp((lp.lambda_q1 * lp.lambda_k1).sum()) - torch.exp((lp.lambda_q2 * lp.lambda_k2).sum())
               + lam_init).double()
        if cfg.attention == "shared_diff":
            q1, q2 = _shared_projection(m.q_proj, x, h, d, cfg)
            k1, k2 = _shared_projection(m.k_proj, x, h_kv, d, cfg)
        else:
            q = _heads(x @ m.q_proj.weight.T, 2 * h)
            k = _heads(x @ m.k_proj.weight.T, 2 * h_kv)
            q1, q2, k1, k2 = q[:, 0::2], q[:, 1::2], k[:, 0::2], k[:, 1::2]
        q1, q2, k1, k2 = rope(q1), rope(q2), rope(k1), rope(k2)
        v = _heads(x @ m.v_proj.weight.T, h_kv).double()  # 2d wide
        out = torch.zeros(b, h, t, 2 * d, dtype=torch.float64)
        for bi in range(b):
            for p in range(h):
                g = p // (h // h_kv)
                a1 = naive_causal_softmax(q1[bi, p], k1[bi, g])
                a2 = naive_causal_softmax(q2[bi, p], k2[bi, g])
                final = a1 - lam * a2
                if cfg.attention == "dint":
                    final = final + lam * naive_integral(a1, cfg.integral)
                maps[bi, p] = final
                o = final @ v[bi, g]
                if cfg.head_norm:
                    o = naive_rmsnorm(o, m.head_norm.weight)
                if cfg.attention != "dint":
                    o = o * (1 - lam_init)
                out[bi, p] = o

    merged = out.transpose(1, 2).reshape(b, t, -1)
    return merged @ m.o_proj.weight.double().T, maps


def _shared_projection(proj, x, n_heads, d, cfg):
    """W_{map, head} = W_base(head) + A_{map, head} B_{map, head}^T, formed as full matrices."""
    r = cfg.rank
    b, t, _ = x.shape
    maps = []
    for map_idx in range(2):
        per_head = []
        for i in range(n_heads):
            base_rows = slice(0, d) if cfg.base_sharing == "heads" else slice(i * d, (i + 1) * d)
            w_base = proj.base.weight[base_rows].T  # (d_model, d)
            a = proj.down.weight[(map_idx * n_heads + i) * r:(map_idx * n_heads + i + 1) * r].T
            w = w_base + a @ proj.up[map_idx, i]
            per_head.append(x @ w)
        maps.append(torch.stack(per_head, dim=1))  # (B, heads, T, d)
    return maps[0], maps[1]

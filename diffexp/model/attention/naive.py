"""Naive building blocks of the variants' reference implementations: explicit loops, float64.

The references read a module's weights but none of its code paths (only RoPE is shared), so a test
that compares a module with its reference checks the math, not the implementation against itself.
"""

from __future__ import annotations

import math

import torch


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

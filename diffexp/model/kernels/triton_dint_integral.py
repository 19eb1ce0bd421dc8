"""DINT's integral term A3 V in Triton with running column sums, forward and backward (O(T) memory).

    A1 = softmax(Q K^T / sqrt(d))  (causal)      G[n, j] = (1/n) sum_{m<=n} A1[m, j]   (n 1-based)
    A3[n, j] = exp(G[n, j]) / Z_n  for j <= n    out = A3 V

The column sums of A1 run down the rows, so each program owns one key (column) block and walks the
query blocks below it, carrying the sums of its columns as one vector: forward A1's rows come from
the row log-sum-exp of the differential kernel (triton_diff_attention), G lies in [0, 1] so exp(G)
needs no max, and each program adds its columns' share of Z_n and exp(G) V to the rows (atomics).

Backward (the math of dint_integral.py): dG = A3 (dA3 - rowsum(A3 dA3)), dA1[m, :] = sum_{n>=m} dG[n, :] / n
and dS = A1 (dA1 - rowsum(A1 dA1)). Each program walks its column block upwards, peeling the prefix
column sums off the saved totals and carrying the reverse sum of dG / n. The first pass gives dV and
rowsum(A1 dA1) (a sum over every column block, so added atomically), the second dS and from it dK
(its own columns) and dQ (atomics). Atomics make GPU sums order-dependent at the last bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from diffexp.model.kernels.tiles import (
    Launch,
    check_blocks,
    check_device,
    default_blocks,
    last_dim_contiguous,
    load_rows,
    probabilities,
    store_rows,
)


@triton.jit
def _integral_fwd(Q, K, V, LSE, Z, NUMER, COLSUM,
                  sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t,
                  H, GROUP, T, D, DV, SCALE,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                  PREC: tl.constexpr, ACC: tl.constexpr):
    scale = tl.load(SCALE)  # 1/sqrt(d) at the accumulators' precision (a Python float arrives as fp32)
    pid_n, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    kvh = h // GROUP
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_d, cols_v = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    k = load_rows(K + b * sk_b + kvh * sk_h, cols, cols_d, sk_t, T, D)
    v = load_rows(V + b * sv_b + kvh * sv_h, cols, cols_v, sv_t, T, DV)
    sums = tl.zeros((BLOCK_N,), ACC)  # column sums of the A1 rows above the current query block
    for start_m in range((pid_n * BLOCK_N // BLOCK_M) * BLOCK_M, T, BLOCK_M):
        rows = start_m + tl.arange(0, BLOCK_M)
        in_seq = rows < T
        q = load_rows(Q + b * sq_b + h * sq_h, rows, cols_d, sq_t, T, D)
        a1 = probabilities(q, k, tl.load(LSE + bh * T + rows, mask=in_seq, other=0.0), rows, cols, T, scale, PREC)
        n = (rows + 1).to(ACC)
        g = (sums[None, :] + tl.cumsum(a1, 0)) / n[:, None]
        numer = tl.where((cols[None, :] <= rows[:, None]) & in_seq[:, None], tl.exp(g), 0.0)
        tl.atomic_add(Z + bh * T + rows, tl.sum(numer, 1), mask=in_seq)
        part = tl.dot(numer.to(v.dtype), v, input_precision=PREC)
        tl.atomic_add(NUMER + bh * T * DV + rows[:, None] * DV + cols_v[None, :], part,
                      mask=in_seq[:, None] & (cols_v[None, :] < DV))
        sums += tl.sum(a1, 0)
    tl.store(COLSUM + bh * T + cols, sums, mask=cols < T)


@triton.jit
def _backward_step(q, k, v, do, lse, z, delta, rows, cols, prefix, carried, T, scale, PREC: tl.constexpr):
    """One query block of the upward walk: A1, A3 and dA1 of the tile, and the walk's state moved past it."""
    a1 = probabilities(q, k, lse, rows, cols, T, scale, PREC)
    prefix -= tl.sum(a1, 0)  # now the sums of the rows above the block
    n = (rows + 1).to(prefix.dtype)
    g = (prefix[None, :] + tl.cumsum(a1, 0)) / n[:, None]
    valid = (cols[None, :] <= rows[:, None]) & (rows[:, None] < T)
    a3 = tl.where(valid, tl.exp(g) / z[:, None], 0.0)
    da3 = tl.dot(do, tl.trans(v), input_precision=PREC)
    scaled = a3 * (da3 - delta[:, None]) / n[:, None]  # dG / n
    da1 = tl.cumsum(scaled, 0, reverse=True) + carried[None, :]
    carried += tl.sum(scaled, 0)
    return a1, a3, da1, prefix, carried


@triton.jit
def _integral_bwd(Q, K, V, DO, LSE, Z, DELTA, COLSUM, ROWDOT, DQ, DK, DVV,
                  sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t,
                  H, HK, GROUP, T, D, DV, SCALE,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                  SCORES: tl.constexpr, PREC: tl.constexpr, ACC: tl.constexpr):
    """SCORES false: dV and ROWDOT = rowsum(A1 dA1); true: dK and dQ from dS = A1 (dA1 - ROWDOT).
    One program per (key block, kv head), summing over the query heads of its GQA group."""
    scale = tl.load(SCALE)  # 1/sqrt(d) at the accumulators' precision (a Python float arrives as fp32)
    pid_n, bkv = tl.program_id(0), tl.program_id(1)
    b, kvh = bkv // HK, bkv % HK
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_d, cols_v = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    k = load_rows(K + b * sk_b + kvh * sk_h, cols, cols_d, sk_t, T, D)
    v = load_rows(V + b * sv_b + kvh * sv_h, cols, cols_v, sv_t, T, DV)
    dk = tl.zeros((BLOCK_N, BLOCK_D), ACC)
    dv = tl.zeros((BLOCK_N, BLOCK_DV), ACC)
    first_block = pid_n * BLOCK_N // BLOCK_M
    last_block = tl.cdiv(T, BLOCK_M) - 1
    for g in range(0, GROUP):
        h = kvh * GROUP + g
        bh = b * H + h
        prefix = tl.load(COLSUM + bh * T + cols, mask=cols < T, other=0.0)
        carried = tl.zeros((BLOCK_N,), ACC)
        for step in range(0, last_block - first_block + 1):
            rows = (last_block - step) * BLOCK_M + tl.arange(0, BLOCK_M)
            in_seq = rows < T
            q = load_rows(Q + b * sq_b + h * sq_h, rows, cols_d, sq_t, T, D)
            do = load_rows(DO + bh * T * DV, rows, cols_v, DV, T, DV)
            lse = tl.load(LSE + bh * T + rows, mask=in_seq, other=0.0)
            z = tl.load(Z + bh * T + rows, mask=in_seq, other=1.0)
            delta = tl.load(DELTA + bh * T + rows, mask=in_seq, other=0.0)
            a1, a3, da1, prefix, carried = _backward_step(q, k, v, do, lse, z, delta, rows, cols, prefix, carried,
                                                          T, scale, PREC)
            if SCORES:
                ds = a1 * (da1 - tl.load(ROWDOT + bh * T + rows, mask=in_seq, other=0.0)[:, None])
                dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=PREC)
                dq = tl.dot(ds.to(k.dtype), k, input_precision=PREC) * scale
                tl.atomic_add(DQ + bh * T * D + rows[:, None] * D + cols_d[None, :], dq,
                              mask=in_seq[:, None] & (cols_d[None, :] < D))
            else:
                dv += tl.dot(tl.trans(a3).to(do.dtype), do, input_precision=PREC)
                tl.atomic_add(ROWDOT + bh * T + rows, tl.sum(a1 * da1, 1), mask=in_seq)
    if SCORES:
        store_rows(DK + bkv * T * D, cols, cols_d, D, T, D, dk * scale)
    else:
        store_rows(DVV + bkv * T * DV, cols, cols_v, DV, T, DV, dv)


class StreamingIntegralKernel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, lse, block_m, block_n):
        run = Launch(q, k, v, block_m, block_n)
        z = torch.zeros(run.b, run.h, run.t, device=q.device, dtype=run.acc)
        numer = torch.zeros(run.b, run.h, run.t, run.dv, device=q.device, dtype=run.acc)
        col_sums = torch.empty_like(z)
        lse = lse.to(run.acc).contiguous()
        _integral_fwd[(triton.cdiv(run.t, block_n), run.b * run.h)](
            q, k, v, lse, z, numer, col_sums, *run.strides, run.h, run.group, run.t, run.d, run.dv, run.scale,
            **run.sizes)
        out = numer / z.unsqueeze(-1)
        ctx.run = run
        ctx.save_for_backward(q, k, v, lse, z, col_sums, out)
        return out.to(v.dtype)

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, lse, z, col_sums, out = ctx.saved_tensors
        run = ctx.run
        d_out = d_out.contiguous()
        delta = (d_out.to(run.acc) * out).sum(-1)  # rowsum(A3 dA3) = dO . out per row
        row_dot = torch.zeros_like(z)
        dq = torch.zeros(run.b, run.h, run.t, run.d, device=q.device, dtype=run.acc)
        dk = torch.empty(run.b, run.hk, run.t, run.d, device=k.device, dtype=k.dtype)
        dv = torch.empty(run.b, run.hk, run.t, run.dv, device=v.device, dtype=v.dtype)
        grid = (triton.cdiv(run.t, run.block_n), run.b * run.hk)
        for scores in (False, True):  # the second pass needs every column block's row_dot
            _integral_bwd[grid](q, k, v, d_out, lse, z, delta, col_sums, row_dot, dq, dk, dv, *run.strides,
                                run.h, run.hk, run.group, run.t, run.d, run.dv, run.scale, SCORES=scores,
                                **run.sizes)
        return dq.to(q.dtype), dk, dv, None, None, None


def dint_integral(q, k, v, lse, block_m: int | None = None, block_n: int | None = None) -> torch.Tensor:
    """A3 V of DINT's "softmax" integral, causal. q: (B, H, T, d); k: (B, Hk, T, d); v: (B, Hk, T, dv) (GQA:
    query head h reads kv head h // (H / Hk)); lse: A1's row log-sum-exp (B, H, T), as differential_attention
    returns it. lse is taken as given: the gradient reaches q and k through the full softmax Jacobian."""
    (q, k, v) = last_dim_contiguous(q, k, v)
    default_m, default_n = default_blocks(q.shape[-1], v.shape[-1])
    block_m, block_n = block_m or default_m, block_n or default_n
    check_blocks(block_m, block_n)
    check_device(q)
    return StreamingIntegralKernel.apply(q, k, v, lse.detach(), block_m, block_n)

"""Fused differential attention in Triton: out = A1 V - lambda A2 V in one pass, forward and backward.

    A_i = softmax(Q_i K_i^T / sqrt(d) + causal mask)     (i = 1, 2; query head h reads kv head h // group)

Flash-attention style: each query block streams over its key blocks once, loading K1, K2 and V once
for both maps and keeping an online softmax (running max and sum) per map. The output is
combined in the kernel; A1 V and A2 V are written as well when a backward will need them (their
row dot products with dO give the softmax gradients and lambda's), and A1's row log-sum-exp is
returned for DINT's integral (diffexp/kernels/triton_dint.py). The per-head norm stays outside.

Backward: one kernel per key block for dK1, dK2, dV (looping over the query heads of its GQA
group, so no atomics), one per query block for dQ1, dQ2. Both maps share dP = dO V^T: map 2's
output gradient is -lambda dO. A gradient reaching A1 V directly (DINT's "mean" integral reads it)
adds to map 1's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from diffexp.model.kernels.tiles import (
    Launch,
    accumulator_dtype,
    check_blocks,
    check_device,
    default_blocks,
    last_dim_contiguous,
    load_rows,
    probabilities,
    same_strides,
    store_rows,
)


@triton.jit
def _query_block(V, sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, H, GROUP, BLOCK_M: tl.constexpr):
    """This program's query block, (batch, head) index, query head and rows, and the offsets of its Q rows, K head
    and V head (GQA: query head h reads kv head h // GROUP)."""
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    kvh = h // GROUP
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    return pid_m, bh, h, rows, b * sq_b + h * sq_h, b * sk_b + kvh * sk_h, V + b * sv_b + kvh * sv_h


@triton.jit
def _diff_fwd(Q1, Q2, K1, K2, V, LAM, O, O1, O2, LSE1, LSE2,
              sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t,
              H, GROUP, T, D, DV, SCALE,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
              STORE_PARTS: tl.constexpr, PREC: tl.constexpr, ACC: tl.constexpr):
    scale = tl.load(SCALE)  # 1/sqrt(d) at the accumulators' precision (a Python float arrives as fp32)
    pid_m, bh, h, rows, q_base, k_off, v_base = _query_block(V, sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, H, GROUP,
                                                             BLOCK_M)
    cols_d, cols_v = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    q1 = load_rows(Q1 + q_base, rows, cols_d, sq_t, T, D)
    q2 = load_rows(Q2 + q_base, rows, cols_d, sq_t, T, D)
    m1 = tl.full((BLOCK_M,), float("-inf"), ACC)
    m2 = tl.full((BLOCK_M,), float("-inf"), ACC)
    l1 = tl.zeros((BLOCK_M,), ACC)
    l2 = tl.zeros((BLOCK_M,), ACC)
    acc1 = tl.zeros((BLOCK_M, BLOCK_DV), ACC)
    acc2 = tl.zeros((BLOCK_M, BLOCK_DV), ACC)
    for start_n in range(0, tl.minimum((pid_m + 1) * BLOCK_M, T), BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        k1 = load_rows(K1 + k_off, keys, cols_d, sk_t, T, D)
        k2 = load_rows(K2 + k_off, keys, cols_d, sk_t, T, D)
        v = load_rows(v_base, keys, cols_v, sv_t, T, DV)  # once, for both maps
        future = keys[None, :] > rows[:, None]
        s1 = tl.where(future, float("-inf"), tl.dot(q1, tl.trans(k1), input_precision=PREC) * scale)
        s2 = tl.where(future, float("-inf"), tl.dot(q2, tl.trans(k2), input_precision=PREC) * scale)
        new1, new2 = tl.maximum(m1, tl.max(s1, 1)), tl.maximum(m2, tl.max(s2, 1))
        p1, p2 = tl.exp(s1 - new1[:, None]), tl.exp(s2 - new2[:, None])
        keep1, keep2 = tl.exp(m1 - new1), tl.exp(m2 - new2)
        l1 = l1 * keep1 + tl.sum(p1, 1)
        l2 = l2 * keep2 + tl.sum(p2, 1)
        acc1 = acc1 * keep1[:, None] + tl.dot(p1.to(v.dtype), v, input_precision=PREC)
        acc2 = acc2 * keep2[:, None] + tl.dot(p2.to(v.dtype), v, input_precision=PREC)
        m1, m2 = new1, new2
    out1, out2 = acc1 / l1[:, None], acc2 / l2[:, None]
    lam = tl.load(LAM + h)
    o_base = bh * T * DV
    store_rows(O + o_base, rows, cols_v, DV, T, DV, out1 - lam * out2)
    tl.store(LSE1 + bh * T + rows, m1 + tl.log(l1), mask=rows < T)
    if STORE_PARTS:
        store_rows(O1 + o_base, rows, cols_v, DV, T, DV, out1)
        store_rows(O2 + o_base, rows, cols_v, DV, T, DV, out2)
        tl.store(LSE2 + bh * T + rows, m2 + tl.log(l2), mask=rows < T)


@triton.jit
def _diff_bwd_kv(Q1, Q2, K1, K2, V, LAM, DO, DO1, LSE1, LSE2, DELTA1, DELTA2, DK1, DK2, DVV,
                 sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t,
                 H, HK, GROUP, T, D, DV, SCALE,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                 HAS_DO1: tl.constexpr, PREC: tl.constexpr, ACC: tl.constexpr):
    """dK1, dK2, dV of one key block of kv head kvh, summed over the query heads of its group."""
    scale = tl.load(SCALE)  # 1/sqrt(d) at the accumulators' precision (a Python float arrives as fp32)
    pid_n, bkv = tl.program_id(0), tl.program_id(1)
    b, kvh = bkv // HK, bkv % HK
    keys = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_d, cols_v = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    k_off = b * sk_b + kvh * sk_h
    k1 = load_rows(K1 + k_off, keys, cols_d, sk_t, T, D)
    k2 = load_rows(K2 + k_off, keys, cols_d, sk_t, T, D)
    v = load_rows(V + b * sv_b + kvh * sv_h, keys, cols_v, sv_t, T, DV)
    dk1 = tl.zeros((BLOCK_N, BLOCK_D), ACC)
    dk2 = tl.zeros((BLOCK_N, BLOCK_D), ACC)
    dv = tl.zeros((BLOCK_N, BLOCK_DV), ACC)
    first_row = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M  # rows above the block see none of its keys
    for g in range(0, GROUP):
        h = kvh * GROUP + g
        bh = b * H + h
        lam = tl.load(LAM + h)
        q_base = b * sq_b + h * sq_h
        for start_m in range(first_row, T, BLOCK_M):
            rows = start_m + tl.arange(0, BLOCK_M)
            in_seq = rows < T
            q1 = load_rows(Q1 + q_base, rows, cols_d, sq_t, T, D)
            q2 = load_rows(Q2 + q_base, rows, cols_d, sq_t, T, D)
            do = load_rows(DO + bh * T * DV, rows, cols_v, DV, T, DV)
            p1 = probabilities(q1, k1, tl.load(LSE1 + bh * T + rows, mask=in_seq, other=0.0), rows, keys, T,
                               scale, PREC)
            p2 = probabilities(q2, k2, tl.load(LSE2 + bh * T + rows, mask=in_seq, other=0.0), rows, keys, T,
                               scale, PREC)
            dp = tl.dot(do, tl.trans(v), input_precision=PREC)  # map 2's is -lambda dp
            dv += tl.dot(tl.trans(p1 - lam * p2).to(do.dtype), do, input_precision=PREC)
            dp1 = dp
            if HAS_DO1:
                do1 = load_rows(DO1 + bh * T * DV, rows, cols_v, DV, T, DV)
                dp1 += tl.dot(do1, tl.trans(v), input_precision=PREC)
                dv += tl.dot(tl.trans(p1).to(do1.dtype), do1, input_precision=PREC)
            delta1 = tl.load(DELTA1 + bh * T + rows, mask=in_seq, other=0.0)
            delta2 = tl.load(DELTA2 + bh * T + rows, mask=in_seq, other=0.0)
            ds1 = p1 * (dp1 - delta1[:, None])
            ds2 = p2 * (-lam * dp - delta2[:, None])
            dk1 += tl.dot(tl.trans(ds1).to(q1.dtype), q1, input_precision=PREC)
            dk2 += tl.dot(tl.trans(ds2).to(q2.dtype), q2, input_precision=PREC)
    out = bkv * T * D
    store_rows(DK1 + out, keys, cols_d, D, T, D, dk1 * scale)
    store_rows(DK2 + out, keys, cols_d, D, T, D, dk2 * scale)
    store_rows(DVV + bkv * T * DV, keys, cols_v, DV, T, DV, dv)


@triton.jit
def _diff_bwd_q(Q1, Q2, K1, K2, V, LAM, DO, DO1, LSE1, LSE2, DELTA1, DELTA2, DQ1, DQ2,
                sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t,
                H, GROUP, T, D, DV, SCALE,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                HAS_DO1: tl.constexpr, PREC: tl.constexpr, ACC: tl.constexpr):
    scale = tl.load(SCALE)  # 1/sqrt(d) at the accumulators' precision (a Python float arrives as fp32)
    pid_m, bh, h, rows, q_base, k_off, v_base = _query_block(V, sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, H, GROUP,
                                                             BLOCK_M)
    in_seq = rows < T
    cols_d, cols_v = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    q1 = load_rows(Q1 + q_base, rows, cols_d, sq_t, T, D)
    q2 = load_rows(Q2 + q_base, rows, cols_d, sq_t, T, D)
    do = load_rows(DO + bh * T * DV, rows, cols_v, DV, T, DV)
    if HAS_DO1:
        do1 = load_rows(DO1 + bh * T * DV, rows, cols_v, DV, T, DV)
    lse1 = tl.load(LSE1 + bh * T + rows, mask=in_seq, other=0.0)
    lse2 = tl.load(LSE2 + bh * T + rows, mask=in_seq, other=0.0)
    delta1 = tl.load(DELTA1 + bh * T + rows, mask=in_seq, other=0.0)
    delta2 = tl.load(DELTA2 + bh * T + rows, mask=in_seq, other=0.0)
    lam = tl.load(LAM + h)
    dq1 = tl.zeros((BLOCK_M, BLOCK_D), ACC)
    dq2 = tl.zeros((BLOCK_M, BLOCK_D), ACC)
    for start_n in range(0, tl.minimum((pid_m + 1) * BLOCK_M, T), BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        k1 = load_rows(K1 + k_off, keys, cols_d, sk_t, T, D)
        k2 = load_rows(K2 + k_off, keys, cols_d, sk_t, T, D)
        v = load_rows(v_base, keys, cols_v, sv_t, T, DV)
        p1 = probabilities(q1, k1, lse1, rows, keys, T, scale, PREC)
        p2 = probabilities(q2, k2, lse2, rows, keys, T, scale, PREC)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        dp1 = dp
        if HAS_DO1:
            dp1 += tl.dot(do1, tl.trans(v), input_precision=PREC)
        ds1 = p1 * (dp1 - delta1[:, None])
        ds2 = p2 * (-lam * dp - delta2[:, None])
        dq1 += tl.dot(ds1.to(k1.dtype), k1, input_precision=PREC)
        dq2 += tl.dot(ds2.to(k2.dtype), k2, input_precision=PREC)
    out = bh * T * D
    store_rows(DQ1 + out, rows, cols_d, D, T, D, dq1 * scale)
    store_rows(DQ2 + out, rows, cols_d, D, T, D, dq2 * scale)


class FusedDifferentialAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q1, q2, k1, k2, v, lam, block_m, block_n, want_out1):
        run = Launch(q1, k1, v, block_m, block_n)
        parts = want_out1 or any(ctx.needs_input_grad[:6])
        out = v.new_empty(run.b, run.h, run.t, run.dv)
        out1, out2 = (torch.empty_like(out) for _ in range(2)) if parts else (out, out)
        lse1, lse2 = (torch.empty(run.b, run.h, run.t, device=q1.device, dtype=run.acc) for _ in range(2))
        _diff_fwd[run.rows_grid(block_m)](
            q1, q2, k1, k2, v, lam, out, out1, out2, lse1, lse2, *run.strides, run.h, run.group, run.t, run.d, run.dv,
            run.scale, STORE_PARTS=parts, **run.sizes)
        ctx.run = run
        ctx.save_for_backward(q1, q2, k1, k2, v, lam, out1, out2, lse1, lse2)
        ctx.mark_non_differentiable(lse1)
        ctx.set_materialize_grads(False)
        return out, (out1 if parts else None), lse1

    @staticmethod
    def backward(ctx, d_out, d_out1, _d_lse1):
        q1, q2, k1, k2, v, lam, out1, out2, lse1, lse2 = ctx.saved_tensors
        run = ctx.run
        d_out = torch.zeros_like(out1) if d_out is None else d_out.contiguous()
        has_do1 = d_out1 is not None
        d_map1 = d_out + d_out1 if has_do1 else d_out
        d_out1 = d_out1.contiguous() if has_do1 else d_out
        # softmax row terms delta_i = rowsum(dO_i * O_i) per map, map 2's dO being -lambda dO
        r2 = (d_out.to(run.acc) * out2.to(run.acc)).sum(-1)
        delta1 = (d_map1.to(run.acc) * out1.to(run.acc)).sum(-1)
        delta2 = -lam.view(1, -1, 1) * r2
        d_lam = -r2.sum(dim=(0, 2))
        dq1, dq2 = torch.empty_like(q1, memory_format=torch.contiguous_format), torch.empty_like(
            q2, memory_format=torch.contiguous_format)
        dk1, dk2 = (torch.empty(run.b, run.hk, run.t, run.d, device=k1.device, dtype=k1.dtype) for _ in range(2))
        dv = torch.empty(run.b, run.hk, run.t, run.dv, device=v.device, dtype=v.dtype)
        common = (q1, q2, k1, k2, v, lam, d_out, d_out1, lse1, lse2, delta1, delta2)
        _diff_bwd_kv[(triton.cdiv(run.t, run.block_n), run.b * run.hk)](
            *common, dk1, dk2, dv, *run.strides, run.h, run.hk, run.group, run.t, run.d, run.dv, run.scale,
            HAS_DO1=has_do1, **run.sizes)
        _diff_bwd_q[run.rows_grid(run.block_m)](
            *common, dq1, dq2, *run.strides, run.h, run.group, run.t, run.d, run.dv, run.scale,
            HAS_DO1=has_do1, **run.sizes)
        return dq1, dq2, dk1, dk2, dv, d_lam.to(lam.dtype), None, None, None


def differential_attention(q1, q2, k1, k2, v, lam, want_out1: bool = False, block_m: int | None = None,
                           block_n: int | None = None):
    """Causal (A1 - lambda A2) V. q1, q2: (B, H, T, d); k1, k2: (B, Hk, T, d); v: (B, Hk, T, dv), any dv
    (DIFF V1's is 2d); lam: broadcastable to (H,), one lambda per query head, differentiable. The scale is
    1/sqrt(d). Returns (out (B, H, T, dv), A1 V or None, A1's row log-sum-exp (B, H, T) in fp32); A1 V
    (differentiable) only when `want_out1`. The log-sum-exp carries no gradient of its own: a consumer
    (DINT's integral) sends its gradient through q1 and k1 itself."""
    b, h, t, d = q1.shape
    if k1.shape[1] == 0 or h % k1.shape[1]:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({k1.shape[1]})")
    q1, q2 = same_strides(*last_dim_contiguous(q1, q2))
    k1, k2 = same_strides(*last_dim_contiguous(k1, k2))
    (v,) = last_dim_contiguous(v)
    lam = torch.as_tensor(lam, device=q1.device).to(accumulator_dtype(q1.dtype)).broadcast_to((h,)).contiguous()
    default_m, default_n = default_blocks(d, v.shape[-1])
    block_m, block_n = block_m or default_m, block_n or default_n
    check_blocks(block_m, block_n)
    check_device(q1)
    return FusedDifferentialAttention.apply(q1, q2, k1, k2, v, lam, block_m, block_n, want_out1)


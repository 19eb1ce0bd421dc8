"""DINT's integral term A3 V in Triton without atomics, forward and backward; map 1's LSE from flex_attention.

    A1 = causal softmax(scale Q K^T)           G[n, j] = (1/(n+1)) sum_{r<=n} A1[r, j]   (n 0-based)
    A3[n, j] = exp(G[n, j]) / Z_n for j <= n   Z_n = sum_{j<=n} exp(G[n, j])   out = A3 V

A1's rows come from map 1's row log-sum-exp (lse1), so no pass needs a running max; G lies in [0, 1], so
exp(G) needs none either. Every tile below is (query block m) x (key block c), and every output element is
written by exactly one program that sums its own terms in a fixed order: no atomics, the same bits on every run.

Forward, two launches:
  1. column prefix: one program per key block c walks the query blocks downwards, adding A1's column sums,
     and stores the sums of the rows above each query block: PREFIX[m, c's columns] (a scan over blocks).
  2. rows: one program per query block m walks its key blocks; G = (PREFIX[m] + cumsum of the tile's A1 over
     its rows) / (n+1), and the program sums Z and exp(G) V for its own rows, flash-style.
Backward (dO given; delta_n = rowsum(A3 dA3) = dO . out per row, dA3 = dO V^T):
  dG = A3 (dA3 - delta),  dA1[r, j] = sum_{n>=r} dG[n, j] / (n+1),  dS = A1 (dA1 - rowsum(A1 dA1))
  A. one program per (key block, kv head) walks upwards carrying the reverse sum of dG / (n+1) over rows:
     stores it as CARRY[m, columns] at each block, gives dV, and each row's share of rowsum(A1 dA1) from
     its columns (ROWPART[c, rows]; summed over c in PyTorch, a fixed-order reduction);
  B. one program per query block: dA1 = reverse cumsum in the tile + CARRY[m], dS, dQ = scale dS K;
  C. one program per (key block, kv head): the same dS, dK = scale dS^T Q over the heads of its GQA group.
Memory: PREFIX (saved for backward), CARRY and ROWPART hold T * T / block floats per head (1/64 of the map at
the default blocks); nothing holds T x T.
Offsets: a program's (batch, head) offsets are 64-bit (program id 1 widened to int64), so tensors past 2^31
elements are addressed right. A row's offset inside one sequence (T times the row stride of q1, k1 or v) stays
32-bit: it passes 2^31 only past T ~ 400K at the widest recipe's rows (2 maps x 20 heads x 128), where the
T * T / block scratch of the heads is far beyond any GPU's memory.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

from diffexp.kernels.dint_tiles import tile_width, tiles


# -- tiles --------------------------------------------------------------------------------------------------------
@triton.jit
def _load(base, rows, cols, stride_t, n_rows, width):
    """The (rows, cols) tile of one head, zero outside the sequence and the width."""
    mask = (rows[:, None] < n_rows) & (cols[None, :] < width)
    return tl.load(base + rows[:, None] * stride_t + cols[None, :], mask=mask, other=0.0)


@triton.jit
def _store(base, rows, cols, stride_t, n_rows, width, value):
    mask = (rows[:, None] < n_rows) & (cols[None, :] < width)
    tl.store(base + rows[:, None] * stride_t + cols[None, :], value.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _a1(q, k, lse, rows, cols, T, scale, PREC: tl.constexpr):
    """A1's tile from its rows' log-sum-exp, zero above the diagonal and past the end; and where it is causal."""
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
    valid = (cols[None, :] <= rows[:, None]) & (rows[:, None] < T)
    return tl.where(valid, tl.exp(s - lse[:, None]), 0.0), valid


@triton.jit
def _a3_and_dg(a1, valid, prefix, z, rows, do, v, delta, PREC: tl.constexpr):
    """A3's tile (G from the column sums above the block plus the tile's own running sum) and dG / (n+1)."""
    n = (rows + 1).to(prefix.dtype)
    g = (prefix[None, :] + tl.cumsum(a1, 0)) / n[:, None]
    a3 = tl.where(valid, tl.exp(g) / z[:, None], 0.0)
    da3 = tl.dot(do, tl.trans(v), input_precision=PREC)
    return a3, a3 * (da3 - delta[:, None]) / n[:, None]


# -- forward ------------------------------------------------------------------------------------------------------
@triton.jit
def _column_prefix(Q, K, LSE, PREFIX, sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, H, GROUP, T, NM, D, SCALE,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   PREC: tl.constexpr, ACC: tl.constexpr):
    """PREFIX[bh, m, cols] = sum of A1[r, cols] over the rows r of the query blocks before m."""
    scale = tl.load(SCALE)
    pid_n, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    cols, dims = pid_n * BLOCK_N + tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_D)
    k = _load(K + b * sk_b + (h // GROUP) * sk_h, cols, dims, sk_t, T, D)
    sums = tl.zeros((BLOCK_N,), ACC)
    for m in range(pid_n * BLOCK_N // BLOCK_M, NM):  # the blocks above hold no causal entry in these columns
        tl.store(PREFIX + (bh * NM + m) * T + cols, sums, mask=cols < T)
        rows = m * BLOCK_M + tl.arange(0, BLOCK_M)
        q = _load(Q + b * sq_b + h * sq_h, rows, dims, sq_t, T, D)
        a1, _ = _a1(q, k, tl.load(LSE + bh * T + rows, mask=rows < T, other=0.0), rows, cols, T, scale, PREC)
        sums += tl.sum(a1, 0)


@triton.jit
def _integral_rows(Q, K, V, LSE, PREFIX, OUT, Z, sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t,
                   H, GROUP, T, NM, D, DV, SCALE, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PREC: tl.constexpr, ACC: tl.constexpr):
    """OUT[rows] = A3 V and Z[rows] for one query block, over its causal key blocks."""
    scale = tl.load(SCALE)
    pid_m, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    kvh = h // GROUP
    rows, dims, dims_v = pid_m * BLOCK_M + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    q = _load(Q + b * sq_b + h * sq_h, rows, dims, sq_t, T, D)
    lse = tl.load(LSE + bh * T + rows, mask=rows < T, other=0.0)
    prefix = PREFIX + (bh * NM + pid_m) * T
    n = (rows + 1).to(ACC)
    z = tl.zeros((BLOCK_M,), ACC)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), ACC)
    for start_n in range(0, (pid_m + 1) * BLOCK_M, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        k = _load(K + b * sk_b + kvh * sk_h, cols, dims, sk_t, T, D)
        v = _load(V + b * sv_b + kvh * sv_h, cols, dims_v, sv_t, T, DV)
        a1, valid = _a1(q, k, lse, rows, cols, T, scale, PREC)
        above = tl.load(prefix + cols, mask=cols < T, other=0.0)
        numer = tl.where(valid, tl.exp((above[None, :] + tl.cumsum(a1, 0)) / n[:, None]), 0.0)
        z += tl.sum(numer, 1)
        acc += tl.dot(numer.to(v.dtype), v, input_precision=PREC)
    z = tl.where(rows < T, z, 1.0)
    _store(OUT + bh * T * DV, rows, dims_v, DV, T, DV, acc / z[:, None])
    tl.store(Z + bh * T + rows, z, mask=rows < T)


# -- backward -----------------------------------------------------------------------------------------------------
@triton.jit
def _column_walk(Q, K, V, DO, LSE, Z, DELTA, PREFIX, CARRY, ROWPART, ROWDOT, DK, DVV,
                 sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, H, HK, GROUP, T, NM, NN, D, DV, SCALE,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                 KEYS: tl.constexpr, PREC: tl.constexpr, ACC: tl.constexpr):
    """One program per (key block, kv head), over the query heads of its GQA group. KEYS false (pass A): walks
    upwards storing CARRY, ROWPART and dV; true (pass C): dK from dS = A1 (dA1 - ROWDOT)."""
    scale = tl.load(SCALE)
    pid_n, bkv = tl.program_id(0), tl.program_id(1).to(tl.int64)
    b, kvh = bkv // HK, bkv % HK
    cols, dims, dims_v = pid_n * BLOCK_N + tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    k = _load(K + b * sk_b + kvh * sk_h, cols, dims, sk_t, T, D)
    v = _load(V + b * sv_b + kvh * sv_h, cols, dims_v, sv_t, T, DV)
    dk = tl.zeros((BLOCK_N, BLOCK_D), ACC)
    dv = tl.zeros((BLOCK_N, BLOCK_DV), ACC)
    first = pid_n * BLOCK_N // BLOCK_M
    for head in range(0, GROUP):
        h = kvh * GROUP + head
        bh = b * H + h
        carried = tl.zeros((BLOCK_N,), ACC)  # sum of dG[n, cols] / (n+1) over the rows below the block
        for step in range(0, NM - first):
            m = NM - 1 - step
            block = (bh * NM + m) * T  # this head's row of PREFIX and CARRY for query block m
            rows = m * BLOCK_M + tl.arange(0, BLOCK_M)
            in_seq = rows < T
            q = _load(Q + b * sq_b + h * sq_h, rows, dims, sq_t, T, D)
            do = _load(DO + bh * T * DV, rows, dims_v, DV, T, DV)
            a1, valid = _a1(q, k, tl.load(LSE + bh * T + rows, mask=in_seq, other=0.0), rows, cols, T, scale, PREC)
            a3, dg = _a3_and_dg(a1, valid, tl.load(PREFIX + block + cols, mask=cols < T, other=0.0),
                                tl.load(Z + bh * T + rows, mask=in_seq, other=1.0), rows, do, v,
                                tl.load(DELTA + bh * T + rows, mask=in_seq, other=0.0), PREC)
            if KEYS:
                carried = tl.load(CARRY + block + cols, mask=cols < T, other=0.0)
            da1 = tl.cumsum(dg, 0, reverse=True) + carried[None, :]
            if KEYS:
                ds = a1 * (da1 - tl.load(ROWDOT + bh * T + rows, mask=in_seq, other=0.0)[:, None])
                dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=PREC)
            else:
                tl.store(CARRY + block + cols, carried, mask=cols < T)
                tl.store(ROWPART + (bh * NN + pid_n) * T + rows, tl.sum(a1 * da1, 1), mask=in_seq)
                carried += tl.sum(dg, 0)
                dv += tl.dot(tl.trans(a3).to(do.dtype), do, input_precision=PREC)
    if KEYS:
        _store(DK + bkv * T * D, cols, dims, D, T, D, dk * scale)
    else:
        _store(DVV + bkv * T * DV, cols, dims_v, DV, T, DV, dv)


@triton.jit
def _row_walk(Q, K, V, DO, LSE, Z, DELTA, PREFIX, CARRY, ROWDOT, DQ,
              sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, H, GROUP, T, NM, D, DV, SCALE,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
              PREC: tl.constexpr, ACC: tl.constexpr):
    """Pass B: dQ[rows] = scale sum over the key blocks of A1 (dA1 - ROWDOT) K, one program per query block."""
    scale = tl.load(SCALE)
    pid_m, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    kvh = h // GROUP
    rows, dims, dims_v = pid_m * BLOCK_M + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    in_seq = rows < T
    q = _load(Q + b * sq_b + h * sq_h, rows, dims, sq_t, T, D)
    do = _load(DO + bh * T * DV, rows, dims_v, DV, T, DV)
    lse = tl.load(LSE + bh * T + rows, mask=in_seq, other=0.0)
    z = tl.load(Z + bh * T + rows, mask=in_seq, other=1.0)
    delta = tl.load(DELTA + bh * T + rows, mask=in_seq, other=0.0)
    rowdot = tl.load(ROWDOT + bh * T + rows, mask=in_seq, other=0.0)
    block = (bh * NM + pid_m) * T
    dq = tl.zeros((BLOCK_M, BLOCK_D), ACC)
    for start_n in range(0, (pid_m + 1) * BLOCK_M, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        k = _load(K + b * sk_b + kvh * sk_h, cols, dims, sk_t, T, D)
        v = _load(V + b * sv_b + kvh * sv_h, cols, dims_v, sv_t, T, DV)
        a1, valid = _a1(q, k, lse, rows, cols, T, scale, PREC)
        _, dg = _a3_and_dg(a1, valid, tl.load(PREFIX + block + cols, mask=cols < T, other=0.0), z, rows, do, v,
                           delta, PREC)
        da1 = tl.cumsum(dg, 0, reverse=True) + tl.load(CARRY + block + cols, mask=cols < T, other=0.0)[None, :]
        ds = a1 * (da1 - rowdot[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
    _store(DQ + bh * T * D, rows, dims, D, T, D, dq * scale)


# -- autograd -----------------------------------------------------------------------------------------------------
_width = tile_width


class _Call:
    """Sizes, strides and constants of one call, shared by its forward and backward launches."""

    def __init__(self, q, k, v, scale: float, block_m: int, block_n: int):
        self.b, self.h, self.t, self.d = q.shape
        self.hk, self.dv = k.shape[1], v.shape[-1]
        self.group = self.h // self.hk
        self.nm, self.nn = triton.cdiv(self.t, block_m), triton.cdiv(self.t, block_n)
        self.acc = torch.float64 if q.dtype == torch.float64 else torch.float32  # fp64 stays exact in tests
        self.sizes = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=_width(self.d), PREC=self.precision(q.dtype),
                          ACC=tl.float64 if self.acc == torch.float64 else tl.float32)
        self.block_dv = _width(self.dv)
        self.strides = tuple(s for x in (q, k, v) for s in (x.stride(0), x.stride(1), x.stride(2)))
        # a tensor, not a float: compiled Triton passes a Python float as fp32, which would round fp64 runs
        self.scale = torch.full((1,), scale, dtype=self.acc, device=q.device)

    @staticmethod
    def precision(dtype: torch.dtype) -> str:
        """fp32 inputs stay exact ("ieee"), as PyTorch's own fp32 attention is; TF32 would cost ~1e-3."""
        return "ieee" if dtype in (torch.float32, torch.float64) else "tf32"

    def buffer(self, blocks: int, device, fill=None) -> torch.Tensor:
        """(B, h, blocks, T) in the accumulators' dtype."""
        shape = (self.b, self.h, blocks, self.t)
        if fill is None:
            return torch.empty(shape, device=device, dtype=self.acc)
        return torch.full(shape, fill, device=device, dtype=self.acc)


class _Integral(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, lse, scale, block_m, block_n):
        c = _Call(q, k, v, scale, block_m, block_n)
        lse = lse.to(c.acc).contiguous()
        prefix = c.buffer(c.nm, q.device)  # each program writes the entries any later pass reads
        out = torch.empty(c.b, c.h, c.t, c.dv, device=q.device, dtype=c.acc)
        z = torch.empty(c.b, c.h, c.t, device=q.device, dtype=c.acc)
        common = (c.h, c.group, c.t, c.nm, c.d)
        _column_prefix[(c.nn, c.b * c.h)](q, k, lse, prefix, *c.strides[:6], *common, c.scale, **c.sizes)
        _integral_rows[(c.nm, c.b * c.h)](q, k, v, lse, prefix, out, z, *c.strides, *common, c.dv, c.scale,
                                          BLOCK_DV=c.block_dv, **c.sizes)
        ctx.call = c
        ctx.save_for_backward(q, k, v, lse, prefix, z, out)
        # not a no-op out.to(v.dtype): torch 2.11's compile gives zero gradients to an autograd.Function whose
        # forward returns such an alias
        return out if out.dtype == v.dtype else out.to(v.dtype)

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, lse, prefix, z, out = ctx.saved_tensors
        c = ctx.call
        d_out = d_out.contiguous()
        delta = (d_out.to(c.acc) * out).sum(-1)  # rowsum(A3 dA3) = dO . out per row
        carry = c.buffer(c.nm, q.device)
        row_part = c.buffer(c.nn, q.device, fill=0.0)  # a key block past a row's diagonal adds nothing to it
        row_dot = torch.empty_like(z)
        dq = torch.empty_like(q, memory_format=torch.contiguous_format)
        dk, dv = torch.empty_like(k, memory_format=torch.contiguous_format), torch.empty_like(
            v, memory_format=torch.contiguous_format)
        sizes = (c.t, c.nm, c.nn, c.d, c.dv, c.scale)
        for keys in (False, True):  # pass A, then (after ROWDOT) pass C
            if keys:
                torch.sum(row_part, dim=2, out=row_dot)
                _row_walk[(c.nm, c.b * c.h)](q, k, v, d_out, lse, z, delta, prefix, carry, row_dot, dq, *c.strides,
                                             c.h, c.group, c.t, c.nm, c.d, c.dv, c.scale, BLOCK_DV=c.block_dv,
                                             **c.sizes)
            _column_walk[(c.nn, c.b * c.hk)](q, k, v, d_out, lse, z, delta, prefix, carry, row_part, row_dot, dk,
                                             dv, *c.strides, c.h, c.hk, c.group, *sizes, BLOCK_DV=c.block_dv,
                                             KEYS=keys, **c.sizes)
        return dq, dk, dv, None, None, None, None


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor, blocks: tuple[int, int]) -> None:
    interpreted = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
    if not (q.is_cuda or interpreted):
        raise RuntimeError("dint_integral's Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 set before "
                           "triton is imported (Triton's CPU interpreter, for tests)")
    b, h, t, d = q.shape
    if k.shape[:1] != (b,) or k.shape[2:] != (t, d) or v.shape[:3] != k.shape[:3] or h % k.shape[1]:
        raise ValueError(f"dint_integral: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected "
                         "q (B, h, T, d), k (B, h_kv, T, d), v (B, h_kv, T, dv) with h_kv dividing h")
    if lse.shape != (b, h, t):
        raise ValueError(f"dint_integral: lse {tuple(lse.shape)}, expected (B, h, T) = {(b, h, t)}")
    for block in blocks:
        if block < 16 or block & (block - 1):
            raise ValueError(f"Triton tile sizes are powers of two >= 16, got {block}")


def dint_integral(q1: torch.Tensor, k1: torch.Tensor, v: torch.Tensor, lse1: torch.Tensor, scale: float | None = None,
                  block_m: int | None = None, block_n: int | None = None) -> torch.Tensor:
    """A3 V of DINT's "softmax" integral, causal: (B, h, T, dv) in v's dtype.

    q1: (B, h, T, d); k1: (B, h_kv, T, d); v: (B, h_kv, T, dv) (GQA: query head p reads kv head p // (h / h_kv));
    lse1: (B, h, T), the row log-sum-exp of scale * q1 k1^T over keys 0..n (map1_lse, or the differential
    kernel's). scale defaults to 1/sqrt(d). lse1 is taken as given (no gradient): the gradient reaches q1 and k1
    through the full softmax Jacobian of A1. Blocks: the query and key tile sizes (powers of two >= 16; by
    default `tiles(d, dv)`)."""
    default_m, default_n = tiles(q1.shape[-1], v.shape[-1])
    block_m, block_n = default_m if block_m is None else block_m, default_n if block_n is None else block_n
    _check(q1, k1, v, lse1, (block_m, block_n))
    q1, k1, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q1, k1, v))
    scale = 1.0 / math.sqrt(q1.shape[-1]) if scale is None else float(scale)
    return _Integral.apply(q1, k1, v, lse1.detach(), scale, block_m, block_n)


# -- map 1's log-sum-exp ------------------------------------------------------------------------------------------
def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


FLEX_BLOCK = 128  # flex_attention's default block size


def causal_blocks(t: int, device) -> BlockMask:
    """The causal mask's blocks, written down rather than found by evaluating the mask over T x T (create_block_mask):
    query block m reads key blocks 0..m-1 whole and block m through the mask. O((T / 128)^2) integers, cheap inside
    a compiled graph, where dynamo would trace through a cache of create_block_mask and redo it in every layer."""
    n = -(-t // FLEX_BLOCK)
    blocks = torch.arange(n, device=device, dtype=torch.int32)
    return BlockMask.from_kv_blocks(
        torch.ones(1, 1, n, device=device, dtype=torch.int32),  # one partial block per row of blocks: the diagonal
        blocks.view(1, 1, n, 1).expand(1, 1, n, n).contiguous(),
        blocks.view(1, 1, n).clone(),  # m whole blocks below it
        blocks.view(1, 1, 1, n).expand(1, 1, n, n).contiguous(),
        BLOCK_SIZE=FLEX_BLOCK, mask_mod=_causal, seq_lengths=(t, t))


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    """flex_attention compiled once: its documented use, the fused kernel that never holds T x T scores. Shapes
    dynamic after the first change (torch.compile's default), so new lengths and batches do not each recompile."""
    return torch.compile(flex_attention)


def map1_attention(q1: torch.Tensor, k1: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                   compiled: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(A1 V, lse1) from one flex_attention call, causal, GQA when k1 has fewer heads: out (B, h, T, dv) with
    gradients; lse1 (B, h, T), the natural log-sum-exp of the scaled scores, fp32 (fp64 for fp64 inputs).
    compiled: whether to run the compiled kernel; by default on CUDA only (eager flex_attention materialises the
    scores: fine for CPU tests only; compiled on CPU, torch 2.13 refuses the log-sum-exp). torch 2.13's
    flex_attention has no CPU backward: on CPU the inputs must not require grad."""
    compiled = q1.is_cuda if compiled is None else compiled
    attend = _compiled_flex() if compiled else flex_attention
    t = q1.shape[-2]
    out, aux = attend(q1, k1, v, block_mask=causal_blocks(t, q1.device), scale=scale,
                      enable_gqa=k1.shape[1] != q1.shape[1], return_aux=AuxRequest(lse=True))
    return out, aux.lse.to(torch.promote_types(q1.dtype, torch.float32))


def map1_lse(q1: torch.Tensor, k1: torch.Tensor, scale: float | None = None, compiled: bool | None = None):
    """lse1 (B, h, T), fp32 (fp64 for fp64 inputs): the row log-sum-exp of scale * q1 k1^T over keys 0..n (scale
    default 1/sqrt(d)), from flex_attention's log-sum-exp. No gradient: dint_integral takes it as given."""
    q1, k1 = q1.detach(), k1.detach()
    return map1_attention(q1, k1, k1, scale, compiled)[1]


__all__ = ["dint_integral", "map1_attention", "map1_lse", "tiles"]

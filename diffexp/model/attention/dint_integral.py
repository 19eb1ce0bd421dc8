"""DINT's integral term A3 V without a T x T tensor, forward and backward (O(T) extra memory per head).

    A1 = softmax(Q K^T / sqrt(d))  (causal)      G[n, :] = (1/n) sum_{m<=n} A1[m, :]
    A3[n, j] = exp(G[n, j]) / Z_n  for j <= n    out = A3 V

Forward walks query blocks in order, carrying the column sums of the A1 rows above the block; the
same walk, started from a cache's column sums, gives the new rows when decoding (integral_rows).
G lies in [0, 1], so exp(G) needs no max subtraction. Only Q, K, V, the output, A1's row
log-sum-exp and A1's total column sums are saved.

Backward walks the blocks in reverse. With dG = A3 * (dA3 - rowsum(A3 * dA3)) and G = C A1 where
C[n, m] = 1/n for m <= n, the gradient reaching A1 is dA1[m, :] = sum_{n>=m} dG[n, :] / n: a reverse
cumulative sum, carried across blocks as one vector. The prefix column sums a block needs are the
saved totals minus the rows from that block on, peeled off as the walk goes up.
"""

from __future__ import annotations

import math

import torch


def _block_a1(q_blk, k, lse_blk, start, scale):
    """A1 rows start..start+blk over columns 0..end, recomputed from the saved log-sum-exp."""
    end = start + q_blk.shape[-2]
    logits = (q_blk @ k[..., :end, :].transpose(-1, -2)) * scale
    future = torch.arange(end, device=q_blk.device) > torch.arange(start, end, device=q_blk.device).unsqueeze(-1)
    return torch.exp(logits.masked_fill(future, float("-inf")) - lse_blk.unsqueeze(-1)), future


def _block_a3(g, future):
    numer = torch.exp(g).masked_fill(future, 0.0)
    return numer / numer.sum(dim=-1, keepdim=True)


def integral_rows(q, k, v, block_size: int = 128, col_sums=None, integral: str = "softmax"):
    """A3 V for the last T_q of T_k positions (T_q = T_k: a whole sequence; fewer: new tokens after a cache).

    q: (B, h, T_q, d); k: (B, h, T_k, d), v: (B, h, T_k, dv), kv heads already expanded; col_sums: the column
    sums of the A1 rows before the queries, (B, h, T_k - T_q), or None for none. integral "mean" takes G
    itself for A3. Returns (A3 V, A1's row log-sum-exp, the column sums of every A1 row so far: (B, h, T_k)),
    in fp32 at least.
    """
    dtype = torch.promote_types(q.dtype, torch.float32)
    qf, kf, vf = q.to(dtype), k.to(dtype), v.to(dtype)
    b, h, t_q, d = q.shape
    t_k = k.shape[-2]
    first = t_k - t_q  # the position of the first query
    scale = 1.0 / math.sqrt(d)
    sums = qf.new_zeros(b, h, t_k)
    if col_sums is not None:
        sums[..., :first] = col_sums
    lse = qf.new_empty(b, h, t_q)
    out = qf.new_empty(b, h, t_q, v.shape[-1])
    for row in range(0, t_q, block_size):
        rows = slice(row, min(row + block_size, t_q))
        start, end = first + rows.start, first + rows.stop  # positions of the block's queries
        logits = (qf[..., rows, :] @ kf[..., :end, :].transpose(-1, -2)) * scale
        future = torch.arange(end, device=q.device) > torch.arange(start, end, device=q.device).unsqueeze(-1)
        logits = logits.masked_fill(future, float("-inf"))
        lse[..., rows] = torch.logsumexp(logits, dim=-1)
        a1 = torch.exp(logits - lse[..., rows].unsqueeze(-1))
        n = torch.arange(start + 1, end + 1, device=q.device, dtype=dtype).unsqueeze(-1)
        g = (sums[..., :end].unsqueeze(-2) + a1.cumsum(dim=-2)) / n
        a3 = _block_a3(g, future) if integral == "softmax" else g.masked_fill(future, 0.0)
        out[..., rows, :] = a3 @ vf[..., :end, :]
        sums[..., :end] += a1.sum(dim=-2)
    return out, lse, sums


class StreamingIntegral(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, block_size: int):
        """q, k: (B, h, T, d), v: (B, h, T, dv) with kv heads already expanded; returns A3 V."""
        out, lse, col_sums = integral_rows(q, k, v, block_size)
        dtype = out.dtype
        ctx.save_for_backward(q.to(dtype), k.to(dtype), v.to(dtype), out, lse, col_sums)
        ctx.block_size, ctx.scale, ctx.in_dtypes = block_size, 1.0 / math.sqrt(q.shape[-1]), (q.dtype, k.dtype, v.dtype)
        return out.to(v.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, col_sums = ctx.saved_tensors
        block, scale = ctx.block_size, ctx.scale
        t = q.shape[-2]
        grad_out = grad_out.to(q.dtype)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        prefix = col_sums.clone()                     # column sums of A1 rows above the current block
        carried = q.new_zeros(col_sums.shape)         # sum over rows n after the block of dG[n, :] / n
        starts = list(range(0, t, block))
        for start in reversed(starts):
            end = min(start + block, t)
            q_blk, do_blk = q[..., start:end, :], grad_out[..., start:end, :]
            a1, future = _block_a1(q_blk, k, lse[..., start:end], start, scale)
            prefix[..., :end] -= a1.sum(dim=-2)
            n = torch.arange(start + 1, end + 1, device=q.device, dtype=q.dtype).unsqueeze(-1)
            g = (prefix[..., :end].unsqueeze(-2) + a1.cumsum(dim=-2)) / n
            a3 = _block_a3(g, future)
            dv[..., :end, :] += a3.transpose(-1, -2) @ do_blk
            da3 = do_blk @ v[..., :end, :].transpose(-1, -2)
            dg = a3 * (da3 - (do_blk * out[..., start:end, :]).sum(dim=-1, keepdim=True))
            scaled = dg / n
            # dA1[m] = sum_{n >= m} dG[n] / n: within the block by a reverse cumsum, plus what later blocks carry
            da1 = scaled.flip(-2).cumsum(dim=-2).flip(-2) + carried[..., :end].unsqueeze(-2)
            carried[..., :end] += scaled.sum(dim=-2)
            ds = a1 * (da1 - (a1 * da1).sum(dim=-1, keepdim=True))
            dq[..., start:end, :] = (ds @ k[..., :end, :]) * scale
            dk[..., :end, :] += (ds.transpose(-1, -2) @ q_blk) * scale
        q_dtype, k_dtype, v_dtype = ctx.in_dtypes
        return dq.to(q_dtype), dk.to(k_dtype), dv.to(v_dtype), None


def streaming_integral(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_size: int = 128) -> torch.Tensor:
    return StreamingIntegral.apply(q, k, v, block_size)

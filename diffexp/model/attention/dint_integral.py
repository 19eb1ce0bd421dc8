"""DINT's integral term A3 V without a T x T tensor, forward and backward (O(T) extra memory per head),
optionally fused with map 1's own output A1 V (the same A1 blocks serve both).

    A1 = softmax(Q K^T / sqrt(d))  (causal)      G[n, :] = (1/n) sum_{m<=n} A1[m, :]
    A3[n, j] = exp(G[n, j]) / Z_n  for j <= n    out = A3 V   (and A1 V with first_map)

Forward walks query blocks in order, carrying the column sums of the A1 rows above the block; the
same walk, started from a cache's column sums, gives the new rows when decoding (integral_rows).
G lies in [0, 1], so exp(G) needs no max subtraction. Only Q, K, V, the outputs and A1's total
column sums are saved; A1 is recomputed blockwise in backward.

Backward walks the blocks in reverse. With dG = A3 * (dA3 - rowsum(A3 * dA3)) and G = C A1 where
C[n, m] = 1/n for m <= n, the gradient reaching A1 is dA1[m, :] = sum_{n>=m} dG[n, :] / n (plus
dO1 V^T with first_map): a reverse cumulative sum, carried across blocks as one vector. The prefix
column sums a block needs are the saved totals minus the rows from that block on, peeled off as the
walk goes up.

The per-block work is elementwise-bound on CPU, so each pass works in place where it can, masks only
the block's diagonal square, and normalises A3 on the (rows x dv) output instead of the (rows x T)
map. (torch.compile of the block functions was tried on CPU, torch 2.13: three graphs each for the
dynamic block shapes, about a minute to compile on 2 cores, and slower than these eager passes.)
"""

from __future__ import annotations

import math

import torch

_NEG_INF = float("-inf")


def _diagonal_future(rows: int, device) -> torch.Tensor:
    """True above the diagonal of the block's own (rows x rows) square: the keys after each query."""
    return torch.ones(rows, rows, dtype=torch.bool, device=device).triu(1)


def _block_a1(q_blk, k_end, start: int, scale: float):
    """softmax rows of A1 for queries start..start+rows over keys 0..end (the causal part only)."""
    rows = q_blk.shape[-2]
    logits = torch.matmul(q_blk, k_end.transpose(-1, -2)).mul_(scale)
    logits[..., start:].masked_fill_(_diagonal_future(rows, q_blk.device), _NEG_INF)
    return torch.softmax(logits, dim=-1)


def _block_g_exp(a1, prefix_end, start: int, integral: str):
    """(exp(G) masked to the causal part, or G for "mean") and 1/n per row, for one block's A1 rows."""
    rows = a1.shape[-2]
    inv_n = 1.0 / torch.arange(start + 1, start + rows + 1, device=a1.device, dtype=a1.dtype).unsqueeze(-1)
    g = a1.cumsum(dim=-2).add_(prefix_end.unsqueeze(-2)).mul_(inv_n)
    if integral == "softmax":
        g.exp_()
    g[..., start:].masked_fill_(_diagonal_future(rows, a1.device), 0.0)
    return g, inv_n


def forward_block(q_blk, k_end, v_end, prefix_end, start: int, scale: float, integral: str, first_map: bool):
    """One query block: (A3 V, A1 V or None, the block's A1 column sums)."""
    a1 = _block_a1(q_blk, k_end, start, scale)
    numer, _ = _block_g_exp(a1, prefix_end, start, integral)
    out3 = torch.matmul(numer, v_end)
    if integral == "softmax":
        out3 = out3.div_(numer.sum(dim=-1, keepdim=True))
    out1 = torch.matmul(a1, v_end) if first_map else None
    return out3, out1, a1.sum(dim=-2)


def backward_block(q_blk, k_end, v_end, through_end, carried_end, do3, out3, do1, start: int, scale: float):
    """Gradients of one block (softmax integral): (dQ rows, dK over 0..end, dV over 0..end, the block's A1
    column sums, the block's contribution to `carried`). through_end: the column sums of A1's rows up to the
    block's last one; the block's own rows are peeled off here."""
    a1 = _block_a1(q_blk, k_end, start, scale)
    a1_sums = a1.sum(dim=-2)
    numer, inv_n = _block_g_exp(a1, through_end - a1_sums, start, "softmax")
    a3 = numer.div_(numer.sum(dim=-1, keepdim=True))
    dv = torch.matmul(a3.transpose(-1, -2), do3)
    # dG / n = A3 * (dA3 - rowsum(A3 * dA3)) / n, with rowsum(A3 * dA3) = do3 . out3 per row
    scaled = torch.matmul(do3, v_end.transpose(-1, -2)).sub_((do3 * out3).sum(dim=-1, keepdim=True))
    scaled.mul_(a3).mul_(inv_n)
    block_sum = scaled.sum(dim=-2, keepdim=True)
    # dA1[m] = sum_{n >= m in block} scaled[n] + carried = block_sum - cumsum[m] + scaled[m] + carried
    da1 = scaled.sub_(scaled.cumsum(dim=-2)).add_(block_sum + carried_end.unsqueeze(-2))
    if do1 is not None:  # map 1's own output: dA1 += dO1 V^T, dV += A1^T dO1
        da1.add_(torch.matmul(do1, v_end.transpose(-1, -2)))
        dv = dv.add_(torch.matmul(a1.transpose(-1, -2), do1))
    ds = da1.sub_((a1 * da1).sum(dim=-1, keepdim=True)).mul_(a1)
    dq = torch.matmul(ds, k_end).mul_(scale)
    dk = torch.matmul(ds.transpose(-1, -2), q_blk).mul_(scale)
    return dq, dk, dv, a1_sums, block_sum.squeeze(-2)


def integral_rows(q, k, v, block_size: int = 32, col_sums=None, integral: str = "softmax",
                  first_map: bool = False):
    """A3 V for the last T_q of T_k positions (T_q = T_k: a whole sequence; fewer: new tokens after a cache).

    q: (B, h, T_q, d); k: (B, h, T_k, d), v: (B, h, T_k, dv), kv heads already expanded; col_sums: the column
    sums of the A1 rows before the queries, (B, h, T_k - T_q), or None for none. integral "mean" takes G
    itself for A3. Returns (A3 V, A1 V or None (first_map), the column sums of every A1 row so far:
    (B, h, T_k)), in fp32 at least.
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
    out3 = qf.new_empty(b, h, t_q, v.shape[-1])
    out1 = qf.new_empty(b, h, t_q, v.shape[-1]) if first_map else None
    for row in range(0, t_q, block_size):
        stop = min(row + block_size, t_q)
        start, end = first + row, first + stop  # positions of the block's queries
        o3, o1, block_sums = forward_block(qf[..., row:stop, :], kf[..., :end, :], vf[..., :end, :],
                                        sums[..., :end], start, scale, integral, first_map)
        out3[..., row:stop, :] = o3
        if first_map:
            out1[..., row:stop, :] = o1
        sums[..., :end] += block_sums
    return out3, out1, sums


class StreamingIntegral(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, block_size: int, first_map: bool):
        """q, k: (B, h, T, d), v: (B, h, T, dv) with kv heads already expanded; returns (A3 V, A1 V or None)."""
        out3, out1, col_sums = integral_rows(q, k, v, block_size, first_map=first_map)
        dtype = out3.dtype
        ctx.save_for_backward(q.to(dtype), k.to(dtype), v.to(dtype), out3, col_sums)
        ctx.block_size, ctx.scale, ctx.in_dtypes = block_size, 1.0 / math.sqrt(q.shape[-1]), (q.dtype, k.dtype, v.dtype)
        ctx.mark_non_differentiable(col_sums)
        return out3.to(v.dtype), (out1.to(v.dtype) if first_map else None)

    @staticmethod
    def backward(ctx, grad_out3, grad_out1):
        q, k, v, out3, col_sums = ctx.saved_tensors
        block, scale = ctx.block_size, ctx.scale
        t = q.shape[-2]
        do3 = torch.zeros_like(out3) if grad_out3 is None else grad_out3.to(q.dtype)
        do1 = None if grad_out1 is None else grad_out1.to(q.dtype)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        through = col_sums.clone()                    # column sums of A1 rows up to the current block's last
        carried = q.new_zeros(col_sums.shape)         # sum over rows n after the block of dG[n, :] / n
        for start in reversed(range(0, t, block)):
            end = min(start + block, t)
            dq_blk, dk_blk, dv_blk, a1_sums, carried_blk = backward_block(
                q[..., start:end, :], k[..., :end, :], v[..., :end, :], through[..., :end],
                carried[..., :end], do3[..., start:end, :], out3[..., start:end, :],
                None if do1 is None else do1[..., start:end, :], start, scale)
            through[..., :end] -= a1_sums
            carried[..., :end] += carried_blk
            dq[..., start:end, :] = dq_blk
            dk[..., :end, :] += dk_blk
            dv[..., :end, :] += dv_blk
        q_dtype, k_dtype, v_dtype = ctx.in_dtypes
        return dq.to(q_dtype), dk.to(k_dtype), dv.to(v_dtype), None, None


def streaming_integral(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_size: int = 32) -> torch.Tensor:
    """A3 V (see the module docstring)."""
    return StreamingIntegral.apply(q, k, v, block_size, False)[0]


def fused_first_map_integral(q, k, v, block_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """(A1 V, A3 V) in one blocked pass, forward and backward: map 1 of DINT and its integral together."""
    out3, out1 = StreamingIntegral.apply(q, k, v, block_size, True)
    return out1, out3

"""DINT's integral term A3 V without a T x T tensor, forward and backward (O(T) extra memory per head),
optionally fused with map 1: (A1 + gamma A3) V, the same A1 blocks serving both and one product with V.

    A1 = softmax(Q K^T / sqrt(d))  (causal)      G[n, :] = (1/n) sum_{m<=n} A1[m, :]
    A3[n, j] = exp(G[n, j]) / Z_n  for j <= n    out = A3 V   (or (A1 + gamma A3) V)

Forward walks query blocks in order, carrying the column sums of the A1 rows above the block; the
same walk, started from a cache's column sums, gives the new rows when decoding (integral_rows).
G lies in [0, 1], so exp(G) needs no max subtraction. Only Q, K, V and A1's total column sums are
saved; A1 and A3 are recomputed blockwise in backward.

Backward walks the blocks in reverse. With dA = dO V^T, dA3 = w3 dA and dG = A3 * (dA3 - rowsum(A3 *
dA3)), and G = C A1 where C[n, m] = 1/n for m <= n, the gradient reaching A1 is dA1[m, :] = sum_{n>=m}
dG[n, :] / n (plus dA itself when fused): a reverse cumulative sum, carried across blocks as one vector.
gamma's gradient is the sum of rowsum(A3 * dA). The prefix column sums a block needs are the saved
totals minus the rows from that block on, peeled off as the walk goes up.

Each pass works in place where it can and masks only the block's diagonal square (elementwise-bound on CPU).
"""

from __future__ import annotations

import math

import torch

_NEG_INF = float("-inf")


def _diagonal_future(rows: int, device) -> torch.Tensor:
    """True above the diagonal of the block's own (rows x rows) square: the keys after each query."""
    return torch.ones(rows, rows, dtype=torch.bool, device=device).triu(1)


def _block_a1(q_blk, k_end, start: int):
    """softmax rows of A1 for queries start..start+rows over keys 0..end (the causal part only); q_blk comes
    multiplied by 1/sqrt(d) already (once per call, not once per block on the larger logits)."""
    rows = q_blk.shape[-2]
    logits = torch.matmul(q_blk, k_end.transpose(-1, -2))
    logits[..., start:].masked_fill_(_diagonal_future(rows, q_blk.device), _NEG_INF)
    return torch.softmax(logits, dim=-1)


def _inverse_positions(start: int, rows: int, like: torch.Tensor) -> torch.Tensor:
    """1/n for the block's rows (n = start + 1, ...), as a column."""
    return 1.0 / torch.arange(start + 1, start + rows + 1, device=like.device, dtype=like.dtype).unsqueeze(-1)


def _block_g_exp(a1, prefix_end, start: int, integral: str):
    """(exp(G) masked to the causal part, or G for "mean") and 1/n per row, for one block's A1 rows."""
    rows = a1.shape[-2]
    inv_n = _inverse_positions(start, rows, a1)
    # the block's running mean as a (rows x rows) lower-triangular matmul: faster on CPU than cumsum over rows
    running_mean = torch.ones(rows, rows, device=a1.device, dtype=a1.dtype).tril_().mul_(inv_n)
    g = torch.matmul(running_mean, a1).addcmul_(inv_n, prefix_end.unsqueeze(-2))
    if integral == "softmax":
        g.exp_()
    g[..., start:].masked_fill_(_diagonal_future(rows, a1.device), 0.0)
    return g, inv_n


def _block_a3(a1, prefix_end, start: int, integral: str):
    """A3's rows for one block of A1 rows (normalised for "softmax"; G itself for "mean") and 1/n per row."""
    numer, inv_n = _block_g_exp(a1, prefix_end, start, integral)
    if integral == "softmax":
        numer.div_(numer.sum(dim=-1, keepdim=True))
    return numer, inv_n


def forward_block(q_blk, k_end, v_end, prefix_end, start: int, integral: str, gamma):
    """One query block: (A3 V, or (A1 + gamma A3) V when gamma is a 0-d tensor; the block's A1 column sums)."""
    a1 = _block_a1(q_blk, k_end, start)
    a1_sums = a1.sum(dim=-2)
    a3, _ = _block_a3(a1, prefix_end, start, integral)
    weights = a3 if gamma is None else a1.addcmul_(a3, gamma)
    return torch.matmul(weights, v_end), a1_sums


def backward_block(q_blk, k_end, v_end, through_end, carried_end, grad, start: int, scale: float, gamma):
    """Gradients of one block of out = w1 A1 V + w3 A3 V (softmax integral; w1, w3 = 0, 1 without gamma, else 1,
    gamma): (dQ rows, dK and dV over 0..end, rowsum(A3 * dO V^T) per row (gamma's gradient), the block's A1 column
    sums, its contribution to `carried`). through_end: the column sums of A1's rows up to the
    block's last one; the block's own rows are peeled off here."""
    a1 = _block_a1(q_blk, k_end, start)
    a1_sums = a1.sum(dim=-2)
    a3, inv_n = _block_a3(a1, through_end - a1_sums, start, "softmax")
    w3 = 1.0 if gamma is None else gamma
    weights = a3 if gamma is None else a1 + gamma * a3
    d_map = torch.matmul(grad, v_end.transpose(-1, -2))  # dO V^T: dA1 = w1 of it, dA3 = w3 of it
    dv = torch.matmul(weights.transpose(-1, -2), grad)
    a3_dot = (a3 * d_map).sum(dim=-1, keepdim=True)
    # dG = w3 A3 * (dA - rowsum(A3 * dA)); dA1[m] = sum_{n >= m in block} dG[n] / n + carried, the reverse
    # running sum as an upper-triangular (rows x rows) matmul with 1/n folded in; its first row is the block's total
    rows = a1.shape[-2]
    reverse_sum = torch.ones(rows, rows, device=a1.device, dtype=a1.dtype).triu_().mul_(inv_n.transpose(0, 1) * w3)
    da1 = torch.matmul(reverse_sum, (d_map - a3_dot).mul_(a3))
    block_sum = da1[..., :1, :].clone()
    da1.add_(carried_end.unsqueeze(-2))
    if gamma is not None:
        da1.add_(d_map)
    ds = da1.sub_((a1 * da1).sum(dim=-1, keepdim=True)).mul_(a1)
    dq = torch.matmul(ds, k_end).mul_(scale)
    dk = torch.matmul(ds.transpose(-1, -2), q_blk)
    return dq, dk, dv, a3_dot.squeeze(-1), a1_sums, block_sum.squeeze(-2)


def integral_rows(q, k, v, block_size: int = 32, col_sums=None, integral: str = "softmax", gamma=None):
    """A3 V for the last T_q of T_k positions (T_q = T_k: a whole sequence; fewer: new tokens after a cache),
    or (A1 + gamma A3) V when gamma is a 0-d tensor.

    q: (B, h, T_q, d); k: (B, h, T_k, d), v: (B, h, T_k, dv), kv heads already expanded; col_sums: the column
    sums of the A1 rows before the queries, (B, h, T_k - T_q), or None for none. integral "mean" takes G
    itself for A3. Returns (the output, the column sums of every A1 row so far: (B, h, T_k)), in fp32 at least.
    """
    dtype = torch.promote_types(q.dtype, torch.float32)
    b, h, t_q, d = q.shape
    scale = 1.0 / math.sqrt(d)
    qf, kf, vf = q.to(dtype) * scale, k.to(dtype), v.to(dtype)
    t_k = k.shape[-2]
    first = t_k - t_q  # the position of the first query
    sums = qf.new_zeros(b, h, t_k)
    if col_sums is not None:
        sums[..., :first] = col_sums
    out = qf.new_empty(b, h, t_q, v.shape[-1])
    for row in range(0, t_q, block_size):
        stop = min(row + block_size, t_q)
        start, end = first + row, first + stop  # positions of the block's queries
        out[..., row:stop, :], block_sums = forward_block(qf[..., row:stop, :], kf[..., :end, :], vf[..., :end, :],
                                                          sums[..., :end], start, integral, gamma)
        sums[..., :end] += block_sums
    return out, sums


class StreamingIntegral(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, gamma, block_size: int):
        """q, k: (B, h, T, d), v: (B, h, T, dv) with kv heads already expanded; gamma: None (returns A3 V) or a
        0-d tensor (returns (A1 + gamma A3) V)."""
        dtype = torch.promote_types(q.dtype, torch.float32)
        # 0-d tensors, never Python numbers: reading one would wait for the GPU in every layer's forward
        weight = None if gamma is None else gamma.detach().to(dtype)
        out, col_sums = integral_rows(q, k, v, block_size, gamma=weight)
        ctx.save_for_backward(q.to(dtype), k.to(dtype), v.to(dtype), col_sums)
        ctx.block_size, ctx.scale, ctx.gamma = block_size, 1.0 / math.sqrt(q.shape[-1]), weight
        ctx.in_dtypes = (q.dtype, k.dtype, v.dtype, None if gamma is None else gamma.dtype)
        # not a no-op out.to(v.dtype): torch 2.11's compile gives zero gradients to an autograd.Function whose
        # forward returns such an alias
        return out if out.dtype == v.dtype else out.to(v.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, col_sums = ctx.saved_tensors
        block, scale, gamma = ctx.block_size, ctx.scale, ctx.gamma
        q_scaled = q * scale
        t = q.shape[-2]
        grad_out = grad_out.to(q.dtype)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        d_gamma = q.new_zeros(())
        through = col_sums.clone()                    # column sums of A1 rows up to the current block's last
        carried = q.new_zeros(col_sums.shape)         # sum over rows n after the block of dG[n, :] / n
        for start in reversed(range(0, t, block)):
            end = min(start + block, t)
            dq_blk, dk_blk, dv_blk, a3_dot, a1_sums, carried_blk = backward_block(
                q_scaled[..., start:end, :], k[..., :end, :], v[..., :end, :], through[..., :end], carried[..., :end],
                grad_out[..., start:end, :], start, scale, gamma)
            through[..., :end] -= a1_sums
            carried[..., :end] += carried_blk
            dq[..., start:end, :] = dq_blk
            dk[..., :end, :] += dk_blk
            dv[..., :end, :] += dv_blk
            d_gamma += a3_dot.sum()
        q_dtype, k_dtype, v_dtype, gamma_dtype = ctx.in_dtypes
        d_gamma = None if gamma is None else d_gamma.to(gamma_dtype)
        return dq.to(q_dtype), dk.to(k_dtype), dv.to(v_dtype), d_gamma, None


def streaming_integral(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_size: int = 32) -> torch.Tensor:
    """A3 V (see the module docstring). Training calls fused_first_map_integral; tests/test_dint_streaming.py checks
    the integral's own forward and backward through this one, apart from map 1's (gradcheck, naive maps)."""
    return StreamingIntegral.apply(q, k, v, None, block_size)


def fused_first_map_integral(q, k, v, gamma: torch.Tensor, block_size: int = 32) -> torch.Tensor:
    """(A1 + gamma A3) V in one blocked pass, forward and backward (gamma a 0-d tensor, its gradient too): DINT's
    map 1 and its integral, with one product with V instead of two."""
    return StreamingIntegral.apply(q, k, v, gamma, block_size)

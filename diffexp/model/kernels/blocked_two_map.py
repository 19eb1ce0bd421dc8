"""(A1 - lambda A2) V of the two-map variants, a block of queries at a time, without a T x T tensor, in PyTorch
ops: the CPU path where the compiled kernel (kernels/cpu_native.py, the same math, faster) cannot be built.

SDPA computes softmax(Q K^T) V per map over V's whole 2d width (its fused CPU kernel wants Q/K as wide as V),
so the two maps cost two calls with zero-padded Q and K: twice the baseline's attention matmuls. Here the two
maps' logits come from one matmul, their softmax rows are combined first, and one product with V serves both,
the same matmul work as the baseline's attention. Only Q, K and V are saved; each block's maps are recomputed
in backward, as flash attention does. Memory is O(block x T) per head.

Per block of queries, with c = (1, -lambda), P_m = softmax(Q_m K_m^T / sqrt(d)) (causal) and A = P1 - lambda P2:

    out = A V                                  dA = dO V^T               dV += A^T dO
    dS_m = c_m P_m * (dA - rowsum(P_m * dA))   dQ_m = dS_m K_m / sqrt(d)  dK_m += dS_m^T Q_m / sqrt(d)
    dlambda = -sum(P2 * dA)
"""

from __future__ import annotations

import torch

from diffexp.model.kernels.single_map import expand_kv

#: query rows per step (the fastest measured on CPU, bench/README.md)
BLOCK_ROWS = 64


def _block_maps(q_blk: torch.Tensor, k_t: torch.Tensor, start: int, buffer: torch.Tensor) -> torch.Tensor:
    """Both maps' softmax rows for queries start.. over keys 0..end, written into `buffer` (flat, large enough):
    (B, H, 2, rows, end). q_blk is pre-scaled."""
    rows = q_blk.shape[-2]
    maps = buffer[: q_blk.shape[:-1].numel() * k_t.shape[-1]].view(*q_blk.shape[:-1], k_t.shape[-1])
    torch.matmul(q_blk, k_t, out=maps)
    future = torch.ones(rows, rows, dtype=torch.bool, device=q_blk.device).triu_(1)
    maps[..., start:].masked_fill_(future, float("-inf"))  # only the block's diagonal square has future keys
    return torch.ops.aten._softmax.out(maps, -1, False, out=maps)  # in place: each row is read before it is written


def _combine(maps: torch.Tensor, neg_lam: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """A = P1 - lambda P2 into `buffer`: (B, H, rows, end)."""
    shape = maps[:, :, 0].shape
    return torch.addcmul(maps[:, :, 0], maps[:, :, 1], neg_lam, out=buffer[: shape.numel()].view(shape))


class BlockedTwoMap(torch.autograd.Function):
    # Every (rows x T) tensor lives in a buffer allocated once per call: a fresh multi-MB allocation per block
    # costs page faults on CPU.
    @staticmethod
    def forward(ctx, q, k, v, lam, block_rows: int):
        """q, k: (B, H, 2, T, d), maps 1 and 2 stacked, kv heads already expanded; v: (B, H, T, dv);
        lam: a 0-d tensor (never read on the host). Returns (A1 - lambda A2) V: (B, H, T, dv)."""
        dtype = torch.promote_types(q.dtype, torch.float32)
        q_scaled = q.to(dtype) * q.shape[-1] ** -0.5
        k, v, neg_lam = k.to(dtype), v.to(dtype), -lam.detach().to(dtype)
        k_t = k.transpose(-1, -2)
        b, h, _, t, _ = q.shape
        out = v.new_empty(b, h, t, v.shape[-1])
        map_buffer, combined_buffer = v.new_empty(b * h * 2 * block_rows * t), v.new_empty(b * h * block_rows * t)
        for start in range(0, t, block_rows):
            end = min(start + block_rows, t)
            maps = _block_maps(q_scaled[..., start:end, :], k_t[..., :end], start, map_buffer)
            torch.matmul(_combine(maps, neg_lam, combined_buffer), v[..., :end, :], out=out[..., start:end, :])
        ctx.save_for_backward(q_scaled, k, v, neg_lam)
        ctx.block_rows = block_rows
        ctx.in_dtypes = (q.dtype, k.dtype, v.dtype, lam.dtype)
        return out.to(ctx.in_dtypes[2])

    @staticmethod
    def backward(ctx, grad_out):
        q_scaled, k, v, neg_lam = ctx.saved_tensors
        block_rows = ctx.block_rows
        b, h, _, t, d = q_scaled.shape
        grad_out = grad_out.to(v.dtype).contiguous()
        # c_m and 1/sqrt(d) folded into the small operands, so the (rows x T) tensors see no extra pass
        coef = torch.stack([torch.ones_like(neg_lam), neg_lam]).view(2, 1, 1)
        k_coef, q_coef = k * (coef * d ** -0.5), q_scaled * coef
        k_t, v_t = k.transpose(-1, -2), v.transpose(-1, -2)
        dq, dk, dv = torch.empty_like(q_scaled), torch.zeros_like(k), torch.zeros_like(v)
        dk_rows, dv_rows = dk.view(b * h * 2, t, d), dv.view(b * h, t, v.shape[-1])  # for in-place accumulation
        map2_dot = q_scaled.new_zeros(())
        map_buffer, grad_buffer = v.new_empty(b * h * 2 * block_rows * t), v.new_empty(b * h * 2 * block_rows * t)
        combined_buffer, d_map_buffer = v.new_empty(b * h * block_rows * t), v.new_empty(b * h * block_rows * t)
        for start in range(0, t, block_rows):
            end = min(start + block_rows, t)
            grad = grad_out[..., start:end, :]
            maps = _block_maps(q_scaled[..., start:end, :], k_t[..., :end], start, map_buffer)
            combined = _combine(maps, neg_lam, combined_buffer)
            dv_rows[:, :end].baddbmm_(combined.flatten(0, 1).transpose(-1, -2), grad.flatten(0, 1))
            d_map = d_map_buffer[: combined.numel()].view(combined.shape)  # dA = dO V^T, shared by both maps
            torch.matmul(grad, v_t[..., :end], out=d_map)
            d_logits = torch.mul(maps, d_map.unsqueeze(2), out=grad_buffer[: maps.numel()].view(maps.shape))
            row_dot = d_logits.sum(dim=-1, keepdim=True)  # rowsum(P_m * dA)
            map2_dot += row_dot[:, :, 1].sum()
            d_logits.addcmul_(maps, row_dot, value=-1)  # P_m * (dA - rowsum(P_m * dA))
            torch.matmul(d_logits, k_coef[..., :end, :], out=dq[..., start:end, :])
            dk_rows[:, :end].baddbmm_(d_logits.flatten(0, 2).transpose(-1, -2), q_coef[..., start:end, :].flatten(0, 2))
        q_dtype, k_dtype, v_dtype, lam_dtype = ctx.in_dtypes
        return dq.to(q_dtype), dk.to(k_dtype), dv.to(v_dtype), (-map2_dot).to(lam_dtype), None


def blocked_two_map(q1, q2, k1, k2, v, lam: torch.Tensor, block_rows: int = BLOCK_ROWS) -> torch.Tensor:
    """(A1 - lambda A2) V over whole causal sequences. q1, q2: (B, h, T, d); k1, k2: (B, h_kv, T, d);
    v: (B, h_kv, T, dv); query head p reads kv head p // (h / h_kv). Returns (B, h, T, dv)."""
    h = q1.shape[1]
    q = torch.stack([q1, q2], dim=2)
    k = torch.stack([expand_kv(k1, h), expand_kv(k2, h)], dim=2)
    return BlockedTwoMap.apply(q, k, expand_kv(v, h).contiguous(), lam, block_rows)

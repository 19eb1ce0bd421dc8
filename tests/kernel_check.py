"""A half-precision kernel of the two-map head against the fp32 plain path, at tolerances a 1% change of lambda
fails: used on CUDA by tests/test_gpu.py, and checked on the CPU by tests/test_kernel_check.py.

Each tensor (the output, the gradients of q1, q2, k1, k2, v, lambda and gamma) is compared with the reference's by
its error e = x - ref in three ways: its size, ||e|| / ||ref||, within the precision's rounding; its part along the
reference itself, <e, ref> / <ref, ref>, under half a percent (a tensor scaled 1% off); and its part along what a
1% change of lambda does to the reference, u = ref(1.01 lambda) - ref, under half of it, <e, u> / <u, u> < 0.5.
Rounding errors are nearly orthogonal to any fixed direction over 10^5 elements, so the last two see a 1% bias well
below the rounding's size. The reference with lambda 1% off must itself fail: the check is tight enough by
construction, wherever it runs.
"""

from __future__ import annotations

import torch

from diffexp.kernels import Integral
from diffexp.model.heads.per_map import per_map_head

#: lambda and gamma of the check: large, so that the difference out = A1 V - lambda A2 V moves with them
LAM = 0.8
#: the largest relative error, by precision: a few roundings of the last bit
ROUNDING = {torch.bfloat16: 2e-2, torch.float16: 3e-3}
#: the largest part of a tensor's error along itself: half of a 1% scale
SCALE_BIAS = 5e-3
#: the elements over which rounding errors average out of a fixed direction
AVERAGED = 1000
NAMES = ("q1", "q2", "k1", "k2", "v")


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def head_inputs(device, dtype, b=2, h=4, h_kv=2, t=300, d=64, seed=0) -> list[torch.Tensor]:
    """q1, q2 (b, h, t, d), k1, k2 (b, h_kv, t, d), v (b, h_kv, t, 2d) and the output's gradient, in dtype (a length
    off every block size)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(b, h, t, d)] * 2 + [(b, h_kv, t, d)] * 2 + [(b, h_kv, t, 2 * d), (b, h, t, 2 * d)]
    return [torch.randn(shape, generator=gen).to(device=device, dtype=dtype) for shape in shapes]


def run_head(head, inputs: list[torch.Tensor], integral: str | None, dtype: torch.dtype,
             lam: float = LAM) -> dict[str, torch.Tensor]:
    """The head's output and every gradient, with its tensors in dtype (lambda and gamma fp32 0-d)."""
    *tensors, grad = inputs
    leaves = [t.detach().to(dtype).requires_grad_() for t in tensors]
    lam_t = torch.tensor(lam, device=grad.device, requires_grad=True)
    gamma = torch.tensor(LAM, device=grad.device, requires_grad=True)
    out = head(*leaves, lam_t, None if integral is None else Integral(integral, gamma))
    out.backward(grad.to(out.dtype))
    result = {"out": out.detach().float(), "dlambda": lam_t.grad.float()}
    result |= {f"d{name}": leaf.grad.float() for name, leaf in zip(NAMES, leaves, strict=True)}
    if integral is not None:
        result["dgamma"] = gamma.grad.float()
    return result


def plain(q1, q2, k1, k2, v, lam, integral):
    return per_map_head(q1, q2, k1, k2, v, lam, integral, None, False)[0]


def part_along(error: torch.Tensor, direction: torch.Tensor) -> float:
    """The coefficient of `direction` in `error`'s least-squares fit."""
    direction = direction.double()
    return ((error.double() * direction).sum() / (direction * direction).sum().clamp_min(1e-300)).item()


def failures(got: dict, want: dict, moved: dict, dtype: torch.dtype) -> list[str]:
    """Why the tensors of `got` are off `want` (lambda's 1% move: `moved`), one line each; none when they match."""
    wrong = []
    for name, ref in want.items():
        error = got[name].double() - ref.double()
        size = relative_error(got[name], ref)
        if size > ROUNDING[dtype]:
            wrong.append(f"{name}: relative error {size:.2e} > {ROUNDING[dtype]:.0e}")
        scaled = part_along(error, ref)
        if ref.numel() >= AVERAGED and abs(scaled) > SCALE_BIAS:  # a scalar's error is its rounding alone
            wrong.append(f"{name}: relative error along itself {scaled:+.2e} (a tensor {100 * scaled:+.2f}% off)")
        move = moved[name].double() - ref.double()
        if move.abs().max() > 0 and abs(part_along(error, move)) > 0.5:
            wrong.append(f"{name}: relative error along lambda's 1% move x{part_along(error, move):+.2f}")
    return wrong


def check_head(head, inputs: list[torch.Tensor], integral: str | None) -> None:
    """Assert the head, run on inputs in their dtype, matches the fp32 plain path on the same values."""
    dtype = inputs[0].dtype
    want = run_head(plain, inputs, integral, torch.float32)
    moved = run_head(plain, inputs, integral, torch.float32, lam=LAM * 1.01)
    assert failures(moved, want, moved, dtype), "the tolerances let lambda 1% off pass"
    wrong = failures(run_head(head, inputs, integral, dtype), want, moved, dtype)
    assert not wrong, "; ".join(wrong)

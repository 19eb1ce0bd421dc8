"""tests/kernel_check.py, the GPU kernels' check, on the CPU: the plain path in half precision passes it, and a head
whose lambda is 1% off fails it, so the check on CUDA can neither reject a sound kernel nor pass a subtly wrong one."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_check import LAM, check_head, head_inputs, plain


@pytest.mark.parametrize("integral", [None, "softmax"])
def test_the_plain_path_in_bf16_passes_the_gpu_kernel_check(integral):
    check_head(plain, head_inputs("cpu", torch.bfloat16, t=96), integral)


@pytest.mark.parametrize("integral", [None, "softmax"])
@pytest.mark.parametrize("scale", [1.01, 0.99])
def test_a_head_with_lambda_one_percent_off_fails_it(integral, scale):
    def off(q1, q2, k1, k2, v, lam, integral):
        return plain(q1, q2, k1, k2, v, lam * scale, integral)

    with pytest.raises(AssertionError, match="relative error"):
        check_head(off, head_inputs("cpu", torch.bfloat16, t=96), integral)
    assert LAM * scale != LAM

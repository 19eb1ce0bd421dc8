"""diffexp/kernels/triton_dint.py against the float64 references of tests/reference.py: DINT's integral A3 V
(output and the gradients of q1, k1 and v) and map 1's log-sum-exp from flex_attention.

Without CUDA the kernels run through Triton's CPU interpreter: tests/conftest.py sets TRITON_INTERPRET=1 before
triton is first imported. Shapes are small (the interpreter runs each program in Python); T = 1, 17 and 100 end
inside a tile, 64 fills whole tiles.
"""

from __future__ import annotations

import math

import pytest
import torch

from diffexp.kernels.triton_support import interpreter_requested, unavailable_reason
from tests.reference import causal_softmax_rows, integral_term

DEVICE = "cuda" if torch.cuda.is_available() and not interpreter_requested() else "cpu"
REASON = unavailable_reason(DEVICE)
if REASON is not None:
    pytest.skip(f"the Triton kernels cannot run here: {REASON}", allow_module_level=True)

from diffexp.kernels.triton_dint import dint_integral, map1_attention, map1_lse  # noqa: E402

# eager flex_attention (CPU) says it materialises the scores: expected at these sizes
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
F64, F32 = torch.float64, torch.float32
TOLERANCE = {F64: dict(rtol=1e-10, atol=1e-10), F32: dict(rtol=2e-5, atol=2e-5)}


def tensors(b, h, hk, t, d, dv, dtype, seed=0):
    """q1 (b, h, t, d), k1 (b, hk, t, d), v (b, hk, t, dv), requiring grad."""
    gen = torch.Generator().manual_seed(seed)

    def make(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype).to(DEVICE).requires_grad_()

    return make(b, h, t, d), make(b, hk, t, d), make(b, hk, t, dv)


def reference_integral(q, k, v, scale=None):
    """A3 V head by head from the naive float64 maps (query head p reads kv head p // (h / h_kv))."""
    b, h, t, d = q.shape
    group = h // k.shape[1]
    q = q.double() * (1.0 if scale is None else scale * math.sqrt(d))  # the reference scales by 1/sqrt(d)
    out = [[integral_term(causal_softmax_rows(q[i, p].cpu(), k[i, p // group].double().cpu()), "softmax")
            @ v[i, p // group].double().cpu() for p in range(h)] for i in range(b)]
    return torch.stack([torch.stack(row) for row in out])


def naive_lse(q, k, scale):
    t = q.shape[-2]
    group = q.shape[1] // k.shape[1]
    scores = q.double() @ k.double().repeat_interleave(group, dim=1).transpose(-1, -2) * scale
    return scores.masked_fill(torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1), -math.inf).logsumexp(-1)


# batch, query heads, kv heads, T, d, V width, query block, key block, dtype
CASES = [
    pytest.param(1, 2, 2, 1, 16, 16, None, None, F64, id="T1"),
    pytest.param(2, 2, 2, 17, 16, 32, None, None, F64, id="B2-T17-dv2d"),
    pytest.param(2, 2, 2, 17, 16, 16, 16, 16, F64, id="B2-T17-blocks16"),
    pytest.param(1, 2, 1, 64, 16, 32, 16, 32, F64, id="gqa-T64-keyblock32"),
    pytest.param(1, 2, 2, 100, 16, 16, 32, 16, F64, id="T100-queryblock32"),
    pytest.param(1, 4, 2, 100, 16, 32, 16, 16, F32, id="fp32-gqa-T100"),
]


@pytest.mark.parametrize("b, h, hk, t, d, dv, block_m, block_n, dtype", CASES)
def test_integral_and_its_gradients_match_the_float64_reference(b, h, hk, t, d, dv, block_m, block_n, dtype):
    q, k, v = tensors(b, h, hk, t, d, dv, dtype)
    lse = naive_lse(q.detach(), k.detach(), 1.0 / math.sqrt(d)).to(dtype)
    out = dint_integral(q, k, v, lse, block_m=block_m, block_n=block_n)
    want = reference_integral(q, k, v)
    assert out.dtype == dtype and out.shape == (b, h, t, dv)
    torch.testing.assert_close(out.double().cpu(), want, **TOLERANCE[dtype])
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    expected = torch.autograd.grad(want, (q, k, v), grad.double().cpu())
    for name, g, w in zip(("q1", "k1", "v"), got, expected):
        assert g.dtype == dtype
        torch.testing.assert_close(g.double().cpu(), w.double(), **TOLERANCE[dtype],
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_a_given_scale_and_strided_inputs():
    """A scale other than 1/sqrt(d), and q1, k1, v as views of (B, T, h, d) projections (as a model holds them)."""
    b, h, t, d = 1, 2, 23, 16
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(b, t, h, d, generator=gen, dtype=F64).to(DEVICE).requires_grad_() for _ in range(3))
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
    scale = 0.4
    out = dint_integral(qh, kh, vh, naive_lse(qh.detach(), kh.detach(), scale), scale=scale, block_m=16, block_n=16)
    want = reference_integral(qh, kh, vh, scale=scale)
    torch.testing.assert_close(out.cpu(), want, **TOLERANCE[F64])
    grad = torch.randn_like(out)
    for g, w in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad.cpu())):
        torch.testing.assert_close(g.cpu(), w, **TOLERANCE[F64])


def test_dint_head_on_map1_from_flex_attention():
    """lse1 from map1_lse feeds the integral: the pair gives the reference's A3 V, gradients included."""
    q, k, v = tensors(1, 2, 1, 21, 16, 32, F64, seed=2)
    out = dint_integral(q, k, v, map1_lse(q, k), block_m=16, block_n=16)
    want = reference_integral(q, k, v)
    torch.testing.assert_close(out.cpu(), want, **TOLERANCE[F64])
    grad = torch.randn_like(out)
    for g, w in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad.cpu())):
        torch.testing.assert_close(g.cpu(), w, **TOLERANCE[F64])


@pytest.mark.parametrize("hk, scale, dtype", [(2, None, F64), (1, 0.3, F64), (2, None, F32)],
                         ids=["mha", "gqa-scale0.3", "fp32"])
def test_map1_lse_matches_a_naive_logsumexp(hk, scale, dtype):
    q, k, _ = (x.detach() for x in tensors(2, 2, hk, 37, 16, 16, dtype, seed=3))
    lse = map1_lse(q, k, scale)
    want = naive_lse(q, k, 1.0 / math.sqrt(16) if scale is None else scale)
    assert lse.shape == (2, 2, 37) and lse.dtype == (F64 if dtype == F64 else F32)
    torch.testing.assert_close(lse.double(), want, **TOLERANCE[dtype])


def test_map1_attention_gives_a1_v():
    q, k, v = tensors(1, 2, 1, 19, 16, 32, F64, seed=4)
    if DEVICE == "cpu":  # torch 2.13's flex_attention refuses CPU inputs that require grad (no CPU backward)
        q, k, v = (x.detach() for x in (q, k, v))
    out, lse = map1_attention(q, k, v)
    a1 = torch.stack([torch.stack([causal_softmax_rows(q[0, p].cpu(), k[0, 0].cpu()) for p in range(2)])])
    want = a1 @ v.double().cpu()
    torch.testing.assert_close(out.cpu(), want, **TOLERANCE[F64])
    torch.testing.assert_close(lse, naive_lse(q.detach(), k.detach(), 0.25), **TOLERANCE[F64])
    if DEVICE == "cpu":
        return
    grad = torch.randn_like(out)
    for g, w in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad.cpu())):
        torch.testing.assert_close(g.cpu(), w.to(g.device), **TOLERANCE[F64])


def test_bad_shapes_and_tiles_are_refused():
    q, k, v = (x.detach() for x in tensors(1, 3, 2, 8, 16, 16, F64))
    lse = torch.zeros(1, 3, 8, dtype=F64, device=DEVICE)
    with pytest.raises(ValueError, match="h_kv dividing h"):
        dint_integral(q, k, v, lse)
    with pytest.raises(ValueError, match=r"lse \(1, 3, 7\)"):
        dint_integral(q, k[:, :1].expand(1, 3, 8, 16), v[:, :1].expand(1, 3, 8, 16), lse[..., :7])
    with pytest.raises(ValueError, match="powers of two >= 16, got 24"):
        dint_integral(q, k[:, :1], v[:, :1], lse, block_m=24)


@pytest.mark.parametrize("t", [1, 77, 128, 300, 512])
def test_the_written_causal_block_mask_is_create_block_masks(t):
    """causal_blocks writes the causal mask's blocks down (no T x T evaluation, cheap in a compiled graph): the same
    mask as create_block_mask finds, entry for entry, and the same attention."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from diffexp.kernels.triton_dint import _causal, causal_blocks

    written, found = causal_blocks(t, "cpu"), create_block_mask(_causal, None, None, t, t, device="cpu")
    assert torch.equal(written.to_dense(), found.to_dense())
    q, k, v = (torch.randn(1, 2, t, 16, dtype=torch.float64) for _ in range(3))
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=written),
                               flex_attention(q, k, v, block_mask=found), rtol=0, atol=1e-12)


def spread_batches(b, h, t, widths, batch_stride, first, tmp_path):
    """Tensors (b, h, t, width) for each width whose batch elements lie batch_stride elements apart, from element
    `first` of one fp32 storage that spans the last of them: 16 GiB here, a sparse file's mapping on the CPU (only
    the pages the tensors use are ever written or read), device memory on CUDA."""
    size = first + (b - 1) * batch_stride + h * t * sum(widths)
    if DEVICE == "cpu":
        path = tmp_path / "storage"
        with open(path, "wb") as f:
            f.truncate(size * 4)
        storage = torch.from_file(str(path), shared=True, size=size, dtype=F32)
    else:
        storage = torch.empty(size, dtype=F32, device=DEVICE)
    gen = torch.Generator().manual_seed(5)
    out, offset = [], first
    for width in widths:
        x = storage.as_strided((b, h, t, width), (batch_stride, t * width, width, 1), offset)
        x.copy_(torch.randn(b, h, t, width, generator=gen, dtype=F32))
        out.append(x.requires_grad_())
        offset += h * t * width
    return out


def test_offsets_past_two_to_the_31_elements(tmp_path):
    """Batch element 2 of q1, k1 and v starts 2 * (2^31 - 2^20) elements past element 0 of its tensor, as in a
    batch of long sequences: 32-bit offset arithmetic wraps that to 2^21 elements before element 0 (still inside
    the storage here, so a wrapped read gives wrong numbers rather than a crash). The stride itself fits in 32 bits,
    so Triton passes it as int32, and only the kernels' own arithmetic decides."""
    b, h, t, d = 3, 1, 17, 16
    stride = 2**31 - 2**20
    q, k, v = spread_batches(b, h, t, (d, d, 2 * d), stride, 2**21, tmp_path)
    assert 2 * stride >= 2**31 > stride
    out = dint_integral(q, k, v, naive_lse(q.detach(), k.detach(), 1.0 / math.sqrt(d)).to(F32))
    qc, kc, vc = (x.detach().clone().requires_grad_() for x in (q, k, v))
    want = reference_integral(qc, kc, vc)
    torch.testing.assert_close(out.double().cpu(), want, **TOLERANCE[F32])
    grad = torch.randn_like(out)
    for name, g, w in zip(("q1", "k1", "v"), torch.autograd.grad(out, (q, k, v), grad),
                          torch.autograd.grad(want, (qc, kc, vc), grad.double().cpu())):
        torch.testing.assert_close(g.double().cpu(), w.double(), **TOLERANCE[F32],
                                   msg=lambda m, name=name: f"{name}: {m}")

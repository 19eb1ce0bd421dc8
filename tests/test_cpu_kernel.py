"""The compiled CPU attention kernel (diffexp/model/kernels/cpu_native.py) against naive float64 references built
from whole T x T maps: values and the gradient of every input (lambda per row or one lambda, DINT's gamma), GQA,
lengths that are not a multiple of the block, one token, causality, other dtypes, and its fallback."""

from __future__ import annotations

import pytest
import torch

from diffexp.model.kernels import cpu_native, forced_kernel, resolve_kernel
from tests.helpers import require_cpu_kernel


@pytest.fixture(autouse=True)
def kernel():
    require_cpu_kernel()


def causal_maps(q, k):
    """softmax(q k^T / sqrt(d)) with the causal mask, GQA by repeating kv heads: (B, h, T, T)."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    logits = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    t = q.shape[-2]
    future = torch.ones(t, t, dtype=torch.bool).triu(1)
    return logits.masked_fill(future, float("-inf")).softmax(-1)


def naive_integral(a1):
    """A3: row n is the softmax over j <= n of the mean of A1's rows 0..n."""
    t = a1.shape[-1]
    g = a1.cumsum(-2) / torch.arange(1, t + 1, dtype=a1.dtype).unsqueeze(-1)
    return g.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)


def naive_head(q1, q2, k1, k2, v, lam, gamma=None):
    """(A1 - lambda A2 [+ gamma A3]) V; lam 0-d or (B, h, T)."""
    a1, a2 = causal_maps(q1, k1), causal_maps(q2, k2)
    lam = lam.unsqueeze(-1) if lam.dim() else lam
    final = a1 - lam * a2
    if gamma is not None:
        final = final + gamma * naive_integral(a1)
    return final @ v.repeat_interleave(q1.shape[1] // v.shape[1], dim=1)


def inputs_for(heads, kv_heads, t, d=8, dv=16, per_row=False, seed=0):
    torch.manual_seed(seed)
    lam = torch.rand(2, heads, t) if per_row else torch.tensor(0.37)
    return [torch.randn(2, heads, t, d), torch.randn(2, heads, t, d), torch.randn(2, kv_heads, t, d),
            torch.randn(2, kv_heads, t, d), torch.randn(2, kv_heads, t, dv), lam]


def compare(fn, reference, inputs, names, rtol=2e-5, atol=2e-5):
    """fn in fp32 against reference in fp64: the output and every input's gradient."""
    got_in = [t.clone().requires_grad_(True) for t in inputs]
    want_in = [t.double().requires_grad_(True) for t in inputs]
    got, want = fn(*got_in), reference(*want_in)
    grad = torch.randn_like(got)
    got.backward(grad)
    want.backward(grad.double())
    torch.testing.assert_close(got, want.float(), rtol=rtol, atol=atol)
    for name, g, w in zip(names, got_in, want_in, strict=True):
        scale = w.grad.abs().max().item()
        torch.testing.assert_close(g.grad, w.grad.float(), rtol=rtol, atol=atol * max(scale, 1.0),
                                   msg=lambda m, name=name: f"d{name}: {m}")


@pytest.mark.parametrize("heads, kv_heads, t, block, per_row", [
    (4, 4, 37, 16, False), (4, 2, 130, 64, True), (2, 1, 64, 64, False), (2, 2, 1, 8, True), (6, 3, 70, 32, True)])
def test_two_map_equals_naive(heads, kv_heads, t, block, per_row):
    inputs = inputs_for(heads, kv_heads, t, per_row=per_row, seed=t + heads)
    compare(lambda *a: cpu_native.two_map(*a, block_rows=block), naive_head, inputs,
            ("q1", "q2", "k1", "k2", "v", "lambda"))


def test_two_map_with_shared_keys_as_diff_v2_calls_it():
    """DIFF V2 passes one K for both maps of a pair: the two dK contributions must add up."""
    q1, q2, k, _, v, lam = inputs_for(4, 2, 45, dv=8, per_row=True, seed=3)
    compare(lambda q1, q2, k, v, lam: cpu_native.two_map(q1, q2, k, k, v, lam, block_rows=16),
            lambda q1, q2, k, v, lam: naive_head(q1, q2, k, k, v, lam), [q1, q2, k, v, lam],
            ("q1", "q2", "k", "v", "lambda"))


@pytest.mark.parametrize("heads, kv_heads, t, block", [(4, 4, 37, 16), (4, 2, 100, 32), (2, 2, 1, 8)])
def test_dint_equals_naive(heads, kv_heads, t, block):
    """DINT's head with a gamma of its own (learned) and with gamma = lambda (the paper)."""
    *inputs, lam = inputs_for(heads, kv_heads, t, seed=t)
    compare(lambda *a: cpu_native.dint_head(*a, block_rows=block), naive_head, [*inputs, lam, torch.tensor(0.6)],
            ("q1", "q2", "k1", "k2", "v", "lambda", "gamma"))
    compare(lambda *a: cpu_native.dint_head(*a, a[-1], block_rows=block), lambda *a: naive_head(*a, a[-1]),
            [*inputs, lam], ("q1", "q2", "k1", "k2", "v", "lambda"))


@pytest.mark.parametrize("head", ["two_map", "dint"])
def test_causal(head):
    """Changing the last token's keys and values changes no earlier output, across block boundaries."""
    q1, q2, k1, k2, v, lam = inputs_for(2, 2, 40)
    run = (lambda *a: cpu_native.two_map(*a, block_rows=16)) if head == "two_map" else (
        lambda *a: cpu_native.dint_head(*a, a[-1], block_rows=16))
    out = run(q1, q2, k1, k2, v, lam)
    k1b, k2b, vb = k1.clone(), k2.clone(), v.clone()
    for tensor in (k1b, k2b, vb):
        tensor[..., -1, :] += 3.0
    changed = run(q1, q2, k1b, k2b, vb, lam)
    torch.testing.assert_close(changed[..., :-1, :], out[..., :-1, :], rtol=0, atol=0)
    assert not torch.allclose(changed[..., -1, :], out[..., -1, :])


def test_other_dtypes_are_cast_in_and_out():
    inputs = [t.bfloat16() for t in inputs_for(2, 2, 20)]
    leaves = [t.requires_grad_(True) for t in inputs]
    out = cpu_native.two_map(*leaves)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and all(t.grad.dtype == torch.bfloat16 for t in leaves)
    want = naive_head(*(t.detach().double() for t in inputs))
    torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=2e-2)


def test_cpu_fp32_takes_the_kernel_and_fp64_the_pytorch_pass():
    assert resolve_kernel("sdpa", torch.zeros(1)) == "cpu_native"
    assert resolve_kernel("sdpa", torch.zeros(1, dtype=torch.float64)) == "blocked"


def test_unavailable_kernel_falls_back_with_one_warning(monkeypatch):
    monkeypatch.setattr(cpu_native, "unavailable_reason", lambda: "no compiler (test)")
    monkeypatch.setattr(cpu_native, "_warned", [])
    with pytest.warns(UserWarning, match="no compiler \\(test\\).*PyTorch-ops pass"):
        assert resolve_kernel("sdpa", torch.zeros(1)) == "blocked"
    assert resolve_kernel("sdpa", torch.zeros(1)) == "blocked"  # warned once
    with pytest.raises(RuntimeError, match="no compiler"):
        with forced_kernel("cpu_native"):
            pass


def test_switch_and_broken_build_give_reasons_not_errors(monkeypatch, tmp_path):
    monkeypatch.setenv(cpu_native.SWITCH, "0")
    assert cpu_native.unavailable_reason.__wrapped__() == f"{cpu_native.SWITCH}=0"
    monkeypatch.delenv(cpu_native.SWITCH)
    broken = tmp_path / "broken.cpp"
    broken.write_text("#error this kernel does not compile\n")
    monkeypatch.setattr(cpu_native, "SOURCE", broken)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "build"))  # never the real kernel's build directory
    reason = cpu_native.unavailable_reason.__wrapped__()
    assert reason is not None and reason.startswith("building broken.cpp failed")


def naive_step_probabilities(q, k, lengths):
    """softmax(q k^T / sqrt(d)) in float64 over each batch row's first lengths[b] keys (all when None)."""
    keys = k.shape[-2]
    visible = torch.arange(keys) < (torch.full((q.shape[0],), keys) if lengths is None else lengths)[:, None]
    logits = (q.double() @ k.double().transpose(-1, -2)) / q.shape[-1] ** 0.5
    return logits.masked_fill(~visible[:, None, None], float("-inf")).softmax(-1), visible


@pytest.mark.parametrize("rows", [1, 2, 4, 7])
@pytest.mark.parametrize("keys, capacity", [(1, 1), (3, 9), (130, 130), (1027, 1100)])
@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("d", [16, 12])  # a multiple of the vector width, and not
@pytest.mark.parametrize("dv", [24, 64])  # values summed in blocks of 32 columns where they split so, else not
def test_step_products_equal_naive(rows, keys, capacity, ragged, d, dv):
    """A decoding step's two products against float64 matmuls: the query rows of each group, keys that are a view
    into a larger cache, each batch row reading its own first lengths[b] keys (the rest weigh 0)."""
    torch.manual_seed(rows * 1000 + keys)
    b, groups = 3, 2
    q = torch.randn(b, groups, rows, d)
    k = torch.randn(b, groups, capacity, d)[..., :keys, :]
    v = torch.randn(b, groups, capacity, dv)[..., :keys, :]
    lengths = torch.tensor([keys, max(1, keys // 2), 1]) if ragged else None
    want, visible = naive_step_probabilities(q, k, lengths)
    got = cpu_native.step_probabilities(q, k, lengths)
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-5)
    weights = torch.randn(b, groups, rows, keys) * visible[:, None, None]
    torch.testing.assert_close(cpu_native.step_values(weights, v, lengths).double(), weights.double() @ v.double(),
                               atol=1e-4, rtol=1e-4)  # fp32 sums of up to 1027 terms of size ~1


@pytest.mark.parametrize("rows", [1, 2, 3, 9])
@pytest.mark.parametrize("keys, capacity", [(1, 1), (3, 9), (1027, 1100)])
@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("d", [16, 12])
@pytest.mark.parametrize("dv", [24, 64])
def test_step_attention_equals_naive(rows, keys, capacity, ragged, d, dv):
    """One map per row, both phases in one op: softmax(q k^T / sqrt(d)) v against float64, each batch row reading
    its own first lengths[b] keys of a view into a larger cache."""
    torch.manual_seed(rows * 1000 + keys)
    b, groups = 3, 2
    q = torch.randn(b, groups, rows, d) * 2
    k = torch.randn(b, groups, capacity, d)[..., :keys, :]
    v = torch.randn(b, groups, capacity, dv)[..., :keys, :]
    lengths = torch.tensor([keys, max(1, keys // 2), 1]) if ragged else None
    want = naive_step_probabilities(q, k, lengths)[0] @ v.double()
    torch.testing.assert_close(cpu_native.step_attention(q, k, v, lengths).double(), want, atol=1e-5, rtol=1e-4)


def test_step_softmax_of_far_apart_logits_and_a_nan():
    """Logits hundreds apart (most weights underflow, as a peaked map's do) equal float64's softmax; a NaN key
    makes its batch row's output NaN, never a finite number that hides it."""
    torch.manual_seed(5)
    q = torch.randn(2, 2, 3, 16) * 40
    k = torch.randn(2, 2, 301, 16)
    v = torch.randn(2, 2, 301, 8)
    want, _ = naive_step_probabilities(q, k, None)
    torch.testing.assert_close(cpu_native.step_probabilities(q, k, None).double(), want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(cpu_native.step_attention(q, k, v, None).double(), want @ v.double(), atol=1e-5,
                               rtol=1e-4)
    k[1, 0, 17, 3] = float("nan")
    out = cpu_native.step_attention(q, k, v, None)
    assert out[1, 0].isnan().all() and not out[0].isnan().any() and not out[1, 1].isnan().any()


@pytest.mark.parametrize("pairs", [1, 2, 3, 5])
@pytest.mark.parametrize("keys, capacity", [(1, 1), (5, 9), (1027, 1100)])
@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("d", [16, 12])
@pytest.mark.parametrize("dv", [20, 64])
def test_step_pair_attention_equals_naive(pairs, keys, capacity, ragged, d, dv):
    """DIFF V2's pairs in one pass: the two maps of pair i (rows 2i and 2i + 1 of q) read one K, and V is weighted
    by softmax(q_2i k^T) - lambda_i softmax(q_2i+1 k^T), against float64."""
    torch.manual_seed(pairs * 1000 + keys)
    b, groups = 3, 2
    q = torch.randn(b, 2 * pairs, groups, d).transpose(1, 2) * 2  # any strides: the kernel copies what it must
    k = torch.randn(b, groups, capacity, d)[..., :keys, :]
    v = torch.randn(b, groups, capacity, dv)[..., :keys, :]
    lam = torch.rand(b, groups, pairs) * 2 - 0.5  # sigmoid's range and beyond ("raw" lambda)
    lengths = torch.tensor([keys, max(1, keys // 2), 1]) if ragged else None
    probs, _ = naive_step_probabilities(q, k, lengths)
    want = (probs[:, :, 0::2] - lam.double()[..., None] * probs[:, :, 1::2]) @ v.double()
    got = cpu_native.step_pair_attention(q, k, v, lam, lengths)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("given", [True, False])
def test_two_map_step_reads_diff_v2s_query_heads_as_pairs(given):
    """DIFF V2's decoding step: query heads 2p and 2p + 1 are the two maps of head p, in GQA groups; passed as one
    tensor (`pairs`, as DIFF V2 does) or as the two maps' views, the step equals the naive maps in float64."""
    from diffexp.model.kernels.cached_step import two_map_step

    torch.manual_seed(3)
    b, h, h_kv, keys, d = 2, 4, 2, 300, 16
    q = torch.randn(b, 2 * h, 1, d)
    k, v = torch.randn(b, h_kv, keys, d), torch.randn(b, h_kv, keys, d)
    lam = torch.rand(b, h, 1, 1)
    lengths = torch.tensor([keys, 120])
    with torch.no_grad():
        got = two_map_step(q[:, 0::2], q[:, 1::2], k, k, v, lam, lengths, pairs=q if given else None)
    probs, _ = naive_step_probabilities(q.view(b, h_kv, 2 * h // h_kv, d), k, lengths)  # rows: a group's heads
    per_head = probs.reshape(b, 2 * h, keys)
    want = (per_head[:, 0::2] - lam.double().view(b, h, 1) * per_head[:, 1::2]).view(b, h_kv, h // h_kv, keys)
    want = (want @ v.double()).view(b, h, 1, d)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("keys, capacity", [(1, 1), (5, 9), (1027, 1100)])
@pytest.mark.parametrize("ragged", [False, True])
def test_step_two_map_attention_equals_naive(rows, keys, capacity, ragged):
    """DIFF V1's and Shared DIFF's step: each map's rows read their own K, and V is weighted by
    softmax(q1 k1^T) - lambda softmax(q2 k2^T) row by row, against float64."""
    torch.manual_seed(rows * 1000 + keys)
    b, groups, d, dv = 3, 2, 16, 32
    q1, q2 = torch.randn(b, groups, rows, d) * 2, torch.randn(b, groups, rows, d) * 2
    k1, k2 = (torch.randn(b, groups, capacity, d)[..., :keys, :] for _ in range(2))
    v = torch.randn(b, groups, capacity, dv)[..., :keys, :]
    lam = torch.rand(b, groups, rows) * 2 - 0.5
    lengths = torch.tensor([keys, max(1, keys // 2), 1]) if ragged else None
    want = (naive_step_probabilities(q1, k1, lengths)[0]
            - lam.double()[..., None] * naive_step_probabilities(q2, k2, lengths)[0]) @ v.double()
    torch.testing.assert_close(cpu_native.step_two_map_attention(q1, k1, q2, k2, v, lam, lengths).double(), want,
                               atol=1e-5, rtol=1e-4)


def naive_dint_step(q1, k1, q2, k2, v, lam, gamma, col_sums, positions, lengths, softmax_integral):
    """DINT's step in float64: A1's row joins the column sums of the rows before it, G = sums / (position + 1), A3 =
    softmax of G over the visible keys (or G), and V weighted by A1 - lam A2 + gamma A3; returns (out, new sums)."""
    b, groups, rows, _ = q1.shape
    a1, visible = naive_step_probabilities(q1, k1, lengths)
    a2, _ = naive_step_probabilities(q2, k2, lengths)
    keys = k1.shape[-2]
    sums = col_sums.double().clone()
    sums[..., :keys] += a1.reshape(b, groups * rows, keys)
    mean = (sums[..., :keys] / (positions.double() + 1).view(-1, 1, 1)).view(b, groups, rows, keys)
    a3 = mean.masked_fill(~visible[:, None, None], float("-inf")).softmax(-1) if softmax_integral else mean
    combined = a1 - lam.double().view(b, groups, rows, 1) * a2 + gamma.double() * a3
    return (combined * visible[:, None, None]) @ v.double(), sums


@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("keys, capacity", [(1, 1), (5, 9), (1027, 1100)])
@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("softmax_integral", [True, False], ids=["softmax", "mean"])
def test_step_dint_attention_equals_naive(rows, keys, capacity, ragged, softmax_integral):
    """DINT's step in one op: both maps, A1's row added to the cached column sums in place (past each batch row's
    visible keys they stay as they were), the integral A3 from them, and V weighted by A1 - lambda A2 + gamma A3,
    against float64."""
    torch.manual_seed(rows * 1000 + keys)
    b, groups, d, dv = 3, 2, 16, 32
    q1, q2 = torch.randn(b, groups, rows, d) * 2, torch.randn(b, groups, rows, d) * 2
    k1, k2 = (torch.randn(b, groups, capacity, d)[..., :keys, :] for _ in range(2))
    v = torch.randn(b, groups, capacity, dv)[..., :keys, :]
    lam = torch.rand(b, groups * rows) * 2 - 0.5
    gamma = torch.tensor([0.7])
    lengths = torch.tensor([keys, max(1, keys // 2), 1]) if ragged else None
    visible = torch.full((b,), keys) if lengths is None else lengths
    positions = visible - 1 + torch.tensor([0, 3, 7])  # a row's position may lie past its last visible key
    col_sums = torch.rand(b, groups * rows, capacity + 4) * visible.view(-1, 1, 1)  # earlier rows' sums, any size
    want, want_sums = naive_dint_step(q1, k1, q2, k2, v, lam, gamma, col_sums, positions, lengths, softmax_integral)
    got = cpu_native.step_dint_attention(q1, k1, q2, k2, v, lam, gamma, col_sums, positions, lengths,
                                         softmax_integral)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(col_sums.double(), want_sums, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("visible", [None, 700, 300])
@pytest.mark.parametrize("batch, threads", [(1, 4), (3, 2), (3, 1)])
@pytest.mark.parametrize("dv", [24, 96])
def test_step_ops_exact_whether_a_task_holds_a_chunk_or_whole_rows(visible, batch, threads, dv):
    """Where the groups do not split evenly over the threads (1 on 4, 3 on 2) a row's keys are split into chunks,
    one task each, each exponentiated against its own maximum; the chunks are rescaled to one softmax. Where they
    do (3 on 1), a task holds whole rows and scores, normalises and reads V at once. Peaked scores (one chunk far
    above the rest) and chunks left partly or wholly empty by lengths, against float64."""
    torch.manual_seed(7)
    keys, d = 1027, 16
    q = torch.randn(batch, 1, 4, d) * 6
    k, v = torch.randn(batch, 1, keys, d), torch.randn(batch, 1, keys, dv)
    lam = torch.rand(batch, 1, 2)
    lengths = None if visible is None else torch.tensor([visible, keys, 1][:batch])
    probs, _ = naive_step_probabilities(q, k, lengths)
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)  # the same tasks whatever the machine's cores
    try:
        checks = [
            (cpu_native.step_probabilities(q, k, lengths), probs),
            (cpu_native.step_attention(q, k, v, lengths), probs @ v.double()),
            (cpu_native.step_pair_attention(q, k, v, lam, lengths),
             (probs[:, :, 0::2] - lam.double()[..., None] * probs[:, :, 1::2]) @ v.double()),
            (cpu_native.step_two_map_attention(q[:, :, :2], k, q[:, :, 2:], k.flip(2), v, lam, lengths),
             (probs[:, :, :2] - lam.double()[..., None] * naive_step_probabilities(q[:, :, 2:], k.flip(2),
                                                                                 lengths)[0]) @ v.double()),
            (cpu_native.step_values(probs.float(), v, lengths), probs @ v.double()),
        ]
        sums, positions, gamma = torch.rand(batch, 2, keys), torch.full((batch,), keys + 5), torch.tensor([0.4])
        want, _ = naive_dint_step(q[:, :, :2], k, q[:, :, 2:], k.flip(2), v, lam.view(batch, 2), gamma, sums,
                                  positions, lengths, True)
        checks.append((cpu_native.step_dint_attention(q[:, :, :2], k, q[:, :, 2:], k.flip(2), v, lam.view(batch, 2),
                                                      gamma, sums, positions, lengths, True), want))
    finally:
        torch.set_num_threads(saved_threads)
    for got, want in checks:
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-4)


def test_step_ops_refuse_values_that_do_not_match_the_keys():
    q, k = torch.randn(1, 2, 2, 16), torch.randn(1, 2, 10, 16)
    with pytest.raises(RuntimeError, match="v must be"):
        cpu_native.step_attention(q, k, torch.randn(1, 2, 9, 16), None)


def test_a_decoding_step_takes_the_kernel_only_where_it_computes_the_step():
    x = torch.randn(1, 2, 4, 8)
    assert cpu_native.runs_step(x, x)
    assert not cpu_native.runs_step(x.double(), x)
    assert not cpu_native.runs_step(x.transpose(-1, -2), x)  # the last stride must be 1
    assert not cpu_native.runs_step(x.requires_grad_(), x)  # the ops have no backward
    with torch.no_grad():
        assert cpu_native.runs_step(x, x)

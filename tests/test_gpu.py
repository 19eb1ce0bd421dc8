"""GPU-only checks: bf16 training step, compiled blocks, the kernels picked on CUDA. Skipped without CUDA."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from diffexp import Decoder, ModelConfig
from diffexp.kernels import Integral
from tests.kernel_check import LAM, head_inputs, relative_error

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none)")
VARIANTS = ["baseline", "diff_v1", "diff_v2", "shared_diff", "dint", "softmax_sink", "gated", "softpick", "ssmax"]


def _pair(attention: str, backend: str):
    cfg = ModelConfig(attention=attention, vocab_size=512, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2,
                      backend=backend)
    fast = Decoder(cfg).cuda()
    eager = copy.deepcopy(fast)
    for block in eager.blocks:
        block.attn.backend = "eager"
    return fast, eager


#: (kernel, head case): what the door must pick on CUDA in half precision at the recipes' shapes (V 2d wide)
PICKED_ON_CUDA = [("sdpa_joined", None), ("gpu_dint", "softmax")]


@pytest.mark.parametrize("name, integral", PICKED_ON_CUDA)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernels_picked_on_cuda_match_the_fp32_plain_path_output_and_every_gradient(name, integral, dtype):
    """Each kernel the door picks on CUDA, on the head's plain tensors, against the fp32 plain path on the same
    (rounded) inputs: the output and the gradient of q1, q2, k1, k2, v, lambda (and gamma), each within half of what
    a 1% change of lambda moves it (tests/kernel_check.py), and the door picks it."""
    from diffexp.kernels import registry, resolve
    from tests.kernel_check import check_head

    inputs = head_inputs("cuda", dtype)
    head_integral = None if integral is None else Integral(integral, torch.tensor(LAM))
    picked = resolve(inputs[0], inputs[2], inputs[4], head_integral)
    assert picked is not None and picked.name == name, f"the door picked {picked} on CUDA in {dtype}"
    check_head(registry._KERNELS[name].head, inputs, integral)


@pytest.mark.parametrize("attention, name", [("diff_v1", "sdpa_joined"), ("dint", "gpu_dint")])
def test_kernels_picked_inside_inductor_compiled_blocks_match_eager(attention, name):
    """The recipes' default: the kernel inside an inductor-compiled block, bf16 autocast, picked (recorded at the
    trace) and equal to the same block eager on the fp32 plain path within bf16's rounding; gradients too."""
    from diffexp.kernels import PLAIN, recording, use
    from diffexp.model.compile import compile_blocks

    torch.compiler.reset()
    fast, plain = _pair(attention, "sdpa")
    assert compile_blocks(fast.blocks, torch.device("cuda")) is None
    tokens = torch.randint(0, 512, (2, 300), device="cuda")
    with recording() as picks, torch.autocast("cuda", dtype=torch.bfloat16):
        out_fast = fast(tokens).float()
    assert picks[name] >= 1 and not picks[PLAIN], dict(picks)
    with use(PLAIN):
        out_plain = plain(tokens).float()
    (out_fast.square().mean()).backward()
    (out_plain.square().mean()).backward()
    assert relative_error(out_fast, out_plain) < 3e-2
    for (param, p), q in zip(plain.named_parameters(), fast.parameters()):  # bf16 autocast's projections too
        assert relative_error(q.grad, p.grad) < 1e-1, param


@pytest.mark.parametrize("attention", VARIANTS)
def test_sdpa_with_the_kernels_picked_on_cuda_matches_eager_in_bf16(attention):
    """The whole model on the kernels the door picks on CUDA (sdpa_joined, gpu_dint) against the eager maps."""
    fast, eager = _pair(attention, "sdpa")
    idx = torch.randint(0, 512, (2, 256), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out_fast, out_eager = fast(idx).float(), eager(idx).float()
    torch.testing.assert_close(out_fast, out_eager, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("attention", VARIANTS)
def test_sdpa_bf16_training_step_is_finite_and_matches_eager(attention):
    fast, eager = _pair(attention, "sdpa")
    idx = torch.randint(0, 512, (2, 257), device="cuda")
    losses = []
    for model in (fast, eager):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(idx[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), idx[:, 1:].flatten())
        loss.backward()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[0] == pytest.approx(losses[1], rel=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_sink_on_cuda_is_one_sdpa_call_that_never_holds_its_map(dtype):
    """The sink as a key slot, its channels padded to CUDA's multiple of 8: an 8K GQA prompt stays far under its
    2 GiB of maps, and a short one equals the eager map with the sink's column, values and gradients."""
    from diffexp.model.heads.sink import eager_sink, sdpa_sink

    torch.manual_seed(0)
    sink = torch.randn(8, device="cuda")
    q = torch.randn(1, 8, 8192, 64, device="cuda", dtype=dtype)
    k, v = (torch.randn(1, 2, 8192, 64, device="cuda", dtype=dtype) for _ in range(2))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    sdpa_sink(q, k, v, sink)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - start < 256 * 2**20
    inputs = [t[:, :, :300].detach().float().requires_grad_() for t in (q, k, v)] + [sink.requires_grad_()]
    grad = torch.randn(1, 8, 300, 64, device="cuda")
    results = []
    for fn in (sdpa_sink, lambda *a: eager_sink(*a)[0]):
        out = fn(*[t.to(dtype) if t.dim() == 4 else t for t in inputs])
        results.append([out.float(), *torch.autograd.grad(out.float(), inputs, grad)])
    tolerance = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_long_gqa_prompt_never_holds_its_attention_map(dtype):
    """SDPA runs GQA in its math kernel on CUDA outside flash's cases (fp32, a mask), which holds every map:
    8 heads x 8K x 8K in fp32 are 2 GiB. attend must stay far under that, and equal the repeated-heads call."""
    from diffexp.model.heads.single_map import attend, expand_kv

    torch.manual_seed(0)
    q = torch.randn(1, 8, 8192, 64, device="cuda", dtype=dtype)
    k, v = (torch.randn(1, 2, 8192, 64, device="cuda", dtype=dtype) for _ in range(2))
    for t_q in (8192, 4096):  # a whole prompt; a chunk after a cache (a bottom-right mask)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        out = attend(q[:, :, -t_q:], k, v)[0]
        torch.cuda.synchronize()
        assert torch.cuda.max_memory_allocated() - start < 256 * 2**20
        ref = attend(q[:, :, -t_q:], expand_kv(k, 8), expand_kv(v, 8))[0]
        torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_fsdp_bf16_fit_logs_diagnostics_and_resumes_from_sharded_checkpoint(tmp_path):
    """The GPU recipes' path at toy size: FSDP2 (fully_shard per block, sharded checkpoints), bf16 compute,
    diagnostics observed inside the FSDP forward, the measured peak memory beside the estimate at the end, then
    `--ckpt_path last` continues the same run."""
    import torch.distributed.checkpoint  # noqa: F401  (sharded checkpoints need it)

    from tests.helpers import run_cli, scalars, write_recipe

    recipe = write_recipe(tmp_path, max_steps=8)
    fsdp = ('--trainer.strategy={"class_path": "diffexp.parallel.FSDP2Strategy", '
            '"init_args": {"mixed_precision": "bf16"}}')
    common = ["--trainer.accelerator=gpu", "--trainer.devices=1", fsdp,
              "--diagnostics.every_n_steps=2", "--model.optim.schedule_steps=12"]  # one lr schedule for both legs
    first = run_cli(["fit", "--config", str(recipe), *common], tmp_path)
    assert "peak memory" in first.stdout and "before training" in first.stdout  # the peak beside the estimate
    run_dir = tmp_path / "runs/run/version_0"
    logged = scalars(run_dir)
    assert "vitals/layer_01/act_kurtosis" in logged and "vitals/attn_logit_max" in logged
    assert (run_dir / "checkpoints/last.ckpt").is_dir()  # sharded: a directory

    run_cli(["fit", "--config", str(recipe), *common, "--trainer.max_steps=12", "--ckpt_path=last"], tmp_path)
    steps = [step for step, _ in scalars(run_dir)["train/loss"]]
    assert max(steps) > 8 and not (tmp_path / "runs/run/version_1").exists()


@pytest.mark.parametrize("attention", VARIANTS)
def test_inductor_compiled_blocks_match_eager_on_cuda(attention):
    """model.compile on CUDA (inductor's Triton code) against the same weights run eagerly, bf16 autocast."""
    from diffexp.model.compile import compile_blocks

    fast, eager = _pair(attention, "sdpa")
    assert compile_blocks(fast.blocks, torch.device("cuda")) is None
    tokens = torch.randint(0, 512, (2, 129), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out_fast, out_eager = fast(tokens), eager(tokens)
    torch.testing.assert_close(out_fast.float(), out_eager.float(), rtol=2e-2, atol=2e-2)

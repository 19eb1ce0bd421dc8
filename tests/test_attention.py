"""Numerics of every variant and flag: against naive references, fast == eager, causality, counts."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from diffexp import Decoder, ModelConfig
from diffexp.model.attention import build_attention
from diffexp.model.attention.differential import depth_lambda_init
from diffexp.model.decoder import named_seed
from tests.helpers import (  # noqa: F401  make_config, small_blocks: test_kv_cache.py's, for now
    CASES,
    SMALL,
    check_causality,
    check_fast_path_equals_eager,
    check_gradients_match_naive_reference,
    check_matches_naive_reference,
    make_config,
    small_blocks,
)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_matches_naive_reference(case, backend):
    check_matches_naive_reference(case, backend)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_every_gradient_matches_naive_reference(case, backend):
    check_gradients_match_naive_reference(case, backend)


@pytest.mark.parametrize("case", list(CASES))
def test_fast_path_equals_eager_forward_and_gradients(case):
    check_fast_path_equals_eager(case)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_causality(case, backend):
    check_causality(case, backend)


def test_lambda_init_depth_schedule():
    expected = [0.200, 0.356, 0.471, 0.556, 0.619]
    assert [round(depth_lambda_init(layer), 3) for layer in range(5)] == expected
    model = Decoder(ModelConfig(**{**SMALL, "attention": "diff_v1", "n_layers": 5}))
    assert [round(b.attn.lambda_init, 3) for b in model.blocks] == expected
    const = Decoder(ModelConfig(**{**SMALL, "attention": "shared_diff", "lambda_init": 0.8}))
    assert all(b.attn.lambda_init == 0.8 for b in const.blocks)


@pytest.mark.parametrize("integral", ["softmax", "mean"])
def test_dint_rows_sum_to_one(integral):
    model = Decoder(ModelConfig(**SMALL, attention="dint", integral=integral))
    _, maps = model(torch.randint(0, 61, (2, 30)), need_weights=True)
    for m in maps:
        torch.testing.assert_close(m.sum(-1), torch.ones_like(m.sum(-1)), rtol=0, atol=1e-5)


@pytest.mark.parametrize("integral", ["softmax", "mean"])
def test_dint_learned_gamma_changes_the_model_and_the_row_sums(integral):
    """gamma: learned weighs the integral term by a scalar of its own, so rows sum to 1 - lambda + gamma;
    with the same weights and gamma = lambda the output differs."""
    unified = Decoder(ModelConfig(**SMALL, attention="dint", integral=integral))
    learned = Decoder(ModelConfig(**SMALL, attention="dint", integral=integral, gamma="learned", gamma_init=0.9))
    missing, unexpected = learned.load_state_dict(unified.state_dict(), strict=False)
    assert sorted(missing) == [f"blocks.{i}.attn.gamma" for i in range(SMALL["n_layers"])] and not unexpected
    assert not any("gamma" in name for name, _ in unified.named_parameters())
    idx = torch.randint(0, 61, (2, 30))
    _, maps = learned(idx, need_weights=True)
    for block, m in zip(learned.blocks, maps):
        assert block.attn.gamma.item() == pytest.approx(0.9)
        expected = 1 - block.attn.lambda_().item() + 0.9
        torch.testing.assert_close(m.sum(-1), torch.full_like(m.sum(-1), expected), rtol=0, atol=1e-5)
    assert not torch.allclose(learned(idx), unified(idx), atol=1e-3)
    F.cross_entropy(learned(idx).flatten(0, 1), idx.flatten()).backward()
    assert all(b.attn.gamma.grad is not None and b.attn.gamma.grad != 0 for b in learned.blocks)
    starts = Decoder(ModelConfig(**SMALL, attention="dint", gamma="learned"))  # gamma_init: lambda_init
    assert [b.attn.gamma.item() for b in starts.blocks] == pytest.approx([b.attn.lambda_init for b in starts.blocks])


def test_diff_v1_rows_sum_to_one_minus_lambda():
    model = Decoder(ModelConfig(**SMALL, attention="diff_v1"))
    _, maps = model(torch.randint(0, 61, (1, 16)), need_weights=True)
    for block, m in zip(model.blocks, maps):
        lam = block.attn.lambda_().item()
        torch.testing.assert_close(m.sum(-1), torch.full_like(m.sum(-1), 1 - lam), rtol=0, atol=1e-5)


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
def test_diff_v2_pairing_follows_gqa_groups(n_kv_heads):
    h = 4
    group = 2 * h // n_kv_heads  # query head i reads kv head i // group
    same = build_attention(ModelConfig(**{**SMALL, "attention": "diff_v2", "n_kv_heads": n_kv_heads}), 0)
    first, second = range(2 * h)[same.first], range(2 * h)[same.second]
    assert all(i // group == j // group for i, j in zip(first, second))
    if n_kv_heads == 1:
        with pytest.raises(ValueError, match="pairing='cross'"):
            ModelConfig(**{**SMALL, "attention": "diff_v2", "n_kv_heads": 1, "pairing": "cross"})
        return
    cross = build_attention(
        ModelConfig(**{**SMALL, "attention": "diff_v2", "n_kv_heads": n_kv_heads, "pairing": "cross"}), 0)
    first, second = range(2 * h)[cross.first], range(2 * h)[cross.second]
    assert all(i // group != j // group for i, j in zip(first, second))


def _attn_params(cfg: ModelConfig) -> int:
    return sum(p.numel() for p in build_attention(cfg, 0).parameters())


def _qk_params(cfg: ModelConfig) -> int:
    attn = build_attention(cfg, 0)
    return sum(p.numel() for proj in (attn.q_proj, attn.k_proj) for p in proj.parameters())


def shared_diff_qk(d_model: int, h: int, h_kv: int, d: int, r: int, scope: str, sharing: str) -> int:
    """Shared DIFF's Q plus K parameters per layer, written out for each of the four settings (variants.md)."""
    formulas = {
        # one full-width base W_Q (h heads of d side by side) and one update per map over h*d columns
        ("layer", "maps"): d_model * h * d + 2 * (d_model * r + h * d * r)
                           + d_model * h_kv * d + 2 * (d_model * r + h_kv * d * r),
        # one d-wide base for every head, and one update per map over h*d columns
        ("layer", "heads"): d_model * d + 2 * (d_model * r + h * d * r)
                            + d_model * d + 2 * (d_model * r + h_kv * d * r),
        # a base per head and an update per head and map over d columns
        ("head", "maps"): d_model * h * d + 2 * h * (d_model * r + d * r)
                          + d_model * h_kv * d + 2 * h_kv * (d_model * r + d * r),
        ("head", "heads"): d_model * d + 2 * h * (d_model * r + d * r)
                           + d_model * d + 2 * h_kv * (d_model * r + d * r),
    }
    return formulas[scope, sharing]


@pytest.mark.parametrize("n_kv_heads", [None, 2])
def test_shared_diff_layer_scope_has_fewer_qk_parameters_than_diff(n_kv_heads):
    """The spec's reading for comparisons: at r < d_model / 6 (h d = d_model / 2), layer scope with a base per
    head costs fewer Q/K parameters than DIFF V1; head scope at the same rank costs more at this width."""
    base = dict(d_model=128, n_heads=4, n_kv_heads=n_kv_heads, rank=8)
    diff = _qk_params(ModelConfig(attention="diff_v1", **{k: v for k, v in base.items() if k != "rank"}))
    assert diff == 128 * 2 * 4 * 16 + 128 * 2 * (n_kv_heads or 4) * 16
    assert _qk_params(ModelConfig(attention="shared_diff", lowrank_scope="layer", **base)) < diff
    if n_kv_heads is None:
        assert _qk_params(ModelConfig(attention="shared_diff", lowrank_scope="head", **base)) > diff


@pytest.mark.parametrize("n_kv_heads", [None, 2])
def test_parameter_counts_follow_the_spec(n_kv_heads):
    d_model, h = 128, 4
    base = dict(d_model=d_model, n_heads=h, n_kv_heads=n_kv_heads)
    h_kv = n_kv_heads or h
    d = d_model // (2 * h)  # differential head dim
    baseline_2h = _attn_params(ModelConfig(attention="baseline", d_model=d_model, n_heads=2 * h,
                                           n_kv_heads=None if n_kv_heads is None else 2 * h_kv))
    # diff_v1 == baseline with 2h heads of dim d, plus lambda (4d) and the shared head-norm weight (2d)
    assert _attn_params(ModelConfig(attention="diff_v1", **base)) == baseline_2h + 4 * d + 2 * d
    assert _attn_params(ModelConfig(attention="diff_v1", head_norm=False, **base)) == baseline_2h + 4 * d
    assert _attn_params(ModelConfig(attention="dint", **base)) == baseline_2h + 6 * d
    assert _attn_params(ModelConfig(attention="dint", gamma="learned", **base)) == baseline_2h + 6 * d + 1

    # shared_diff: bases plus, for Q and for K, 2 maps x (A: d_model x r, B: width x r) per update
    r = 8
    v_and_o = d_model * h_kv * 2 * d + h * 2 * d * d_model
    for scope, sharing in itertools.product(("layer", "head"), ("maps", "heads")):
        cfg = ModelConfig(attention="shared_diff", rank=r, base_sharing=sharing, lowrank_scope=scope, **base)
        expected_qk = shared_diff_qk(d_model, h, h_kv, d, r, scope, sharing)
        assert _qk_params(cfg) == expected_qk, (scope, sharing)
        assert _attn_params(cfg) == expected_qk + v_and_o + 4 * d + 2 * d, (scope, sharing)

    # diff_v2 == baseline (h heads of dim d2) + extra query width (d_model h d2) + lambda projection
    d2 = d_model // h
    baseline_h = _attn_params(ModelConfig(attention="baseline", **base))
    v2 = ModelConfig(attention="diff_v2", **base)
    assert v2.resolved_head_dim == d2
    assert _attn_params(v2) == baseline_h + d_model * h * d2 + d_model * h
    assert _attn_params(ModelConfig(attention="diff_v2", lambda_mode="none", **base)) == \
        baseline_h + d_model * h * d2
    # pair_norm: one d-wide RMSNorm weight shared by the heads
    assert _attn_params(ModelConfig(attention="diff_v2", pair_norm=True, **base)) == _attn_params(v2) + d2


def test_diff_v2_pair_norm_puts_a_per_head_norm_back():
    cfg = ModelConfig(**SMALL, attention="diff_v2")
    plain = build_attention(cfg, 0)
    assert isinstance(plain.pair_norm, torch.nn.Identity)  # the blog's V2: no norm unless asked for
    normed = build_attention(ModelConfig(**SMALL, attention="diff_v2", pair_norm=True), 0)
    normed.load_state_dict(plain.state_dict(), strict=False)  # same projections, plus the norm's weight
    assert [n for n, _ in normed.named_parameters() if "pair_norm" in n] == ["pair_norm.weight"]
    assert normed.pair_norm.weight.shape == (plain.head_dim,)
    x = torch.randn(2, 9, cfg.d_model)
    with torch.no_grad():
        out_plain, out_normed = plain(x)[0], normed(x)[0]
        heads = normed.o_proj.weight.shape[1] // normed.head_dim
        # before W_O, every head of the normed module has RMS 1 (weight 1 at init)
        captured = {}
        normed.o_proj.register_forward_hook(lambda m, args, out: captured.update(x=args[0]))
        normed(x)
    rms = captured["x"].view(2, 9, heads, -1).pow(2).mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.ones_like(rms), rtol=0, atol=5e-3)  # 1 up to the norm's eps
    assert not torch.allclose(out_plain, out_normed)


@pytest.mark.parametrize("scheme", ["default", "normal"])
def test_diff_v2_lambda_projection_init(scheme):
    """The spec: W_lam has PyTorch's default nn.Linear init (kaiming-uniform, U(-1/sqrt(d_model), 1/sqrt(d_model)));
    `lambda_proj_init: normal` gives it the decoder's N(0, init_std^2) like every other linear."""
    cfg = ModelConfig(vocab_size=61, d_model=256, n_layers=2, n_heads=8, n_kv_heads=2, attention="diff_v2",
                      lambda_proj_init=scheme)
    model = Decoder(cfg)
    bound = 1 / cfg.d_model ** 0.5  # 0.0625, against init_std 0.02
    for block in model.blocks:
        w = block.attn.lambda_proj.weight.detach()
        if scheme == "default":
            assert w.abs().max() <= bound and w.abs().max() > 0.95 * bound
            assert w.std().item() == pytest.approx(bound / 3 ** 0.5, rel=0.1)  # the std of U(-b, b)
        else:
            assert w.std().item() == pytest.approx(cfg.init_std, rel=0.1)  # U(-b, b) would give 0.036
        # the other projections keep the decoder's normal init either way
        assert block.attn.q_proj.weight.std().item() == pytest.approx(cfg.init_std, rel=0.1)


def test_lambda_projection_init_schemes():
    """`lambda_proj_init: normal` draws W_lam like every other linear, N(0, init_std^2) from its own seeded stream;
    the default keeps nn.Linear's uniform init (bound 1/sqrt(fan_in)); every other weight is the same."""
    models = {}
    for scheme in ("normal", "default"):
        torch.manual_seed(3)
        models[scheme] = Decoder(ModelConfig(**{**SMALL, "attention": "diff_v2", "lambda_proj_init": scheme}))
    normal, default = (dict(models[s].named_parameters()) for s in ("normal", "default"))
    for name, weight in normal.items():
        assert torch.equal(weight, default[name]) != ("lambda_proj" in name), name
    name = "blocks.0.attn.lambda_proj"
    torch.manual_seed(named_seed(3, name))
    expected = torch.empty_like(normal[f"{name}.weight"]).normal_(0.0, models["normal"].cfg.init_std)
    assert torch.equal(normal[f"{name}.weight"], expected)
    assert default[f"{name}.weight"].abs().max() <= SMALL["d_model"] ** -0.5


def test_flags_change_the_built_module():
    no_norm = build_attention(ModelConfig(**SMALL, attention="diff_v1", head_norm=False), 0)
    assert isinstance(no_norm.head_norm, torch.nn.Identity)
    assert not any("head_norm" in n for n, _ in no_norm.named_parameters())
    heads = build_attention(ModelConfig(**SMALL, attention="shared_diff", base_sharing="heads", rank=3), 0)
    assert heads.q_proj.base.weight.shape == (heads.head_dim, SMALL["d_model"])
    assert heads.q_proj.up.shape[2] == 3
    h, d = SMALL["n_heads"], SMALL["d_model"] // (2 * SMALL["n_heads"])
    assert ModelConfig(**SMALL, attention="shared_diff").lowrank_scope == "layer"
    layer = build_attention(ModelConfig(**SMALL, attention="shared_diff", rank=3), 0)
    assert layer.q_proj.up.shape == (2, 1, 3, h * d) and layer.q_proj.down.weight.shape == (2 * 3, SMALL["d_model"])
    assert layer.k_proj.up.shape == (2, 1, 3, SMALL["n_kv_heads"] * d)
    head = build_attention(ModelConfig(**SMALL, attention="shared_diff", rank=3, lowrank_scope="head"), 0)
    assert head.q_proj.up.shape == (2, h, 3, d) and head.q_proj.down.weight.shape == (2 * h * 3, SMALL["d_model"])
    assert layer.q_proj.up.std() > 0  # B starts non-zero: the two maps start apart
    tied = Decoder(ModelConfig(**SMALL, tie_embeddings=True))
    assert tied.lm_head.weight is tied.embed.weight
    assert tied.num_parameters() == Decoder(ModelConfig(**SMALL)).num_parameters() - 61 * 64


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (dict(attention="diff_v3"), "attention='diff_v3'"),
        (dict(attention="shared_diff", rank=0), "rank=0"),
        (dict(attention="shared_diff", lowrank_scope="block"), "model.arch.lowrank_scope='block'"),
        (dict(attention="diff_v1", lowrank_scope="heads"), "model.arch.lowrank_scope='heads'"),
        (dict(attention="diff_v1", lambda_init=1.0), "lambda_init=1.0"),
        (dict(attention="diff_v1", lambda_init=0.0), "lambda_init=0.0"),
        (dict(attention="diff_v1", lambda_init="linear"), "lambda_init='linear'"),
        (dict(d_model=100, n_heads=3), "n_heads=3"),
        (dict(n_heads=4, n_kv_heads=3), "n_kv_heads=3"),
        (dict(attention="diff_v2", n_kv_heads=1, pairing="cross"), "pairing='cross'"),
        (dict(attention="diff_v2", lambda_proj_init="kaiming"), "lambda_proj_init='kaiming'"),
        (dict(attention="diff_v2", pair_norm="yes"), "pair_norm='yes'"),
        (dict(backend="tensorrt"), "backend='tensorrt'"),
        (dict(attention="softmax_sink", sink="one"), "model.arch.sink='one'"),
        (dict(attention="softmax_sink", sink=None), "model.arch.sink=null"),
        (dict(attention="gated", gate="channel"), "model.arch.gate='channel'"),
        (dict(attention="ssmax", ssmax_init=0), "model.arch.ssmax_init=0"),
        (dict(attention="ssmax", ssmax_init="auto"), "model.arch.ssmax_init='auto'"),
        (dict(attention="dint", gamma="both"), "model.arch.gamma='both'"),
        (dict(attention="dint", gamma_init=0.5), "model.arch.gamma_init=0.5"),
        (dict(attention="dint", gamma="learned", gamma_init=float("nan")), "model.arch.gamma_init=nan"),
    ],
)
def test_bad_config_names_the_value(overrides, needle):
    with pytest.raises(ValueError) as err:
        ModelConfig(**{**SMALL, **overrides})
    assert needle in str(err.value)


def test_flops_per_token_counts_maps_causal_half_and_v_width():
    t = 256
    base = Decoder(ModelConfig(**{**SMALL, "n_kv_heads": None}))
    linear = sum(m.weight.numel() for m in base.modules() if isinstance(m, torch.nn.Linear))
    d, h, layers = 16, 4, 2  # baseline: 4 heads of dim 16
    attention = layers * h * 2 * (t / 2) * (d + d)
    assert base.flops_per_token(t, training=False) == 2 * linear + attention
    assert base.flops_per_token(t) == 3 * base.flops_per_token(t, training=False)
    v1 = Decoder(ModelConfig(**{**SMALL, "attention": "diff_v1", "n_kv_heads": None}))  # 2 x 4 maps of 8, V 16
    dint = Decoder(ModelConfig(**{**SMALL, "attention": "dint", "n_kv_heads": None}))
    v1_attention = layers * 2 * h * 2 * (t / 2) * (8 + 16)
    assert v1.flops_per_token(t, training=False) - 2 * linear == v1_attention
    assert dint.flops_per_token(t, training=False) - v1.flops_per_token(t, training=False) == \
        layers * h * 2 * (t / 2) * 16
    # Shared DIFF: DIFF V1's maps plus the up-projections (X A) B^T, 2 FLOPs per multiply-add; X A is a Linear
    r, h_kv, d = 4, 2, 8
    for scope in ("layer", "head"):
        shared = Decoder(ModelConfig(**{**SMALL, "attention": "shared_diff", "rank": r, "lowrank_scope": scope}))
        linear = sum(m.weight.numel() for m in shared.modules() if isinstance(m, torch.nn.Linear))
        maps = layers * 2 * h * 2 * (t / 2) * (8 + 16)
        up = 2 * r * (h * d + h_kv * d) if scope == "layer" else 2 * (h + h_kv) * r * d  # B's weights, Q and K
        assert shared.flops_per_token(t, training=False) == 2 * linear + maps + layers * 2 * up, scope


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_equals_llamas_rotate_half_bit_for_bit(dtype):
    """RoPE as LLaMA (and transformers' Llama, which the export targets) writes it: x cos + rotate_half(x) sin, with
    rotate_half(x) = [-x2, x1], at a start offset and per row of a decoding step."""
    from diffexp.model.rope import RotaryEmbedding

    d, positions, theta = 16, 40, 500.0
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)

    def llama(x, rows):
        x1, x2 = x.chunk(2, dim=-1)
        return x * angles.cos()[rows].to(dtype) + torch.cat([-x2, x1], dim=-1) * angles.sin()[rows].to(dtype)

    rope = RotaryEmbedding(d, positions, theta)
    x = torch.randn(2, 3, 7, d).to(dtype)
    assert torch.equal(rope.rotate(x, 5), llama(x, slice(5, 12)))
    step, starts = x[:, :, :1], torch.tensor([0, 33])
    assert torch.equal(rope.rotate(step, starts), llama(step, starts.view(-1, 1, 1)))  # row b at starts[b]

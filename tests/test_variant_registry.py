"""A sixth variant defined in this file alone reaches every part of diffexp through its registry entry.

`GatedAttention` is softmax attention whose heads are scaled by a learned sigmoid gate, optionally
after a per-head RMSNorm. Nothing outside this file knows it: it is registered for the length of a
test, and then validates, trains through `diffexp fit`, counts its FLOPs, passes the shared
attention cases, and shows up in the benchmark and in a compare table.
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from rich.console import Console
from torch import nn

from diffexp import Decoder, ModelConfig
from diffexp.cli import main
from diffexp.compare import compare
from diffexp.errors import UserError, invalid
from diffexp.model.attention import build_attention, variant_names, variants
from diffexp.model.attention.base import AttentionBase, merge_heads, split_heads
from diffexp.model.attention.differential import TWO_MAP_FLAGS
from diffexp.model.attention.registry import Variant, register, unregister
from diffexp.model.blocks import RMSNorm
from diffexp.model.flags import Flag
from diffexp.sweep.layout import TRIAL_FILE, trial_dir
from diffexp.sweep.runs import load_curves
from diffexp.training.preflight import check_read_flags
from tests import reference as naive
from tests.fixtures_compare import write_sweep
from tests.helpers import check_causality, check_fast_path_equals_eager, check_matches_naive_reference

REPO = Path(__file__).resolve().parents[1]
TOY = "toy_gated"


GATE_OFFSET = Flag("gate_offset", float, 0.0, "toy_gated: added to every head's initial gate logit",
                   "a finite number", lambda value: abs(value) < float("inf"))


def toy_flops(cfg, keys: float) -> float:
    """h maps of dim d: 2 d per key for Q K^T and 2 d per key for A V; the gate is negligible."""
    d = cfg.resolved_head_dim
    return cfg.n_heads * 2 * keys * (d + d)


def toy_check(cfg) -> None:
    if cfg.n_heads < 2:
        raise invalid("model.arch.n_heads", cfg.n_heads, f"{TOY} gates heads against each other; expected >= 2")


def toy_reference(m, x: torch.Tensor):
    cfg = m.cfg
    h, h_kv = cfg.n_heads, cfg.kv_heads
    q = m.rope.rotate(naive.project(x, m.q_proj, h))  # the shared naive blocks of tests/reference.py
    k = m.rope.rotate(naive.project(x, m.k_proj, h_kv))
    v = naive.project(x, m.v_proj, h_kv).double()
    b, t = x.shape[:2]
    maps = torch.zeros(b, h, t, t, dtype=torch.float64)
    out = torch.zeros(b, h, t, v.shape[-1], dtype=torch.float64)
    for bi in range(b):
        for i in range(h):
            gate = 1.0 / (1.0 + torch.exp(-m.gate[i].double()))
            a = naive.causal_softmax_rows(q[bi, i], k[bi, i // (h // h_kv)])
            o = a @ v[bi, i // (h // h_kv)]
            if cfg.head_norm:
                o = naive.rmsnorm(o, m.head_norm.weight)
            maps[bi, i], out[bi, i] = gate * a, gate * o
    return naive.output(out, m.o_proj), maps


class GatedAttention(AttentionBase):
    variant = Variant(
        name=TOY,
        summary="softmax attention with a learned sigmoid gate per head (a test's toy)",
        paper="none: tests/test_variant_registry.py",
        differential=False,
        # a flag of its own, declared once here, and the two-map variants' head_norm, shared
        flags=(*(f for f in TWO_MAP_FLAGS if f.name == "head_norm"), GATE_OFFSET),
        check=toy_check,
        attention_flops=toy_flops,
    )

    def __init__(self, cfg, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        h, h_kv, d = self.n_heads, self.n_kv_heads, self.head_dim
        self.q_proj = self.linear(self.d_model, h * d)
        self.k_proj = self.linear(self.d_model, h_kv * d)
        self.v_proj = self.linear(self.d_model, h_kv * d)
        self.o_proj = self.linear(h * d, self.d_model)
        # distinct per head, so a mix-up shows
        self.gate = nn.Parameter(torch.linspace(-1.0, 1.0, h) + cfg.gate_offset)
        self.head_norm = RMSNorm(d) if cfg.head_norm else nn.Identity()

    def forward(self, x: torch.Tensor, need_weights: bool = False):
        q = self.rope.rotate(split_heads(self.q_proj(x), self.n_heads))
        k = self.rope.rotate(split_heads(self.k_proj(x), self.n_kv_heads))
        v = split_heads(self.v_proj(x), self.n_kv_heads)
        out, weights = self.attend(q, k, v, need_weights)
        gate = torch.sigmoid(self.gate).view(1, -1, 1, 1)
        out = self.head_norm(out) * gate.to(out.dtype)
        effective = weights * gate.to(weights.dtype) if weights is not None else None
        return self.o_proj(merge_heads(out)), effective


TOY_CASES = {"": {}, "mha": {"n_kv_heads": None}, "nonorm": {"head_norm": False}, "offset": {"gate_offset": 0.5}}


@pytest.fixture
def toy():
    register(GatedAttention)
    naive.REFERENCES[TOY], naive.CASES[TOY] = toy_reference, TOY_CASES
    yield GatedAttention.variant
    unregister(TOY)
    del naive.REFERENCES[TOY], naive.CASES[TOY]


def test_unknown_until_registered_then_validated_like_any_variant(toy):
    unregister(TOY)
    with pytest.raises(ValueError, match=f"attention='{TOY}'"):
        ModelConfig(attention=TOY)
    register(GatedAttention)
    cfg = ModelConfig(attention=TOY, d_model=64, n_heads=4, n_kv_heads=2)
    assert TOY in variant_names() and toy in variants()
    assert cfg.resolved_head_dim == 16  # maps_per_head 1: the baseline's parameter matching
    with pytest.raises(ValueError, match="n_heads=1"):  # its own check
        ModelConfig(attention=TOY, d_model=64, n_heads=1)
    with pytest.raises(ValueError, match="n_kv_heads=3"):  # the shared checks
        ModelConfig(attention=TOY, d_model=64, n_heads=4, n_kv_heads=3)
    assert ModelConfig(attention=TOY, rank=4).unused_settings() == {"rank": 4}
    assert ModelConfig(attention=TOY, head_norm=False).unused_settings() == {}


def test_flops_come_from_its_entry(toy):
    cfg = ModelConfig(attention=TOY, vocab_size=61, d_model=64, n_layers=3, n_heads=4, n_kv_heads=None)
    model = Decoder(cfg)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    t, h, d = 128, 4, 16
    assert model.flops_per_token(t, training=False) == 2 * linear + 3 * h * 2 * (t / 2) * (d + d)
    assert model.flops_per_token(t) == 3 * model.flops_per_token(t, training=False)
    attn_params = sum(p.numel() for p in build_attention(cfg, 0).parameters())
    assert attn_params == 4 * 64 * 64 + h + d  # Q, K, V, O, the gates and the head-norm weight


@pytest.mark.parametrize("case", [TOY, f"{TOY}-mha", f"{TOY}-nonorm", f"{TOY}-offset"])
def test_shared_attention_cases(toy, case):
    for backend in ("sdpa", "eager"):
        torch.manual_seed(0)
        check_matches_naive_reference(case, backend)
        check_causality(case, backend)
    check_fast_path_equals_eager(case)


def test_its_flag_is_one_declaration_plus_its_use(toy, capsys):
    """ModelConfig, its validation, the CLI's help and the refusal of an unread flag all come from GATE_OFFSET."""
    assert ModelConfig(attention=TOY, gate_offset=0.5).gate_offset == 0.5 and ModelConfig().gate_offset == 0.0
    with pytest.raises(UserError, match=r"model.arch.gate_offset='high' is invalid: expected a finite number"):
        ModelConfig(attention=TOY, gate_offset="high")
    with pytest.raises(UserError, match=r"model.arch.gate_offset=inf is invalid"):
        ModelConfig(attention=TOY, gate_offset=float("inf"))
    assert ModelConfig(attention="baseline", gate_offset=0.5).unused_settings() == {"gate_offset": 0.5}
    assert ModelConfig(attention=TOY, gate_offset=0.5).unused_settings() == {}
    assert ModelConfig(attention="baseline").unused_settings(named=["gate_offset"]) == {"gate_offset": 0.0}
    with pytest.raises(UserError, match=rf"'baseline' does not read --model.arch.gate_offset 0.5 \(read by {TOY}\)"):
        check_read_flags(ModelConfig(attention="baseline", gate_offset=0.5), ["--model.arch.gate_offset", "0.5"])
    with pytest.raises(UserError, match=rf"'softmax_sink' does not read model.arch.gate_offset: 0.5 \(read by {TOY}\)"
                                        r".*softmax_sink reads model.arch.sink beyond the shared flags"):
        check_read_flags(ModelConfig(attention="softmax_sink", gate_offset=0.5))
    check_read_flags(ModelConfig(attention=TOY, gate_offset=0.5), ["--model.arch.gate_offset", "0.5"])
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())  # wrapped at any terminal width
    assert "added to every head's initial gate logit" in help_text
    torch.manual_seed(0)
    plain = build_attention(ModelConfig(attention=TOY, d_model=32, n_heads=2), 0)
    torch.manual_seed(0)
    offset = build_attention(ModelConfig(attention=TOY, d_model=32, n_heads=2, gate_offset=0.5), 0)
    torch.testing.assert_close(offset.gate, plain.gate + 0.5)
    x = torch.randn(1, 8, 32)
    assert not torch.allclose(plain(x)[0], offset(x)[0])


def test_an_unregistered_flag_leaves_the_config(toy):
    unregister(TOY)
    with pytest.raises(TypeError, match="gate_offset"):
        ModelConfig(gate_offset=0.5)
    register(GatedAttention)
    assert ModelConfig(gate_offset=0.5).gate_offset == 0.5


def test_the_gate_really_changes_the_output(toy):
    attn = build_attention(ModelConfig(attention=TOY, d_model=32, n_heads=2, max_seq_len=16), 0)
    x = torch.randn(1, 8, 32)
    before = attn(x)[0]
    with torch.no_grad():
        attn.gate.add_(1.0)
    assert not torch.allclose(before, attn(x)[0])


RECIPE = """
seed_everything: 3
trainer:
  max_steps: 4
  val_check_interval: 4
  limit_val_batches: 1
  log_every_n_steps: 1
  enable_progress_bar: false
  logger:
    class_path: lightning.pytorch.loggers.TensorBoardLogger
    init_args: {{save_dir: runs, name: toy, default_hp_metric: false}}
model:
  arch: {{attention: {name}, d_model: 32, n_layers: 1, n_heads: 2}}
  optim: {{lr: 3.0e-3, warmup_steps: 1}}
data:
  source: stdlib
  seq_len: 32
  batch_size: 2
  max_chars: 20000
  cache_dir: {cache}
"""


def test_trains_through_diffexp_fit_and_appears_in_a_compare_table(toy, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe = tmp_path / "toy.yaml"
    recipe.write_text(RECIPE.format(name=TOY, cache=tmp_path / "cache"))
    main(["fit", "--config", str(recipe)])
    run = tmp_path / "runs" / "toy" / "version_0"
    last = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert last["global_step"] == 4 and last["hyper_parameters"]["arch"]["attention"] == TOY
    gates = [v for k, v in last["state_dict"].items() if k.endswith("attn.gate")]
    assert len(gates) == 1 and not torch.equal(gates[0], torch.linspace(-1.0, 1.0, 2))  # trained

    # the run, filed as the one trial of a one-case study the way the sweep runner files trials
    study = tmp_path / "runs" / "toy-study"
    write_sweep(study, [("Gated heads", TOY)], [0])
    trial = trial_dir(study, TOY, 0)
    shutil.copytree(run, trial)
    (trial / TRIAL_FILE).write_text(json.dumps({
        "study": study.name, "case": "Gated heads", "case_slug": TOY, "seed": 0, "state": "complete",
        "overrides": {"model.arch.attention": TOY}, "metrics": {}, "global_step": 4}))
    buffer = io.StringIO()
    compare(study, out=tmp_path / "compare", plots=False,
            console=Console(file=buffer, width=200, color_system=None))
    row = next(line for line in buffer.getvalue().splitlines() if line.startswith("│ Gated heads"))
    final_val_loss = load_curves(run)["val/loss"][-1][1]  # read from the run's own events
    assert TOY in row and f"{final_val_loss:.3f} ± n/a" in row


def test_no_other_file_names_the_toy():
    found = subprocess.run(["grep", "-rl", TOY, str(REPO / "diffexp"), str(REPO / "recipes"), str(REPO / "sweeps")],
                           capture_output=True, text=True)
    assert found.stdout == ""


def test_built_in_variants_are_named_only_in_their_own_file_and_the_registry():
    """The registry is the one place that knows a variant: no other module dispatches on its name."""
    import inspect
    import re

    from diffexp.model.attention import variant_class

    sources = {p: p.read_text() for p in (REPO / "diffexp").rglob("*.py")}
    for name in variant_names():
        own = {Path(inspect.getfile(variant_class(name))), REPO / "diffexp/model/attention/registry.py"}
        # "baseline" is also an English word: only its use as a string literal counts
        pattern = re.compile(rf"[\"']{name}[\"']" if name == "baseline" else rf"\b{name}\b")
        named = [f"{p.relative_to(REPO)}:{i}" for p, text in sources.items() if p not in own
                 for i, line in enumerate(text.splitlines(), 1) if pattern.search(line)]
        assert named == [], f"{name} is named outside its own file: {named}"


def test_its_transformers_class_is_the_one_its_entry_names(toy):
    """`export --format hf` writes the class on the entry: none refuses (naming the variants that have one), a
    known one is written, an unknown one is an error; model.init_from reads the class back as that variant."""
    from dataclasses import replace

    from diffexp.hf.classes import read_as
    from diffexp.hf.writer import hf_form

    cfg = ModelConfig(attention=TOY, vocab_size=64, d_model=32, n_layers=1, n_heads=2)
    with pytest.raises(UserError, match=rf"model.arch.attention='{TOY}' has no transformers class \(only "
                                        r"baseline as LlamaForCausalLM and diff_v1 as DiffLlamaForCausalLM"):
        hf_form(cfg, remote=False)
    assert hf_form(cfg, remote=True) == "remote"

    class Named(GatedAttention):
        variant = replace(GatedAttention.variant, hf_architecture="NoSuchForCausalLM")

    unregister(TOY)
    register(Named)
    try:
        with pytest.raises(ValueError, match="NoSuchForCausalLM"):
            hf_form(cfg, remote=False)
    finally:
        unregister(TOY)
        register(GatedAttention)
    assert read_as("llama")[0] == "baseline" and read_as("diffllama")[0] == "diff_v1" and read_as("gpt2") is None


def test_appears_in_the_benchmark(toy, tmp_path):
    threads = torch.get_num_threads()
    path = tmp_path / "train.json"
    try:
        main(["bench", "train", "--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--vocab-size", "64",
              "--seq-lens", "32", "--batch-size", "2", "--steps", "1", "--warmup", "0", "--rounds", "1",
              "--threads", "1", "--no-memory", "--json", str(path)])
    except SystemExit as exit_:
        assert exit_.code == 0
    finally:
        torch.set_num_threads(threads)
    results = json.loads(path.read_text())["results"]
    toy_result = results[f"{TOY}@32"]
    model = Decoder(ModelConfig(attention=TOY, vocab_size=64, d_model=32, n_layers=1, n_heads=2))
    assert toy_result["flops_per_step"] == 2 * 32 * model.flops_per_token(32)  # batch 2 x 32 predicted tokens
    assert toy_result["speed_ratio"] > 0 and {name.split("@")[0] for name in results} == set(variant_names())

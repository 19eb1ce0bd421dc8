"""The evaluations' door into attention (diffexp.model.heads.taps): unused it changes nothing; with an identity tap
the forward is the normal one, every map of every layer is seen, and its terms rebuild the head's output; a tap
that changes the logits changes the output."""

from __future__ import annotations

import pytest
import torch

from diffexp.model.attention import variant_names
from diffexp.model.config import ModelConfig
from diffexp.model.decoder import Decoder
from diffexp.model.heads import taps

#: the maps each variant's layer shows the taps
MAPS = {"diff_v1": {"map1", "map2"}, "shared_diff": {"map1", "map2"}, "dint": {"map1", "map2"},
        "diff_v2": {"paired"}, "softmax_sink": {"sink"}, "softpick": {"softpick"}}


def tiny(attention: str) -> Decoder:
    torch.manual_seed(0)
    return Decoder(ModelConfig(attention=attention, vocab_size=64, d_model=32, n_layers=2, n_heads=2,
                               max_seq_len=16)).eval()


class Recorder(taps.Tap):
    def __init__(self) -> None:
        self.logit_sites, self.outputs = [], []

    def logits(self, z, site):
        self.logit_sites.append((site.layer, site.map))
        return z

    def maps(self, site, terms):
        out = sum(t.weight * (t.probs.double() @ t.v.double()) for t in terms)
        self.outputs.append((site.layer, out))


class Never(taps.Tap):
    def logits(self, z, site):
        raise AssertionError("a tap outside its context was called")


@pytest.mark.parametrize("attention", variant_names())
def test_the_door_is_the_normal_forward(attention):
    model = tiny(attention)
    tokens = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        untapped = model(tokens)
        before, maps_before = model(tokens, need_weights=True)
        recorder = Recorder()
        with taps.tapping(recorder):
            tapped, tapped_maps = model(tokens, need_weights=True)
            plain = model(tokens)
        with taps.tapping(Never()):
            pass
        after = model(tokens)
    assert taps.ACTIVE is None
    assert torch.equal(after, untapped)  # bit for bit: entering and leaving a tap left nothing behind
    torch.testing.assert_close(tapped, before, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(plain, before, rtol=1e-5, atol=1e-5)
    for got, want in zip(tapped_maps, maps_before, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert {layer for layer, _ in recorder.logit_sites} == {0, 1}
    assert {name for _, name in recorder.logit_sites} == MAPS.get(attention, {"softmax"})
    assert all(out.shape[0] == 2 and out.shape[-2] == 12 for _, out in recorder.outputs)


@pytest.mark.parametrize("attention", ["baseline", "diff_v1", "dint", "softmax_sink", "softpick"])
def test_the_terms_rebuild_the_head_output_and_a_changed_logit_changes_the_output(attention, monkeypatch):
    model = tiny(attention)
    tokens = torch.randint(0, 64, (1, 10))
    heads = []
    layer = model.blocks[0].attn
    original = layer.o_proj.forward
    monkeypatch.setattr(layer.o_proj, "forward", lambda x: heads.append(x) or original(x))
    recorder = Recorder()
    with torch.no_grad(), taps.tapping(recorder):
        normal = model(tokens)
    monkeypatch.setattr(layer.o_proj, "forward", original)
    if attention == "baseline":  # no norm or gate between the head and o_proj: the terms are the head's output
        out = recorder.outputs[0][1]
        merged = out.transpose(1, 2).reshape(1, 10, -1)
        torch.testing.assert_close(merged.float(), heads[0], rtol=1e-5, atol=1e-6)

    class Flatten(taps.Tap):
        def logits(self, z, site):
            return torch.where(torch.isfinite(z), torch.zeros_like(z), z)  # uniform rows over the visible keys

    with torch.no_grad(), taps.tapping(Flatten()):
        flat = model(tokens)
    assert not torch.allclose(flat, normal, atol=1e-4)

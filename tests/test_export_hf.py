"""`diffexp export --format hf`: transformers loads the export and computes what diffexp computes.

Against a real transformers install: the logits of the loaded model equal diffexp's to 1e-5 in fp32, HF greedy
`generate` equals diffexp's greedy decoding (the `diffexp generate --temperature 0` code path), the tokenizer
files load with AutoTokenizer, the remote code runs where diffexp cannot be imported, what a plain class cannot
compute is refused, and `model.init_from` reads an HF Llama / DiffLlama directory back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from diffexp.cli import main
from diffexp.errors import UserError
from diffexp.export import export
from diffexp.generate.decode import generate
from diffexp.generate.sampling import Sampling
from diffexp.model.attention import variant_names
from diffexp.model.config import ModelConfig
from diffexp.model.decoder import Decoder
from tests.helpers import CASES, PROMPT, naive_logprob, tiny_decoder, write_checkpoint, write_local_task

transformers = pytest.importorskip("transformers")

#: one case per registered variant for the default run (and each value of the sink's and the gate's flag); every
#: flag case of the registry runs under -m heavy
DEFAULT_CASES = [*variant_names(), "softmax_sink-learned", "gated-headwise"]
#: cases a plain transformers class represents: baseline -> Llama, diff_v1 -> DiffLlama
PLAIN_CASES = ["baseline", "baseline-mha", "baseline-tied", "diff_v1", "diff_v1-mha"]
def exported(tmp_path, case: str, remote: bool, **extra):
    model = tiny_decoder(case, **extra)
    out = export(str(write_checkpoint(model, tmp_path / f"{case}.ckpt")), str(tmp_path / f"{case}-hf"), "hf", remote)
    return model, out


def load(out, remote: bool):
    return transformers.AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=remote).eval()


def assert_same_logits(model: Decoder, hf_model) -> None:
    ids = torch.randint(0, 257, (2, 37), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours, theirs = model(ids), hf_model(ids).logits
    assert theirs.dtype == torch.float32
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)


def assert_same_greedy(model: Decoder, hf_model, out, remote: bool) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out), trust_remote_code=remote)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    ours = torch.stack(list(generate(model, ids, 12, Sampling(temperature=0.0), stop_id=256)), dim=1)
    theirs = hf_model.generate(ids, max_new_tokens=12, do_sample=False)[:, ids.shape[1]:]
    assert theirs.tolist() == ours.tolist()
    if remote:  # the model's own cache gives what a full forward per step gives
        uncached = hf_model.generate(ids, max_new_tokens=12, do_sample=False, use_cache=False)[:, ids.shape[1]:]
        assert uncached.tolist() == ours.tolist()


@pytest.mark.parametrize("case", PLAIN_CASES)
def test_plain_class_computes_the_checkpoint(tmp_path, case):
    model, out = exported(tmp_path, case, remote=False)
    config = json.loads((out / "config.json").read_text())
    expected = "LlamaForCausalLM" if case.startswith("baseline") else "DiffLlamaForCausalLM"
    assert config["architectures"] == [expected] and "auto_map" not in config
    assert not list(out.glob("*.py"))  # loads without trust_remote_code
    hf_model = load(out, remote=False)
    assert type(hf_model).__name__ == expected
    assert_same_logits(model, hf_model)
    assert_same_greedy(model, hf_model, out, remote=False)


@pytest.mark.parametrize("case", DEFAULT_CASES)
def test_remote_code_computes_every_variant(tmp_path, case):
    model, out = exported(tmp_path, case, remote=True)
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_diffexp.DiffexpForCausalLM"
    hf_model = load(out, remote=True)
    assert_same_logits(model, hf_model)
    assert_same_greedy(model, hf_model, out, remote=True)


@pytest.mark.heavy
@pytest.mark.parametrize("case", sorted(CASES))
def test_remote_code_computes_every_flag_case(tmp_path, case):
    """Every flag case of the registry: the bundled model code is diffexp's, so any drift shows here."""
    model, out = exported(tmp_path, case, remote=True)
    hf_model = load(out, remote=True)
    assert_same_logits(model, hf_model)
    assert_same_greedy(model, hf_model, out, remote=True)


def test_remote_code_runs_without_diffexp(tmp_path):
    """A machine without diffexp: `import diffexp` fails in the child, which loads, scores and generates."""
    model, out = exported(tmp_path, "dint-learned", remote=True)
    ids = torch.randint(0, 257, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(ids)[0, -1]
    torch.save({"ids": ids, "expected": expected}, tmp_path / "io.pt")
    script = textwrap.dedent(f"""
        import sys
        sys.modules["diffexp"] = None  # diffexp is not installed here: any import of it fails
        try:
            import diffexp
            raise SystemExit("diffexp imported")
        except ImportError:
            pass
        import torch
        from transformers import AutoModelForCausalLM
        io = torch.load({str(tmp_path / 'io.pt')!r})
        model = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True).eval()
        with torch.no_grad():
            last = model(io["ids"]).logits[0, -1]
        assert torch.allclose(last, io["expected"], atol=1e-5, rtol=0), (last - io["expected"]).abs().max()
        cached = model.generate(io["ids"], max_new_tokens=5, do_sample=False)
        full = model.generate(io["ids"], max_new_tokens=5, do_sample=False, use_cache=False)
        assert cached.tolist() == full.tolist()
        print("ok", sorted(name for name in sys.modules if name.startswith("diffexp")))
    """)
    child = subprocess.run([sys.executable, "-I", "-c", script], cwd=tmp_path, capture_output=True, text=True,
                           timeout=300, env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1",
                                             "HF_HOME": str(tmp_path / "hf-home"), "OMP_NUM_THREADS": "1"})
    assert child.returncode == 0, child.stderr[-3000:]
    assert child.stdout.strip() == "ok ['diffexp']"  # only the blocked entry: nothing of diffexp was loaded


def test_byte_tokenizer_loads_with_autotokenizer(tmp_path):
    _, out = exported(tmp_path, "baseline", remote=False)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tokenizer(PROMPT).input_ids == list(PROMPT.encode("utf-8"))
    assert tokenizer.eos_token_id == 256 and len(tokenizer) == 257
    assert tokenizer.decode(list(PROMPT.encode("utf-8")) + [256], skip_special_tokens=True) == PROMPT
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 256


def test_bpe_checkpoint_exports_its_own_tokenizer(tmp_path):
    from diffexp.data.tokenizer import HFTokenizer, tokenizer_state, train_bpe

    texts = ["the cat sat on the mat. " * 20, "a dog ran in the park; the dog sat. " * 20]
    bpe = HFTokenizer(train_bpe(texts, 300), "bpe-test")
    model = Decoder(ModelConfig(attention="baseline", vocab_size=bpe.vocab_size, d_model=32, n_layers=1,
                                n_heads=2, max_seq_len=64))
    checkpoint = write_checkpoint(model, tmp_path / "bpe.ckpt", tokenizer_state(bpe))
    out = export(str(checkpoint), str(tmp_path / "bpe-hf"), "hf")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tokenizer("the dog sat on the mat.").input_ids == bpe.encode("the dog sat on the mat.")
    assert tokenizer.eos_token_id == bpe.eos_id


@pytest.mark.parametrize("case, flag, words", [
    ("dint", "--format hf: model.arch.attention='dint'", "add --remote-code"),
    ("diff_v1-nonorm", "model.arch.head_norm=False", "DiffLlama always normalises each head"),
    ("diff_v1-lam0.5", "model.arch.lambda_init=0.5", "DiffLlama's lambda_init is always 'depth'"),
])
def test_what_no_plain_class_computes_is_refused(tmp_path, capsys, case, flag, words):
    checkpoint = write_checkpoint(tiny_decoder(case), tmp_path / "model.ckpt")
    with pytest.raises(SystemExit) as done:
        main(["export", str(checkpoint), str(tmp_path / "out"), "--format", "hf"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and flag in err and words in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


def test_remote_code_needs_format_hf(tmp_path):
    checkpoint = write_checkpoint(tiny_decoder("baseline"), tmp_path / "model.ckpt")
    with pytest.raises(UserError, match="--remote-code is invalid with --format='safetensors'"):
        export(str(checkpoint), str(tmp_path / "out"), "safetensors", remote_code=True)


# -- from the Hub into diffexp: model.init_from ----------------------------------------------------------------
@pytest.mark.parametrize("case", ["baseline", "baseline-tied", "diff_v1", "diff_v1-mha"])
def test_init_from_reads_an_hf_directory_back(tmp_path, case):
    from diffexp.hf.reading import read_hf_model
    from diffexp.training.warm_start import architecture_differences

    model, out = exported(tmp_path, case, remote=False)
    back = read_hf_model(out, "model.init_from")
    assert architecture_differences(back["hyper_parameters"]["arch"], asdict(model.cfg)) == []
    restored = Decoder(ModelConfig(**back["hyper_parameters"]["arch"])).eval()
    restored.load_state_dict({k.removeprefix("model."): v for k, v in back["state_dict"].items()})
    original = model.state_dict()
    if case.startswith("baseline"):  # the round trip is bit-identical
        assert all(torch.equal(restored.state_dict()[k], v) for k, v in original.items())
    else:  # the head norm's weight is folded into o_proj: the same function, and the HF weights bit-identical
        assert_same_logits(restored, load(out, remote=False))
        assert_same_logits(model, load(out, remote=False))
        again = export(str(write_checkpoint(restored, tmp_path / "again.ckpt")), str(tmp_path / "again"), "hf")
        from safetensors.torch import load_file

        first, second = load_file(str(out / "model.safetensors")), load_file(str(again / "model.safetensors"))
        assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_init_from_an_hf_directory_in_a_run(tmp_path):
    """DiffexpLM starts from the HF weights through model.init_from; a model of another shape is refused."""
    from diffexp.training import DiffexpLM
    from diffexp.training.warm_start import check_init_from, load_initial_weights

    model, out = exported(tmp_path, "baseline", remote=False)
    arch = asdict(model.cfg) | {"n_kv_heads": 2, "head_dim": None, "max_seq_len": 128}
    assert check_init_from(str(out), arch, {}) == out
    module = DiffexpLM(ModelConfig(**arch))
    load_initial_weights(module, str(out), None)
    assert all(torch.equal(module.model.state_dict()[k], v) for k, v in model.state_dict().items()
               if not k.endswith((".cos", ".signed_sin")))
    with pytest.raises(UserError, match=r"model.arch.n_layers: checkpoint 2, this config 3"):
        check_init_from(str(out), arch | {"n_layers": 3}, {})


def test_init_from_refuses_rope_scaling(tmp_path):
    from diffexp.training.warm_start import check_init_from

    model, out = exported(tmp_path, "baseline", remote=False)
    config = json.loads((out / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}
    (out / "config.json").write_text(json.dumps(config))
    (out / "SHA256SUMS").unlink()  # as a directory from the Hub, not from diffexp export, holds no sums
    with pytest.raises(UserError, match="rope_type 'llama3'"):
        check_init_from(str(out), asdict(model.cfg), {})


# -- lm_eval --model hf ------------------------------------------------------------------------------------------
@pytest.mark.heavy
@pytest.mark.parametrize("case, remote", [("baseline", False), ("diff_v1", False), *[(c, True) for c in DEFAULT_CASES]])
def test_lm_eval_hf_gives_the_accuracy_of_diffexp_eval_harness(tmp_path, capsys, case, remote):
    """`lm_eval --model hf` on the export and `diffexp eval harness` on the checkpoint, one local task, offline."""
    pytest.importorskip("accelerate", reason="lm_eval --model hf needs accelerate (in the dev extra)")

    model = tiny_decoder(case)
    checkpoint = write_checkpoint(model, tmp_path / "model.ckpt")
    out = export(str(checkpoint), str(tmp_path / "hf"), "hf", remote)
    tasks = write_local_task(tmp_path)
    with pytest.raises(SystemExit) as done:
        main(["eval", "harness", str(checkpoint), "--tasks", "diffexp_toy", "--include-path", str(tasks),
              "--device", "cpu", "--out", str(tmp_path / "ours"), "--bootstrap-iters", "0"])
    assert done.value.code == 0, capsys.readouterr().err[-2000:]
    ours = json.loads((tmp_path / "ours/harness.json").read_text())["tasks"]["diffexp_toy"]["acc"]
    model_args = f"pretrained={out},dtype=float32" + (",trust_remote_code=True" if remote else "")
    child = subprocess.run(
        [str(Path(sys.executable).with_name("lm_eval")), "--model", "hf", "--model_args", model_args,
         "--tasks", "diffexp_toy", "--include_path", str(tasks), "--device", "cpu", "--log_samples",
         "--output_path", str(tmp_path / "theirs")],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert child.returncode == 0, child.stderr[-3000:]
    [result] = list((tmp_path / "theirs").rglob("results_*.json"))
    theirs = json.loads(result.read_text())["results"]["diffexp_toy"]["acc,none"]
    assert theirs == pytest.approx(ours)
    # and each choice's log-likelihood is the checkpoint's own
    [samples] = list((tmp_path / "theirs").rglob("samples_diffexp_toy_*.jsonl"))
    for line in samples.read_text().splitlines():
        sample = json.loads(line)
        doc = sample["doc"]
        context = list(doc["question"].encode())
        for choice, response in zip(doc["choices"], sample["filtered_resps"]):
            whole = list(f"{doc['question']} {choice}".encode())
            assert float(response[0]) == pytest.approx(naive_logprob(model, whole, len(context)), abs=1e-4)

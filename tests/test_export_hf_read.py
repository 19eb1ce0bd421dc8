"""An `export --format hf` directory read back as a user would: `diffexp generate` gives the checkpoint's tokens,
and transformers loads the exported tokenizer without an interactive trust_remote_code prompt.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from diffexp.cli import main
from diffexp.data.tokenizer import ByteTokenizer, HFTokenizer, tokenizer_from_state, tokenizer_state, train_bpe
from diffexp.export import export
from diffexp.generate.decode import generate
from diffexp.generate.sampling import Sampling
from diffexp.model.config import ModelConfig
from diffexp.model.decoder import Decoder
from diffexp.training.loading import load_checkpoint as read_model
from diffexp.training.loading import load_model
from tests.helpers import PROMPT, tiny_decoder, write_checkpoint

pytest.importorskip("transformers")

#: (case, --remote-code): Llama, DiffLlama and remote code
FORMS = [("baseline", False), ("diff_v1", False), ("dint", True)]


def export_case(tmp_path, case: str, remote: bool):
    checkpoint = write_checkpoint(tiny_decoder(case), tmp_path / f"{case}.ckpt")
    return checkpoint, export(str(checkpoint), str(tmp_path / f"{case}-hf"), "hf", remote)


def greedy_ids(path) -> list[int]:
    checkpoint, hparams = read_model(str(path))
    tokenizer = tokenizer_from_state(checkpoint["diffexp_tokenizer"])
    assert isinstance(tokenizer, ByteTokenizer)  # the exported byte-level BPE is read back as the byte tokenizer
    model = load_model(checkpoint, str(path), "cpu").model
    ids = torch.tensor([tokenizer.encode(PROMPT)])
    return [int(t) for t in generate(model, ids, 24, Sampling(temperature=0.0), stop_id=None)]


def generated_text(capsys, path, *flags: str) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        main(["generate", str(path), "--prompt", PROMPT, "--max-new-tokens", "24", "--device", "cpu", *flags])
    assert done.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("case, remote", FORMS)
def test_generate_reads_an_hf_export_as_its_checkpoint(tmp_path, capsys, case, remote):
    checkpoint, out = export_case(tmp_path, case, remote)
    assert greedy_ids(out) == greedy_ids(checkpoint)
    for flags in (["--temperature", "0"], ["--temperature", "1.0", "--top-k", "50", "--seed", "7"]):
        from_export = generated_text(capsys, out, *flags)
        assert from_export == generated_text(capsys, checkpoint, *flags)
    assert from_export.strip()


def test_generate_reads_an_exported_bpe(tmp_path):
    texts = ["the cat sat on the mat. " * 20, "a dog ran in the park; the dog sat. " * 20]
    bpe = HFTokenizer(train_bpe(texts, 300), "bpe-test")
    model = Decoder(ModelConfig(attention="baseline", vocab_size=bpe.vocab_size, d_model=32, n_layers=1,
                                n_heads=2, max_seq_len=64))
    out = export(str(write_checkpoint(model, tmp_path / "bpe.ckpt", tokenizer_state(bpe))),
                 str(tmp_path / "bpe-hf"), "hf")
    checkpoint, _ = read_model(str(out))
    tokenizer = tokenizer_from_state(checkpoint["diffexp_tokenizer"])
    text = "the dog sat on the mat."
    assert tokenizer.encode(text) == bpe.encode(text) and tokenizer.eos_id == bpe.eos_id
    assert tokenizer.decode(bpe.encode(text)) == text


def test_exported_tokenizer_loads_without_a_prompt(tmp_path):
    """A plain export's tokenizer loads with AutoTokenizer and no trust_remote_code; a remote-code export's with
    the trust its model needs anyway, or PreTrainedTokenizerFast and none; stdin closed, offline, no prompt."""
    _, plain = export_case(tmp_path, "diff_v1", remote=False)
    _, remote = export_case(tmp_path, "dint", remote=True)
    for out in (plain, remote):
        assert json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    ids = list(PROMPT.encode("utf-8"))
    script = textwrap.dedent(f"""
        import json
        from transformers import AutoTokenizer, PreTrainedTokenizerFast
        loaded = [AutoTokenizer.from_pretrained({str(plain)!r}),
                  AutoTokenizer.from_pretrained({str(remote)!r}, trust_remote_code=True),
                  PreTrainedTokenizerFast.from_pretrained({str(remote)!r})]
        print(json.dumps([[t({PROMPT!r}).input_ids, t.decode({ids!r} + [256], skip_special_tokens=True),
                           t.eos_token_id] for t in loaded]))
    """)
    child = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                           stdin=subprocess.DEVNULL, timeout=300,
                           env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home"),
                                "PYTHONPATH": ":".join(sys.path), "OMP_NUM_THREADS": "1"})
    assert child.returncode == 0, child.stderr[-3000:]
    assert "trust_remote_code" not in child.stderr + child.stdout  # the prompt names it
    results = json.loads(child.stdout.strip().splitlines()[-1])
    assert results == [[ByteTokenizer().encode(PROMPT), PROMPT, ByteTokenizer.eos_id]] * 3


def test_a_remote_code_export_reads_back_as_its_checkpoint(tmp_path):
    """read_hf_model (generate, model.init_from) on a --remote-code export: the arch it carries and the very weights."""
    from diffexp.hf.reading import read_hf_model

    checkpoint, out = export_case(tmp_path, "dint", remote=True)
    saved = torch.load(checkpoint, weights_only=True)
    read = read_hf_model(out, "CKPT")
    arch = {**saved["hyper_parameters"]["arch"], "backend": "sdpa"}  # the bundle's backend
    assert read["hyper_parameters"]["arch"] == arch
    assert read["state_dict"].keys() == saved["state_dict"].keys()
    for name, tensor in saved["state_dict"].items():
        assert torch.equal(read["state_dict"][name], tensor), name


@pytest.mark.parametrize("case, remote", [("diff_v1", False), ("dint", True)])
def test_eval_reads_an_hf_export_as_its_checkpoint(tmp_path, case, remote):
    """`diffexp eval nll` on the export writes the checkpoint's per-position losses."""
    import json

    checkpoint, out = export_case(tmp_path, case, remote)
    document = tmp_path / "doc.txt"
    document.write_text("The quick brown fox jumps over the lazy dog. " * 4)
    results = []
    for source, where in ((checkpoint, "from-ckpt"), (out, "from-export")):
        with pytest.raises(SystemExit) as done:
            main(["eval", "nll", str(source), "--text-file", str(document), "--documents", "1", "--context-len", "32",
                  "--device", "cpu", "--out", str(tmp_path / where)])
        assert done.value.code == 0
        (written,) = (tmp_path / where).rglob("nll-ctx32.json")
        results.append(json.loads(written.read_text()))
    got, want = ([(row["nll"], row["cumulative_nll"]) for row in result.pop("positions")] for result in results[::-1])
    assert results[0] == results[1] and got == [pytest.approx(pair, rel=1e-6) for pair in want]

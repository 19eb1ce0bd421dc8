"""Sampling rules, decoding with the cache, and `diffexp generate` on checkpoints."""

from __future__ import annotations

import io

import pytest
import torch

from diffexp.cli import main
from diffexp.data.tokenizer import ByteTokenizer
from diffexp.generate import Sampling, generate
from diffexp.generate.cli import TextStream
from diffexp.generate.sampling import next_token
from diffexp.model.compile import compile_unavailable
from tests.helpers import PATTERN, save_checkpoint, small_model


# -- sampling ---------------------------------------------------------------------------------------
def draws(logits: torch.Tensor, sampling: Sampling, n: int = 4000) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return next_token(logits.expand(n, -1), sampling, generator)


def test_temperature_zero_and_top_k_one_are_greedy():
    logits = torch.randn(5, 30)
    assert torch.equal(next_token(logits, Sampling(temperature=0)), logits.argmax(-1))
    assert torch.equal(next_token(logits, Sampling(temperature=3.0, top_k=1)), logits.argmax(-1))


def test_sampling_follows_the_softmax_of_the_scaled_logits():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    for temperature in (1.0, 0.5):
        counts = torch.bincount(draws(logits, Sampling(temperature)), minlength=4).float() / 4000
        expected = (logits[0] / temperature).softmax(-1)
        assert torch.allclose(counts, expected, atol=0.03), (temperature, counts, expected)


def test_top_k_and_top_p_only_draw_inside_their_sets():
    logits = torch.tensor([[3.0, 2.5, 1.0, 0.0, -2.0]])  # probabilities .53 .32 .07 .03 .00
    assert set(draws(logits, Sampling(top_k=2)).tolist()) == {0, 1}
    assert set(draws(logits, Sampling(top_p=0.8)).tolist()) == {0, 1}  # .53 < .8: the second is needed
    assert set(draws(logits, Sampling(top_p=0.5)).tolist()) == {0}     # the first alone reaches .5
    # inside the set, the renormalised probabilities
    kept = torch.bincount(draws(logits, Sampling(top_k=2)), minlength=2).float() / 4000
    assert torch.allclose(kept[:2], logits[0, :2].softmax(-1), atol=0.03)


def test_same_seed_same_tokens():
    logits = torch.randn(3, 50)
    a = next_token(logits, Sampling(), torch.Generator().manual_seed(7))
    b = next_token(logits, Sampling(), torch.Generator().manual_seed(7))
    assert torch.equal(a, b)


@pytest.mark.parametrize("flags,match", [(dict(temperature=-1.0), "--temperature=-1.0"),
                                         (dict(temperature=float("nan")), "--temperature=nan"),
                                         (dict(top_k=0), "--top-k=0"), (dict(top_p=0.0), "--top-p=0.0"),
                                         (dict(top_p=1.5), "--top-p=1.5")])
def test_bad_sampling_flags_are_named(flags, match):
    from diffexp.errors import UserError

    with pytest.raises(UserError, match=match):
        Sampling(**flags).check()


# -- decoding ---------------------------------------------------------------------------------------
def test_generate_stops_at_the_stop_token_and_at_max_new_tokens():
    model = small_model().model.eval()
    prompt = torch.tensor([[1, 2, 3], [4, 5, 6]])
    free = torch.stack(list(generate(model, prompt, 10, Sampling(temperature=0))), dim=1)
    assert free.shape == (2, 10)
    stop = int(free[0, 3])  # a token the first sequence greedily produces at step 3
    stopped = torch.stack(list(generate(model, prompt, 10, Sampling(temperature=0), stop_id=stop)), dim=1)
    first = int((free[0] == stop).nonzero()[0])
    assert torch.equal(stopped[0, :first + 1], free[0, :first + 1])
    assert (stopped[0, first:] == stop).all()  # a finished sequence only repeats the stop token


def test_generate_refuses_to_pass_max_seq_len_before_any_work():
    model = small_model(max_seq_len=16).model.eval()
    assert len(list(generate(model, torch.zeros(1, 10, dtype=torch.long), 7))) == 7  # 10 + 7 - 1 = 16 fits
    with pytest.raises(ValueError, match="max_seq_len=16"):
        next(generate(model, torch.zeros(1, 10, dtype=torch.long), 8))


def test_text_stream_keeps_multibyte_characters_whole():
    out = io.StringIO()
    stream = TextStream(ByteTokenizer(), out)
    for byte in "né€".encode():
        stream.add(byte)
        assert "\ufffd" not in out.getvalue()
    stream.close()
    assert out.getvalue() == "né€\n"


# -- the command ------------------------------------------------------------------------------------
def run_generate(args, capsys):
    with pytest.raises(SystemExit) as done:
        main(["generate", *args])
    captured = capsys.readouterr()
    return done.value.code, captured.out, captured.err


def test_greedy_generation_continues_what_the_model_learned(memorised, capsys):
    code, out, _ = run_generate([str(memorised), "--prompt", "the cat", "--temperature", "0",
                                 "--max-new-tokens", "30", "--device", "cpu"], capsys)
    assert code == 0
    assert out == (PATTERN * 2)[len("the cat"):len("the cat") + 30] + "\n"


def test_prompt_from_a_file_and_stdin(memorised, capsys, tmp_path, monkeypatch):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("the cat sat")
    code, from_file, _ = run_generate([str(memorised), "--prompt-file", str(prompt), "--temperature", "0",
                                       "--max-new-tokens", "8", "--device", "cpu"], capsys)
    assert code == 0 and from_file == " on the \n"
    monkeypatch.setattr("sys.stdin", io.StringIO("the cat sat"))
    code, from_stdin, _ = run_generate([str(memorised), "--temperature", "0", "--max-new-tokens", "8",
                                        "--device", "cpu"], capsys)
    assert code == 0 and from_stdin == from_file


@pytest.mark.skipif(compile_unavailable(torch.device("cpu")) is not None, reason="torch.compile cannot run here")
def test_compile_gives_the_same_text(memorised, capsys):
    torch.compiler.reset()
    args = [str(memorised), "--prompt", "the cat", "--temperature", "0", "--max-new-tokens", "30", "--device", "cpu"]
    code, compiled, _ = run_generate([*args, "--compile"], capsys)
    assert code == 0 and compiled == run_generate(args, capsys)[1] == (PATTERN * 2)[7:37] + "\n"
    torch.compiler.reset()


def test_compile_where_it_cannot_run_is_one_clear_error(memorised, capsys, monkeypatch):
    monkeypatch.setattr("diffexp.model.compile.compile_unavailable", lambda device, **options: "no C++ compiler found")
    code, out, err = run_generate([str(memorised), "--prompt", "the", "--compile", "--max-new-tokens", "5",
                                   "--device", "cpu"], capsys)
    assert code == 2 and "--compile is invalid here" in err and "no C++ compiler found" in err and out == ""


def test_sampling_is_reproducible_by_seed(memorised, capsys):
    args = [str(memorised), "--prompt", "the", "--temperature", "1.5", "--max-new-tokens", "20", "--device", "cpu"]
    outs = [run_generate(args + ["--seed", str(seed)], capsys)[1] for seed in (1, 1, 2)]
    assert outs[0] == outs[1] and outs[0] != outs[2]


def test_the_checkpoint_carries_its_bpe_tokenizer(tmp_path, capsys):
    """A model trained on a BPE: the checkpoint holds the tokenizer, so generate decodes BPE ids to text."""
    from diffexp.data import TextDataModule

    datamodule = TextDataModule(tokenizer="bpe", bpe_vocab_size=300, seq_len=32, cache_dir=str(tmp_path / "cache"))
    vocab = datamodule.tokenizer.vocab_size
    path = save_checkpoint(small_model(vocab_size=vocab), tmp_path / "bpe.ckpt", datamodule)
    assert torch.load(path, weights_only=False)["diffexp_tokenizer"]["kind"] == "tokenizers"
    code, out, _ = run_generate([str(path), "--prompt", "Once upon", "--max-new-tokens", "5", "--device", "cpu"],
                                capsys)
    assert code == 0 and out.strip()  # an untrained model's five BPE tokens, as text
    # saved without its tokenizer (outside a fit), a BPE model cannot be decoded by guess: it asks
    bare = save_checkpoint(small_model(vocab_size=vocab), tmp_path / "bare.ckpt")
    code, _, err = run_generate([str(bare), "--prompt", "Once", "--device", "cpu"], capsys)
    assert code == 2 and "saved without its tokenizer" in err and "--tokenizer" in err
    tokenizer_json = tmp_path / "tokenizer.json"
    datamodule.tokenizer.tokenizer.save(str(tokenizer_json))
    code, _, _ = run_generate([str(bare), "--prompt", "Once", "--max-new-tokens", "5", "--device", "cpu", "--tokenizer",
                               str(tokenizer_json)],
                              capsys)
    assert code == 0
    # the saved tokenizer is the file's: the same weights, seed and ids give the same text
    code, with_file, _ = run_generate([str(path), "--prompt", "Once upon", "--max-new-tokens", "5", "--device", "cpu",
                                       "--tokenizer", str(tokenizer_json)], capsys)
    assert code == 0 and with_file == out


@pytest.mark.parametrize("args,message", [
    (["--prompt", ""], "the prompt is empty"),
    (["--prompt", "x" * 200], "longer than the model's max_seq_len=128"),
    (["--prompt", "abc", "--max-new-tokens", "200"], "--max-new-tokens=200 is invalid"),
    (["--prompt", "abc", "--max-new-tokens", "0"], "--max-new-tokens=0 is invalid"),
    (["--prompt", "abc", "--top-p", "2"], "--top-p=2.0 is invalid"),
    (["--prompt-file", "/nonexistent/prompt.txt"], "--prompt-file='/nonexistent/prompt.txt' is invalid"),
    (["--prompt", "abc", "--tokenizer", "/nonexistent/tokenizer.json"], "--tokenizer='/nonexistent/tokenizer.json'"),
])
def test_bad_input_is_one_clear_error(memorised, capsys, args, message):
    code, out, err = run_generate([str(memorised), "--device", "cpu", *args], capsys)
    assert code == 2 and message in err and "Traceback" not in err and out == ""


def test_a_missing_checkpoint_is_named(capsys, tmp_path):
    code, _, err = run_generate([str(tmp_path / "nope.ckpt"), "--prompt", "x"], capsys)
    assert code == 2 and "CKPT" in err and "nope.ckpt" in err

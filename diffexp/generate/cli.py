"""`diffexp generate CKPT --prompt TEXT`: continue a prompt with a trained model, streaming the text.

CKPT is a checkpoint, a `diffexp export` directory or a `diffexp export --format hf` one (diffexp.hf.reading, its
tokenizer from its tokenizer.json). The prompt comes from --prompt, --prompt-file or standard input; the tokenizer
is --tokenizer, else the checkpoint's own, else what its data settings name. Everything is checked before the
model is built.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from diffexp.data.tokenizer import ByteTokenizer, TextTokenizer, load_tokenizer_file, tokenizer_from_state
from diffexp.errors import UserError
from diffexp.generate.sampling import Sampling
from diffexp.training.loading import CKPT_KEY, check_compile, check_device, load_checkpoint, load_decoder


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, prog="diffexp generate", description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    parser.add_argument("checkpoint", metavar=CKPT_KEY,
                        help="a .ckpt file, a sharded checkpoint directory or a `diffexp export` directory "
                             "(--format hf ones included)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--prompt", help="the prompt text (default: --prompt-file, else standard input)")
    source.add_argument("--prompt-file", help="a UTF-8 text file holding the prompt")
    parser.add_argument("--max-new-tokens", type=int, default=200, help="tokens to add at most (default 200)")
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy (default 0.8)")
    parser.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    parser.add_argument("--top-p", type=float, default=None, help="sample within this probability mass (nucleus)")
    parser.add_argument("--seed", type=int, default=0, help="the sampling seed: same seed, same text")
    parser.add_argument("--tokenizer", default=None,
                        help="'byte' or a tokenizer.json, for checkpoints saved without their tokenizer")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu, cuda or cuda:<index> (default: cuda when available)")
    parser.add_argument("--compile", action="store_true",
                        help="decode through the torch.compile'd step on a static cache (CUDA graphs on a GPU); "
                             "compiling takes a while, so it pays off on long generations")
    return parser


def read_prompt(args) -> str:
    if args.prompt is not None:
        text = args.prompt
    elif args.prompt_file is not None:
        path = Path(args.prompt_file)
        if not path.is_file():
            raise UserError(f"--prompt-file={args.prompt_file!r} is invalid: no such file")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise UserError(f"--prompt-file={args.prompt_file!r} is invalid: not UTF-8 text") from None
    elif not sys.stdin.isatty():
        text = sys.stdin.read()
    else:
        raise UserError("no prompt: give --prompt TEXT, --prompt-file FILE, or pipe the prompt on standard input")
    if not text:
        raise UserError("the prompt is empty: the model needs at least one token to continue")
    return text


def resolve_tokenizer(checkpoint: dict, hparams: dict, flag: str | None) -> TextTokenizer:
    """--tokenizer, else the checkpoint's saved tokenizer, else the byte tokenizer its data settings name."""
    if flag == "byte":
        return ByteTokenizer()
    if flag is not None:
        if not Path(flag).is_file():
            raise UserError(f"--tokenizer={flag!r} is invalid: no such file; expected 'byte' or a tokenizer.json")
        return load_tokenizer_file(flag, flag)
    if "diffexp_tokenizer" in checkpoint:
        return tokenizer_from_state(checkpoint["diffexp_tokenizer"])
    named = hparams["data"].get("tokenizer", "byte" if hparams["arch"]["vocab_size"] == ByteTokenizer.vocab_size
                                else None)
    if named == "byte":
        return ByteTokenizer()
    if named and named != "bpe" and Path(named).is_file():
        return load_tokenizer_file(named, named)
    raise UserError(f"{CKPT_KEY}: this checkpoint was saved without its tokenizer (data.tokenizer={named!r}); "
                    "pass --tokenizer PATH with the tokenizer.json it was trained with (a trained BPE is in the "
                    "run's data cache_dir under tokenizers/)")


def check_vocab(tokenizer: TextTokenizer, arch: dict) -> None:
    if tokenizer.vocab_size > arch["vocab_size"]:
        raise UserError(f"--tokenizer: its {tokenizer.vocab_size} ids do not fit the model's "
                        f"vocab_size={arch['vocab_size']}; expected the tokenizer the model was trained with")


def check_fits(tokenizer: TextTokenizer, arch: dict, prompt_ids: list[int], max_new_tokens: int) -> None:
    check_vocab(tokenizer, arch)
    limit = arch["max_seq_len"]
    if len(prompt_ids) > limit:
        raise UserError(f"the prompt is {len(prompt_ids)} tokens: longer than the model's max_seq_len={limit}; "
                        "shorten it")
    room = limit - len(prompt_ids) + 1  # the last new token is never fed back
    if max_new_tokens > room:
        raise UserError(f"--max-new-tokens={max_new_tokens} is invalid: a {len(prompt_ids)}-token prompt leaves "
                        f"room for {room} new tokens within max_seq_len={limit}; expected <= {room}")


class TextStream:
    """Prints decoded text as ids arrive. Decoding the whole continuation each time and printing what is new
    keeps multi-byte characters whole; a trailing replacement character waits for the rest of its bytes."""

    def __init__(self, tokenizer: TextTokenizer, out=None) -> None:
        self.tokenizer, self.out = tokenizer, out or sys.stdout
        self.ids: list[int] = []
        self.printed = 0

    def add(self, token_id: int) -> None:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids)
        ready = len(text.rstrip("\ufffd"))
        if ready > self.printed:
            self.out.write(text[self.printed:ready])
            self.out.flush()
            self.printed = ready

    def close(self) -> None:
        text = self.tokenizer.decode(self.ids)
        self.out.write(text[self.printed:] + "\n")
        self.out.flush()


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    sampling = Sampling(args.temperature, args.top_k, args.top_p).check()
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens={args.max_new_tokens} is invalid: expected a positive integer")
    prompt = read_prompt(args)
    checkpoint, hparams = load_checkpoint(args.checkpoint)
    tokenizer = resolve_tokenizer(checkpoint, hparams, args.tokenizer)
    prompt_ids = tokenizer.encode(prompt)
    if not prompt_ids:
        raise UserError("the prompt encodes to no tokens: the model needs at least one token to continue")
    check_fits(tokenizer, hparams["arch"], prompt_ids, args.max_new_tokens)
    check_device(args.device)
    if args.compile:
        check_compile(args.device)
    from diffexp.generate.decode import generate  # the model's modules: after every check, not for --help

    model = load_decoder(checkpoint, args.checkpoint, args.device)
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    ids = torch.tensor([prompt_ids], device=args.device)
    stream = TextStream(tokenizer)
    for token in generate(model, ids, args.max_new_tokens, sampling, tokenizer.eos_id, generator, args.compile):
        if int(token) == tokenizer.eos_id:
            break
        stream.add(int(token))
    stream.close()
    return 0

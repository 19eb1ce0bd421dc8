"""Offline tokenizers with one small interface (``encode``, ``decode``, ``vocab_size``, ``eos_id``): UTF-8 bytes
(``ByteTokenizer``, vocab 257) or a Hugging Face ``tokenizers.Tokenizer`` (``HFTokenizer``). ``decode`` drops the
end-of-document token.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from diffexp.data.checks import TOKENIZER_CHOICES, looks_like_path, tokenizer_error
from diffexp.errors import UserError, invalid

EOS_TOKEN = "<|endoftext|>"
# End-of-document tokens used by common tokenizer.json files, tried in this order.
KNOWN_EOS_TOKENS = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "[SEP]")


class TextTokenizer(Protocol):
    vocab_size: int
    eos_id: int
    identity: str  # stable description used in cache keys

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]: ...


class ByteTokenizer:
    """UTF-8 bytes (ids 0..255) plus an end-of-document id 256."""

    vocab_size = 257
    eos_id = 256
    identity = "byte"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8) for text in texts]


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` behind the common interface; ``identity`` must be cache-stable."""

    def __init__(self, tokenizer: Tokenizer, identity: str) -> None:
        self.tokenizer = tokenizer
        self.identity = identity
        eos_id = next(
            (tokenizer.token_to_id(t) for t in KNOWN_EOS_TOKENS if tokenizer.token_to_id(t) is not None), None
        )
        if eos_id is None:
            # No document separator in the file: add ours (it becomes the last id).
            tokenizer.add_special_tokens([EOS_TOKEN])
            eos_id = tokenizer.token_to_id(EOS_TOKEN)
        self.eos_id: int = eos_id
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encodings = self.tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(encoding.ids, dtype=np.int64) for encoding in encodings]


def load_tokenizer_file(path: str | os.PathLike, spec: str | None = None) -> HFTokenizer:
    """Load an existing ``tokenizer.json``; its content hash is the cache identity.

    A file that is not a tokenizer.json raises a UserError naming ``data.tokenizer={spec}``.
    """
    content = Path(path).read_bytes()
    try:
        tokenizer = Tokenizer.from_str(content.decode("utf-8"))
    except Exception as err:  # tokenizers raises a bare Exception for a bad file; decoding a UnicodeDecodeError
        raise tokenizer_error(str(path) if spec is None else spec, Path(path), err) from None
    return HFTokenizer(tokenizer, identity=f"file-{hashlib.sha256(content).hexdigest()[:16]}")


def check_bpe_vocab_size(vocab_size: int, key: str = "data.bpe_vocab_size") -> None:
    """The one rule of a BPE's vocabulary (``key``: the setting as the command spells it): every byte is a symbol,
    plus the end-of-document token."""
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 257:
        raise invalid(key, vocab_size, "expected an integer of at least 257 (256 byte symbols + <|endoftext|>)")


def train_bpe(texts: Sequence[str], vocab_size: int) -> Tokenizer:
    """Train a GPT-2 style byte-level BPE (lossless on any text) with an ``<|endoftext|>`` token."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte stays encodable
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tokenizer


def tokenizer_state(tokenizer: object) -> dict | None:
    """What a checkpoint keeps to turn its model's ids back into text without the data cache: the byte
    tokenizer by name, a `tokenizers` one as its whole tokenizer.json (a BPE of 32K tokens is about 2 MB)."""
    if isinstance(tokenizer, ByteTokenizer):
        return {"kind": "byte"}
    if isinstance(tokenizer, HFTokenizer):
        return {"kind": "tokenizers", "json": tokenizer.tokenizer.to_str(), "identity": tokenizer.identity}
    return None


def tokenizer_from_state(state: dict) -> TextTokenizer:
    """The tokenizer tokenizer_state saved."""
    if state.get("kind") == "byte":
        return ByteTokenizer()
    if state.get("kind") == "tokenizers":
        return HFTokenizer(Tokenizer.from_str(state["json"]), state["identity"])
    raise ValueError(f"unknown tokenizer kind {state.get('kind')!r}; expected 'byte' or 'tokenizers'")


def load_named_tokenizer(spec: str, key: str):
    """A tokenizer.json file, or a Hub tokenizer by name (needs network or the local Hub cache); a
    ``(tokenizers.Tokenizer, json text)`` pair, or a UserError naming ``key``."""
    from tokenizers import Tokenizer

    path = Path(spec).expanduser()
    if path.is_dir():
        inside = path / "tokenizer.json"
        hint = f"; did you mean {str(inside)!r}?" if inside.is_file() else ""
        raise UserError(f"{key}={spec!r}: {path} is a directory, not a tokenizer.json file{hint}")
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
            return Tokenizer.from_str(text), text
        except Exception as err:  # tokenizers raises a bare Exception for a bad file
            reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise UserError(f"{key}={spec!r}: {path} is not a Hugging Face tokenizer.json ({reason}); "
                            f"{TOKENIZER_CHOICES}") from None
    if looks_like_path(spec):
        raise UserError(f"{key}={spec!r}: no such file; {TOKENIZER_CHOICES}")
    try:
        tokenizer = Tokenizer.from_file(_hub_tokenizer_file(spec))
    except Exception as err:  # offline, no such repository, no tokenizer.json in it
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise UserError(f"{key}={spec!r}: not a local file, and no Hub tokenizer of that name could be loaded "
                        f"({reason}); {TOKENIZER_CHOICES}") from None
    return tokenizer, tokenizer.to_str()


def _hub_tokenizer_file(name: str) -> str:
    """A Hub repository's tokenizer.json: from the local Hub cache, else downloaded (failing at once offline,
    where huggingface_hub would retry for half a minute)."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache

    cached = try_to_load_from_cache(name, "tokenizer.json")
    if isinstance(cached, str):
        return cached
    if constants.HF_HUB_OFFLINE:
        raise OSError("offline (HF_HUB_OFFLINE is set) and not in the local Hub cache")
    try:
        socket.getaddrinfo(urlparse(constants.ENDPOINT).hostname, 443)
    except OSError as err:
        raise OSError(f"the Hub cannot be reached ({err.strerror or err}), and it is not in the local Hub "
                      "cache") from None
    return hf_hub_download(name, "tokenizer.json")

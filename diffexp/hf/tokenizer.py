"""The tokenizer files `AutoTokenizer` reads (tokenizer.json + tokenizer_config.json), for either tokenizer, and
the tokenizer of an HF directory read back (`diffexp generate` on an export).

The byte tokenizer becomes a byte-level BPE without merges whose 256 symbols are the bytes, in id order, plus
its end-of-document token at 256: every text encodes to its UTF-8 bytes, as diffexp's does. A BPE trained by
diffexp ships its own tokenizer.json. tokenizer_config.json names transformers' built-in
`PreTrainedTokenizerFast`, so no tokenizer code is run; only a `--remote-code` export's config.json needs trust.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from diffexp.data.tokenizer import (
    EOS_TOKEN,
    ByteTokenizer,
    load_tokenizer_file,
    tokenizer_from_state,
    tokenizer_state,
)
from diffexp.errors import UserError

TOKENIZER_FILE, TOKENIZER_CONFIG = "tokenizer.json", "tokenizer_config.json"
#: the class tokenizer_config.json names: built into transformers 4 and 5 (an alias of TokenizersBackend in 5)
TOKENIZER_CLASS = "PreTrainedTokenizerFast"


def byte_tokenizer() -> Tokenizer:
    """diffexp's ByteTokenizer as a `tokenizers.Tokenizer` (ids 0..255 the bytes, 256 the end of a document)."""
    symbols = pre_tokenizers.ByteLevel.alphabet()  # one printable character per byte
    by_byte = {ord(c): c for c in symbols}
    # GPT-2's byte-to-character table: printable bytes stand for themselves, the rest are shifted past 255
    table, shifted = {}, 0
    for byte in range(256):
        char = chr(byte)
        if char not in by_byte.values():
            char = chr(256 + shifted)
            shifted += 1
        table[byte] = char
    vocab = {table[byte]: byte for byte in range(256)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([EOS_TOKEN])  # id 256
    return tokenizer


def write_tokenizer(state: dict | None, out: Path, max_length: int) -> int | None:
    """Write the tokenizer of a checkpoint's `diffexp_tokenizer` state into `out`; returns its end-of-document
    id (None for a checkpoint without a tokenizer: nothing is written)."""
    from transformers import PreTrainedTokenizerFast

    if state is None:
        return None
    text_tokenizer = tokenizer_from_state(state)
    tokenizer = byte_tokenizer() if isinstance(text_tokenizer, ByteTokenizer) else text_tokenizer.tokenizer
    eos = tokenizer.id_to_token(text_tokenizer.eos_id)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eos, model_max_length=max_length,
                                   clean_up_tokenization_spaces=False)
    fast.save_pretrained(str(out))
    config_file = out / TOKENIZER_CONFIG
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config_file.write_text(json.dumps({**config, "tokenizer_class": TOKENIZER_CLASS}, indent=2) + "\n",
                           encoding="utf-8")
    return text_tokenizer.eos_id


def read_tokenizer(path: Path, key: str) -> dict | None:
    """The tokenizer_state of an HF directory's tokenizer.json (None without one): diffexp's byte tokenizer when
    the file holds exactly its vocabulary (what write_tokenizer writes for it), else the file itself."""
    file = Path(path) / TOKENIZER_FILE
    if not file.is_file():
        return None
    try:
        tokenizer = load_tokenizer_file(file)
    except UserError:
        raise UserError(f"{key}={str(path)!r}: its {TOKENIZER_FILE} is not a Hugging Face tokenizer.json; pass "
                        "--tokenizer PATH with the tokenizer the model was trained with") from None
    if tokenizer.tokenizer.get_vocab(with_added_tokens=True) == byte_tokenizer().get_vocab(with_added_tokens=True):
        return tokenizer_state(ByteTokenizer())
    return tokenizer_state(tokenizer)

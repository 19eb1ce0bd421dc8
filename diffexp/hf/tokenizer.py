"""The tokenizer files `AutoTokenizer` reads (tokenizer.json + tokenizer_config.json), for either tokenizer.

The byte tokenizer becomes a byte-level BPE without merges whose 256 symbols are the bytes, in id order, plus
its end-of-document token at 256: every text encodes to its UTF-8 bytes, as diffexp's does. A BPE trained by
diffexp ships its own tokenizer.json.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from diffexp.data.tokenizer import EOS_TOKEN, ByteTokenizer, tokenizer_from_state


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
    return text_tokenizer.eos_id

"""`diffexp export --format hf`: which transformers form a checkpoint takes, and its files.

A variant whose registry entry names a transformers class (`hf_architecture`) is written as that class where its
flags allow (diffexp.hf.classes), and with --remote-code any variant as remote code. A model its class cannot
compute is refused, naming the setting, before anything is written: an export never computes something else
than the checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from diffexp.errors import UserError
from diffexp.hf import remote_code
from diffexp.hf.classes import CLASSES, hf_class, written_as
from diffexp.hf.tokenizer import write_tokenizer

REMOTE = "remote"


def hf_form(cfg, remote: bool) -> str:
    """The transformers class a ModelConfig is written as, or REMOTE; a UserError when no plain class computes it."""
    if remote:
        return REMOTE
    form = hf_class(cfg.attention)
    if form is None:
        have = " and ".join(f"{name} as {c.name}" for name, c in written_as().items())
        raise UserError(f"--format hf: model.arch.attention={cfg.attention!r} has no transformers class (only "
                        f"{have} have one); add --remote-code to export it as remote code, loaded with "
                        f"trust_remote_code=True")
    problems = form.unrepresentable(cfg)
    if problems:
        key, value, why = problems[0]
        raise UserError(f"--format hf: {key}={value!r} cannot be written as {form.name} ({why}); add "
                        f"--remote-code to export it as remote code, loaded with trust_remote_code=True")
    return form.name


def write_hf_files(out: Path, cfg, arch: dict, checkpoint: dict, form: str,
                   tokenizer: dict | None) -> dict[str, torch.Tensor]:
    """Config, generation config, tokenizer (a tokenizer_state, or None) and remote code into `out`; returns the
    weights to save."""
    from transformers import AutoConfig, GenerationConfig

    eos_id = write_tokenizer(tokenizer, out, cfg.max_seq_len)
    state = checkpoint["state_dict"]
    dtype = str(state["model.embed.weight"].dtype).removeprefix("torch.")
    if form == REMOTE:
        remote_code.write_remote_code(out, arch, eos_id)
        weights = {name: tensor for name, tensor in state.items() if name.startswith("model.")}
        config = json.loads((out / "config.json").read_text(encoding="utf-8"))
        (out / "config.json").write_text(json.dumps({**config, "dtype": dtype}, indent=2) + "\n", encoding="utf-8")
    else:
        decoder = {name.removeprefix("model."): tensor for name, tensor in state.items() if name.startswith("model.")}
        fields = CLASSES[form].config(cfg, eos_id)
        config = AutoConfig.for_model(fields.pop("model_type"), **fields, dtype=dtype)
        config.save_pretrained(str(out))
        weights = CLASSES[form].to_hf(decoder, cfg)
    GenerationConfig(eos_token_id=eos_id, bos_token_id=None, pad_token_id=eos_id).save_pretrained(str(out))
    return weights

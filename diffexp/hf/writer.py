"""`diffexp export --format hf`: which transformers form a checkpoint takes, and its files.

baseline -> LlamaForCausalLM, DIFF V1 -> DiffLlamaForCausalLM where its flags allow, and with --remote-code any
variant as remote code. A model one of the plain classes cannot compute is refused, naming the setting, before
anything is written: an export never computes something else than the checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from diffexp.errors import UserError
from diffexp.hf import diff_llama, llama, remote_code
from diffexp.hf.tokenizer import write_tokenizer

FORMS = {"baseline": "LlamaForCausalLM", "diff_v1": "DiffLlamaForCausalLM"}


def hf_form(cfg, remote: bool) -> str:
    """'llama', 'diff_llama' or 'remote' for a ModelConfig; a UserError when no plain class computes it."""
    if remote:
        return "remote"
    if cfg.attention not in FORMS:
        raise UserError(f"--format hf: model.arch.attention={cfg.attention!r} has no transformers class (only "
                        f"baseline as LlamaForCausalLM and diff_v1 as DiffLlamaForCausalLM have one); add "
                        f"--remote-code to export it as remote code, loaded with trust_remote_code=True")
    if cfg.attention == "diff_v1":
        problems = diff_llama.unrepresentable(cfg)
        if problems:
            key, value, why = problems[0]
            raise UserError(f"--format hf: {key}={value!r} cannot be written as DiffLlamaForCausalLM ({why}); add "
                            f"--remote-code to export it as remote code, loaded with trust_remote_code=True")
        return "diff_llama"
    return "llama"


def write_hf_files(out: Path, cfg, arch: dict, checkpoint: dict, form: str,
                   tokenizer: dict | None) -> dict[str, torch.Tensor]:
    """Config, generation config, tokenizer (a tokenizer_state, or None) and remote code into `out`; returns the
    weights to save."""
    from transformers import AutoConfig, GenerationConfig

    eos_id = write_tokenizer(tokenizer, out, cfg.max_seq_len)
    state = checkpoint["state_dict"]
    dtype = str(state["model.embed.weight"].dtype).removeprefix("torch.")
    if form == "remote":
        remote_code.write_remote_code(out, arch, eos_id)
        weights = {name: tensor for name, tensor in state.items() if name.startswith("model.")}
        config = json.loads((out / "config.json").read_text(encoding="utf-8"))
        (out / "config.json").write_text(json.dumps({**config, "dtype": dtype}, indent=2) + "\n", encoding="utf-8")
    else:
        decoder = {name.removeprefix("model."): tensor for name, tensor in state.items() if name.startswith("model.")}
        fields = (llama.llama_config if form == "llama" else diff_llama.diff_llama_config)(cfg, eos_id)
        config = AutoConfig.for_model(fields.pop("model_type"), **fields, dtype=dtype)
        config.save_pretrained(str(out))
        weights = (llama.to_llama if form == "llama" else diff_llama.to_diff_llama)(decoder, cfg)
    GenerationConfig(eos_token_id=eos_id, bos_token_id=None, pad_token_id=eos_id).save_pretrained(str(out))
    return weights

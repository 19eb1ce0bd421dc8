"""An HF Llama or DiffLlama directory (an export, or a published Llama-architecture checkpoint) as a diffexp
checkpoint, for `model.init_from` and `diffexp generate`: the variant whose registry entry names the class
(diffexp.hf.classes). A `--remote-code` export is read as the arch and weights it carries unchanged.

What diffexp cannot compute is refused, naming the config.json field: biases, another activation, RoPE scaling.
Weights are read from model.safetensors or the shards its index names.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from diffexp.checkpoint_io import fill_added_later, verify_checkpoint
from diffexp.errors import UserError
from diffexp.hf import diff_llama, remote_code
from diffexp.hf.classes import read_as, written_as


def hf_model_type(path: os.PathLike | str) -> str | None:
    """The model_type of an HF model directory (a config.json with one and no diffexp `format`), else None."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    try:
        fields = json.loads(config.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        return None
    return fields.get("model_type") if isinstance(fields, dict) and "format" not in fields else None


def _refuse(key: str, path: Path, problem: str) -> UserError:
    return UserError(f"{key}={str(path)!r}: cannot read this Hugging Face model: {problem}")


def hf_arch(fields: dict, key: str, path: Path) -> dict:
    """The `model.arch` of an HF Llama or DiffLlama config.json."""
    model_type = fields.get("model_type")
    if read_as(model_type) is None:
        known = ", ".join(c.model_type for c in written_as().values())
        raise _refuse(key, path, f"model_type {model_type!r}; expected one of {known}")
    for name, wanted in (("attention_bias", False), ("mlp_bias", False), ("hidden_act", "silu")):
        if fields.get(name, wanted) != wanted:
            raise _refuse(key, path, f"config.json has {name}={fields[name]!r}; diffexp's decoder has {wanted!r}")
    rope = fields.get("rope_parameters") or fields.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise _refuse(key, path, f"config.json's rope_type {rope.get('rope_type', rope.get('type'))!r}; diffexp's "
                                 "RoPE has no scaling (rope_type 'default')")
    theta = rope.get("rope_theta", fields.get("rope_theta", 10000.0))
    heads, kv_heads = fields["num_attention_heads"], fields.get("num_key_value_heads") or fields["num_attention_heads"]
    head_dim = fields.get("head_dim") or fields["hidden_size"] // heads
    if model_type == "diffllama":
        heads, kv_heads = heads // 2, kv_heads // 2  # DiffLlama counts each map as a head
        if fields.get("rms_norm_eps", 1e-5) != diff_llama.HEAD_NORM_EPS:
            raise _refuse(key, path, f"config.json's rms_norm_eps {fields['rms_norm_eps']!r} is DiffLlama's head "
                                     f"norm epsilon too; diffexp's is {diff_llama.HEAD_NORM_EPS:g}")
    arch = {"attention": read_as(model_type)[0], "vocab_size": fields["vocab_size"], "d_model": fields["hidden_size"],
            "n_layers": fields["num_hidden_layers"], "n_heads": heads, "n_kv_heads": kv_heads, "head_dim": head_dim,
            "ffn_hidden": fields["intermediate_size"], "max_seq_len": fields.get("max_position_embeddings", 2048),
            "rope_theta": float(theta), "tie_embeddings": bool(fields.get("tie_word_embeddings", False)),
            "norm_eps": float(fields.get("rms_norm_eps", 1e-5))}
    if model_type == "diffllama":
        arch.update(lambda_init="depth", head_norm=True)
    return arch


def _weight_files(path: Path, key: str) -> list[Path]:
    """The safetensors files of an HF directory, every one there; refused before any work otherwise (read with
    the config, weights or not, so that `model.init_from` fails before the run directory exists)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise _refuse(key, path, f"{index.name} is damaged ({type(err).__name__}: {err}); expected a "
                                     "weight_map of tensor names to files") from None
        missing = [name for name in names if not (path / name).is_file()]
        if missing:
            raise _refuse(key, path, f"{index.name} names {', '.join(missing[:4])}, which "
                                     f"{'is' if len(missing) == 1 else 'are'} not there")
        return [path / name for name in names]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    pickled = sorted(p.name for p in path.glob("pytorch_model*.bin"))
    if pickled:
        raise _refuse(key, path, _pickled(path, pickled))
    raise _refuse(key, path, "no model.safetensors (or model.safetensors.index.json) in it; expected an HF model "
                             "directory with safetensors weights")


def _pickled(path: Path, pickled: list[str]) -> str:
    """What to do with a directory of PyTorch pickle weights: convert it once with transformers."""
    convert = ("python -c \"from transformers import AutoModelForCausalLM as M; M.from_pretrained('" + str(path) +
               "').save_pretrained('" + str(path) + "-safetensors')\"")
    return (f"it holds {', '.join(pickled[:3])} (PyTorch pickle weights) and no model.safetensors; diffexp reads "
            f"safetensors only (a pickle can run code when loaded). Convert it once, then give the new directory: "
            f"{convert}")


def _hf_weights(path: Path, key: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for file in _weight_files(path, key):
        weights.update(load_file(str(file), device="cpu"))
    return weights


def read_hf_model(path: os.PathLike | str, key: str, weights: bool = True) -> dict:
    """The directory in read_checkpoint's form: hyper_parameters.arch and (with weights) DiffexpLM's state dict.
    One `diffexp export --format hf` wrote is first checked against its SHA256SUMS."""
    from diffexp.model.config import ModelConfig

    path = Path(path)
    verify_checkpoint(path, key)
    fields = json.loads((path / "config.json").read_text(encoding="utf-8"))
    if fields.get("model_type") == remote_code.MODEL_TYPE and isinstance(fields.get("arch"), dict):
        checkpoint = {"hyper_parameters": {"arch": dict(fields["arch"])}, "global_step": 0}
        if weights:  # remote code keeps DiffexpLM's names
            checkpoint["state_dict"] = _hf_weights(path, key)
        return fill_added_later(checkpoint)
    arch = hf_arch(fields, key, path)
    _weight_files(path, key)  # weights or not: a directory without readable weights is refused now
    checkpoint = {"hyper_parameters": {"arch": arch}, "global_step": 0}
    if weights:
        cfg = ModelConfig(**arch)
        hf = _hf_weights(path, key)
        try:
            decoder = read_as(fields["model_type"])[1].from_hf(hf, cfg)
        except KeyError as missing:
            raise _refuse(key, path, f"its weights lack {missing}") from None
        checkpoint["state_dict"] = {f"model.{name}": tensor for name, tensor in decoder.items()}
    return checkpoint

"""Starting a new run from another run's weights (`model.init_from`): the papers' long-context extension.

Only the weights are taken (the optimizer, lr schedule and step count start fresh, in a run directory of its own).
The checkpoint must describe the same network: every architecture field its variant reads must be equal but those
that change no weight (FREE_ON_INIT: max_seq_len and rope_theta, the point of the extension, the backend and the
initialisation), and a difference is refused before any work, naming each field. A Hugging Face Llama or DiffLlama
directory is read as a baseline or DIFF V1 checkpoint (diffexp.hf.reading): continued pretraining from a published
Llama-architecture model is this one setting.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from diffexp.checkpoint_io import is_exported_model, is_sharded_checkpoint, read_checkpoint
from diffexp.errors import UserError

KEY = "model.init_from"
#: fields that may change between the checkpoint and the run it starts: no weight depends on them
FREE_ON_INIT = ("max_seq_len", "rope_theta", "backend", "init_std", "lowrank_init_std",
                "lambda_proj_init")


def read(path: Path, weights: bool = True) -> dict:
    """The checkpoint at a resolved path, an HF Llama or DiffLlama directory included."""
    from diffexp.hf.reading import hf_model_type, read_hf_model

    if hf_model_type(path) is not None:
        return read_hf_model(path, KEY, weights)
    return read_checkpoint(path, KEY, weights=weights)


def resolve(init_from: str) -> Path:
    """The checkpoint `model.init_from` names: a .ckpt file, a sharded checkpoint or `diffexp export`
    directory (or a Hugging Face Llama or DiffLlama one), a run directory (its checkpoints/last.ckpt) or an
    experiment directory (the newest run's)."""
    from diffexp.training.runs import find_last_checkpoint

    path = Path(init_from).expanduser()
    if not path.exists():
        raise UserError(f"{KEY}={init_from!r} is invalid: no such file or directory; expected a checkpoint "
                        "(.ckpt, a sharded checkpoint or export directory) or a run or experiment directory")
    if not path.is_dir() or is_sharded_checkpoint(path) or is_exported_model(path):
        return path
    if (path / "checkpoints" / "last.ckpt").exists():
        return path / "checkpoints" / "last.ckpt"
    found = find_last_checkpoint(path)
    if found is None:
        raise UserError(f"{KEY}={init_from!r} is invalid: a directory without a checkpoint (no checkpoints/"
                        "last.ckpt in it or in a run under it); expected a checkpoint or a run directory")
    return found


def architecture_differences(saved_arch: dict[str, Any], arch: dict[str, Any]) -> list[str]:
    """One line per architecture field that differs between a checkpoint and the run it would start."""
    from diffexp.model.attention import variant, variant_names
    from diffexp.model.config import SHARED_FIELDS

    attention = saved_arch.get("attention")
    if attention != arch.get("attention") or attention not in variant_names():
        return [f"  model.arch.attention: checkpoint {attention!r}, this config {arch.get('attention')!r}"]
    read = [name for name in (*SHARED_FIELDS, *variant(attention).fields)
            if name not in FREE_ON_INIT and name != "vocab_size"]  # vocab: checked against the tokenizer
    saved_arch, arch = {**saved_arch, **_sizes(saved_arch)}, {**arch, **_sizes(arch)}
    return [f"  model.arch.{name}: checkpoint {saved_arch.get(name)!r}, this config {arch.get(name)!r}"
            for name in read if saved_arch.get(name) != arch.get(name)]


def _sizes(arch: dict[str, Any]) -> dict[str, Any]:
    """The sizes a null stands for (n_kv_heads, head_dim, ffn_hidden), so that 4 and null compare equal where null
    means 4; {} for an arch that does not validate (its raw values are compared)."""
    from diffexp.model.config import ModelConfig

    try:
        cfg = ModelConfig(**arch)
    except (TypeError, ValueError):
        return {}
    return {"n_kv_heads": cfg.kv_heads, "head_dim": cfg.resolved_head_dim, "ffn_hidden": cfg.resolved_ffn_hidden}


def check_init_from(init_from: str, arch: dict[str, Any], data_args: dict[str, Any]) -> Path:
    """Preflight: the checkpoint exists and describes the same network (and tokenizer settings, where both
    name one). Returns its path; reads no weights."""
    path = resolve(init_from)
    checkpoint = read(path, weights=False)
    saved_arch = dict(checkpoint["hyper_parameters"]["arch"])
    differences = architecture_differences(saved_arch, arch)
    saved_data = checkpoint.get("datamodule_hyper_parameters") or {}
    for key in ("tokenizer", "bpe_vocab_size"):
        if key in saved_data and key in data_args and saved_data[key] != data_args[key]:
            differences.append(f"  data.{key}: checkpoint {saved_data[key]!r}, this config {data_args[key]!r}")
    if differences:
        free = ", ".join(FREE_ON_INIT[:2])
        raise UserError(f"{KEY}={init_from!r}: cannot start from this checkpoint: its model differs from this "
                        f"config's in {len(differences)} field(s):\n" + "\n".join(differences) +
                        f"\nOnly {free} (and the backend and init settings) may change; set the others as the "
                        f"checkpoint has them")
    return path


def load_initial_weights(module, init_from: str, tokenizer_state: dict | None) -> str:
    """Copy the checkpoint's weights into `module` (a DiffexpLM); returns a one-line account of it.

    `tokenizer_state` is the new run's tokenizer (diffexp.data.tokenizer.tokenizer_state): the weights'
    embeddings only mean something with the tokenizer they were trained with.
    """
    path = resolve(init_from)
    checkpoint = read(path)
    saved_tokenizer = checkpoint.get("diffexp_tokenizer")
    if saved_tokenizer is not None and tokenizer_state is not None and \
            _tokenizer_fingerprint(saved_tokenizer) != _tokenizer_fingerprint(tokenizer_state):
        raise UserError(f"{KEY}={init_from!r}: the checkpoint was trained with another tokenizer than this run's "
                        f"data ({saved_tokenizer.get('identity', saved_tokenizer['kind'])} against "
                        f"{tokenizer_state.get('identity', tokenizer_state['kind'])}); give the data module the "
                        "checkpoint's tokenizer (`diffexp export` writes it as tokenizer.json: data.tokenizer=PATH)")
    try:
        module.load_state_dict(checkpoint["state_dict"])
    except RuntimeError as err:
        reason = str(err).strip().splitlines()[0]
        raise UserError(f"{KEY}={init_from!r}: its weights do not fit this run's model ({reason})") from None
    with torch.no_grad():
        if not all(torch.isfinite(p).all() for p in module.parameters()):
            raise UserError(f"{KEY}={init_from!r}: the checkpoint holds non-finite weights")
    saved = checkpoint["hyper_parameters"]["arch"]
    return (f"initialised from {path} (step {checkpoint.get('global_step', 0)}, max_seq_len {saved['max_seq_len']}, "
            f"rope_theta {saved['rope_theta']:g}); the optimizer, lr schedule and step count start fresh")


def _tokenizer_fingerprint(state: dict) -> tuple:
    return (state["kind"], state.get("json"))

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


def check_init_from(init_from: str, arch: dict[str, Any], data_args: dict[str, Any],
                    data_class: str | None = None) -> Path:
    """Preflight: the checkpoint exists and describes the same network, and this run's data gives its tokenizer
    (where that is known before any work: see diffexp.data.identity.planned_tokenizer). Returns its path; reads
    no weights."""
    from diffexp.data.identity import is_prepared_source, planned_tokenizer
    from diffexp.data.tokenizer import tokenizer_state

    path = resolve(init_from)
    checkpoint = read(path, weights=False)
    saved_arch = dict(checkpoint["hyper_parameters"]["arch"])
    differences = architecture_differences(saved_arch, arch)
    text_data = data_class is None or data_class.endswith("TextDataModule")
    planned = planned_tokenizer(data_args) if text_data else None
    saved_data = checkpoint.get("datamodule_hyper_parameters") or {}
    if planned is None and not (text_data and is_prepared_source(data_args)):  # a BPE not trained yet: its settings
        for key in ("tokenizer", "bpe_vocab_size"):
            if key in saved_data and key in data_args and saved_data[key] != data_args[key]:
                differences.append(f"  data.{key}: checkpoint {saved_data[key]!r}, this config {data_args[key]!r}")
    if differences:
        free = ", ".join(FREE_ON_INIT[:2])
        raise UserError(f"{KEY}={init_from!r}: cannot start from this checkpoint: its model differs from this "
                        f"config's in {len(differences)} field(s):\n" + "\n".join(differences) +
                        f"\nOnly {free} (and the backend and init settings) may change; set the others as the "
                        f"checkpoint has them")
    if planned is not None:
        check_same_tokenizer(init_from, path, checkpoint.get("diffexp_tokenizer"), tokenizer_state(planned),
                             data_args)
    return path


def check_same_tokenizer(init_from: str, path: Path, saved: dict | None, run: dict | None,
                         data_args: dict[str, Any]) -> None:
    """The weights' embeddings mean something only with the tokenizer they were trained with."""
    if saved is None or run is None or _tokenizer_fingerprint(saved) == _tokenizer_fingerprint(run):
        return
    raise UserError(f"{KEY}={init_from!r}: the checkpoint was trained with another tokenizer than this run's data "
                    f"gives ({saved.get('identity', saved['kind'])} against {run.get('identity', run['kind'])}): its "
                    f"embeddings would read other token ids. {_tokenizer_advice(path, saved, data_args)}")


def _tokenizer_advice(path: Path, saved: dict, data_args: dict[str, Any]) -> str:
    """How to give this run the checkpoint's tokenizer: data.tokenizer for a raw source; for a prepared directory
    (its manifest fixes the tokenizer, data.tokenizer is not read) the command that prepares its corpus again."""
    import shlex

    from diffexp.data.identity import is_prepared_source
    from diffexp.data.shards import read_manifest

    how = ""
    if saved["kind"] == "byte":
        tokenizer = "byte"
    elif path.is_dir() and (path / "tokenizer.json").is_file():  # an export holds it
        tokenizer = str(path / "tokenizer.json")
    else:
        tokenizer = "DIR/tokenizer.json"
        how = f"`diffexp export {shlex.quote(str(path))} DIR` writes the checkpoint's tokenizer as {tokenizer}; then "
    source = str(data_args.get("source"))
    if not is_prepared_source(data_args):
        return _sentence(f"{how}train with --data.tokenizer {shlex.quote(tokenizer)}")
    try:
        words = shlex.split(read_manifest(Path(source).expanduser(), "")["command"])
    except (UserError, KeyError, ValueError):
        words = ["diffexp", "data", "prepare", "SOURCE", "{directory}"]
    command, skip = [], False
    for word in words:
        if skip:
            skip = False
        elif word in ("--tokenizer", "--bpe-vocab-size", "--bpe-sample-chars"):
            skip = True
        else:
            command.append("NEWDIR" if word == "{directory}" else word)
    command += ["--tokenizer", tokenizer]
    prepare = (f"prepare its corpus again with it (data.source={source!r} is a prepared directory: its manifest "
               f"fixes the tokenizer, data.tokenizer is not read): `{shlex.join(command)}`, then train with "
               "--data.source NEWDIR")
    return _sentence(how + prepare)


def _sentence(text: str) -> str:
    return text[0].upper() + text[1:]


def load_initial_weights(module, init_from: str, tokenizer_state: dict | None,
                         data_args: dict[str, Any] | None = None) -> str:
    """Copy the checkpoint's weights into `module` (a DiffexpLM); returns a one-line account of it.

    `tokenizer_state` is the new run's tokenizer (diffexp.data.tokenizer.tokenizer_state): the weights'
    embeddings only mean something with the tokenizer they were trained with (`data_args`: its data settings,
    for the advice).
    """
    path = resolve(init_from)
    checkpoint = read(path)
    # known only once a raw source's BPE is trained; any other tokenizer was checked before the run (check_init_from)
    check_same_tokenizer(init_from, path, checkpoint.get("diffexp_tokenizer"), tokenizer_state, data_args or {})
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

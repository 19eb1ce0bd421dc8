"""`diffexp export CKPT OUT`: one self-contained model directory from any checkpoint.

OUT gets config.json (format, hyperparameters, data settings, step, and the run it comes from: its name and version,
the checkpoint's file name and the weights' SHA-256, never a local path: an export is meant to be shared),
model.safetensors (or model.pt with
--format torch; DiffexpLM's state-dict names) and, for a model trained on a BPE, tokenizer.json. Every
`diffexp eval` task and `diffexp generate` read OUT like a checkpoint. With --format hf, OUT is a Hugging Face
transformers directory instead (diffexp.hf: LlamaForCausalLM, DiffLlamaForCausalLM, or with --remote-code any
variant), with the tokenizer files AutoTokenizer reads; `diffexp generate` and `model.init_from` read it back.
Every directory gets SHA256SUMS (`sha256sum -c` form), the SHA-256 of each file, which diffexp's readers check before
loading it. It is written beside itself and renamed into place; an existing OUT is never overwritten, and a disk that
fills leaves nothing behind.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
from pathlib import Path

import torch

from diffexp.checkpoint_io import (
    EXPORT_CONFIG,
    EXPORT_FORMAT,
    no_space_for_export,
    save_failed_for_space,
    tensor_bytes,
    write_checksums,
)
from diffexp.errors import UserError
from diffexp.hf import require_transformers
from diffexp.training.loading import CKPT_KEY, load_checkpoint
from diffexp.training.values import to_builtin

FORMATS = {"safetensors": "model.safetensors", "torch": "model.pt", "hf": "model.safetensors"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, prog="diffexp export", description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    parser.add_argument("checkpoint", metavar=CKPT_KEY, help="a .ckpt file or a sharded checkpoint directory")
    parser.add_argument("out", metavar="OUT", help="the directory to create (must not exist yet)")
    parser.add_argument("--format", choices=tuple(FORMATS), default="safetensors",
                        help="safetensors (default) or torch.save: a diffexp directory; hf: a Hugging Face "
                        "transformers directory (the baseline as LlamaForCausalLM, DIFF V1 as DiffLlamaForCausalLM)")
    parser.add_argument("--remote-code", action="store_true",
                        help="with --format hf: any variant and flag as remote code built from diffexp's model "
                        "(configuration_diffexp.py, modeling_diffexp.py; load with trust_remote_code=True)")
    return parser


def untied(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor with storage of its own: safetensors refuses shared storage (tied embeddings)."""
    seen: set[int] = set()
    result = {}
    for name, tensor in state_dict.items():
        pointer = tensor.untyped_storage().data_ptr()
        result[name] = tensor.detach().clone().contiguous() if pointer in seen else tensor.detach().contiguous()
        seen.add(pointer)
    return result


def export(checkpoint_path: str, out: str, weights_format: str = "safetensors", remote_code: bool = False) -> Path:
    target = Path(out)
    if target.exists():
        raise UserError(f"OUT={out!r} is invalid: it exists; expected a new directory (export never overwrites)")
    _check_creatable(out, target)
    if remote_code and weights_format != "hf":
        raise UserError(f"--remote-code is invalid with --format={weights_format!r}: it writes Hugging Face remote "
                        "code; add --format hf")
    if weights_format == "hf":
        require_transformers("--format hf")
    checkpoint, hparams = load_checkpoint(checkpoint_path)
    if weights_format == "hf":
        return _export_hf(checkpoint, hparams, target, remote_code)
    tokenizer = checkpoint.get("diffexp_tokenizer")
    config = {
        "format": EXPORT_FORMAT,
        "weights": FORMATS[weights_format],
        "hyper_parameters": without_local_paths(to_builtin(checkpoint["hyper_parameters"], json_safe=True)),
        "datamodule_hyper_parameters": without_local_paths(
            to_builtin(checkpoint.get("datamodule_hyper_parameters") or {}, json_safe=True)),
        "global_step": hparams["global_step"],
        "tokenizer": None if tokenizer is None else
        {"kind": tokenizer["kind"], **({"file": "tokenizer.json", "identity": tokenizer["identity"]}
                                       if tokenizer["kind"] == "tokenizers" else {})},
        "source": run_identity(Path(checkpoint_path)),
    }
    with _staged(target, tensor_bytes(checkpoint["state_dict"])) as staging:
        weights = untied(checkpoint["state_dict"])
        if weights_format == "safetensors":
            _save_safetensors(weights, staging / FORMATS["safetensors"])
        else:
            torch.save(weights, staging / FORMATS["torch"])
        config["source"]["weights_sha256"] = _sha256(staging / FORMATS[weights_format])
        if tokenizer is not None and tokenizer["kind"] == "tokenizers":
            (staging / "tokenizer.json").write_text(tokenizer["json"], encoding="utf-8")
        (staging / EXPORT_CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        write_checksums(staging, {FORMATS[weights_format]: config["source"]["weights_sha256"]})
    return target


#: settings that only name a place on the machine that trained the model: left out of an export
LOCAL_ONLY = ("cache_dir",)


def without_local_paths(value):
    """`value` as a shared model may carry it: every absolute path reduced to its last component (a corpus directory's
    name, an init_from checkpoint's file), the local-only settings (LOCAL_ONLY) left out."""
    if isinstance(value, dict):
        return {k: without_local_paths(v) for k, v in value.items() if k not in LOCAL_ONLY}
    if isinstance(value, list):
        return [without_local_paths(v) for v in value]
    if isinstance(value, str) and os.path.isabs(value):
        return Path(value).name
    return value


def run_identity(checkpoint_path: Path) -> dict:
    """What identifies the checkpoint without a local path: `<name>/<version>` of the run whose checkpoints/ holds
    it (None elsewhere) and its file name (a sharded checkpoint: its directory's)."""
    path = checkpoint_path.resolve()
    run = path.parent.parent if path.parent.name == "checkpoints" else None
    return {"run": None if run is None else f"{run.parent.name}/{run.name}", "checkpoint": path.name}


def _sha256(path: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _export_hf(checkpoint: dict, hparams: dict, target: Path, remote_code: bool) -> Path:
    from diffexp.data.tokenizer import tokenizer_state
    from diffexp.generate.cli import resolve_tokenizer
    from diffexp.hf.writer import hf_form, write_hf_files
    from diffexp.model.config import ModelConfig

    cfg = ModelConfig(**hparams["arch"])
    form = hf_form(cfg, remote_code)  # refuses, naming the setting, before anything is written
    try:  # the tokenizer `diffexp generate` would use: saved, or named by the data settings
        tokenizer = tokenizer_state(resolve_tokenizer(checkpoint, hparams, None))
    except UserError:
        tokenizer = None  # saved without one it can name: the model alone
    with _staged(target, tensor_bytes(checkpoint["state_dict"])) as staging:
        weights = write_hf_files(staging, cfg, to_builtin(dict(hparams["arch"]), json_safe=True), checkpoint, form,
                                 tokenizer)
        _save_safetensors(untied(weights), staging / FORMATS["hf"])
        write_checksums(staging)  # transformers ignores the file; diffexp's HF reader checks it
    return target


def _check_creatable(out: str, target: Path) -> None:
    """OUT's missing parents can be made: its nearest existing ancestor is a directory this process may write."""
    ancestor = target.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UserError(f"OUT={out!r} is invalid: {str(ancestor)!r} is a file, not a directory; expected a new "
                        "directory under a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise UserError(f"OUT={out!r} is invalid: the directory {str(ancestor)!r} is not writable")


@contextlib.contextmanager
def _staged(target: Path, needed: int):
    """A directory to fill, renamed to `target` when the block succeeds and removed when it fails; a failure for
    want of space (about `needed` bytes) is the one-paragraph no-space error. Missing parents are made here, after
    every check (an export refused writes nothing)."""
    staging = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()
        yield staging
        os.replace(staging, target)
    except Exception as err:
        no_space = save_failed_for_space(err, staging, needed)  # asked before the partial files give space back
        shutil.rmtree(staging, ignore_errors=True)
        if no_space:
            raise no_space_for_export(target, needed) from err
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _save_safetensors(weights: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(weights, str(path), metadata={"format": "pt"})
    umask = os.umask(0)  # safetensors writes the file owner-only; give it the user's usual mode
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    target = export(args.checkpoint, args.out, args.format, args.remote_code)
    files = ", ".join(sorted(p.name for p in target.iterdir()))
    if args.format == "hf":
        trust = ", trust_remote_code=True" if args.remote_code else ""
        print(f"wrote {target}/ ({files}); load it with AutoModelForCausalLM.from_pretrained({str(target)!r}{trust}) "
              f"and AutoTokenizer.from_pretrained({str(target)!r}{trust}), or read it with diffexp generate {target}")
    else:
        print(f"wrote {target}/ ({files}); use it wherever a checkpoint goes: diffexp generate {target} --prompt ...")
    return 0

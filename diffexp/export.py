"""`diffexp export CKPT OUT`: one self-contained model directory from any checkpoint.

OUT gets config.json (format, hyperparameters, data settings, step, source), model.safetensors (or model.pt with
--format torch; DiffexpLM's state-dict names) and, for a model trained on a BPE, tokenizer.json. Every
`diffexp eval` task and `diffexp generate` read OUT like a checkpoint. It is written beside itself and renamed
into place; an existing OUT is never overwritten.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import torch

from diffexp.checkpoint_io import EXPORT_CONFIG, EXPORT_FORMAT
from diffexp.errors import UserError
from diffexp.training.loading import CKPT_KEY, load_checkpoint
from diffexp.training.values import to_builtin

FORMATS = {"safetensors": "model.safetensors", "torch": "model.pt"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="diffexp export", description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    parser.add_argument("checkpoint", metavar=CKPT_KEY, help="a .ckpt file or a sharded checkpoint directory")
    parser.add_argument("out", metavar="OUT", help="the directory to create (must not exist yet)")
    parser.add_argument("--format", choices=tuple(FORMATS), default="safetensors",
                        help="the weights file: safetensors (default) or torch.save")
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


def export(checkpoint_path: str, out: str, weights_format: str = "safetensors") -> Path:
    target = Path(out)
    if target.exists():
        raise UserError(f"OUT={out!r} is invalid: it exists; expected a new directory (export never overwrites)")
    if not target.parent.exists():
        raise UserError(f"OUT={out!r} is invalid: its parent directory {str(target.parent)!r} does not exist")
    checkpoint, hparams = load_checkpoint(checkpoint_path)
    tokenizer = checkpoint.get("diffexp_tokenizer")
    config = {
        "format": EXPORT_FORMAT,
        "weights": FORMATS[weights_format],
        "hyper_parameters": to_builtin(checkpoint["hyper_parameters"], json_safe=True),
        "datamodule_hyper_parameters": to_builtin(checkpoint.get("datamodule_hyper_parameters") or {}, json_safe=True),
        "global_step": hparams["global_step"],
        "tokenizer": None if tokenizer is None else
        {"kind": tokenizer["kind"], **({"file": "tokenizer.json", "identity": tokenizer["identity"]}
                                       if tokenizer["kind"] == "tokenizers" else {})},
        "source": str(Path(checkpoint_path).resolve()),
    }
    staging = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        weights = untied(checkpoint["state_dict"])
        if weights_format == "safetensors":
            from safetensors.torch import save_file

            save_file(weights, str(staging / FORMATS["safetensors"]), metadata={"format": "pt"})
            umask = os.umask(0)  # safetensors writes the file owner-only; give it the user's usual mode
            os.umask(umask)
            os.chmod(staging / FORMATS["safetensors"], 0o666 & ~umask)
        else:
            torch.save(weights, staging / FORMATS["torch"])
        if tokenizer is not None and tokenizer["kind"] == "tokenizers":
            (staging / "tokenizer.json").write_text(tokenizer["json"], encoding="utf-8")
        (staging / EXPORT_CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    target = export(args.checkpoint, args.out, args.format)
    files = ", ".join(sorted(p.name for p in target.iterdir()))
    print(f"wrote {target}/ ({files}); use it wherever a checkpoint goes: diffexp generate {target} --prompt ...")
    return 0

"""Reading diffexp checkpoints safely, with errors a user can act on; and the one error for a save that found the
disk full.

A .ckpt file, a sharded (torch.distributed.checkpoint) directory or a `diffexp export` directory is read on the CPU
with ``torch.load(weights_only=True)``, so a file needing anything else unpickled is refused, never run; every
failure is a ``UserError`` naming the key, the file and the problem. Before anything is unpickled the bytes are
verified (``verify_checkpoint``): a file's zip members against the CRC-32 torch.save stores for each (torch.load
never checks it), a directory's files against the SHA-256 sums its SHA256SUMS lists (written by FSDP2Strategy's
sharded saves and by `diffexp export`), so a damaged checkpoint is refused by name instead of loading changed weights.
"""

from __future__ import annotations

import errno
import hashlib
import os
import pickle
import re
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from diffexp.errors import UserError

DCP_INDEX = ".metadata"  # torch.distributed.checkpoint's index of the shards
EXPORT_CONFIG = "config.json"  # `diffexp export`'s directory: this file, the weights and the tokenizer
EXPORT_FORMAT = "diffexp-export/1"
#: where the model's tensors sit in a sharded checkpoint: FSDPStrategy (FSDP1), FSDP2Strategy (ModelParallelStrategy)
SHARDED_WEIGHTS = ("model", "state_dict")
LIGHTNING_META = "meta.pt"  # Lightning's FSDP checkpoints: everything but the sharded tensors
ZIP_MAGIC = b"PK\x03\x04"  # torch.save's default format is a zip archive
PICKLE_PROTO = 0x80  # torch.save's legacy format starts with a pickle protocol opcode
#: a sharded checkpoint's or an export's SHA-256 of each file, in `sha256sum -c` form ("<hex>  <name>" per line)
CHECKSUMS = "SHA256SUMS"
READ_CHUNK = 16 << 20  # bytes read at a time when verifying
EXPECTED = "expected a .ckpt written by diffexp (a dict with 'state_dict' and 'hyper_parameters' with 'arch')"


#: hyperparameter sections and keys added after checkpoints were first written, with the value an older
#: checkpoint (one without the key) was trained with, computed from its saved section
ADDED_LATER: dict[str, dict[str, Callable[[dict], Any]]] = {
    # Shared DIFF's low-rank updates were per head and per map before model.arch.lowrank_scope existed
    "arch": {"lowrank_scope": lambda arch: "head",
             # DINT weighed its integral term by lambda before model.arch.gamma
             "gamma": lambda arch: "lambda", "gamma_init": lambda arch: "lambda_init"},
    # every repeated bigram was an AR-Hit unless a threshold was given, before model.ar_hit.exclude_frequent
    "ar_hit": {"exclude_frequent": lambda ar_hit: ar_hit.get("min_count") is not None
               or ar_hit.get("top_percent") is not None},
}
#: where read_checkpoint records what it filled in: {"model.arch.lowrank_scope": "head", ...}
FILLED = "diffexp_filled_hparams"
#: arch keys that no longer exist, each with the value that replaces it (None: dropped): the attention computed
#: is the same (backend_fallback only chose a fallback; the flash_attn and triton backends computed what sdpa does)
RETIRED_ARCH: dict[str, Callable[[Any], Any]] = {
    "backend_fallback": lambda value: None,
    "backend": lambda value: "sdpa" if value in ("flash_attn", "triton") else value,
}


def fill_added_later(checkpoint: dict) -> dict:
    """Give a checkpoint's hyperparameters the keys added since it was written (ADDED_LATER), and drop or replace
    the retired ones (RETIRED_ARCH), in place."""
    hparams = checkpoint["hyper_parameters"]
    arch = dict(hparams["arch"])
    for key, replace in RETIRED_ARCH.items():
        if key in arch:
            new = replace(arch[key])
            if new is None:
                del arch[key]
            else:
                arch[key] = new
    hparams["arch"] = arch
    filled = {}
    for section, keys in ADDED_LATER.items():
        values = hparams.get(section)
        values = dict(values) if isinstance(values, dict) else {}
        for key, then in keys.items():
            if key not in values:
                values[key] = filled[f"model.{section}.{key}"] = then(values)
        hparams[section] = values
    checkpoint[FILLED] = filled
    return checkpoint


def _error(key: str, path: os.PathLike | str, problem: str) -> UserError:
    return UserError(f"{key}={str(path)!r}: {problem}")


def is_sharded_checkpoint(path: os.PathLike | str) -> bool:
    """A directory written by torch.distributed.checkpoint (Lightning's FSDP `state_dict_type="sharded"`)."""
    return Path(path).is_dir() and (Path(path) / DCP_INDEX).is_file()


def _first_bytes(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(4)


def _why_unreadable(path: Path) -> str:
    """Why torch.load failed on a file, told from its bytes (torch's own message suggests weights_only=False, which
    would run code from the file)."""
    size = path.stat().st_size
    if size == 0:
        return "the file is empty (0 bytes): an interrupted write or copy?"
    head = _first_bytes(path)
    if head == ZIP_MAGIC:
        if not zipfile.is_zipfile(path):
            return (f"the file is truncated ({size:,} bytes, the end of its zip archive is missing): an "
                    "interrupted copy or write? Copy it again, or use another checkpoint")
        return "the file is a damaged torch.save archive (a record inside it cannot be read)"
    if head[:1] == bytes([PICKLE_PROTO]):
        return "the file is truncated or damaged (legacy torch.save format)"
    return f"the file is not a PyTorch checkpoint (it starts with bytes {head!r}): corrupt, or another kind of file"


def _torch_load(path: Path, key: str, mmap: bool = False) -> Any:
    mmap = mmap and _first_bytes(path) == ZIP_MAGIC  # torch can memory-map only the zip format
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(err))
        if found:
            raise _error(key, path, f"the file needs the Python object {found.group(1)} unpickled, which a "
                                    "safe load refuses (unpickling runs code from the file). diffexp checkpoints "
                                    f"hold only tensors and plain data; {EXPECTED}") from None
        raise _error(key, path, _why_unreadable(path)) from None
    except Exception:  # noqa: BLE001
        # random or cut bytes can fail anywhere in the unpickler (IndexError, KeyError, EOFError, ...)
        raise _error(key, path, _why_unreadable(path)) from None


def _check_diffexp(checkpoint: Any, path: Path, key: str, need_weights: bool = True) -> dict:
    if not isinstance(checkpoint, dict):
        raise _error(key, path, f"the file holds a {type(checkpoint).__name__}, not a diffexp checkpoint; {EXPECTED}")
    if checkpoint and all(isinstance(v, torch.Tensor) for v in checkpoint.values()):
        example = next(iter(checkpoint))
        raise _error(key, path, f"the file is a bare state dict ({len(checkpoint)} tensors such as {example!r}), "
                                f"not a diffexp checkpoint: it has no hyper_parameters to rebuild the model; "
                                f"{EXPECTED}")
    hparams = checkpoint.get("hyper_parameters")
    missing = [name for name, ok in (("state_dict", not need_weights or isinstance(checkpoint.get("state_dict"), dict)),
                                     ("hyper_parameters.arch", isinstance(hparams, dict)
                                      and isinstance(hparams.get("arch"), dict))) if not ok]
    if missing:
        keys = ", ".join(map(repr, list(checkpoint)[:8])) or "none"
        raise _error(key, path, f"the file is not a diffexp checkpoint: it lacks {' and '.join(missing)} "
                                f"(its keys: {keys}); {EXPECTED}")
    return fill_added_later(checkpoint)


def is_exported_model(path: os.PathLike | str) -> bool:
    """A directory written by `diffexp export`."""
    return Path(path).is_dir() and (Path(path) / EXPORT_CONFIG).is_file()


def _read_exported(path: Path, key: str, weights: bool) -> dict:
    """The checkpoint an exported directory holds, in read_checkpoint's form."""
    import json

    try:
        config = json.loads((path / EXPORT_CONFIG).read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise _error(key, path, f"its {EXPORT_CONFIG} is not valid JSON ({err})") from None
    if not isinstance(config, dict) or config.get("format") != EXPORT_FORMAT:
        raise _error(key, path, f"its {EXPORT_CONFIG} is not a `diffexp export` config (format "
                                f"{config.get('format') if isinstance(config, dict) else None!r}, expected "
                                f"{EXPORT_FORMAT!r})")
    checkpoint = {"hyper_parameters": config.get("hyper_parameters"),
                  "datamodule_hyper_parameters": config.get("datamodule_hyper_parameters") or {},
                  "global_step": config.get("global_step", 0)}
    tokenizer = config.get("tokenizer")
    if tokenizer and tokenizer.get("kind") == "tokenizers":
        checkpoint["diffexp_tokenizer"] = {"kind": "tokenizers", "identity": tokenizer.get("identity", "exported"),
                                           "json": (path / tokenizer["file"]).read_text(encoding="utf-8")}
    elif tokenizer:
        checkpoint["diffexp_tokenizer"] = dict(tokenizer)
    if weights:
        file = path / str(config.get("weights"))
        if not file.is_file():
            raise _error(key, path, f"the weights file {config.get('weights')!r} its {EXPORT_CONFIG} names is missing")
        if file.suffix == ".safetensors":
            from safetensors import SafetensorError
            from safetensors.torch import load_file

            try:
                checkpoint["state_dict"] = load_file(str(file), device="cpu")
            except (SafetensorError, OSError) as err:
                raise _error(key, path, f"{file.name} cannot be read (truncated or damaged?): {err}") from None
        else:
            checkpoint["state_dict"] = _torch_load(file, key)
    return _check_diffexp(checkpoint, path, key, need_weights=weights)


def _read_sharded(path: Path, key: str, weights: bool) -> dict:
    meta = path / LIGHTNING_META
    if not meta.is_file():
        raise _error(key, path, f"the directory is a sharded checkpoint without Lightning's {LIGHTNING_META}, so not "
                                f"a diffexp checkpoint; {EXPECTED}, or a sharded one written by diffexp fit")
    checkpoint = _check_diffexp(_torch_load(meta, key), path, key, need_weights=False)
    if not weights:
        return checkpoint
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    loaded: dict[str, Any] = {}
    try:
        # the planner rebuilds the tensors from the index; only the model's, not the optimizer's
        _load_state_dict(loaded, storage_reader=FileSystemReader(path),
                         planner=_EmptyStateDictLoadPlanner(keys=set(SHARDED_WEIGHTS)), no_dist=True)
    except Exception as err:  # torch.distributed.checkpoint wraps every failure in its own types
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise _error(key, path, f"the sharded checkpoint cannot be read (a shard missing, truncated or damaged?): "
                                f"{reason}") from None
    weights = next((loaded[name] for name in SHARDED_WEIGHTS if isinstance(loaded.get(name), dict)), None)
    if weights is None:
        raise _error(key, path, f"the sharded checkpoint holds no model weights; {EXPECTED}")
    return {**checkpoint, "state_dict": weights}


# -- integrity ------------------------------------------------------------------------------------------------
#: what verify_checkpoint has found intact in this process, by the files' identity and modification time, so a
#: checkpoint read twice (the resume checks, then Lightning's load) is verified once
_VERIFIED: set[tuple] = set()


def file_sha256(path: os.PathLike | str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(READ_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def write_checksums(directory: os.PathLike | str, digests: dict[str, str] | None = None) -> None:
    """Write `directory`/SHA256SUMS for every file in it (recursively), taking the sums already known from
    `digests` (name relative to `directory` -> hex). Call it on a staging directory before it is renamed into
    place, so the sums and the files arrive together; the file itself is written beside and renamed."""
    directory = Path(directory)
    digests = dict(digests or {})
    for file in sorted(p for p in directory.rglob("*") if p.is_file()):
        name = file.relative_to(directory).as_posix()
        if name != CHECKSUMS and not name.startswith(f".{CHECKSUMS}."):
            digests.setdefault(name, file_sha256(file))
    temporary = directory / f".{CHECKSUMS}.tmp"
    temporary.write_text("".join(f"{digests[name]}  {name}\n" for name in sorted(digests)), encoding="utf-8")
    os.replace(temporary, directory / CHECKSUMS)


def _identity(paths: list[Path]) -> tuple:
    return tuple((str(p.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
                 for p in paths for st in [p.stat()])


def _damaged(key: str, path: Path, problem: str) -> UserError:
    others = sorted(p.name for p in path.parent.glob("*.ckpt") if p.name != path.name) if path.suffix == ".ckpt" else []
    instead = f"another checkpoint ({', '.join(others[:4])} beside it)" if others else "another checkpoint"
    return _error(key, path, f"the checkpoint is damaged: {problem} (its bytes changed after it was written: a "
                             f"faulty copy or disk?); copy it again from where it was written, or use {instead}")


def _verify_zip(path: Path, key: str) -> None:
    """Read every member of a torch.save archive to its end, which checks its CRC-32 (zipfile's public reader)."""
    member = None
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                member = info.filename.split("/", 1)[-1]  # without the archive's own top directory
                with archive.open(info) as data:
                    while data.read(READ_CHUNK):
                        pass
    except Exception as err:  # noqa: BLE001  # an archive zipfile found whole but cannot read: damage, whatever the error
        crc = "CRC-32" in str(err)
        problem = (f"its record {member} fails its CRC-32 check" if crc and member else
                   f"its zip archive cannot be read at record {member}" if member else "its zip index cannot be read")
        raise _damaged(key, path, problem) from None


def _verify_sums(directory: Path, key: str) -> list[Path]:
    """Check every file SHA256SUMS lists; the files checked (none when there is no SHA256SUMS: written before
    diffexp wrote one, or by another tool)."""
    listing = directory / CHECKSUMS
    if not listing.is_file():
        return []
    files = []
    for number, line in enumerate(listing.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        found = re.fullmatch(r"([0-9a-f]{64}) [ *](.+)", line.strip())
        if not found:
            raise _damaged(key, directory, f"line {number} of its {CHECKSUMS} is not '<sha256>  <file>'")
        expected, name = found.groups()
        file = directory / name
        if not file.is_file():
            raise _damaged(key, directory, f"{name}, which its {CHECKSUMS} lists, is missing")
        if file_sha256(file) != expected:
            raise _damaged(key, directory, f"{name} does not match its SHA-256 in {CHECKSUMS}")
        files.append(file)
    return [*files, listing]


def verify_checkpoint(path: os.PathLike | str, key: str = "--ckpt_path") -> None:
    """Refuse a checkpoint whose bytes changed since it was written, with a UserError naming `key` and the file.

    A .ckpt file (zip format): every record against its CRC-32. A directory (a sharded checkpoint or an export):
    every file its SHA256SUMS lists against its sum; an export written before SHA256SUMS existed, its weights
    against the SHA-256 in its config.json. A checkpoint without any sum (older sharded ones) is read as it is.
    A truncated or foreign file is left to the reader, which says what it is. Reads every byte once."""
    path = Path(path).expanduser()
    if path.is_dir():
        if not (path / CHECKSUMS).is_file() and not is_exported_model(path):
            return  # no sums to check (an older sharded checkpoint), or no checkpoint: the reader says which
        identity = _identity(sorted(p for p in path.rglob("*") if p.is_file()))
        if identity in _VERIFIED:
            return
        if not _verify_sums(path, key) and is_exported_model(path):
            _verify_export_weights(path, key)
        _VERIFIED.add(identity)
    elif path.is_file() and _first_bytes(path) == ZIP_MAGIC and zipfile.is_zipfile(path):
        identity = _identity([path])
        if identity not in _VERIFIED:
            _verify_zip(path, key)
            _VERIFIED.add(identity)


def _verify_export_weights(path: Path, key: str) -> None:
    """An export without SHA256SUMS: its weights against the sum its config.json records (source.weights_sha256)."""
    import json

    try:
        config = json.loads((path / EXPORT_CONFIG).read_text(encoding="utf-8"))
        weights, expected = str(config["weights"]), config["source"]["weights_sha256"]
    except (ValueError, UnicodeDecodeError, KeyError, TypeError):
        return  # _read_exported says what is wrong with the config
    if (path / weights).is_file() and file_sha256(path / weights) != expected:
        raise _damaged(key, path, f"{weights} does not match the SHA-256 its {EXPORT_CONFIG} records")


def read_checkpoint(path: os.PathLike | str, key: str = "--ckpt_path", *, weights: bool = True) -> dict:
    """Load a diffexp checkpoint (a .ckpt file or a sharded checkpoint directory) on the CPU.

    ``key`` is how the user wrote the path (``--ckpt_path``, ``CKPT``), for the error messages.
    ``weights=False`` memory-maps the tensors (zip files) or skips them (sharded directories), for reading the
    hyperparameters of a large checkpoint; either way its bytes are verified first (verify_checkpoint), once per
    process.
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise _error(key, path, "no such file")
    verify_checkpoint(path, key)
    if path.is_dir():
        if is_sharded_checkpoint(path):
            return _read_sharded(path, key, weights)
        if is_exported_model(path):
            return _read_exported(path, key, weights)
        inside = sorted(p.name for p in path.glob("*.ckpt"))
        hint = f"; it holds {', '.join(inside[:5])}: did you mean {str(path / inside[0])!r}?" if inside else ""
        raise _error(key, path, f"a directory, not a checkpoint file, a sharded checkpoint (no {DCP_INDEX} "
                                f"file) or an exported model (no {EXPORT_CONFIG}){hint}")
    return _check_diffexp(_torch_load(path, key, mmap=not weights), path, key)


def model_hparams(checkpoint: dict) -> dict:
    """The hyperparameters of a checkpoint read by read_checkpoint, as plain dicts:
    ``arch``, ``optim`` and ``ar_hit`` (the model), ``data`` (the data module's init arguments, {} if none
    were saved), ``data_class`` (its class path when trained through the CLI, else None), ``global_step``."""
    hparams = checkpoint["hyper_parameters"]
    data = dict(checkpoint.get("datamodule_hyper_parameters") or {})
    data_class = data.pop("_class_path", None)
    return {
        "arch": dict(hparams["arch"]),
        "optim": dict(hparams.get("optim") or {}),
        "ar_hit": dict(hparams.get("ar_hit") or {}),
        "data": {k: v for k, v in data.items() if not k.startswith("_")},  # no _instantiator
        "data_class": data_class,
        "global_step": int(checkpoint.get("global_step", 0)),
    }


# -- writing -------------------------------------------------------------------------------------------------
#: a write that found no room: the file system is full, or the user's quota is used up
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
#: torch's zip writer reports a failed write in these words, without the errno (a file opened by path)
TORCH_WRITE_FAILED = re.compile(r"unexpected pos|file write failed|PytorchStreamWriter failed")
#: safetensors reports the OS error in its message only: "I/O error: No space left on device (os error 28)", or
#: before 0.5 "Error while serializing: IoError(Os { code: 28, kind: StorageFull, ... })"
OS_ERROR_NO_SPACE = re.compile(rf"\(os error ({'|'.join(map(str, NO_SPACE))})\)|"
                               rf"Os {{ code: ({'|'.join(map(str, NO_SPACE))}),")


def _errors_within(err: BaseException):
    """err and every exception it carries: its causes and contexts, and the per-rank failures
    torch.distributed.checkpoint gathers into its CheckpointException."""
    pending, seen = [err], set()
    while pending:
        exc = pending.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        yield exc
        pending += [exc.__cause__, exc.__context__]
        failures = getattr(exc, "failures", None)
        if isinstance(failures, dict):
            pending += [failure[0] for failure in failures.values() if isinstance(failure, tuple)]


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def free_bytes(path: os.PathLike | str) -> int:
    """Free space on the file system that holds `path` (or would hold it)."""
    return shutil.disk_usage(_nearest_existing(Path(path))).free


def tensor_bytes(checkpoint: Any) -> int:
    """The bytes of the tensors in a (nested) checkpoint: about the size it takes on disk. A sharded tensor
    (DTensor) counts whole, as all ranks together write it; tensors sharing storage (tied weights) count once."""
    total, seen = 0, set()
    pending = [checkpoint]
    while pending:
        value = pending.pop()
        if isinstance(value, dict):
            pending += list(value.values())
        elif isinstance(value, (list, tuple)):
            pending += list(value)
        elif isinstance(value, torch.Tensor):
            if not hasattr(value, "full_tensor"):  # a DTensor has no storage of its own to compare
                key = (value.data_ptr(), value.numel(), value.dtype)
                if key in seen:
                    continue
                seen.add(key)
            total += value.numel() * value.element_size()
    return total


def save_failed_for_space(err: BaseException, path: os.PathLike | str, needed: int) -> bool:
    """Whether a checkpoint save (or an export) failed because the disk is full: an ENOSPC (or EDQUOT) anywhere in
    the error (safetensors': in its message), or torch's bare "file write failed" while less than the checkpoint's
    size is free. Call it before removing the partial files, which would give the space back."""
    carried = list(_errors_within(err))
    if any(isinstance(exc, OSError) and exc.errno in NO_SPACE or OS_ERROR_NO_SPACE.search(str(exc))
           for exc in carried):
        return True
    torch_write = any(isinstance(exc, RuntimeError) and TORCH_WRITE_FAILED.search(str(exc)) for exc in carried)
    return torch_write and free_bytes(path) < needed


def _human_size(n_bytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.1f} {unit}"
    return f"{n_bytes / 2**10:.1f} KiB"


def no_space_error(path: os.PathLike | str, needed: int) -> UserError:
    """The one paragraph for a checkpoint that did not fit: where, how much it needs and how much is free, that
    the checkpoints saved before are intact, and how to go on."""
    path = Path(path)
    previous = path.with_name("last.ckpt")
    if previous.exists():
        kept = f"The checkpoints saved before are intact; the newest is {previous}."
        # --ckpt_path last finds last.ckpt in a run directory's checkpoints/ only (diffexp.training.runs)
        resume = f"resume with --ckpt_path {'last' if path.parent.name == 'checkpoints' else previous}"
    else:
        kept, resume = "No checkpoint of this run was saved before this one.", "start the run again"
    return UserError(
        f"no space left on the device to save the checkpoint {path}: it needs about {_human_size(needed)}, "
        f"{_human_size(free_bytes(path.parent))} is free on that file system. {kept} Free space there, or set "
        f"--checkpoint.dirpath to a directory on a disk with room, then {resume}."
    )


def no_space_for_export(out: os.PathLike | str, needed: int) -> UserError:
    """The one paragraph for an export that did not fit (its partial directory already removed)."""
    out = Path(out)
    return UserError(
        f"OUT={str(out)!r}: no space left on the device to write the export: it needs about {_human_size(needed)}, "
        f"{_human_size(free_bytes(out.parent))} is free on that file system. Nothing was written (the partial "
        f"directory was removed). Free space there, or give OUT a directory on a disk with room, then run diffexp "
        f"export again."
    )

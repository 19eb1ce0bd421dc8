"""Checks of a parsed `fit`/`validate`/`test` config that run before any data, model or run directory is made.

Everything that can be found wrong without doing work is found here, and reported as one `UserError` that
names the key as the user writes it (`model.arch.rank`, `trainer.max_steps`), the value and what is allowed.
A resume (`--ckpt_path`) must describe the same run as the checkpoint, or it is refused with every differing
key and the command that resumes with the saved config.
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from diffexp.checkpoint_io import FILLED
from diffexp.errors import UserError, invalid
from diffexp.model.config import ModelConfig
from diffexp.parallel.launch import check_launch, requested_world_size, strategy_class
from diffexp.training.checkpointing import check_checkpoint_settings
from diffexp.training.construction import check_build_config
from diffexp.training.global_batch import GLOBAL_BATCH, accumulation_for
from diffexp.training.trainer_checks import check_trainer
from diffexp.training.values import data_init_args, to_builtin

# data module settings that do not change what is trained (where files live, how many loader processes)
DATA_KEYS_FREE_ON_RESUME = {"num_workers", "cache_dir"}
TOKENIZER_KEYS = ("tokenizer", "bpe_vocab_size")
# optimizer settings a resumed run applies from its first step on (DiffexpLM._apply_configured_optim)
HONOURED_ON_RESUME = {"model.optim.lr", "model.optim.betas", "model.optim.eps", "model.optim.weight_decay",
                      "model.optim.warmup_steps", "model.optim.min_lr_ratio", "trainer.gradient_clip_val"}
# trainer settings that shape the optimization (a checkpoint records them in "diffexp_run")
RESUME_TRAINER_KEYS = ("max_steps", "accumulate_grad_batches", "gradient_clip_val")
# the processes a run trains on: each reads its own share of every global batch
WORLD_SIZE = "world size (trainer.num_nodes x trainer.devices)"
ACCUMULATE = "trainer.accumulate_grad_batches"
# free on resume while their product, the global batch, stays: the training order is cut into global batches
LAYOUT_KEYS = ("data.batch_size", WORLD_SIZE, ACCUMULATE)
ARCH = "model.arch"
# model.ar_hit settings that decide which tokens are AR-Hits (a resume must log the same metric)
AR_HIT_RESUME_KEYS = ("exclude_frequent", "min_count", "top_percent")


def model_sections(config) -> tuple[ModelConfig, Any, Any]:
    """Build the model's config dataclasses from a parsed config; their own checks raise UserError."""
    from diffexp.training.module import ARHitConfig, OptimConfig

    model = to_builtin(config.get("model") or {})
    arch = ModelConfig(**(model.get("arch") or {}))
    optim = OptimConfig(**(model.get("optim") or {}))
    ar_hit = ARHitConfig(**(model.get("ar_hit") or {}))
    return arch, optim, ar_hit


def check_writable(key: str, path: str | os.PathLike | None) -> None:
    """The directory exists and is writable, or can be created: probed with a real file, since permission bits
    say nothing for root or on read-only mounts. Nothing is created or left behind."""
    if path is None or str(path) == "" or "://" in str(path):  # remote logger URLs are the logger's business
        return
    target = Path(path).expanduser()
    probe = target
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if not probe.is_dir():
        raise invalid(key, str(path), f"{probe} exists and is not a directory; expected a writable directory")
    try:
        fd, name = tempfile.mkstemp(prefix=".diffexp-write-check-", dir=probe)
        os.close(fd)
        os.unlink(name)
    except OSError as err:
        where = "is not writable" if probe == target else f"cannot be created: {probe} is not writable"
        raise invalid(key, str(path), f"the directory {where} ({err.strerror}); expected a writable "
                      "directory") from None


def logger_save_dirs(trainer: dict[str, Any]) -> list[tuple[str, Any]]:
    logger = trainer.get("logger")
    loggers = logger if isinstance(logger, list) else [logger]
    dirs = []
    for i, entry in enumerate(loggers):
        if isinstance(entry, dict) and isinstance(entry.get("init_args"), dict):
            where = "trainer.logger" if not isinstance(logger, list) else f"trainer.logger[{i}]"
            dirs.append((f"{where}.init_args.save_dir", entry["init_args"].get("save_dir")))
    return dirs


def validate_fit_config(config, subcommand: str = "fit", words: list[str] = ()) -> ModelConfig:
    """Check a parsed config of `subcommand` before anything is built (`words`: the command line it was parsed
    from, which names the keys the user gave). Returns the model config."""
    arch, _, _ = model_sections(config)
    _, data_args = data_init_args(config)
    seq_len = data_args.get("seq_len")
    if isinstance(seq_len, int) and seq_len > arch.max_seq_len:
        raise invalid("data.seq_len", seq_len, f"expected at most model.arch.max_seq_len={arch.max_seq_len} "
                      "(RoPE is precomputed up to it); raise model.arch.max_seq_len or lower data.seq_len")
    trainer = to_builtin(config.get("trainer") or {})
    check_trainer(trainer, subcommand)
    check_launch(trainer)
    check_build_config(trainer, arch)
    if subcommand == "fit":
        derived_accumulation(config)  # refuses a global batch the launch cannot make up
    check_writable("trainer.default_root_dir", trainer.get("default_root_dir"))
    for key, save_dir in logger_save_dirs(trainer):
        check_writable(key, save_dir)
    checkpoint = to_builtin(config.get("checkpoint") or {})
    check_writable("checkpoint.dirpath", checkpoint.get("dirpath"))
    check_checkpoint_settings(checkpoint, trainer, subcommand)
    check_data(config)
    check_read_flags(arch, words)
    return arch


def check_data(config) -> None:
    """The text data a config reads, checked without any work (diffexp.data.identity.check_text_data): what
    `diffexp fit` and every trial of a sweep would refuse once building its data module."""
    from diffexp.data.identity import check_text_data

    data_class, data_args = data_init_args(config)
    if data_class is None or data_class.endswith("TextDataModule"):
        check_text_data(data_args)


def check_cpu_memory(arch: ModelConfig, trainer: dict[str, Any], data_args: dict[str, Any]) -> None:
    """A CPU run that would need more memory than the host has free is refused: the kernel's OOM killer would end
    it mid-run without a word. A rough upper bound skips the estimate (two meta-device forwards) where it is far
    below the free memory. FSDP2 checks its own shards; a GPU run gets CUDA's out-of-memory error. Run once the
    config is known to build (check_buildable), before data and model exist."""
    micro_batch, seq_len = data_args.get("batch_size"), data_args.get("seq_len") or arch.max_seq_len
    if os.environ.get("LOCAL_RANK", "0") != "0":  # the host's first process checked for all of them
        return
    if not _trains_on_cpu(trainer) or "fsdp" in (strategy_class(trainer) or "").lower() or not (
            isinstance(micro_batch, int) and isinstance(seq_len, int) and micro_batch > 0 and seq_len > 0):
        return
    from diffexp.parallel.memory import estimate_memory, host_memory_available, rough_training_bytes, size

    available = host_memory_available()
    if available is None:
        return
    if data_args.get("tokenizer") == "bpe" and isinstance(data_args.get("bpe_vocab_size"), int):
        arch = replace(arch, vocab_size=max(arch.vocab_size, data_args["bpe_vocab_size"]))  # linked at build time
    nodes = int(trainer.get("num_nodes") or 1)
    processes = max(1, (requested_world_size(trainer) or nodes) // nodes)  # on this host, each a whole replica
    if processes * rough_training_bytes(arch, micro_batch, seq_len) <= available / 4:
        return
    compute = torch.bfloat16 if "bf16" in str(trainer.get("precision") or "") else torch.float32
    from diffexp.training.loss import token_losses

    estimate = estimate_memory(arch, micro_batch, seq_len, 1, compute, loss=token_losses)
    if processes * estimate.total <= available:
        return
    each = f" in each of {processes} processes" if processes > 1 else ""
    raise UserError(
        f"model.arch (attention={arch.attention}, d_model={arch.d_model}, n_layers={arch.n_layers}) with "
        f"data.batch_size={micro_batch} x data.seq_len={seq_len}: training needs about "
        f"{estimate.describe().replace(' per rank', '')}"
        f"{each}, more than the {size(available)} this machine has free, so it would be killed out of memory; "
        "lower model.arch.d_model or model.arch.n_layers (the states), or data.batch_size or data.seq_len (the "
        "activations)")


def _trains_on_cpu(trainer: dict[str, Any]) -> bool:
    accelerator = trainer.get("accelerator") or "auto"
    if accelerator == "cpu":
        return True
    return accelerator == "auto" and not torch.cuda.is_available() and not torch.backends.mps.is_available()


def derived_accumulation(config) -> int | None:
    """trainer.accumulate_grad_batches as global_batch.rows makes it, where the config alone says (else None)."""
    rows = to_builtin(config.get("global_batch") or {}).get("rows")
    if rows is None:
        return None
    trainer = to_builtin(config.get("trainer") or {})
    if trainer.get("accumulate_grad_batches") not in (None, 1):
        raise UserError(f"global_batch.rows={rows} and trainer.accumulate_grad_batches="
                        f"{trainer['accumulate_grad_batches']}: give one of them; with global_batch.rows the "
                        "accumulation follows from the number of processes and data.batch_size")
    world, micro_batch = requested_world_size(trainer), data_init_args(config)[1].get("batch_size")
    if world is None or not isinstance(micro_batch, int):
        return None
    return accumulation_for(rows, micro_batch, world)


def check_read_flags(arch: ModelConfig, words: list[str] = ()) -> None:
    """A `model.arch` flag the chosen variant does not read would change nothing: refused, naming the flag as the
    user gave it, the variant and the flags it reads. Refused when set away from its default (a command line or a
    config file) or named on the command line at all; a config file that names it at its default value (a run's
    saved config.yaml names every flag) is not refused."""
    from diffexp.model.attention import variant, variants
    from diffexp.training.command_line import config_files, file_setting, given_keys

    given = given_keys(list(words))
    named = [key[len(ARCH) + 1:] for key in given if key.startswith(ARCH + ".")]
    unused = arch.unused_settings(named)
    if not unused:
        return
    files = config_files(list(words))

    def as_given(name: str, value: Any) -> str:
        key = f"{ARCH}.{name}"
        if key in given:
            return f"--{key} {given[key]}".rstrip()
        where = [path for path in files if file_setting(path, key)[0]]
        return f"{key}: {_flag_value(value)}" + (f" in {where[-1]}" if where else "")

    chosen = variant(arch.attention)
    own = ", ".join(f"{ARCH}.{name}" for name in chosen.fields)
    reads = (f"{chosen.name} reads {own} beyond the shared flags" if own else
             f"{chosen.name} reads no {ARCH} flag beyond the shared ones (sizes, RoPE, backend, init)")
    lines = []
    for name, value in unused.items():
        readers = [entry.name for entry in variants() if name in entry.fields]
        read_by = f"read by {', '.join(readers)}" if readers else "read by no variant"
        lines.append(f"{as_given(name, value)} ({read_by})")
    them = "it" if len(lines) == 1 else "them"
    raise UserError(f"{ARCH}.attention={arch.attention!r} does not read {'; '.join(lines)}: the run would train "
                    f"without {them}. {reads}. Remove {them}, or choose a variant that reads {them} with "
                    f"--{ARCH}.attention (`diffexp variants` lists each variant's flags)")


# -- resume ------------------------------------------------------------------------------------------------
def _dotted(prefix: str, values: dict[str, Any]) -> dict[str, Any]:
    """Each key as `prefix.key`, the way a config names it (tuples as lists)."""
    return {f"{prefix}.{k}": (list(v) if isinstance(v, tuple) else v) for k, v in values.items()}


def _same_value(a: Any, b: Any) -> bool:
    """Numbers by value (8 and 8.0 are the same), anything else as built-in types."""
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) \
            and not isinstance(b, bool):
        return float(a) == float(b)
    return to_builtin(a) == to_builtin(b)


def _unread(checkpoint: dict[str, Any]) -> set[str]:
    """The model.arch keys of a checkpoint that its variant does not read (saved with every flag, or filled in by
    read_checkpoint when added after it was written): they meant nothing to that run, so they pin nothing."""
    from diffexp.model.attention import variant, variant_names
    from diffexp.model.config import SHARED_FIELDS

    arch = (checkpoint.get("hyper_parameters") or {}).get("arch") or {}
    if arch.get("attention") not in variant_names():
        return set()
    read = {*SHARED_FIELDS, *variant(arch["attention"]).fields}
    filled = {key[len(ARCH) + 1:] for key in checkpoint.get(FILLED, {}) if key.startswith(ARCH + ".")}
    return {f"{ARCH}.{name}" for name in {*arch, *filled} if name not in read}


def saved_run_values(checkpoint: dict[str, Any], model_only: bool) -> dict[str, Any]:
    """The dotted keys a checkpoint pins, as the user writes them."""
    hparams = checkpoint.get("hyper_parameters") or {}
    arch = {k: v for k, v in (hparams.get("arch") or {}).items() if k != "vocab_size"}
    unread = _unread(checkpoint)
    values = {k: v for k, v in _dotted("model.arch", arch).items() if k not in unread}
    data_hparams = checkpoint.get("datamodule_hyper_parameters") or {}
    if model_only:  # evaluating: the same network, and the tokenizer its embeddings were trained with
        return {**values, **_dotted("data", {k: v for k, v in data_hparams.items() if k in TOKENIZER_KEYS})}
    optim = dict(hparams.get("optim") or {})
    optim.pop("schedule_steps", None)  # compared below, resolved against max_steps
    values.update(_dotted("model.optim", optim))
    # what counts as an AR-Hit: a resume must log the same metric (turning it on or off changes no value)
    ar_hit = {k: v for k, v in (hparams.get("ar_hit") or {}).items() if k in AR_HIT_RESUME_KEYS}
    values.update(_dotted("model.ar_hit", ar_hit))
    data_class = (checkpoint.get("diffexp_run") or {}).get("data_class") or data_hparams.get("_class_path")
    if data_class:
        values["data.class_path"] = data_class
    # keys with a leading underscore are LightningCLI's bookkeeping (_class_path, _instantiator)
    data = {k: v for k, v in data_hparams.items() if k not in DATA_KEYS_FREE_ON_RESUME and not k.startswith("_")}
    values.update(_dotted("data", data))
    run = checkpoint.get("diffexp_run") or {}
    for key in RESUME_TRAINER_KEYS:
        if key in run:
            values[f"trainer.{key}"] = run[key]
    if "world_size" in run:
        values[WORLD_SIZE] = run["world_size"]
    return values


def requested_run_values(config, keys: set[str]) -> dict[str, Any]:
    """The same dotted keys, from the parsed config (data keys looked up under init_args)."""
    from diffexp.training.module import ARHitConfig

    model = to_builtin(config.get("model") or {})
    arch = asdict(ModelConfig(**(model.get("arch") or {})))
    optim_section = dict(model.get("optim") or {})
    ar_hit = asdict(ARHitConfig(**(model.get("ar_hit") or {})))
    values = {**_dotted("model.arch", arch), **_dotted("model.optim", optim_section), **_dotted("model.ar_hit", ar_hit)}
    data_class, data_args = data_init_args(config)
    values["data.class_path"] = data_class
    values.update(_dotted("data", data_args))
    trainer = to_builtin(config.get("trainer") or {})
    for key in RESUME_TRAINER_KEYS:
        values[f"trainer.{key}"] = trainer.get(key)
    values[WORLD_SIZE] = requested_world_size(trainer)
    return {k: values.get(k) for k in keys}


def _schedule_difference(checkpoint: dict[str, Any], config) -> str | None:
    """Changing max_steps changes the lr of the remaining steps unless schedule_steps pins the cosine."""
    run = checkpoint.get("diffexp_run") or {}
    saved_total = run.get("schedule_steps")
    if saved_total is None:
        return None
    _, optim, _ = model_sections(config)
    max_steps = to_builtin(config.get("trainer") or {}).get("max_steps")
    total = optim.schedule_steps if optim.schedule_steps is not None else max_steps
    if total == saved_total:
        return None
    return (f"  learning-rate schedule: the saved run's cosine spans {saved_total} steps, this config's spans {total}"
            f" (model.optim.schedule_steps, else trainer.max_steps). To train past step {saved_total} with the lr "
            f"schedule as it was (the lr stays at its final value), add --model.optim.schedule_steps {saved_total}")


def _global_rows(values: dict[str, Any]) -> int | None:
    layout = [values.get(key) for key in LAYOUT_KEYS]
    if all(isinstance(v, int) and not isinstance(v, bool) for v in layout):
        return layout[0] * layout[1] * layout[2]
    return None


def _global_batch_difference(saved: dict[str, Any], requested: dict[str, Any]) -> str | None:
    """data.batch_size, the world size and the accumulation may change on resume when the rows of a step (their
    product) stay: takes the three out of the comparison and returns the line for another global batch. Where the
    launch alone knows the world size, data.batch_size and the accumulation are compared as they are, and
    DiffexpLM's on_load_checkpoint checks the global batch once launched."""
    rows = _global_rows(saved)
    if rows is None or requested.get(WORLD_SIZE) is None:  # an older checkpoint, or devices auto: key by key
        return None
    layout = [f"{requested.get(key)}" for key in LAYOUT_KEYS]
    for key in LAYOUT_KEYS:
        saved.pop(key, None)
    now = _global_rows(requested)
    if now is None or now == rows:
        return None
    return (f"  {GLOBAL_BATCH}: checkpoint {rows} rows, this config {now} ({' x '.join(layout)}). data.batch_size "
            f"and the number of processes may change on resume when the global batch stays: add --global_batch.rows "
            f"{rows}")


def _flag_value(value: Any) -> str:
    """A value as a command-line flag writes it (true, null, 8)."""
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else str(value)


def check_resume(config, checkpoint: dict[str, Any], ckpt_path: Path, subcommand: str) -> None:
    """Refuse a resume (fit) or an evaluation (validate/test) whose config differs from the checkpoint's run."""
    model_only = subcommand != "fit"
    saved = saved_run_values(checkpoint, model_only)
    requested = requested_run_values(config, set(saved))
    if "data.class_path" in saved and requested.get("data.class_path"):  # by class name: modules re-export
        saved["data.class_path"] = saved["data.class_path"].rsplit(".", 1)[-1]
        requested["data.class_path"] = requested["data.class_path"].rsplit(".", 1)[-1]
    if to_builtin(config.get("global_batch") or {}).get("rows") is not None and not model_only:
        requested[ACCUMULATE] = derived_accumulation(config)  # what the launch will set (None: known once launched)
    global_batch = _global_batch_difference(saved, requested) if not model_only else None
    for key in (WORLD_SIZE, ACCUMULATE):  # known only once launched: DiffexpLM.on_load_checkpoint checks them
        if requested.get(key) is None:
            saved.pop(key, None)
    schedule_pinned = not model_only and (checkpoint.get("diffexp_run") or {}).get("schedule_steps") is not None
    differing_keys = [key for key in sorted(saved) if not _same_value(saved[key], requested[key])
                      and not (schedule_pinned and key == "trainer.max_steps")]  # the lr schedule decides instead
    # e.g. the lower lr a non-finite stop advises: honoured and announced, never silent
    honoured_keys = [key for key in differing_keys if key in HONOURED_ON_RESUME] if not model_only else []

    def line(key: str) -> str:
        return f"  {key}: checkpoint {saved[key]!r}, this config {requested[key]!r}"

    differing = [line(key) for key in differing_keys if key not in honoured_keys]
    differing += [global_batch] if global_batch else []
    schedule = _schedule_difference(checkpoint, config) if schedule_pinned else None
    differing += [schedule] if schedule else []
    honoured = [line(key) for key in honoured_keys]
    if not differing:
        if honoured:
            print("resuming with changed optimization settings, applied from the checkpoint's step on:\n"
                  + "\n".join(honoured), file=sys.stderr)
        return
    run_config = ckpt_path.parent.parent / "config.yaml"
    # keys the checkpoint predates: its run config lacks them too, so the command spells out their values
    older = "".join(f" --{key} {_flag_value(value)}" for key, value in checkpoint.get(FILLED, {}).items()
                    if key in saved)
    if ckpt_path.parent.name == "checkpoints" and run_config.is_file():
        how = f"To {'resume' if subcommand == 'fit' else subcommand} the saved run as it was: diffexp {subcommand} " \
              f"--config {run_config}{older} --ckpt_path {ckpt_path}"
    else:
        how = "Pass the checkpoint's values above as flags (or in the config) to use this checkpoint."
    what = "resume" if subcommand == "fit" else subcommand
    raise UserError(f"--ckpt_path {ckpt_path}: cannot {what}: the config differs from the run that wrote this "
                    f"checkpoint in {len(differing)} key(s):\n" + "\n".join(differing) + f"\n{how}")


def check_same_data(config, checkpoint: dict[str, Any], ckpt_path: Path, subcommand: str) -> None:
    """A resume (fit) on text data prepared again since the checkpoint's run, or an evaluation (validate/test) of
    the same data.source prepared again, is refused before any run directory is touched."""
    from diffexp.data.identity import check_same_preparation
    from diffexp.data.loader import ResumableDataLoader

    data_class, data_args = data_init_args(config)
    if data_class is not None and not data_class.endswith("TextDataModule"):
        return
    saved_source = (checkpoint.get("datamodule_hyper_parameters") or {}).get("source")
    if subcommand != "fit" and str(data_args.get("source")) != str(saved_source):
        return  # another corpus, chosen on purpose: nothing to compare
    if subcommand == "fit":
        consequence = "a resume would train its remaining steps on other data than its first ones"
        remedy = (f"resume on the data that run read (restore that preparation), or start a new run from its "
                  f"weights: --model.init_from {ckpt_path} without --ckpt_path")
    else:
        consequence = "its validation and test splits are not the documents that run held out (some may be ones it " \
                      "trained on)"
        remedy = f"{subcommand} on the data that run read (restore that preparation), or on another data.source"
    check_same_preparation(data_args, ResumableDataLoader.saved_identity(checkpoint), "data.source", consequence,
                           remedy)

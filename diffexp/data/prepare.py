"""``diffexp data prepare``: a corpus becomes token shards, once, in flat memory, on every core.

Each unit of the corpus (``diffexp.data.units``) is tokenized and written by one process and recorded once its
shards are on disk, so a rerun continues a killed preparation and ends byte-identical; ``--part i --of n`` shares
the units among machines, and ``join`` writes the manifest once all are done.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import queue
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from diffexp.data import sources
from diffexp.data.settings import settings_differences, unit_settings
from diffexp.data.shards import (
    FORMAT,
    MANIFEST,
    SPLITS,
    DiskFull,
    read_manifest,
    token_dtype,
    write_atomic,
    write_json,
)
from diffexp.data.splits import held_out_overrides, unit_splits
from diffexp.data.tokenizer import check_bpe_vocab_size, load_named_tokenizer
from diffexp.data.units import Unit, content_fingerprint, plan_units
from diffexp.data.worker import WORKER, Job, finished, init_worker, prepare_unit
from diffexp.errors import UserError, invalid

SETTINGS = "prepare.json"
SHARD_TOKENS = 1 << 27  # 128M tokens: a 256 MiB piece at uint16
BPE_SAMPLE_CHARS = 32_000_000  # what a BPE is trained on: enough for its merges, bounded in memory


def check_settings(tokenizer: str, bpe_vocab_size: int, val_fraction: float, test_fraction: float,
                   max_chars: int | None) -> None:
    """A preparation's settings, named as the data module's keys (`diffexp data prepare` renames them to its
    flags), refused before any work."""
    if tokenizer == "bpe":
        check_bpe_vocab_size(bpe_vocab_size)
    if not 0.0 < val_fraction < 1.0:
        raise invalid("data.val_fraction", val_fraction, "expected a number strictly between 0 and 1")
    if not 0.0 <= test_fraction < 1.0 or val_fraction + test_fraction >= 1.0:
        raise invalid("data.test_fraction", test_fraction, f"expected [0, 1), leaving documents for training beside "
                      f"data.val_fraction={val_fraction}")
    if max_chars is not None and max_chars <= 0:
        raise invalid("data.max_chars", max_chars, "expected a positive number of characters, or null (all)")


@dataclass
class Plan:
    """Everything that decides a preparation's bytes (``prepare.json``); reruns and parts must agree on it."""

    source: sources.Source
    text_field: str
    max_chars: int | None
    tokenizer: str
    bpe_vocab_size: int
    bpe_sample_chars: int
    seed: int
    val_fraction: float
    test_fraction: float
    shard_tokens: int = SHARD_TOKENS
    hf_cache_dir: str = ""
    unit_bytes: int | None = None  # None: from the corpus size (diffexp.data.units.unit_bytes_for)
    units: list[Unit] = field(default_factory=list)
    overrides: dict[float, str] = field(default_factory=dict)  # held_out_overrides, once planned

    def plan(self) -> None:
        """Cut the corpus into units and find the split's overrides (reads at most the corpus's first documents)."""
        if not self.units:
            self.units = plan_units(self.source, self.text_field, self.max_chars, self.hf_cache_dir, self.unit_bytes)
            self.overrides = held_out_overrides(self.units, self.source, self.text_field, self.hf_cache_dir,
                                                self.seed, self.val_fraction, self.test_fraction)

    def settings(self, tokenizer_info: dict, command: str) -> dict:
        bpe = {"vocab_size": self.bpe_vocab_size, "sample_chars": self.bpe_sample_chars} \
            if self.tokenizer == "bpe" else None
        return {
            "format": FORMAT,
            "source": {"spec": self.source.spec, "fingerprint": content_fingerprint(self.source),
                       "text_field": self.text_field, "max_chars": self.max_chars},
            "tokenizer": {"spec": self.tokenizer, "bpe": bpe, **tokenizer_info},
            "split": {"rule": "blake2b-64 of the document's UTF-8 text keyed by str(seed), as a fraction of 2^64: "
                              "below val_fraction -> val, below val_fraction + test_fraction -> test",
                      "seed": self.seed, "val_fraction": self.val_fraction, "test_fraction": self.test_fraction,
                      "overrides": [[score, split] for score, split in sorted(self.overrides.items())]},
            "shard_tokens": self.shard_tokens,
            "command": command,  # what rebuilds it, with {directory} for the output directory
            "units": [unit.to_json() for unit in self.units],
        }


def _train_bpe_on_sample(plan: Plan) -> str:
    """A byte-level BPE trained on up to ``bpe_sample_chars`` characters of training documents, an equal share
    from the start of every unit (so every file and shard of the corpus is represented)."""
    from diffexp.data.tokenizer import train_bpe

    quota = max(1, plan.bpe_sample_chars // max(1, len(plan.units)))
    texts = []
    for unit in plan.units:
        taken = 0
        for split, text in unit_splits(unit, plan.source, plan.text_field, plan.hf_cache_dir, plan.seed,
                                       plan.val_fraction, plan.test_fraction, plan.overrides):
            if split == "train":
                texts.append(text[: quota - taken])
                taken += len(texts[-1])
                if taken >= quota:
                    break
    if not texts:
        raise UserError(f"data.source={plan.source.spec!r}: no training documents to train the BPE on")
    return train_bpe(texts, plan.bpe_vocab_size).to_str()


def resolve_tokenizer(plan: Plan, out: Path, key: str = "data.tokenizer") -> tuple[dict, str | None]:
    """The tokenizer's identity, vocabulary size and end-of-document id, and its tokenizer.json text (None for
    the byte tokenizer). A BPE already trained into ``out`` by an earlier run or another part is reused."""
    from diffexp.data.tokenizer import ByteTokenizer, HFTokenizer

    if plan.tokenizer == "byte":
        tokenizer = ByteTokenizer()
        return {"identity": tokenizer.identity, "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id}, None
    saved = out / "tokenizer.json"
    if plan.tokenizer == "bpe":
        text = saved.read_text() if saved.is_file() and (out / SETTINGS).is_file() else _train_bpe_on_sample(plan)
    else:
        text = load_named_tokenizer(plan.tokenizer, key)[1]
    from tokenizers import Tokenizer

    wrapped = HFTokenizer(Tokenizer.from_str(text), "")  # may add an end-of-document token
    text = wrapped.tokenizer.to_str()
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    identity = f"bpe{plan.bpe_vocab_size}-{digest}" if plan.tokenizer == "bpe" else f"file-{digest}"
    info = {"identity": identity, "vocab_size": wrapped.vocab_size, "eos_id": wrapped.eos_id, "file": "tokenizer.json"}
    return info, text


# -- one unit ------------------------------------------------------------------------------------------------
def part_units(units: list[Unit], part: int, of: int) -> list[Unit]:
    """The ``part``-th of ``of`` contiguous runs of units (balanced by count)."""
    return units[part * len(units) // of : (part + 1) * len(units) // of]


@dataclass
class Result:
    out: Path
    manifest: dict | None  # None while other parts are unfinished
    prepared_units: int
    skipped_units: int
    seconds: float  # the whole command
    tokenizing_seconds: float  # the units alone (no planning, no BPE training)
    tokens: int
    source_bytes: int


def prepare(plan: Plan, out: Path, num_proc: int | None = None, part: int = 0, of: int = 1,
            progress: bool = True, command: str = "") -> Result:
    """Prepare ``plan``'s units of this part into ``out``; write the manifest when every unit is finished."""
    started = time.perf_counter()
    out = Path(out).expanduser()
    _check_out(out)
    for leftover in [*out.glob("shards/.*.tmp"), *out.glob("units/.*.tmp"), *out.glob(".*.tmp")]:
        leftover.unlink(missing_ok=True)  # a killed run's half-written files
    plan.plan()
    _write_or_compare_settings(out, plan.settings({}, command), before_tokenizer=True)  # no BPE trained for nothing
    tokenizer_info, tokenizer_json = resolve_tokenizer(plan, out)
    settings = plan.settings(tokenizer_info, command)
    _write_or_compare_settings(out, {**settings, "command": saved_command(out, command)})
    saved_tokenizer = out / "tokenizer.json"
    if tokenizer_json is not None and not saved_tokenizer.is_file():
        write_atomic(saved_tokenizer, tokenizer_json.encode())
    if (out / MANIFEST).is_file():
        manifest = read_manifest(out, _rebuild_hint(out, command))
        return Result(out, manifest, 0, len(plan.units), time.perf_counter() - started, 0.0, 0, 0)
    mine = part_units(plan.units, part, of)
    pending = [unit for unit in mine if not finished(out, unit)]
    (out / "shards").mkdir(exist_ok=True)
    (out / "units").mkdir(exist_ok=True)
    job = Job(str(out), plan.source, plan.text_field, plan.hf_cache_dir,
              tokenizer_json, tokenizer_info["eos_id"],
              token_dtype(tokenizer_info["vocab_size"]).str, plan.seed, plan.val_fraction, plan.test_fraction,
              plan.overrides, plan.shard_tokens, unit_settings(settings))
    tokens, units_started = 0, time.perf_counter()
    try:
        tokens = _run_units(job, pending, num_proc, progress)
    except DiskFull as full:
        raise _disk_full_error(full, out, plan.units, command) from None
    tokenizing = time.perf_counter() - units_started
    complete = all(finished(out, unit) for unit in plan.units)
    manifest = join(out) if complete else None
    return Result(out, manifest, len(pending), len(mine) - len(pending), time.perf_counter() - started, tokenizing,
                  tokens, sum(unit.size for unit in pending))


def _check_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise UserError(f"OUT={str(out)!r}: exists and is not a directory; expected a new or a prepared directory")
    if out.is_dir() and any(out.iterdir()) and not (out / SETTINGS).is_file():
        raise UserError(f"OUT={str(out)!r}: the directory holds other files and no preparation; expected a new "
                        "directory (a preparation never writes over other files)")


def _write_or_compare_settings(out: Path, settings: dict, before_tokenizer: bool = False) -> None:
    """Compare ``settings`` with those of the preparation in ``out``, or write them where none is there yet.
    ``before_tokenizer``: the tokenizer is not resolved yet (a BPE not trained for nothing): only its chosen
    settings are compared, and nothing is written."""
    path = out / SETTINGS
    if path.is_file():
        saved = json.loads(path.read_text())
        if before_tokenizer:
            settings = {**settings, "tokenizer": {**(saved.get("tokenizer") or {}), **settings["tokenizer"]}}
        differing = settings_differences(saved, settings)
        if differing:
            raise UserError(f"OUT={str(out)!r}: holds a preparation made with other settings: {'; '.join(differing)}"
                            ". A preparation continues only with the settings that started it: rerun with the values "
                            "there, or prepare into a new directory")
        return
    if not before_tokenizer:
        out.mkdir(parents=True, exist_ok=True)
        write_json(path, settings)


def _check_same_settings(out: Path, settings: dict, records: list[dict]) -> None:
    """Every unit prepared with the settings of ``prepare.json`` here: parts prepared with other settings
    (another tokenizer, split or source) and copied together would make shards no one manifest describes."""
    wanted = unit_settings(settings)
    others = [record for record in records if record.get("settings", wanted) != wanted]  # older records: no check
    if not others:
        return
    first = others[0]
    alike = [r["unit"]["index"] for r in others if r["settings"] == first["settings"]]
    shown = ", ".join(map(str, alike[:8])) + (" ..." if len(alike) > 8 else "")
    label = f"in unit{'s' if len(alike) > 1 else ''} {shown}"
    differing = settings_differences(wanted, first["settings"], f"in {SETTINGS}", label)
    command = settings["command"].replace("{directory}", "DIR")
    raise UserError(f"OUT={str(out)!r}: {len(others)} of {len(records)} units were prepared with other settings than "
                    f"this directory's {SETTINGS}: {'; '.join(differing)}. Every part is prepared with the same "
                    "command (only --part differs): prepare the other parts again with the settings of "
                    f"{SETTINGS} (`{command}`), each into its own directory, copy them here and join "
                    "again; nothing was written")


def _run_units(job: Job, units: list[Unit], num_proc: int | None, show: bool) -> int:
    """Prepare ``units`` in this process (one unit, or one process) or a pool of ``num_proc`` processes."""
    if not units:
        return 0
    num_proc = min(num_proc or os.cpu_count() or 1, len(units))
    bar = _progress_bar(units, show)
    tokens = 0
    if num_proc == 1:
        updates: queue.SimpleQueue = queue.SimpleQueue()
        init_worker(job, updates, single_threaded=False)  # the tokenizer's own threads use every core
        try:
            for unit in units:
                prepare_unit(unit)
                tokens += _apply_progress(updates, bar)
        finally:
            WORKER.clear()
            bar.close()
        return tokens
    context = multiprocessing.get_context("spawn")  # workers import only the data code, never torch
    updates = context.Queue()
    with context.Pool(num_proc, initializer=init_worker, initargs=(job, updates, True)) as pool:
        try:
            pending = [pool.apply_async(prepare_unit, (unit,)) for unit in units]
            while pending:
                tokens += _apply_progress(updates, bar, wait=0.2)
                for result in [r for r in pending if r.ready()]:
                    result.get()  # raises a worker's error here
                    pending.remove(result)
            tokens += _apply_progress(updates, bar)
        finally:
            pool.terminate()
            bar.close()
    return tokens


def _progress_bar(units: list[Unit], show: bool):
    from tqdm import tqdm

    total = sum(unit.size for unit in units)
    bar = tqdm(total=total or None, unit="B", unit_scale=True, unit_divisor=1024, desc="preparing",
               disable=not show, file=sys.stderr, dynamic_ncols=True, mininterval=0.5)
    bar.documents = bar.tokens = 0
    return bar


def _apply_progress(updates, bar, wait: float = 0.0) -> int:
    """Apply the progress the workers reported; the tokens it adds."""
    tokens = 0
    try:
        while True:
            documents, size, count = updates.get(timeout=wait) if wait else updates.get_nowait()
            wait = 0.0
            bar.documents += documents
            tokens += count
            bar.tokens += count
            bar.update(size)
            elapsed = max(bar.format_dict["elapsed"], 1e-9)
            bar.set_postfix_str(f"{bar.documents:,} docs, {bar.tokens / elapsed / 1e6:.2f}M tok/s", refresh=False)
    except (queue.Empty, EOFError):
        pass
    return tokens


def _disk_full_error(full: DiskFull, out: Path, units: list[Unit], command: str) -> UserError:
    done = [unit for unit in units if finished(out, unit)]
    written = sum(p.stat().st_size for p in (out / "shards").glob("*.bin"))
    done_source = sum(unit.size for unit in done) or 1
    left_source = sum(unit.size for unit in units) - done_source
    needed = int(written / done_source * left_source) if done else None
    free = shutil.disk_usage(out).free
    estimate = f"about {needed / 2**30:.2f} GiB more are needed" if needed else "the space needed is not known yet"
    again = f" ({command.replace('{directory}', str(out))})" if command else ""
    return UserError(f"the disk holding {out} is full: writing {full.path} failed with no space left on the device "
                     f"({free / 2**30:.2f} GiB free). {len(done)} of {len(units)} units are finished and kept; "
                     f"{estimate}. Free space, then run the same command again{again}: it continues from the finished "
                     "units.")


def saved_command(out: Path, command: str) -> str:
    """The command an existing preparation recorded (a rerun through `diffexp fit` keeps the CLI's), else
    ``command``: how the command was spelled is no setting that decides the bytes."""
    try:
        return json.loads((out / SETTINGS).read_text())["command"]
    except (OSError, KeyError, json.JSONDecodeError):
        return command


def _rebuild_hint(out: Path, command: str) -> str:
    return f"rebuild it: delete {out} and run {command.replace('{directory}', str(out))}"


def join(out: Path) -> dict:
    """Write ``manifest.json`` from the unit records (every unit must be finished); the manifest."""
    settings = json.loads((out / SETTINGS).read_text())
    command = settings["command"]
    units = [Unit(**u) for u in settings["units"]]
    missing = [unit.index for unit in units if not finished(out, unit)]
    if missing:
        shown = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
        raise UserError(f"{out}: {len(missing)} of {len(units)} units are not finished (units {shown}); run every "
                        "part's `diffexp data prepare ... --part i --of n` to its end (or copy its directory's "
                        "shards/ and units/ here), then join again")
    records = [json.loads((out / "units" / f"{unit.index:06d}.json").read_text()) for unit in units]
    _check_same_settings(out, settings, records)
    splits = {split: {"documents": 0, "tokens": 0, "pieces": []} for split in SPLITS}
    for record in records:
        for split in SPLITS:
            for piece in record["splits"][split]:
                splits[split]["pieces"].append(piece)
                splits[split]["documents"] += piece["documents"]
                splits[split]["tokens"] += piece["tokens"]
    tokenizer = settings["tokenizer"]
    manifest = {"format": FORMAT, "source": settings["source"], "tokenizer": tokenizer, "split": settings["split"],
                "dtype": token_dtype(tokenizer["vocab_size"]).name, "splits": splits,
                "command": command, "settings": SETTINGS}
    write_json(out / MANIFEST, manifest)
    return manifest

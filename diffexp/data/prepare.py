"""``diffexp data prepare``: a corpus becomes token shards, once, in flat memory, on every core.

The corpus is planned as units (``diffexp.data.units``); each unit is read, split by document, tokenized and
written as shards by one process (``--num-proc`` of them), and recorded in ``units/<index>.json`` once its
shards are on disk. A rerun of the same command skips the recorded units, so a killed preparation continues
where it stopped and ends byte-identical to an uninterrupted one. ``--part i --of n`` prepares the i-th of n
contiguous runs of units (one per machine, into one shared or later merged directory); ``join`` (run by the
last part to finish, or by ``diffexp data join``) writes ``manifest.json`` from the records, so the result is
the same files as a one-machine preparation.

A document goes to validation or test by a keyed hash of its text (``split_of``): the choice depends on the
document alone, never on its position, the unit layout or the machine.
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
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from diffexp.data import sources
from diffexp.data.checks import TOKENIZER_CHOICES, looks_like_path
from diffexp.data.shards import (
    FORMAT,
    MANIFEST,
    SPLITS,
    DiskFull,
    PieceWriter,
    read_manifest,
    token_dtype,
    write_atomic,
    write_json,
)
from diffexp.data.units import Unit, content_fingerprint, plan_units, unit_documents
from diffexp.errors import UserError

SETTINGS = "prepare.json"
SHARD_TOKENS = 1 << 27  # 128M tokens: a 256 MiB piece at uint16
BPE_SAMPLE_CHARS = 32_000_000  # what a BPE is trained on: enough for its merges, bounded in memory
BATCH_CHARS = 1 << 20  # documents tokenized together


def split_score(text: str, seed: int) -> float:
    """A document's place in [0, 1): a hash of its text keyed by ``seed``."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8, key=str(seed).encode()).digest()
    return int.from_bytes(digest, "little") / 2**64


def split_of(text: str, seed: int, val_fraction: float, test_fraction: float,
             overrides: dict[float, str] | None = None) -> str:
    """"val", "test" or "train" for a document by its score alone, so documents with the same text always land
    in the same split (``overrides``: the scores ``held_out_overrides`` moves out of training)."""
    u = split_score(text, seed)
    if overrides and u in overrides:
        return overrides[u]
    return "val" if u < val_fraction else "test" if u < val_fraction + test_fraction else "train"


GUARANTEED_WITHIN = 10_000


def held_out_overrides(first: Unit, source: sources.Source, text_field: str, hf_cache_dir: str, seed: int,
                       val_fraction: float, test_fraction: float) -> dict[float, str]:
    """A small corpus may have no score below a fraction: if none of the corpus's first ``GUARANTEED_WITHIN``
    documents is held out for validation (or test), the training text with the lowest score is, one each
    (every copy of it). Large corpora are never affected."""
    scores = set()
    for ordinal, text in enumerate(unit_documents(first, source, text_field, hf_cache_dir)):
        if ordinal == GUARANTEED_WITHIN:
            break
        scores.add(split_score(text, seed))
    held_out = val_fraction + test_fraction
    wanted = [split for split, low, high in (("val", 0.0, val_fraction), ("test", val_fraction, held_out))
              if high > low and not any(low <= score < high for score in scores)]
    training = sorted(score for score in scores if score >= held_out)
    if len(training) <= len(wanted):
        splits = "train/val/test" if test_fraction > 0 else "train/val"
        needed = 3 if test_fraction > 0 else 2
        hint = "raise data.max_chars" if first.max_chars else "add text; .txt files split at blank lines"
        raise UserError(f"data.source={source.spec!r}: need at least {needed} documents to split into {splits}, got "
                        f"{len(scores)} different ones ({hint})")
    return dict(zip(training, wanted))


def unit_splits(unit: Unit, source: sources.Source, text_field: str, hf_cache_dir: str, seed: int,
                val_fraction: float, test_fraction: float, overrides: dict[float, str]) -> Iterator[tuple[str, str]]:
    """(split, document) for each document of a unit."""
    for text in unit_documents(unit, source, text_field, hf_cache_dir):
        yield split_of(text, seed, val_fraction, test_fraction, overrides), text


# -- tokenizers ----------------------------------------------------------------------------------------------
def is_builtin_tokenizer(spec: str) -> bool:
    return spec in ("byte", "bpe")


def load_named_tokenizer(spec: str, key: str):
    """A tokenizer.json file, or a Hub tokenizer by name (needs network or the local Hub cache); a
    ``(tokenizers.Tokenizer, json text)`` pair, or a UserError naming ``key``."""
    from tokenizers import Tokenizer

    path = Path(spec).expanduser()
    if path.is_dir():
        inside = path / "tokenizer.json"
        hint = f"; did you mean {str(inside)!r}?" if inside.is_file() else ""
        raise UserError(f"{key}={spec!r}: {path} is a directory, not a tokenizer.json file{hint}")
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
            return Tokenizer.from_str(text), text
        except Exception as err:  # tokenizers raises a bare Exception for a bad file
            reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise UserError(f"{key}={spec!r}: {path} is not a Hugging Face tokenizer.json ({reason}); "
                            f"{TOKENIZER_CHOICES}") from None
    if looks_like_path(spec):
        raise UserError(f"{key}={spec!r}: no such file; {TOKENIZER_CHOICES}")
    try:
        tokenizer = Tokenizer.from_file(_hub_tokenizer_file(spec))
    except Exception as err:  # offline, no such repository, no tokenizer.json in it
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise UserError(f"{key}={spec!r}: not a local file, and no Hub tokenizer of that name could be loaded "
                        f"({reason}); {TOKENIZER_CHOICES}") from None
    return tokenizer, tokenizer.to_str()


def _hub_tokenizer_file(name: str) -> str:
    """A Hub repository's tokenizer.json: from the local Hub cache, else downloaded (failing at once offline,
    where huggingface_hub would retry for half a minute)."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache

    cached = try_to_load_from_cache(name, "tokenizer.json")
    if isinstance(cached, str):
        return cached
    if constants.HF_HUB_OFFLINE:
        raise OSError("offline (HF_HUB_OFFLINE is set) and not in the local Hub cache")
    try:
        socket.getaddrinfo(urlparse(constants.ENDPOINT).hostname, 443)
    except OSError as err:
        raise OSError(f"the Hub cannot be reached ({err.strerror or err}), and it is not in the local Hub "
                      "cache") from None
    return hf_hub_download(name, "tokenizer.json")


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
        """Cut the corpus into units and find the split's overrides (reads at most the first unit's start)."""
        if not self.units:
            self.units = plan_units(self.source, self.text_field, self.max_chars, self.hf_cache_dir, self.unit_bytes)
            self.overrides = held_out_overrides(self.units[0], self.source, self.text_field, self.hf_cache_dir,
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
@dataclass
class _Job:
    """What a process needs to prepare units: sent once to each worker."""

    out: str
    source: sources.Source
    text_field: str
    hf_cache_dir: str
    tokenizer_json: str | None  # None: the byte tokenizer
    eos_id: int
    dtype: str
    seed: int
    val_fraction: float
    test_fraction: float
    overrides: dict[float, str]
    shard_tokens: int


_WORKER: dict = {}


def _init_worker(job: _Job, progress, single_threaded: bool) -> None:
    if single_threaded:  # one process per core: the tokenizer's own thread pool would oversubscribe them
        os.environ["RAYON_NUM_THREADS"] = "1"
    encode = None
    if job.tokenizer_json is not None:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_str(job.tokenizer_json)

        def encode(texts: list[str]) -> list[list[int]]:
            return [e.ids for e in tokenizer.encode_batch_fast(texts, add_special_tokens=False)]
    _WORKER.update(job=job, encode=encode, progress=progress)


def _tokens(texts: list[str], encode, eos_id: int, dtype: np.dtype) -> np.ndarray:
    """The documents' ids, each followed by ``eos_id``, as one array."""
    if encode is None:  # the byte tokenizer: UTF-8 bytes are the ids
        encoded = [text.encode("utf-8") for text in texts]
        ends = np.cumsum(np.fromiter(map(len, encoded), np.int64, len(encoded)) + 1) - 1
        ids = np.empty(int(ends[-1]) + 1 if len(ends) else 0, dtype=dtype)
        is_text = np.ones(len(ids), dtype=bool)
        is_text[ends] = False
        ids[is_text] = np.frombuffer(b"".join(encoded), dtype=np.uint8)
        ids[ends] = eos_id
        return ids
    flat: list[int] = []
    for ids in encode(texts):
        flat.extend(ids)
        flat.append(eos_id)
    return np.array(flat, dtype=dtype)


def prepare_unit(unit: Unit) -> dict:
    """Read, split, tokenize and write one unit; its record once its shards are on disk."""
    job, encode, progress = _WORKER["job"], _WORKER["encode"], _WORKER["progress"]
    out, dtype = Path(job.out), np.dtype(job.dtype)
    writers = {split: PieceWriter(out / "shards", f"{split}-{unit.index:06d}", dtype, job.eos_id, job.shard_tokens)
               for split in SPLITS}
    reported = 0

    def flush(batch: dict[str, list[str]], chars: int) -> None:
        nonlocal reported
        tokens = 0
        for split, texts in batch.items():
            if texts:
                ids = _tokens(texts, encode, job.eos_id, dtype)
                writers[split].write(ids)
                tokens += len(ids)
        if progress is not None:
            progress.put((sum(map(len, batch.values())), chars, tokens))
            reported += chars

    batch: dict[str, list[str]] = {split: [] for split in SPLITS}
    chars = 0
    for split, text in unit_splits(unit, job.source, job.text_field, job.hf_cache_dir, job.seed, job.val_fraction,
                                   job.test_fraction, job.overrides):
        batch[split].append(text)
        chars += len(text)
        if chars >= BATCH_CHARS:
            flush(batch, chars)
            batch, chars = {split: [] for split in SPLITS}, 0
    flush(batch, chars)
    if progress is not None and unit.size > reported:  # the bar counts source bytes: end on the unit's size
        progress.put((0, unit.size - reported, 0))
    record = {"unit": unit.to_json(), "splits": {split: writers[split].close() for split in SPLITS}}
    write_json(out / "units" / f"{unit.index:06d}.json", record)
    return record


# -- the whole corpus ----------------------------------------------------------------------------------------
def _finished(out: Path, unit: Unit) -> bool:
    """A unit whose record is written and whose pieces are all there at their size."""
    path = out / "units" / f"{unit.index:06d}.json"
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    if record.get("unit") != unit.to_json():
        return False
    pieces = [p for split in SPLITS for p in record["splits"][split]]
    return all((out / p["file"]).is_file() and (out / p["file"]).stat().st_size == p["bytes"] for p in pieces)


def part_units(units: list[Unit], part: int, of: int) -> list[Unit]:
    """The ``part``-th of ``of`` contiguous runs of units (balanced by count)."""
    return units[part * len(units) // of : (part + 1) * len(units) // of]


@dataclass
class Result:
    out: Path
    manifest: dict | None  # None while other parts are unfinished
    prepared_units: int
    skipped_units: int
    seconds: float
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
    tokenizer_info, tokenizer_json = resolve_tokenizer(plan, out)
    settings = plan.settings(tokenizer_info, command)
    _write_or_compare_settings(out, {**settings, "command": saved_command(out, command)}, command)
    saved_tokenizer = out / "tokenizer.json"
    if tokenizer_json is not None and not saved_tokenizer.is_file():
        write_atomic(saved_tokenizer, tokenizer_json.encode())
    if (out / MANIFEST).is_file():
        manifest = read_manifest(out, _rebuild(out, command))
        return Result(out, manifest, 0, len(plan.units), time.perf_counter() - started, 0, 0)
    mine = part_units(plan.units, part, of)
    pending = [unit for unit in mine if not _finished(out, unit)]
    (out / "shards").mkdir(exist_ok=True)
    (out / "units").mkdir(exist_ok=True)
    job = _Job(str(out), plan.source, plan.text_field, plan.hf_cache_dir,
               tokenizer_json, tokenizer_info["eos_id"],
               token_dtype(tokenizer_info["vocab_size"]).str, plan.seed, plan.val_fraction, plan.test_fraction,
               plan.overrides, plan.shard_tokens)
    tokens = 0
    try:
        tokens = _run_units(job, pending, num_proc, progress)
    except DiskFull as full:
        raise _disk_full_error(full, out, plan.units, command) from None
    finished = all(_finished(out, unit) for unit in plan.units)
    manifest = join(out) if finished else None
    return Result(out, manifest, len(pending), len(mine) - len(pending), time.perf_counter() - started, tokens,
                  sum(unit.size for unit in pending))


def _check_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise UserError(f"OUT={str(out)!r}: exists and is not a directory; expected a new or a prepared directory")
    if out.is_dir() and any(out.iterdir()) and not (out / SETTINGS).is_file():
        raise UserError(f"OUT={str(out)!r}: the directory holds other files and no preparation; expected a new "
                        "directory (a preparation never writes over other files)")


def _write_or_compare_settings(out: Path, settings: dict, command: str) -> None:
    path = out / SETTINGS
    if path.is_file():
        saved = json.loads(path.read_text())
        differing = [key for key in settings if saved.get(key) != settings[key]]
        if differing:
            raise UserError(f"OUT={str(out)!r}: holds a preparation with other settings ({', '.join(differing)} "
                            f"differ{'s' if len(differing) == 1 else ''}: {_difference(saved, settings, differing)}); "
                            "a preparation continues only with the command that started it: use a new directory")
        return
    out.mkdir(parents=True, exist_ok=True)
    write_json(path, settings)


def _difference(saved: dict, wanted: dict, keys: list[str]) -> str:
    key = keys[0]
    if key == "units":
        return f"the source's layout: {len(saved.get(key) or [])} units there, {len(wanted[key])} now"
    there, now = (json.dumps(value, sort_keys=True)[:160] for value in (saved.get(key), wanted[key]))
    return f"{key} there {there}, now {now}"


def _run_units(job: _Job, units: list[Unit], num_proc: int | None, show: bool) -> int:
    """Prepare ``units`` in this process (one unit, or one process) or a pool of ``num_proc`` processes."""
    if not units:
        return 0
    num_proc = min(num_proc or os.cpu_count() or 1, len(units))
    bar = _progress_bar(units, show)
    tokens = 0
    if num_proc == 1:
        updates: queue.SimpleQueue = queue.SimpleQueue()
        _init_worker(job, updates, single_threaded=False)  # the tokenizer's own threads use every core
        try:
            for unit in units:
                prepare_unit(unit)
                tokens += _drain(updates, bar)
        finally:
            _WORKER.clear()
            bar.close()
        return tokens
    context = multiprocessing.get_context("spawn")  # workers import only the data code, never torch
    updates = context.Queue()
    with context.Pool(num_proc, initializer=_init_worker, initargs=(job, updates, True)) as pool:
        try:
            pending = [pool.apply_async(prepare_unit, (unit,)) for unit in units]
            while pending:
                tokens += _drain(updates, bar, wait=0.2)
                for result in [r for r in pending if r.ready()]:
                    result.get()  # raises a worker's error here
                    pending.remove(result)
            tokens += _drain(updates, bar)
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


def _drain(updates, bar, wait: float = 0.0) -> int:
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
    done = [unit for unit in units if _finished(out, unit)]
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


def _rebuild(out: Path, command: str) -> str:
    return f"rebuild it: delete {out} and run {command.replace('{directory}', str(out))}"


def join(out: Path) -> dict:
    """Write ``manifest.json`` from the unit records (every unit must be finished); the manifest."""
    settings = json.loads((out / SETTINGS).read_text())
    command = settings["command"]
    units = [Unit(**u) for u in settings["units"]]
    missing = [unit.index for unit in units if not _finished(out, unit)]
    if missing:
        shown = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
        raise UserError(f"{out}: {len(missing)} of {len(units)} units are not finished (units {shown}); run every "
                        "part's `diffexp data prepare ... --part i --of n` to its end (or copy its directory's "
                        "shards/ and units/ here), then join again")
    splits = {split: {"documents": 0, "tokens": 0, "pieces": []} for split in SPLITS}
    for unit in units:
        record = json.loads((out / "units" / f"{unit.index:06d}.json").read_text())
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


def iter_documents(tokens: np.ndarray, eos_id: int) -> Iterator[np.ndarray]:
    """Each document's ids (without its end-of-document id) from a stream of ids."""
    ends = np.flatnonzero(tokens == eos_id)
    start = 0
    for end in ends:
        yield tokens[start:end]
        start = end + 1

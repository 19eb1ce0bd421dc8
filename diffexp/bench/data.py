"""`diffexp bench data`: the data preparation's cost on synthetic corpora generated here, against the tokenizer."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from diffexp.data.tokenizer import check_bpe_vocab_size
from diffexp.errors import UserError

NAME = "data"
ABOUT = "data preparation: peak memory and tokens/s against the tokenizer's encode_batch, loader tokens/s"
#: the description `diffexp bench data --help` shows
HELP = """`diffexp bench data`: the data preparation's cost on synthetic corpora generated here, against the tokenizer.

For each corpus size (default 100 MB and 1 GB of JSON lines) it measures, each in a fresh process:

* `diffexp data prepare` with one tokenizer.json on every core: wall time, tokens/s, and the peak memory of the
  whole process tree (the sum of every process's resident memory, sampled every 50 ms);
* the tokenizer's own `encode_batch` on the same cores over the same documents, held in memory beforehand
  (the reference: tokens/s of tokenization alone), on the smallest corpus;
* the training loader reading the prepared shards (rows of seq 2048, batches of 8, one process): tokens/s;
* with `--fit-mb N`, `diffexp fit` for one step on a raw N MB corpus with `--data.tokenizer bpe`: peak memory.

The corpus: documents of the Python standard library with their identifiers renamed at random per document
(so a larger corpus is not the same text again), as {"text": ...} lines, written once under --work-dir.
"""
MB = 10**6
IDENTIFIER = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]{2,}\b")
SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "ta", "vo", "zi", "pe", "su", "do", "ha", "ji", "qu", "we", "xy"]
KEEP = {"def", "class", "return", "import", "from", "for", "while", "if", "elif", "else", "try", "except",
        "finally", "with", "as", "in", "not", "and", "or", "is", "None", "True", "False", "self", "lambda",
        "yield", "pass", "break", "continue", "raise", "global", "nonlocal", "assert", "del", "async", "await"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="diffexp bench data", description=HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[100, 1000], help="corpus sizes (MB)")
    parser.add_argument("--num-proc", type=int, default=None, help="preparation processes (default: every core)")
    parser.add_argument("--bpe-vocab-size", type=int, default=32768, help="the tokenizer's vocabulary")
    parser.add_argument("--fit-mb", type=int, default=None, help="also `diffexp fit` one step on a raw corpus of "
                        "this size (MB) with --data.tokenizer bpe, and report its peak memory")
    parser.add_argument("--work-dir", default="bench/data-corpora", help="where corpora are generated and kept")
    parser.add_argument("--json", default=None, help="results file (default: bench/results/data-<time>.json)")
    return parser


# -- the corpus ------------------------------------------------------------------------------------------------
def _renamed_identifiers(text: str, rng: random.Random) -> str:
    names: dict[str, str] = {}

    def rename(match: re.Match) -> str:
        word = match.group(0)
        if word in KEEP:
            return word
        if word not in names:
            names[word] = "".join(rng.choice(SYLLABLES) for _ in range(rng.choice((2, 3, 4)))) + word[-1]
        return names[word]

    return IDENTIFIER.sub(rename, text)


def synthetic_corpus(path: Path, size_mb: int, seed: int = 0) -> Path:
    """A JSON-lines corpus of about ``size_mb`` MB (kept and reused once written)."""
    if path.is_file() and path.stat().st_size >= size_mb * MB:
        return path
    from diffexp.data.corpus import load_stdlib_corpus

    documents = load_stdlib_corpus(max_chars=None)
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    written = 0
    with open(tmp, "w", encoding="utf-8") as f:
        while written < size_mb * MB:
            line = json.dumps({"text": _renamed_identifiers(rng.choice(documents), rng)}) + "\n"
            f.write(line)
            written += len(line.encode("utf-8"))
    tmp.replace(path)
    return path


# -- measuring ---------------------------------------------------------------------------------------------------
def _process_tree_rss(root: int) -> int:
    """Resident bytes of a process and all its descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        stack += children.get(pid, [])
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def run_measured(command: list[str], env: dict | None = None, cwd: Path | None = None) -> dict:
    """Run ``command``; its wall time, peak process-tree memory and output."""
    started = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), **(env or {})},
                            cwd=cwd)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, _process_tree_rss(proc.pid))
        time.sleep(0.05)
    output = proc.stdout.read()
    if proc.returncode != 0:
        raise UserError(f"`{' '.join(command)}` failed (exit {proc.returncode}):\n{output[-2000:]}")
    return {"seconds": time.perf_counter() - started, "peak_bytes": peak, "output": output}


ENCODE_BATCH = """
import json, sys, time
from tokenizers import Tokenizer
tokenizer = Tokenizer.from_file(sys.argv[1])
texts = [json.loads(line)["text"] for line in open(sys.argv[2], encoding="utf-8")]
started, tokens = time.perf_counter(), 0
for i in range(0, len(texts), 1024):
    tokens += sum(len(e.ids) for e in tokenizer.encode_batch_fast(texts[i:i + 1024], add_special_tokens=False))
print(json.dumps({"seconds": time.perf_counter() - started, "tokens": tokens + len(texts)}))
"""

LOADER = """
import json, sys, time
from pathlib import Path
from diffexp.data.loader import PackedRows, ResumableDataLoader
from diffexp.data.prepared import open_prepared
rows = open_prepared(Path(sys.argv[1]), "DIR", checksums=False).rows("train", 2048)
loader = ResumableDataLoader(PackedRows(rows), batch_size=8, seed=0)
started, tokens = time.perf_counter(), 0
for i, batch in enumerate(loader):
    tokens += batch.numel()
    if i == 2000:
        break
print(json.dumps({"seconds": time.perf_counter() - started, "tokens": tokens}))
"""


def _bpe_file(corpus: Path, vocab_size: int, work: Path) -> Path:
    """One BPE for every measurement, trained on a 32 MB sample of the corpus (kept)."""
    path = work / f"bpe-{vocab_size}.json"
    if not path.is_file():
        from diffexp.data.tokenizer import train_bpe

        texts, size = [], 0
        with open(corpus, encoding="utf-8") as f:
            for line in f:
                texts.append(json.loads(line)["text"])
                size += len(texts[-1])
                if size > 32 * MB:
                    break
        train_bpe(texts, vocab_size).save(str(path))
    return path


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    for flag, values in (("--sizes-mb", args.sizes_mb), ("--num-proc", [args.num_proc or 1]),
                         ("--fit-mb", [args.fit_mb or 1])):
        if any(v < 1 for v in values):
            raise UserError(f"{flag}={values} is invalid: expected positive integers")
    check_bpe_vocab_size(args.bpe_vocab_size, "--bpe-vocab-size")  # the rule `diffexp data prepare` applies
    work = Path(args.work_dir)
    num_proc = args.num_proc or os.cpu_count() or 1
    diffexp_cli = [sys.executable, "-m", "diffexp"]
    results: dict = {"num_proc": num_proc, "sizes": {}}
    sizes = sorted(args.sizes_mb)
    corpora = {size: synthetic_corpus(work / f"corpus-{size}mb.jsonl", size) for size in sizes}
    tokenizer = _bpe_file(corpora[sizes[0]], args.bpe_vocab_size, work)
    reference = run_measured([sys.executable, "-c", ENCODE_BATCH, str(tokenizer), str(corpora[sizes[0]])],
                             env={"RAYON_NUM_THREADS": str(num_proc)})
    encode = json.loads(reference["output"].strip().splitlines()[-1])
    results["encode_batch_tokens_per_s"] = encode["tokens"] / encode["seconds"]
    for size in sizes:
        out = work / f"prepared-{size}mb-{time.strftime('%Y%m%d-%H%M%S')}"
        measured = run_measured([*diffexp_cli, "data", "prepare", str(corpora[size]), str(out), "--tokenizer",
                                 str(tokenizer), "--num-proc", str(num_proc), "--no-progress"])
        manifest = json.loads((out / "manifest.json").read_text())
        tokens = sum(split["tokens"] for split in manifest["splits"].values())
        loader = run_measured([sys.executable, "-c", LOADER, str(out)])
        served = json.loads(loader["output"].strip().splitlines()[-1])
        results["sizes"][size] = {
            "corpus_bytes": corpora[size].stat().st_size, "seconds": measured["seconds"], "tokens": tokens,
            "tokens_per_s": tokens / measured["seconds"], "peak_bytes": measured["peak_bytes"],
            "vs_encode_batch": tokens / measured["seconds"] / results["encode_batch_tokens_per_s"],
            "loader_tokens_per_s": served["tokens"] / served["seconds"],
            "shard_bytes": sum(p["bytes"] for s in manifest["splits"].values() for p in s["pieces"]),
        }
        print(f"{size} MB: {json.dumps(results['sizes'][size])}", flush=True)
        shutil.rmtree(out)
    if args.fit_mb:
        corpus = synthetic_corpus(work / f"corpus-{args.fit_mb}mb.jsonl", args.fit_mb)
        cache = (work / f"fit-{time.strftime('%Y%m%d-%H%M%S')}").resolve()  # the run's directory too
        cache.mkdir(parents=True)
        fit = run_measured([*diffexp_cli, "fit", "--data.source", str(corpus.resolve()), "--data.tokenizer", "bpe",
                            "--data.cache_dir", str(cache), "--trainer.max_steps", "1", "--trainer.logger", "false",
                            "--trainer.enable_checkpointing", "false", "--trainer.limit_val_batches", "0"], cwd=cache)
        results["fit"] = {"corpus_mb": args.fit_mb, "seconds": fit["seconds"], "peak_bytes": fit["peak_bytes"]}
        shutil.rmtree(cache, ignore_errors=True)
    _print_results(results, sizes)
    path = Path(args.json or f"bench/results/data-{time.strftime('%Y%m%d-%H%M%S')}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"kind": NAME, "created": _dt.datetime.now().isoformat(timespec="seconds"),
                                "command": " ".join(["diffexp", "bench", "data", *argv]), "results": results},
                               indent=1))
    print(f"results: {path}")
    return 0


def _print_results(results: dict, sizes: list[int]) -> None:
    print(f"encode_batch reference ({results['num_proc']} threads): "
          f"{results['encode_batch_tokens_per_s'] / 1e6:.2f}M tokens/s")
    print(f"{'corpus':>8} {'wall s':>8} {'M tok/s':>8} {'x encode_batch':>15} {'peak MB':>8} {'loader M tok/s':>15}")
    for size in sizes:
        r = results["sizes"][size]
        print(f"{size:>6}MB {r['seconds']:>8.1f} {r['tokens_per_s'] / 1e6:>8.2f} {r['vs_encode_batch']:>15.2f} "
              f"{r['peak_bytes'] / 2**20:>8.0f} {r['loader_tokens_per_s'] / 1e6:>15.1f}")
    if len(sizes) > 1:
        ratio = results["sizes"][sizes[-1]]["peak_bytes"] / results["sizes"][sizes[0]]["peak_bytes"]
        print(f"peak memory {sizes[-1]} MB / {sizes[0]} MB: {ratio:.2f}x")
    if "fit" in results:
        fit = results["fit"]
        print(f"diffexp fit, one step on a raw {fit['corpus_mb']} MB corpus (bpe): {fit['seconds']:.0f} s, peak "
              f"{fit['peak_bytes'] / 2**20:.0f} MB")

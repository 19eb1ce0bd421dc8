"""``diffexp data prepare | join | inspect``: prepare a corpus as token shards once, then look at it."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from diffexp.data.shards import SPLITS
from diffexp.errors import UserError, dash_value_hint

# the data module's keys as this command spells them, so shared checks name what the user typed
FLAG_NAMES = {"data.source": "SOURCE", "data.text_field": "--text-field", "data.tokenizer": "--tokenizer",
              "data.max_chars": "--max-chars", "data.bpe_vocab_size": "--bpe-vocab-size",
              "data.val_fraction": "--val-fraction", "data.test_fraction": "--test-fraction", "data.seed": "--seed",
              "bpe_sample_chars": "--bpe-sample-chars", "shard_tokens": "--shard-tokens"}
#: the description `diffexp data --help` shows
HELP = """``diffexp data prepare | join | inspect``: prepare a corpus as token shards once, then look at it.

    diffexp data prepare corpus.jsonl data/corpus --tokenizer bpe --bpe-vocab-size 32768
    diffexp data prepare hf:HuggingFaceFW/fineweb-edu:sample-10BT data/fineweb --part 0 --of 4   # machine 0 of 4
    diffexp data join data/fineweb        # after every part: writes manifest.json
    diffexp data inspect data/corpus      # the manifest's figures and decoded samples of each split

Training reads the result with ``--data.source data/corpus``.
"""
DEFAULTS = {"tokenizer": "byte", "bpe_vocab_size": 4096, "text_field": "text", "seed": 1234, "val_fraction": 0.05,
            "test_fraction": 0.05}  # TextDataModule's, so a prepared directory holds what `fit` would make


class _Parser(argparse.ArgumentParser):
    words: list[str] | None = None  # what main() parses, read by error()

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)  # a shortened flag is an unknown flag, never another one
        super().__init__(*args, **kwargs)
    def error(self, message: str):
        hint = dash_value_hint(message, sys.argv[1:] if _Parser.words is None else _Parser.words)
        raise UserError(f"{message}{hint} (`{self.prog} --help` lists the options)")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="diffexp data", description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    prepare = commands.add_parser("prepare", help="tokenize a corpus into token shards (resumable, on every core)")
    prepare.add_argument("source", metavar="SOURCE", help="'stdlib', a .txt/.jsonl/.json/.parquet file, directory or "
                         "glob, or hf:<name>[:<config>] (a Hub dataset, streamed; online)")
    prepare.add_argument("out", metavar="OUT", help="the directory to write (new, or this command's unfinished one)")
    prepare.add_argument("--tokenizer", default=DEFAULTS["tokenizer"], help="'byte', 'bpe' (trained here on a "
                         "sample), a tokenizer.json file, or a Hub tokenizer name (online). Default: byte")
    prepare.add_argument("--bpe-vocab-size", type=int, default=DEFAULTS["bpe_vocab_size"], help="default: 4096")
    prepare.add_argument("--bpe-sample-chars", type=int, default=None,
                         help="characters of training documents the BPE is trained on, an equal share from the "
                              "start of every unit of the corpus (default: 32,000,000)")
    prepare.add_argument("--text-field", default=DEFAULTS["text_field"], help="the text column of JSON, Parquet "
                         "and Hub records. Default: text")
    prepare.add_argument("--max-chars", type=int, default=None, help="cap on the corpus's characters (in order)")
    prepare.add_argument("--seed", type=int, default=DEFAULTS["seed"], help="keys the validation/test choice")
    prepare.add_argument("--val-fraction", type=float, default=DEFAULTS["val_fraction"])
    prepare.add_argument("--test-fraction", type=float, default=DEFAULTS["test_fraction"])
    prepare.add_argument("--num-proc", type=int, default=None, help="processes (default: every core)")
    prepare.add_argument("--part", type=int, default=0, help="with --of: which part of the corpus this machine "
                         "prepares (0 .. of-1)")
    prepare.add_argument("--of", type=int, default=1, help="the number of machines preparing parts")
    prepare.add_argument("--shard-tokens", type=int, default=None, help="most tokens per shard file "
                         "(default: 2^27)")
    prepare.add_argument("--unit-mb", type=float, default=None, help="MiB of source per unit of work, the "
                         "granularity of parallel work and of a resume (default: the corpus / 64, within 8-256)")
    prepare.add_argument("--cache-dir", default=".cache/diffexp", help="where Hub datasets are cached")
    prepare.add_argument("--no-progress", action="store_true", help="no progress bar")
    join = commands.add_parser("join", help="write the manifest once every part's units are in OUT")
    join.add_argument("out", metavar="OUT")
    inspect = commands.add_parser("inspect", help="a prepared directory's figures and decoded samples")
    inspect.add_argument("directory", metavar="DIR")
    inspect.add_argument("--samples", type=int, default=2, help="documents decoded per split (default: 2)")
    inspect.add_argument("--chars", type=int, default=300, help="characters shown per sample (default: 300)")
    inspect.add_argument("--verify", action="store_true", help="also check every shard's SHA-256")
    return parser


def main(argv: list[str]) -> int:
    _Parser.words = list(argv)
    args = _parser().parse_args(argv)
    try:
        return {"prepare": _prepare, "join": _join, "inspect": _inspect}[args.command](args)
    except UserError as err:
        message = str(err)
        for key, flag in FLAG_NAMES.items():
            message = message.replace(f"{key}=", f"{flag}=")
        raise UserError(message) from None


def _positive(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise UserError(f"{name}={value} is invalid: expected a positive integer")


OUT_PLACEHOLDER = "{directory}"  # the manifest names no path of its own: a copy elsewhere is the same bytes


def canonical_command(args: argparse.Namespace) -> str:
    """The command that rebuilds this preparation: every setting that decides the bytes, no --part/--num-proc,
    and ``{directory}`` for OUT."""
    words = ["diffexp", "data", "prepare", args.source, OUT_PLACEHOLDER, "--tokenizer", args.tokenizer]
    if args.tokenizer == "bpe":
        words += ["--bpe-vocab-size", str(args.bpe_vocab_size)]
        if args.bpe_sample_chars is not None:
            words += ["--bpe-sample-chars", str(args.bpe_sample_chars)]
    for flag, value, default in (("--text-field", args.text_field, DEFAULTS["text_field"]),
                                 ("--max-chars", args.max_chars, None), ("--seed", args.seed, DEFAULTS["seed"]),
                                 ("--val-fraction", args.val_fraction, DEFAULTS["val_fraction"]),
                                 ("--test-fraction", args.test_fraction, DEFAULTS["test_fraction"]),
                                 ("--shard-tokens", args.shard_tokens, None), ("--unit-mb", args.unit_mb, None)):
        if value != default:
            words += [flag, str(value)]
    return shlex.join(words)


def _prepare(args: argparse.Namespace) -> int:
    from diffexp.data import sources
    from diffexp.data.prepare import BPE_SAMPLE_CHARS, SHARD_TOKENS, Plan, check_settings, prepare

    for name, value in (("--bpe-sample-chars", args.bpe_sample_chars), ("--num-proc", args.num_proc),
                        ("--of", args.of), ("--shard-tokens", args.shard_tokens)):
        _positive(name, value)
    if args.unit_mb is not None and not args.unit_mb > 0:
        raise UserError(f"--unit-mb={args.unit_mb} is invalid: expected a positive number of MiB")
    if not 0 <= args.part < args.of:
        raise UserError(f"--part={args.part} is invalid: expected 0 .. {args.of - 1} (--of {args.of} parts)")
    check_settings(args.tokenizer, args.bpe_vocab_size, args.val_fraction, args.test_fraction, args.max_chars)
    source = sources.resolve_source(args.source)
    sources.check_out_outside(args.source, Path(args.out))
    sources.check_source(source, args.text_field)
    if args.tokenizer not in ("byte", "bpe"):
        from diffexp.data.tokenizer import load_named_tokenizer

        load_named_tokenizer(args.tokenizer, "--tokenizer")  # a bad name fails before the corpus is planned
    plan = Plan(source, args.text_field, args.max_chars, args.tokenizer, args.bpe_vocab_size,
                args.bpe_sample_chars or BPE_SAMPLE_CHARS, args.seed, args.val_fraction, args.test_fraction,
                args.shard_tokens or SHARD_TOKENS, str(Path(args.cache_dir).expanduser() / "hf_datasets"),
                None if args.unit_mb is None else max(1, int(args.unit_mb * 2**20)))
    for directory in source.left_out:
        print(f"SOURCE={args.source!r}: left out {directory}: a preparation (its {sources.PREPARATION}), never read "
              "as corpus", file=sys.stderr)
    result = prepare(plan, Path(args.out), args.num_proc, args.part, args.of, progress=not args.no_progress,
                     command=canonical_command(args))
    part = f" (part {args.part} of {args.of})" if args.of > 1 else ""
    rate = max(result.tokenizing_seconds, 1e-9)
    print(f"prepared {result.prepared_units} unit(s){part} in {result.seconds:.1f} s"
          + (f", {result.skipped_units} already finished" if result.skipped_units else "")
          + (f"; the units took {result.tokenizing_seconds:.1f} s: {result.tokens / rate / 1e6:.2f}M tokens/s, "
             f"{result.source_bytes / rate / 2**20:.1f} MiB/s of source" if result.tokens else ""))
    if result.manifest is None:
        print(f"other parts are unfinished; once every part is done: diffexp data join {shlex.quote(args.out)}")
    else:
        print(summary(result.out, result.manifest))
    return 0


def _join(args: argparse.Namespace) -> int:
    from diffexp.data.prepare import SETTINGS, join

    out = Path(args.out)
    if not (out / SETTINGS).is_file():
        raise UserError(f"OUT={args.out!r} is invalid: no preparation there ({SETTINGS} is missing)")
    print(summary(out, join(out)))
    return 0


def summary(directory: Path, manifest: dict) -> str:
    """The manifest's figures: per split documents, tokens, shards and bytes; the tokenizer and the source."""
    tokenizer = manifest["tokenizer"]
    lines = [f"{directory}: {manifest['source']['spec']} | tokenizer {tokenizer['identity']} "
             f"(vocab {tokenizer['vocab_size']:,}, {manifest['dtype']}) | split seed {manifest['split']['seed']}"]
    total = 0
    for name in SPLITS:
        split = manifest["splits"][name]
        size = sum(piece["bytes"] for piece in split["pieces"])
        total += size
        lines.append(f"  {name:<5} {split['documents']:>12,} documents {split['tokens']:>16,} tokens "
                     f"{len(split['pieces']):>6,} shards {size / 2**20:>10.1f} MiB")
    lines.append(f"  on disk: {total / 2**30:.2f} GiB of shards")
    return "\n".join(lines)


def _inspect(args: argparse.Namespace) -> int:
    from diffexp.data.prepared import open_prepared

    prepared = open_prepared(Path(args.directory), key="DIR", checksums=args.verify)
    print(summary(Path(args.directory), prepared.manifest))
    for split in SPLITS:
        texts = prepared.texts(split)
        for number in range(args.samples):
            text = next(texts, None)
            if text is None:
                break
            shown = text[: args.chars] + (" ..." if len(text) > args.chars else "")
            print(f"\n--- {split} document {number} ({len(text):,} characters) ---\n{shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

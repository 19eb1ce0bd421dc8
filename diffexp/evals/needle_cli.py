"""`diffexp eval needle CKPT`: the retrieval grid and the attention-to-answer table on a checkpoint trained
with any tokenizer (its own, else --tokenizer), zero-shot or trained on the task (``diffexp.evals.needle``)."""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Sequence

import torch

from diffexp.data.needle_samples import min_context_len
from diffexp.errors import UserError, guarded
from diffexp.evals import common
from diffexp.evals.needle import DEFAULT_DEPTHS, DEFAULT_NR, evaluate_needles, samples_by_depth
from diffexp.generate.cli import check_vocab, resolve_tokenizer


def _parse_nr(pairs: Sequence[str]) -> list[tuple[int, int]]:
    nr = []
    for pair in pairs:
        try:
            n, r = (int(x) for x in pair.split(","))
        except ValueError:
            raise UserError(f"--nr={pair!r} is invalid: expected N,R pairs such as 4,2") from None
        if not 1 <= r <= n:
            raise UserError(f"--nr={pair!r} is invalid: expected 1 <= R <= N")
        nr.append((n, r))
    return nr


def needle_main(argv: list[str]) -> int:
    """Multi-needle retrieval grid (context length x depth x N,R) and the attention-to-answer table."""
    parser = argparse.ArgumentParser(prog="diffexp eval needle", description=needle_main.__doc__)
    parser.add_argument("checkpoint", metavar=common.CKPT_KEY,
                        help="a .ckpt file, a sharded checkpoint directory or a `diffexp export` directory")
    parser.add_argument("--context-lens", type=int, nargs="+", default=[512],
                        help="context lengths in the model's tokens (default 512)")
    parser.add_argument("--depths", type=float, nargs="+", default=list(DEFAULT_DEPTHS))
    parser.add_argument("--nr", nargs="+", default=[f"{n},{r}" for n, r in DEFAULT_NR], help="N,R pairs")
    parser.add_argument("--samples", type=int, default=50)
    parser.add_argument("--haystack", choices=("corpus", "synthetic"), default="corpus")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", default=None,
                        help="'byte' or a tokenizer.json, for checkpoints saved without their tokenizer")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None, help="directory for needles.csv, heatmaps and attention.md "
                        "(default: <run>/eval/ beside the checkpoint's checkpoints/)")
    args = parser.parse_args(argv)
    # everything is checked before the model is built and before any output exists
    checkpoint, hparams = common.load_checkpoint(args.checkpoint)
    nr = _parse_nr(args.nr)
    common.positive("--samples", args.samples)
    common.positive("--batch-size", args.batch_size)
    common.positive("--context-lens", args.context_lens)
    common.at_most_max_seq_len("--context-lens", args.context_lens, hparams["arch"])
    for context_len, (n, r) in itertools.product(args.context_lens, nr):
        if context_len < min_context_len(n, r):
            raise UserError(f"--context-lens={context_len} is invalid: too short for N={n}, R={r} (--nr); "
                            f"expected >= {min_context_len(n, r)}")
    for depth in args.depths:
        if not 0.0 <= depth <= 1.0:
            raise UserError(f"--depths={depth} is invalid: expected fractions in [0, 1]")
    tokenizer = resolve_tokenizer(checkpoint, hparams, args.tokenizer)
    check_vocab(tokenizer, hparams["arch"])
    common.check_device(args.device)
    common.check_out(args.out)
    from diffexp.evals.attention import attention_by_depth, attention_table

    model = common.load_model(checkpoint, args.checkpoint, args.device)
    print(f"tokenizer: {tokenizer.identity} ({tokenizer.vocab_size} ids); --context-lens count its tokens")
    results = evaluate_needles(model, args.context_lens, args.depths, nr, args.samples, args.haystack, args.seed,
                               args.device, batch_size=args.batch_size, tokenizer=tokenizer)
    print(results.table())
    n, r = nr[-1]
    by_depth = samples_by_depth(args.context_lens[-1], args.depths, n, r, min(args.samples, 16), args.haystack,
                                args.seed, tokenizer)
    table = attention_table(attention_by_depth(model, by_depth, device=args.device), model.arch.attention)
    print(f"\nattention from the query (context {args.context_lens[-1]}, N={n}, R={r}):\n{table}")
    out, writer, step = common.eval_output(args.checkpoint, args.out, hparams["global_step"])
    results.to_csv(out / "needles.csv")
    results.heatmaps(out / "needles")
    (out / "attention.md").write_text(table + "\n")
    (out / "needles.md").write_text(results.table() + "\n")
    if writer is not None:  # into the run's own TensorBoard, at the checkpoint's step
        results.log_to_tensorboard(writer, step)
        writer.close()
    print(f"wrote {out}/needles.csv, needles.md, needles_*.png, attention.md")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m diffexp.evals.needle_cli CKPT ...``: the same as ``diffexp eval needle CKPT ...``."""
    return guarded(needle_main, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    raise SystemExit(main())

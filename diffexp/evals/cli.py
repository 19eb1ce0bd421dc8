"""`diffexp eval <task> CKPT ...`: the papers' evaluations on a trained checkpoint.

Results go to files (default <run>/eval/) and into the run's own TensorBoard at the checkpoint's step.
Tasks: needle (retrieval grid + attention-to-answer table), icl (many-shot in-context classification),
mqar (multi-query associative recall).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch


def eval_output(checkpoint: str, out: str | None):
    """(output dir, SummaryWriter on the run dir or None, the checkpoint's global step)."""
    ckpt = Path(checkpoint)
    if not ckpt.is_file():
        raise SystemExit(f"error: checkpoint {checkpoint!r}: no such file")
    run_dir = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else None
    if out:
        directory = Path(out)
    else:
        directory = run_dir / "eval" if run_dir else ckpt.with_name(ckpt.stem + "-eval")
    directory.mkdir(parents=True, exist_ok=True)
    step = int(torch.load(ckpt, map_location="cpu", weights_only=True).get("global_step", 0))
    writer = None
    if run_dir is not None:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(log_dir=str(run_dir))
    return directory, writer, step


def _load(checkpoint: str, device: str):
    from diffexp.training.module import DiffexpLM

    return DiffexpLM.load_from_checkpoint(checkpoint, map_location=device).eval()


def _icl_training_task(checkpoint: str) -> dict:
    """The ICLDataModule settings saved in a checkpoint ({} when it was trained on other data)."""
    ckpt = torch.load(checkpoint, map_location="cpu", weights_only=True)
    return dict(ckpt.get("datamodule_hyper_parameters") or {})


def icl_main(argv: list[str]) -> int:
    """Many-shot in-context classification: accuracy vs demonstrations, spread over orderings."""
    import argparse

    from diffexp.evals.icl import ICLTask, evaluate_icl

    parser = argparse.ArgumentParser(prog="diffexp eval icl", description=icl_main.__doc__)
    parser.add_argument("checkpoint")
    parser.add_argument("--k-classes", type=int, default=None,
                        help="default: the checkpoint's ICLDataModule setting, else 4 (also for the next three)")
    parser.add_argument("--group-size", type=int, default=None, help="words per class (default 10)")
    parser.add_argument("--words-per-input", type=int, default=None, help="default 3")
    parser.add_argument("--random-label-names", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--n-demos", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--orderings", nargs="+", default=["random", "alternating"])
    parser.add_argument("--n-orderings", type=int, default=5)
    parser.add_argument("--n-tests", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None, help="default: <run>/eval/")
    args = parser.parse_args(argv)
    trained = _icl_training_task(args.checkpoint)  # evaluate the task shape the model was trained on
    shape = {"k_classes": 4, "group_size": 10, "words_per_input": 3, "random_label_names": False}
    for key in shape:
        given = getattr(args, key)
        shape[key] = given if given is not None else trained.get(key, shape[key])
    model = _load(args.checkpoint, args.device)
    source = "the checkpoint's ICLDataModule" if trained else "defaults"
    print(f"ICL task: K={shape['k_classes']}, {shape['group_size']} words per class, {shape['words_per_input']} per "
          f"input, random label names {shape['random_label_names']} (flags, else {source})")
    task = ICLTask(shape.pop("k_classes"), seed=args.seed, **shape)
    results = evaluate_icl(model, task, args.n_demos, args.orderings,
                           args.n_orderings, args.n_tests, device=args.device, seed=args.seed,
                           max_seq_len=model.arch.max_seq_len)
    print(results.summary())
    out, writer, step = eval_output(args.checkpoint, args.out)
    results.save(out)
    if writer is not None:
        results.log_to_tensorboard(writer, step)
        writer.close()
    print(f"wrote {out}/icl.*")
    return 0


def mqar_main(argv: list[str]) -> int:
    """Multi-query associative recall accuracy on held-out MQAR sequences."""
    import argparse
    import json

    from diffexp.data.mqar import MQARDataModule
    from diffexp.evals.mqar import evaluate_mqar

    parser = argparse.ArgumentParser(prog="diffexp eval mqar", description=mqar_main.__doc__)
    parser.add_argument("checkpoint")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--num-kv-pairs", type=int, default=16)
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None, help="default: <run>/eval/")
    args = parser.parse_args(argv)
    model = _load(args.checkpoint, args.device)
    data = MQARDataModule(vocab_size=model.arch.vocab_size, seq_len=args.seq_len, num_kv_pairs=args.num_kv_pairs,
                          val_size=args.samples, seed=args.seed)
    result = evaluate_mqar(model, data, device=args.device)
    print(json.dumps(result))
    out, writer, step = eval_output(args.checkpoint, args.out)
    (out / f"mqar-seq{args.seq_len}-kv{args.num_kv_pairs}.json").write_text(json.dumps(result, indent=2))
    if writer is not None:
        writer.add_scalar(f"mqar/accuracy_seq{args.seq_len}_kv{args.num_kv_pairs}", result["mqar/accuracy"], step)
        writer.close()
    return 0


def _tasks():
    from diffexp.evals import needle

    return {"needle": needle.main, "icl": icl_main, "mqar": mqar_main}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    tasks = _tasks()
    if not argv or argv[0] not in tasks:
        given = repr(argv[0]) if argv else "nothing"
        print(f"usage: diffexp eval {{{','.join(tasks)}}} CKPT [options]\nerror: got {given}; expected one of "
              f"{', '.join(tasks)}", file=sys.stderr)
        return 2
    return tasks[argv[0]](argv[1:])

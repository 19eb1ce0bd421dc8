"""`diffexp eval`: help lists the tasks; a bad checkpoint or flag is one paragraph, exit 2, and changes no file."""

from __future__ import annotations

import os

import pytest

from diffexp.cli import main
from diffexp.errors import UserError
from diffexp.model.config import ModelConfig
from tests.helpers import save_untrained_checkpoint

TASKS = ("needle", "icl", "mqar", "nll")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory with a checkpoint of a byte-level model (max_seq_len 128) and a TensorBoard file."""
    run = tmp_path_factory.mktemp("runs") / "version_0"
    save_untrained_checkpoint(ModelConfig(attention="baseline", vocab_size=257, d_model=32, n_layers=1, n_heads=2,
                                          max_seq_len=128), run / "checkpoints" / "last.ckpt")
    (run / "events.out.tfevents.0").write_bytes(b"")
    return run


def snapshot(directory) -> dict:
    return {(path, stat.st_size, stat.st_mtime_ns) for path in directory.rglob("*")
            for stat in [path.stat()]}


def run_eval(args, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_:
        main(["eval", *args])
    captured = capsys.readouterr()
    return exit_.value.code, captured.out + captured.err


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_eval_help_lists_the_tasks_one_line_each(capsys, flag):
    code, out = run_eval([flag], capsys)
    assert code == 0
    for task in TASKS:
        assert sum(line.strip().startswith(f"{task} ") for line in out.splitlines()) == 1


@pytest.mark.parametrize("task", TASKS)
def test_eval_task_help(capsys, task):
    code, out = run_eval([task, "--help"], capsys)
    assert code == 0 and f"diffexp eval {task}" in out and "CKPT" in out


@pytest.mark.parametrize("args", [[], ["bogus", "x.ckpt"]])
def test_eval_without_a_known_task(capsys, args):
    code, out = run_eval(args, capsys)
    assert code == 2 and "Traceback" not in out
    assert all(name in out for name in ("needle", "icl", "mqar", "nll", "harness"))
    assert (args[0] if args else "no evaluation") in out
    assert "diffexp eval --help" in out  # where the tasks are described


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("kind", ["truncated", "random", "plain", "missing"])
def test_eval_on_a_bad_checkpoint(tmp_path, run_dir, capsys, task, kind):
    import torch

    bad = run_dir / "checkpoints" / f"{kind}.ckpt"
    if kind == "truncated":
        data = (run_dir / "checkpoints" / "last.ckpt").read_bytes()
        bad.write_bytes(data[: len(data) // 2])
    elif kind == "random":
        bad.write_bytes(os.urandom(3000))
    elif kind == "plain":
        torch.save({"a": 1}, bad)
    before = snapshot(run_dir)
    try:
        code, out = run_eval([task, str(bad), "--device", "cpu"], capsys)
        after = snapshot(run_dir)
    finally:
        bad.unlink(missing_ok=True)
    assert code == 2 and "Traceback" not in out and "weights_only" not in out
    assert f"CKPT={str(bad)!r}" in out
    assert after == before


BAD_FLAGS = [
    ("icl", ["--n-demos", "0"], "--n-demos=0"),
    ("icl", ["--n-tests", "-1"], "--n-tests=-1"),
    ("icl", ["--n-demos", "100000"], "--n-demos=100000"),
    ("icl", ["--words-per-input", "20"], "--words-per-input=20"),
    ("mqar", ["--seq-len", "4096"], "--seq-len=4096"),
    ("mqar", ["--seq-len", "64", "--samples", "-5"], "--samples=-5"),
    ("mqar", ["--seq-len", "64", "--num-kv-pairs", "40"], "--num-kv-pairs"),
    ("needle", ["--context-lens", "4096"], "--context-lens=4096"),
    ("needle", ["--context-lens", "128", "--samples", "-1"], "--samples=-1"),
    ("needle", ["--context-lens", "128", "--nr", "2,3"], "--nr='2,3'"),
    ("needle", ["--context-lens", "128", "--nr", "six"], "--nr='six'"),
    ("needle", ["--context-lens", "128", "--nr", "1,1", "--depths", "1.5"], "--depths=1.5"),
    ("mqar", ["--seq-len", "64", "--device", "nonsense"], "--device='nonsense'"),
    ("nll", ["--context-len", "4096"], "--context-len=4096"),
    ("nll", ["--documents", "0"], "--documents=0"),
    ("nll", ["--text-file", "/nonexistent/a.txt"], "--text-file='/nonexistent/a.txt' is invalid"),
    ("nll", [], "not trained on text documents"),
]


@pytest.mark.parametrize(("task", "flags", "named"), BAD_FLAGS)
def test_eval_bad_flags_are_checked_before_anything_is_written(run_dir, capsys, task, flags, named):
    before = snapshot(run_dir)
    code, out = run_eval([task, str(run_dir / "checkpoints" / "last.ckpt"), "--device", "cpu", *flags], capsys)
    assert code == 2 and "Traceback" not in out
    assert named in out, out
    assert snapshot(run_dir) == before and not (run_dir / "eval").exists()


def test_evals_cli_and_needle_do_not_import_each_other():
    import ast
    import inspect

    import diffexp.evals.needle as needle

    imported = {node.module for node in ast.walk(ast.parse(inspect.getsource(needle)))
                if isinstance(node, ast.ImportFrom)}
    assert "diffexp.evals.cli" not in imported


def fit_setup(name: str, options: dict):
    """diffexp.evals.Evaluate(name, options) set up for a fit of a byte model (max_seq_len 32), as a recipe's
    trainer.callbacks makes it: its inputs are made there, before the first step."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import SingleDeviceStrategy

    from diffexp.evals import Evaluate

    arch = ModelConfig(attention="baseline", vocab_size=257, d_model=32, n_layers=1, n_heads=2, max_seq_len=32)
    trainer = SimpleNamespace(strategy=SingleDeviceStrategy("cpu"), datamodule=None, global_step=0)
    Evaluate(name, options).setup(trainer, SimpleNamespace(arch=arch, device="cpu"), "fit")


@pytest.mark.parametrize(("task", "options", "cli", "fit"), [
    ("nll", {"text_file": ["/nonexistent/a.txt"]}, "--text-file='/nonexistent/a.txt' is invalid: no such file",
     "options.text_file='/nonexistent/a.txt' is invalid: no such file"),
    ("quantize", {"text_file": ["/nonexistent/a.txt"]}, "--text-file='/nonexistent/a.txt' is invalid: no such file",
     "options.text_file='/nonexistent/a.txt' is invalid: no such file"),
    ("nll", {"text_file": ["SHORT"], "documents": 2, "context_len": 16},
     "--documents=2 is invalid: only 0 of the 1 documents of the --text-file files have at least 17 tokens "
     "(--context-len + 1", "options.documents=2 is invalid: only 0 of the 1 documents of the options.text_file "
     "files have at least 17 tokens (options.context_len + 1"),
    ("nll", {}, "give documents with --text-file FILE ... or --dataset PATH",
     "give documents with options.text_file FILE ... or options.dataset PATH"),
    ("quantize", {}, "so it has no validation documents; give documents with --text-file FILE ...",
     "so it has no validation documents; give documents with options.text_file FILE ..."),
    ("nll", {"dataset": "/nonexistent/rows.jsonl"}, "--dataset='/nonexistent/rows.jsonl' is invalid: no such file",
     "options.dataset='/nonexistent/rows.jsonl' is invalid: no such file"),
    ("nll", {"dataset": "ROWS", "split": "validation"}, "--split='validation' is invalid: a local file is one table",
     "options.split='validation' is invalid: a local file is one table"),
    ("nll", {"dataset": "ROWS", "text_column": "body"}, "--text-column='body' is invalid: --dataset=",
     "options.text_column='body' is invalid: options.dataset="),
    ("icl", {"dataset": "ROWS", "label_column": "kind"}, "--label-column='kind' is invalid: --dataset=",
     "options.label_column='kind' is invalid: options.dataset="),
])
def test_document_and_table_errors_name_the_option_as_written_on_the_command_line_and_in_a_fit(
        run_dir, tmp_path, capsys, task, options, cli, fit):
    """One check of the documents (files, or a table's rows), worded by where it runs: `diffexp eval`'s flag, or
    the key under the fit callback's options (and that callback)."""
    short, rows = tmp_path / "short.txt", tmp_path / "rows.jsonl"
    short.write_text("too short")
    rows.write_text("".join(f'{{"text": "row {i}", "label": "{i % 2}"}}\n' for i in range(8)))
    given = {"SHORT": str(short), "ROWS": str(rows)}
    options = {key: [given.get(v, v) for v in value] if isinstance(value, list) else given.get(value, value)
               for key, value in options.items()}
    flags = [word for key, value in options.items()
             for word in ("--" + key.replace("_", "-"), *(value if isinstance(value, list) else [str(value)]))]
    code, out = run_eval([task, str(run_dir / "checkpoints" / "last.ckpt"), "--device", "cpu", *flags], capsys)
    assert code == 2 and cli in out, out
    with pytest.raises(UserError) as refused:
        fit_setup(task, options)
    message = str(refused.value)
    assert message.startswith(f"diffexp.evals.Evaluate(evaluation={task!r}): ") and fit in message, message
    assert "--" not in message, message
    if task == "quantize":  # it reads no table: the way out offers none
        assert "dataset" not in out and "dataset" not in message, (out, message)

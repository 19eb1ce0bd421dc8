"""Bad input, fed to the CLI as a user would (in-process, through `diffexp.cli.main`): each case exits nonzero
before any training step or data preparation, prints a message naming the culprit (the key as the user writes
it, the file, the value) without a traceback, and leaves every file of an existing run byte-identical.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from diffexp.cli import main
from diffexp.data import TextDataModule
from diffexp.training import DiffexpLM
from tests.helpers import REPO, write_recipe


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A directory holding a tiny recipe and one finished run of it (dint), shared by every case."""
    root = tmp_path_factory.mktemp("bad-input")
    cwd = Path.cwd()
    import os

    os.chdir(root)
    try:
        recipe = write_recipe(root, attention="dint", max_steps=6)
        main(["fit", "--config", str(recipe)])
    finally:
        os.chdir(cwd)
    run = root / "runs/run/version_0"
    assert (run / "checkpoints/last.ckpt").is_file()
    good = run / "checkpoints/last.ckpt"
    files = {
        "truncated.ckpt": good.read_bytes()[: good.stat().st_size // 2],
        "random.ckpt": bytes(range(256)) * 64,
        "empty.ckpt": b"",
    }
    for name, data in files.items():
        (root / name).write_bytes(data)
    torch.save({"a": torch.ones(2)}, root / "plain.ckpt")
    torch.save({"state_dict": {"w": torch.ones(2)}}, root / "weights-only.ckpt")
    (root / "notyaml.yaml").write_text("model: [unclosed\n")
    (root / "list.yaml").write_text("- 1\n- 2\n")
    (root / "afile").write_text("x")
    (root / "unread.yaml").write_text("model:\n  arch:\n    gate: headwise\n")
    (root / "data-typo.yaml").write_text("data:\n  init_args:\n    batch_sise: 3\n")
    (root / "data-unknown.yaml").write_text("data:\n  bogus: 3\n")
    (root / "trainer-typo.yaml").write_text("trainer:\n  max_stepz: 10\n")
    return root


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((root / "runs").rglob("*")) if p.is_file()}


@pytest.fixture
def no_work(monkeypatch):
    def trap(*args, **kwargs):
        raise AssertionError("work started on bad input")

    monkeypatch.setattr(DiffexpLM, "training_step", trap)
    monkeypatch.setattr(TextDataModule, "prepare_data", trap)
    monkeypatch.setattr(TextDataModule, "setup", trap)


RECIPE = "{root}/run.yaml"
LAST = "{root}/runs/run/version_0/checkpoints/last.ckpt"

# (id, argv after `diffexp`, fragments the message must contain)
CASES = [
    # model.arch
    ("attention", ["fit", "--config", RECIPE, "--model.arch.attention", "diff_v9"],
     ["model.arch.attention", "diff_v9", "baseline"]),
    ("rank-zero", ["fit", "--config", RECIPE, "--model.arch.rank", "0"], ["model.arch.rank", "0"]),
    ("rank-negative", ["fit", "--config", RECIPE, "--model.arch.rank", "-3"], ["model.arch.rank", "-3"]),
    ("rank-text", ["fit", "--config", RECIPE, "--model.arch.rank", "abc"], ["model.arch.rank", "abc"]),
    ("lambda-high", ["fit", "--config", RECIPE, "--model.arch.lambda_init", "1.5"],
     ["model.arch.lambda_init", "1.5", "(0, 1)"]),
    ("lambda-zero", ["fit", "--config", RECIPE, "--model.arch.lambda_init", "0"], ["model.arch.lambda_init", "0"]),
    ("lambda-word", ["fit", "--config", RECIPE, "--model.arch.lambda_init", "linear"],
     ["model.arch.lambda_init", "linear"]),
    ("heads-divide", ["fit", "--config", RECIPE, "--model.arch.n_heads", "3"], ["model.arch.n_heads", "3"]),
    ("kv-heads", ["fit", "--config", RECIPE, "--model.arch.n_kv_heads", "3", "--model.arch.n_heads", "4"],
     ["model.arch.n_kv_heads", "3"]),
    ("kv-heads-zero", ["fit", "--config", RECIPE, "--model.arch.n_kv_heads", "0"], ["model.arch.n_kv_heads", "0"]),
    ("cross-pairing", ["fit", "--config", RECIPE, "--model.arch.attention", "diff_v2", "--model.arch.n_kv_heads",
                       "1", "--model.arch.pairing", "cross"], ["model.arch.pairing", "cross"]),
    ("pairing-word", ["fit", "--config", RECIPE, "--model.arch.pairing", "diagonal"],
     ["model.arch.pairing", "diagonal"]),
    ("lambda-mode", ["fit", "--config", RECIPE, "--model.arch.lambda_mode", "tanh"],
     ["model.arch.lambda_mode", "tanh"]),
    ("lambda-proj-init", ["fit", "--config", RECIPE, "--model.arch.lambda_proj_init", "kaiming"],
     ["model.arch.lambda_proj_init", "kaiming"]),
    ("pair-norm", ["fit", "--config", RECIPE, "--model.arch.pair_norm", "sometimes"],
     ["model.arch.pair_norm", "sometimes"]),
    ("integral", ["fit", "--config", RECIPE, "--model.arch.integral", "max"], ["model.arch.integral", "max"]),
    ("sink", ["fit", "--config", RECIPE, "--model.arch.attention", "softmax_sink", "--model.arch.sink", "one"],
     ["model.arch.sink", "one", "zero", "learned"]),
    ("gate", ["fit", "--config", RECIPE, "--model.arch.attention", "gated", "--model.arch.gate", "channel"],
     ["model.arch.gate", "channel", "elementwise", "headwise"]),
    ("ssmax-init", ["fit", "--config", RECIPE, "--model.arch.attention", "ssmax", "--model.arch.ssmax_init", "0"],
     ["model.arch.ssmax_init", "0", "'length'", "a positive number"]),
    ("backend", ["fit", "--config", RECIPE, "--model.arch.backend", "triton2"], ["model.arch.backend", "triton2"]),
    ("sink-null", ["fit", "--config", RECIPE, "--model.arch.attention", "softmax_sink", "--model.arch.sink", "null"],
     ["model.arch.sink: null is not allowed", "zero or learned"]),
    # a flag the chosen variant does not read: the flag as given, the variant, the flags it reads, who reads it
    ("unread-sink", ["fit", "--config", RECIPE, "--model.arch.attention", "baseline", "--model.arch.sink", "learned"],
     ["model.arch.attention='baseline' does not read --model.arch.sink learned (read by softmax_sink)",
      "baseline reads no model.arch flag beyond the shared ones"]),
    ("unread-gate", ["fit", "--config", RECIPE, "--model.arch.attention", "softmax_sink",
                     "--model.arch.gate=headwise"],
     ["'softmax_sink' does not read --model.arch.gate headwise (read by gated)",
      "softmax_sink reads model.arch.sink beyond the shared flags"]),
    ("unread-lambda", ["fit", "--config", RECIPE, "--model.arch.attention", "baseline", "--model.arch.lambda_init",
                       "0.5"], ["does not read --model.arch.lambda_init 0.5 (read by diff_v1, dint, shared_diff)"]),
    ("unread-at-default", ["fit", "--config", RECIPE, "--model.arch.sink", "zero", "--model.arch.rank", "8"],
     ["'dint' does not read --model.arch.rank 8 (read by shared_diff); --model.arch.sink zero (read by "
      "softmax_sink): the run would train without them", "dint reads model.arch.lambda_init"]),
    ("unread-in-recipe", ["fit", "--config", RECIPE, "--config", "{root}/unread.yaml"],
     ["'dint' does not read model.arch.gate: headwise in {root}/unread.yaml (read by gated)"]),
    # launches: the global batch, FSDP2's precision, the strategy, the world size of a resume
    ("global-batch-divide", ["fit", "--config", RECIPE, "--trainer.accelerator", "cpu", "--trainer.devices", "3",
                             "--global_batch.rows", "8"], ["global_batch.rows=8", "3 process(es)", "12 rows"]),
    ("global-batch-accumulate", ["fit", "--config", RECIPE, "--global_batch.rows", "8",
                                 "--trainer.accumulate_grad_batches", "2"],
     ["global_batch.rows=8", "trainer.accumulate_grad_batches=2", "one of them"]),
    ("global-batch-zero", ["fit", "--config", RECIPE, "--global_batch.rows", "0"], ["global_batch.rows", "0"]),
    ("fsdp2-precision", ["fit", "--config", RECIPE, "--trainer.strategy", "diffexp.parallel.FSDP2Strategy",
                         "--trainer.precision", "bf16-mixed"], ["trainer.precision='bf16-mixed'", "32-true"]),
    ("model-parallel", ["fit", "--config", RECIPE, "--trainer.strategy",
                        "lightning.pytorch.strategies.ModelParallelStrategy"], ["trainer.strategy", "FSDP2Strategy"]),
    ("resume-world-size", ["fit", "--config", RECIPE, "--trainer.accelerator", "cpu", "--trainer.devices", "2",
                           "--ckpt_path", LAST], ["world size", "checkpoint 4 rows, this config 8 (4 x 2 x 1)",
                                                  "--global_batch.rows 4"]),
    ("base-sharing", ["fit", "--config", RECIPE, "--model.arch.base_sharing", "all"],
     ["model.arch.base_sharing", "all"]),
    ("lowrank-scope", ["fit", "--config", RECIPE, "--model.arch.attention", "shared_diff",
                       "--model.arch.lowrank_scope", "block"], ["model.arch.lowrank_scope", "block"]),
    ("odd-head-dim", ["fit", "--config", RECIPE, "--model.arch.head_dim", "7"], ["model.arch.head_dim", "7"]),
    ("d-model-zero", ["fit", "--config", RECIPE, "--model.arch.d_model", "0"], ["model.arch.d_model", "0"]),
    ("layers-zero", ["fit", "--config", RECIPE, "--model.arch.n_layers", "0"], ["model.arch.n_layers", "0"]),
    ("init-std", ["fit", "--config", RECIPE, "--model.arch.init_std", "0"], ["model.arch.init_std", "0"]),
    ("norm-eps", ["fit", "--config", RECIPE, "--model.arch.norm_eps", "-1e-5"], ["model.arch.norm_eps"]),
    # more memory than any host has: the states (d_model), the activations (batch_size)
    ("memory-states", ["fit", "--config", RECIPE, "--model.arch.d_model", "65536", "--model.arch.n_layers", "8"],
     ["model.arch", "d_model=65536", "GiB", "free", "killed out of memory"]),
    ("memory-activations", ["fit", "--config", RECIPE, "--data.batch_size", "100000000"],
     ["data.batch_size=100000000", "activations", "free"]),
    ("rope-theta", ["fit", "--config", RECIPE, "--model.arch.rope_theta", "0"], ["model.arch.rope_theta", "0"]),
    ("ffn-hidden", ["fit", "--config", RECIPE, "--model.arch.ffn_hidden", "-64"], ["model.arch.ffn_hidden", "-64"]),
    ("unknown-arch-key", ["fit", "--config", RECIPE, "--model.arch.nope", "1"], ["model.arch.nope"]),
    # model.optim and model.ar_hit
    ("lr-negative", ["fit", "--config", RECIPE, "--model.optim.lr", "-1"], ["model.optim.lr", "-1"]),
    ("lr-zero", ["fit", "--config", RECIPE, "--model.optim.lr", "0"], ["model.optim.lr", "0"]),
    ("warmup", ["fit", "--config", RECIPE, "--model.optim.warmup_steps", "-5"], ["model.optim.warmup_steps", "-5"]),
    ("min-lr", ["fit", "--config", RECIPE, "--model.optim.min_lr_ratio", "2"], ["model.optim.min_lr_ratio", "2"]),
    ("betas", ["fit", "--config", RECIPE, "--model.optim.betas", "[0.9, 1.5]"], ["model.optim.betas", "1.5"]),
    ("weight-decay", ["fit", "--config", RECIPE, "--model.optim.weight_decay", "-0.1"],
     ["model.optim.weight_decay", "-0.1"]),
    ("eps", ["fit", "--config", RECIPE, "--model.optim.eps", "0"], ["model.optim.eps", "0"]),
    ("schedule-steps", ["fit", "--config", RECIPE, "--model.optim.schedule_steps", "0"],
     ["model.optim.schedule_steps", "0"]),
    ("ar-hit-both", ["fit", "--config", RECIPE, "--model.ar_hit.min_count", "2", "--model.ar_hit.top_percent", "5"],
     ["model.ar_hit.min_count", "model.ar_hit.top_percent"]),
    ("ar-hit-count", ["fit", "--config", RECIPE, "--model.ar_hit.min_count", "0"], ["model.ar_hit.min_count", "0"]),
    ("ar-hit-threshold-unused", ["fit", "--config", RECIPE, "--model.ar_hit.exclude_frequent", "false",
                                 "--model.ar_hit.top_percent", "5"],
     ["model.ar_hit.exclude_frequent", "model.ar_hit.top_percent=5"]),
    ("unknown-model-key", ["fit", "--config", RECIPE, "--model.rank", "4"], ["model.rank"]),
    # trainer and checkpoint
    ("max-steps-zero", ["fit", "--config", RECIPE, "--trainer.max_steps", "0"], ["trainer.max_steps", "0"]),
    ("max-steps-negative", ["fit", "--config", RECIPE, "--trainer.max_steps", "-5"], ["trainer.max_steps", "-5"]),
    ("clip-negative", ["fit", "--config", RECIPE, "--trainer.gradient_clip_val", "-1"],
     ["trainer.gradient_clip_val", "-1"]),
    ("accumulate", ["fit", "--config", RECIPE, "--trainer.accumulate_grad_batches", "0"],
     ["trainer.accumulate_grad_batches", "0"]),
    ("log-every", ["fit", "--config", RECIPE, "--trainer.log_every_n_steps", "0"], ["trainer.log_every_n_steps"]),
    ("val-interval", ["fit", "--config", RECIPE, "--trainer.val_check_interval", "0"],
     ["trainer.val_check_interval"]),
    ("limit-val", ["fit", "--config", RECIPE, "--trainer.limit_val_batches", "-1"], ["trainer.limit_val_batches"]),
    ("root-dir-unwritable", ["fit", "--config", RECIPE, "--trainer.default_root_dir", "/proc/diffexp-runs"],
     ["trainer.default_root_dir", "/proc/diffexp-runs"]),
    ("root-dir-is-file", ["fit", "--config", RECIPE, "--trainer.default_root_dir", "{root}/afile/runs"],
     ["trainer.default_root_dir", "afile"]),
    ("logger-dir-unwritable", ["fit", "--config", RECIPE, "--trainer.logger.init_args.save_dir", "/proc/diffexp"],
     ["save_dir", "/proc/diffexp"]),
    ("checkpoint-dir", ["fit", "--config", RECIPE, "--checkpoint.dirpath", "/proc/diffexp-ckpt"],
     ["checkpoint.dirpath", "/proc/diffexp-ckpt"]),
    ("unknown-trainer-key", ["fit", "--config", RECIPE, "--trainer.max_stepz", "5"], ["trainer.max_stepz"]),
    ("unknown-top-key", ["fit", "--config", RECIPE, "--optimizer", "adam"], ["optimizer"]),
    # data (values; files are in test_data's own cases)
    ("seq-len-over-max", ["fit", "--config", RECIPE, "--data.seq_len", "4096", "--model.arch.max_seq_len", "128"],
     ["data.seq_len", "4096", "model.arch.max_seq_len"]),
    ("seq-len-zero", ["fit", "--config", RECIPE, "--data.seq_len", "0"], ["data.seq_len", "0"]),
    ("batch-size", ["fit", "--config", RECIPE, "--data.batch_size", "0"], ["data.batch_size", "0"]),
    ("val-fraction", ["fit", "--config", RECIPE, "--data.val_fraction", "1.5"], ["data.val_fraction", "1.5"]),
    ("missing-source", ["fit", "--config", RECIPE, "--data.source", "/nonexistent/corpus.txt"],
     ["data.source", "/nonexistent/corpus.txt"]),
    ("tokenizer", ["fit", "--config", RECIPE, "--data.tokenizer", "wordpiece"], ["data.tokenizer", "wordpiece"]),
    ("bpe-vocab", ["fit", "--config", RECIPE, "--data.tokenizer", "bpe", "--data.bpe_vocab_size", "100"],
     ["data.bpe_vocab_size", "100"]),
    ("mqar-kv-pairs", ["fit", "--config", "{repo}/recipes/mqar/diff_v1.yaml", "--data.num_kv_pairs", "0"],
     ["data.num_kv_pairs", "0"]),
    ("needle-depth", ["fit", "--config", "{repo}/recipes/needle/baseline.yaml", "--data.depth", "1.5"],
     ["data.depth", "1.5"]),
    ("icl-classes", ["fit", "--config", "{repo}/recipes/icl/baseline.yaml", "--data.k_classes", "1"],
     ["data.k_classes", "1"]),
    ("data-class", ["fit", "--config", RECIPE, "--data", "diffexp.data.NoSuchDataModule"],
     ["NoSuchDataModule"]),
    # a data module's keys: named as data.<key>, with the nearest key and the keys of the configured class
    ("unknown-data-key", ["fit", "--config", RECIPE, "--data.bogus", "3"],
     ["unknown key(s) data.bogus; data holds the arguments of diffexp.data.TextDataModule: source, ", "seq_len"]),
    ("misspelt-data-key", ["fit", "--config", RECIPE, "--data.batch_sise", "3"],
     ["unknown key(s) data.batch_sise; data.batch_sise: did you mean data.batch_size?"]),
    ("misspelt-needle-key", ["fit", "--config", "{repo}/recipes/needle/baseline.yaml", "--data.dept", "0.5"],
     ["unknown key(s) data.dept; data.dept: did you mean data.depth?",
      "data holds the arguments of diffexp.data.needle.NeedleDataModule: context_len"]),
    ("misspelt-mqar-key", ["fit", "--config", "{repo}/recipes/mqar/diff_v1.yaml", "--data.num_kv_pair", "4"],
     ["data.num_kv_pair: did you mean data.num_kv_pairs?", "diffexp.data.mqar.MQARDataModule"]),
    ("misspelt-data-key-in-file", ["fit", "--config", RECIPE, "--config", "{root}/data-typo.yaml"],
     ["--config {root}/data-typo.yaml: unknown key(s) data.batch_sise; data.batch_sise: did you mean "
      "data.batch_size?", "diffexp.data.TextDataModule"]),
    ("unknown-data-key-in-file", ["fit", "--config", RECIPE, "--config", "{root}/data-unknown.yaml"],
     ["--config {root}/data-unknown.yaml: unknown key(s) data.bogus;"]),
    ("data-value-text", ["fit", "--config", RECIPE, "--data.batch_size", "abc"],
     ["data.batch_size: 'abc' is not allowed; allowed: an integer or auto"]),
    ("misspelt-trainer-key-in-file", ["fit", "--config", RECIPE, "--config", "{root}/trainer-typo.yaml"],
     ["--config {root}/trainer-typo.yaml: unknown key(s) trainer.max_stepz; trainer.max_stepz: did you mean "
      "trainer.max_steps?", "`diffexp fit --help`"]),
    # callbacks diffexp always adds
    ("diagnostics", ["fit", "--config", RECIPE, "--diagnostics.every_n_steps", "-1"],
     ["diagnostics", "every_n_steps=-1"]),
    ("throughput", ["fit", "--config", RECIPE, "--throughput.peak_tflops", "-1"], ["throughput.peak_tflops", "-1"]),
    # config files
    ("missing-config", ["fit", "--config", "{root}/nope.yaml"], ["nope.yaml"]),
    ("broken-yaml", ["fit", "--config", "{root}/notyaml.yaml"], ["notyaml.yaml"]),
    ("yaml-not-mapping", ["fit", "--config", "{root}/list.yaml"], ["list.yaml"]),
    # checkpoints and resume
    ("ckpt-missing", ["fit", "--config", RECIPE, "--ckpt_path", "{root}/gone.ckpt"], ["--ckpt_path", "gone.ckpt"]),
    ("ckpt-truncated", ["fit", "--config", RECIPE, "--ckpt_path", "{root}/truncated.ckpt"],
     ["truncated.ckpt", "truncated"]),
    ("ckpt-random", ["fit", "--config", RECIPE, "--ckpt_path", "{root}/random.ckpt"], ["random.ckpt"]),
    ("ckpt-empty", ["fit", "--config", RECIPE, "--ckpt_path", "{root}/empty.ckpt"], ["empty.ckpt"]),
    ("ckpt-not-diffexp", ["fit", "--config", RECIPE, "--ckpt_path", "{root}/plain.ckpt"],
     ["plain.ckpt", "not a diffexp checkpoint"]),
    ("ckpt-weights-only", ["fit", "--config", RECIPE, "--ckpt_path", "{root}/weights-only.ckpt"],
     ["weights-only.ckpt", "not a diffexp checkpoint"]),
    ("ckpt-directory", ["fit", "--config", RECIPE, "--ckpt_path", "{root}/runs"], ["--ckpt_path", "runs"]),
    ("ckpt-other-variant", ["fit", "--config", RECIPE, "--model.arch.attention", "baseline", "--ckpt_path", LAST],
     ["model.arch.attention", "'dint'", "'baseline'", "config.yaml"]),
    ("ckpt-other-width", ["fit", "--config", RECIPE, "--model.arch.d_model", "64", "--ckpt_path", LAST],
     ["model.arch.d_model", "32", "64"]),
    ("resume-max-steps", ["fit", "--config", RECIPE, "--trainer.max_steps", "20", "--ckpt_path", LAST],
     ["schedule", "--model.optim.schedule_steps 6"]),
    ("resume-data", ["fit", "--config", RECIPE, "--data.seq_len", "16", "--ckpt_path", LAST],
     ["data.seq_len", "32", "16"]),
    ("resume-accumulate", ["fit", "--config", RECIPE, "--trainer.accumulate_grad_batches", "2", "--ckpt_path",
                           LAST], ["trainer.accumulate_grad_batches", "1", "2"]),
    ("resume-other-data", ["fit", "--config", RECIPE, "--data.source", "{root}/run.yaml", "--ckpt_path", LAST],
     ["data.source", "stdlib"]),
    ("validate-other-variant", ["validate", "--config", RECIPE, "--model.arch.attention", "diff_v1",
                                "--ckpt_path", LAST], ["model.arch.attention", "'dint'", "'diff_v1'"]),
    ("validate-other-tokenizer", ["validate", "--config", RECIPE, "--data.tokenizer", "bpe", "--ckpt_path", LAST],
     ["data.tokenizer", "'byte'", "'bpe'"]),
    ("test-missing-ckpt", ["test", "--config", RECIPE, "--ckpt_path", "{root}/gone.ckpt"], ["gone.ckpt"]),
    # the command line itself
    ("unknown-subcommand", ["predict", "--config", RECIPE], ["predict", "fit"]),
    ("no-subcommand", [], ["subcommand"]),
]


@pytest.mark.parametrize("argv, fragments", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_fails_early_and_clearly(workspace, no_work, monkeypatch, capsys, argv, fragments):
    monkeypatch.chdir(workspace)
    before = snapshot(workspace)
    argv = [a.format(root=workspace, repo=REPO) for a in argv]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code not in (0, None)
    out = capsys.readouterr()
    text = out.err + out.out
    assert "Traceback" not in text
    message = text[text.find("error:"):]
    assert message.startswith("error:"), text[-2000:]
    for fragment in fragments:
        assert fragment.format(root=workspace) in message, f"{fragment!r} not in {message!r}"
    assert "weights_only=False" not in message and "NestedArg" not in message
    assert "typing." not in message and "<class" not in message, message  # values a user writes, not Python types
    assert snapshot(workspace) == before


def test_a_refused_fit_prints_only_its_error(tmp_path):
    """A refusal found after Lightning seeds (a model value) is the command's whole output, as a user sees it in a
    fresh process: no "Seed set to N" above the error, and no file written."""
    from tests.helpers import run_cli

    recipe = write_recipe(tmp_path, attention="diff_v1")
    before = sorted(tmp_path.rglob("*"))
    done = run_cli(["fit", "--config", str(recipe), "--model.arch.n_layers", "0"], cwd=tmp_path, check=False)
    assert done.returncode == 2
    assert done.stderr.splitlines() == ["error: model.arch.n_layers=0 is invalid: expected a positive integer",
                                        "(DIFFEXP_DEBUG=1 shows the traceback)"], done.stderr
    assert done.stdout == "" and sorted(tmp_path.rglob("*")) == before


@pytest.mark.parametrize("argv, unknown, nearest", [
    (["fit", "--trainer.max_step", "10"], "trainer.max_step", "trainer.max_steps"),
    (["fit", "--model.arch.d_mdel", "64"], "model.arch.d_mdel", "model.arch.d_model"),
])
def test_a_shortened_or_misspelt_key_is_unknown_and_the_nearest_key_is_named(argv, unknown, nearest, tmp_path,
                                                                              monkeypatch, capsys):
    """argparse would take --trainer.max_step as max_steps (prefix matching): it is an unknown key, refused before
    any file is written, with the key it is nearest to."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"unknown key(s) {unknown}" in err and f"did you mean {nearest}?" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv", [
    ["bench", "train", "--seq-len", "64"],
    ["data", "prepare", "stdlib", "out", "--tok", "byte"],
    ["generate", "x.ckpt", "--max-new", "3"],
    ["compare", "runs", "--ref", "a"],
])
def test_no_command_takes_a_shortened_flag(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments" in err and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, key, value", [
    (["fit", "--model.optim.lr", "-1e-3"], "--model.optim.lr", "-1e-3"),
    (["fit", "--model.arch.init_std", "-2e-2"], "--model.arch.init_std", "-2e-2"),
])
def test_a_value_that_starts_with_a_dash_is_named_with_the_key_value_form(argv, key, value, tmp_path, monkeypatch,
                                                                          capsys):
    """`--model.optim.lr -1e-3` reads -1e-3 as an option ("expected one argument"; argparse takes -5 or -0.5 as
    values, not a number with an exponent): the message names the form that passes it, --model.optim.lr=-1e-3,
    before any file is written."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"argument {key}: expected one argument" in err and f"write it as {key}={value}" in err
    assert "Traceback" not in err and list(tmp_path.iterdir()) == []


def test_a_flag_the_variant_does_not_read_is_refused_only_when_given(workspace, monkeypatch):
    """A run's saved config.yaml names every model.arch flag, each other variant's at its default: it is no
    refusal (`fit --config config.yaml --ckpt_path last` resumes); the same flag on the command line, or set away
    from its default in a file, is."""
    import yaml

    from diffexp.errors import UserError
    from diffexp.training.cli import parse_config
    from diffexp.training.preflight import validate_fit_config

    monkeypatch.chdir(workspace)
    saved = workspace / "runs/run/version_0/config.yaml"
    arch = yaml.safe_load(saved.read_text())["model"]["arch"]
    assert arch["attention"] == "dint" and arch["sink"] == "zero" and arch["rank"] is not None  # every flag
    words = ["--config", str(saved)]
    assert validate_fit_config(parse_config(words), "fit", words).attention == "dint"
    for given in (["--model.arch.sink", "zero"], ["--model.arch.sink=learned"]):
        with pytest.raises(UserError, match="does not read --model.arch.sink"):
            validate_fit_config(parse_config(words + given), "fit", words + given)


def test_a_checkpoint_pins_only_the_flags_its_variant_reads():
    """A checkpoint of a run that set another variant's flag (before such a flag was refused) is resumed without
    it: the flag meant nothing to that run, so it is not compared."""
    from diffexp.training.preflight import saved_run_values

    checkpoint = {"hyper_parameters": {"arch": {"attention": "baseline", "d_model": 32, "lambda_init": 0.5,
                                                "sink": "learned"}}}
    values = saved_run_values(checkpoint, model_only=True)
    assert values["model.arch.attention"] == "baseline" and values["model.arch.d_model"] == 32
    assert "model.arch.lambda_init" not in values and "model.arch.sink" not in values

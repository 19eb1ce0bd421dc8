"""The subcommands that train nothing start without Lightning (issue 69): importing it alone takes seconds, more
than torch, and a researcher runs `variants`, `params`, `compare` and `generate` dozens of times a day.

One fresh interpreter runs every light invocation in turn through `diffexp.cli.main`, as the `diffexp` script
does, and records after each which Lightning modules sys.modules holds: an invocation that imports Lightning is
named, the first one after which it appears. Each must also succeed (exit 0), so that an early error cannot pass
for a light start. No time is asserted (bench/startup.py measures the times); the import set is.
"""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from diffexp.errors import UserError
from tests.fixtures_compare import make_study
from tests.helpers import REPO, markdown_tables, one_thread_env, tiny_decoder, write_checkpoint

#: what must stay out of sys.modules (the package and the standalone distribution of its trainer)
HEAVY = ("lightning", "pytorch_lightning")

RUN_IN_TURN = r"""
import contextlib, io, json, sys

from diffexp.cli import main

heavy, invocations = tuple(json.loads(sys.argv[1])), json.loads(sys.argv[2])
seen = []
for argv in invocations:
    code = 0
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            main(argv)
        except SystemExit as exit:
            code = exit.code or 0
    loaded = sorted(m for m in sys.modules if any(m == h or m.startswith(h + ".") for h in heavy))
    seen.append({"argv": argv, "code": code, "heavy": loaded})
    if loaded:
        break
print(json.dumps(seen))
"""


def run_in_turn(invocations: list[list[str]], heavy: tuple[str, ...] = HEAVY) -> list[dict]:
    done = subprocess.run([sys.executable, "-c", RUN_IN_TURN, json.dumps(heavy), json.dumps(invocations)],
                          cwd=REPO, env=one_thread_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_the_light_subcommands_never_import_lightning(tmp_path):
    checkpoint = write_checkpoint(tiny_decoder("diff_v1"), tmp_path / "tiny.ckpt")
    study = make_study(tmp_path / "runs")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"document {i}: the differential heads cancel common-mode noise.\n\n"
                              for i in range(200)))
    prepared = tmp_path / "prepared"
    helps = [["--help"], *([name, "--help"] for name in ("data", "sweep", "compare", "eval", "generate", "export",
                                                          "params", "bench")),
             ["data", "inspect", "--help"], ["eval", "mqar", "--help"], ["eval", "nll", "--help"]]
    # params reads recipes without fit's parser (diffexp.training.recipe): a single file, a synthetic task's, and
    # a GPU variant at every size with the memory per rank
    runs = [["variants"],
            ["params", str(REPO / "recipes/tiny/diff_v1.yaml"), str(REPO / "recipes/needle/dint.yaml")],
            ["params", str(REPO / "recipes/gpu/variant/diff_v1.yaml"), "--memory", "8"],
            ["compare", str(study), "--out", str(tmp_path / "compared"), "--no-plots"],
            ["data", "prepare", str(corpus), str(prepared), "--num-proc", "1", "--no-progress"],
            ["data", "inspect", str(prepared), "--samples", "1"],
            ["generate", str(checkpoint), "--prompt", "the", "--max-new-tokens", "4", "--device", "cpu"],
            ["export", str(checkpoint), str(tmp_path / "exported")]]
    seen = run_in_turn(helps + runs)
    last = seen[-1]
    assert not last["heavy"], f"`diffexp {' '.join(last['argv'])}` imported {', '.join(last['heavy'][:5])}"
    assert [s["argv"] for s in seen] == helps + runs
    failed = [(" ".join(s["argv"]), s["code"]) for s in seen if s["code"] != 0]
    assert not failed, f"these did not succeed, so their imports prove nothing: {failed}"
    # each real invocation did its work
    assert (tmp_path / "compared").is_dir() and any((tmp_path / "compared").iterdir())
    assert (prepared / "manifest.json").is_file()
    assert (tmp_path / "exported" / "model.safetensors").is_file()


def test_generate_builds_the_model_eval_builds(tmp_path):
    """load_decoder (generate, without Lightning) is load_model(...).model (eval, through DiffexpLM): the same
    config, every weight, the same logits; DINT's gamma goes through its own state-dict load in both."""
    from diffexp.training.loading import load_checkpoint, load_decoder, load_model

    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    for case in ("diff_v1", "dint"):
        path = str(write_checkpoint(tiny_decoder(case), tmp_path / f"{case}.ckpt"))
        checkpoint, _ = load_checkpoint(path)
        light, full = load_decoder(checkpoint, path, "cpu"), load_model(checkpoint, path, "cpu").model
        assert light.cfg == full.cfg and not light.training
        assert light.state_dict().keys() == full.state_dict().keys()
        for name, value in full.state_dict().items():
            assert torch.equal(light.state_dict()[name], value), name
        with torch.no_grad():
            assert torch.equal(light(ids), full(ids)), case


def test_generate_refuses_what_eval_refuses(tmp_path):
    """Weights that do not fit their hyper_parameters, or hyper_parameters no ModelConfig accepts: one UserError
    naming CKPT from either loader."""
    from diffexp.training.loading import load_checkpoint, load_decoder, load_model

    path = str(write_checkpoint(tiny_decoder("diff_v1"), tmp_path / "tiny.ckpt"))
    checkpoint, _ = load_checkpoint(path)
    wider = {**checkpoint, "hyper_parameters": {**checkpoint["hyper_parameters"], "vocab_size": 300}}
    unknown = {**checkpoint, "hyper_parameters": {"arch": {**checkpoint["hyper_parameters"]["arch"], "colour": 1}}}
    for bad, message in ((wider, "its weights do not fit"), (unknown, "do not describe a model")):
        for load in (load_decoder, load_model):
            try:
                load(bad, path, "cpu")
            except UserError as err:
                assert str(err).startswith(f"CKPT={path!r}: ") and message in str(err), (load.__name__, err)
            else:
                raise AssertionError(f"{load.__name__} built a model from {message!r} hyper_parameters")



def test_the_startup_bench_times_and_tables_its_commands(tmp_path):
    """bench/startup.py (bench/README.md): its flags add the real runs they name, its measurement times fresh
    interpreters and reads their imports, its table gives each command's median, ratio and imports. Run here on
    three cheap commands, one round each."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("startup_bench", REPO / "bench" / "startup.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    checkpoint = write_checkpoint(tiny_decoder("diff_v1"), tmp_path / "tiny.ckpt")
    args = bench.build_parser().parse_args(["--rounds", "5", "--checkpoint", str(checkpoint), "--runs", "RUNS",
                                            "--prepared", "PREPARED"])
    rows = dict(bench.commands(args))
    assert next(iter(rows)) == 'python -c "import torch"'
    assert rows["diffexp compare RUNS --no-plots"][:4] == ["-m", "diffexp", "compare", "RUNS"]
    assert rows["diffexp data inspect PREPARED"] == ["-m", "diffexp", "data", "inspect", "PREPARED"]
    assert rows["diffexp export CKPT OUT"][3] == str(checkpoint)

    cheap = [("python -c pass", ["-c", "pass"]), ("diffexp --help", ["-m", "diffexp", "--help"]),
             ("diffexp data --help", ["-m", "diffexp", "data", "--help"])]
    times, profiles = bench.measure(cheap, rounds=1)
    assert all(len(times[label]) == 1 and times[label][0] > 0 for label, _ in cheap)
    packages, largest = profiles["diffexp data --help"]
    assert {"diffexp", "numpy"} <= packages and "lightning" not in packages and len(largest) == 3
    table, _ = bench.render([label for label, _ in cheap], times, profiles)
    (rows_,) = markdown_tables(table)
    assert [row[0] for row in rows_[1:]] == [f"`{label}`" for label, _ in cheap]
    assert rows_[1][2] == "1.00" and all(row[3] == "no" for row in rows_[1:])


def test_compare_reads_a_study_without_torch_or_tensorboards_reader(tmp_path):
    """compare reads numbers: no torch (the reference variant is read from the variants' source), no
    tensorboard event processing and its TensorFlow stub (diffexp.sweep.events reads the files), with or without
    plots."""
    study = make_study(tmp_path / "runs")
    runs = [["compare", str(study), "--out", str(tmp_path / "compared"), "--no-plots"],
            ["compare", str(study), "--out", str(tmp_path / "plotted")]]
    seen = run_in_turn(runs, heavy=("torch", "tensorboard.backend", "tensorboard.compat.tensorflow_stub",
                                    *HEAVY))
    last = seen[-1]
    assert not last["heavy"], f"`diffexp {' '.join(last['argv'])}` imported {', '.join(last['heavy'][:5])}"
    assert [s["argv"] for s in seen] == runs and all(s["code"] == 0 for s in seen), seen
    assert (tmp_path / "plotted" / "paired_diffs.png").is_file()


def test_the_model_subcommands_never_load_torchs_compiler_stack(tmp_path):
    """torch._dynamo (with sympy and Triton) costs about a second: the kernel door marks its trace-time functions
    without it (diffexp.kernels.registry.constant_result), so listing, generating and exporting never load it, and
    params builds its models on the meta device without the arithmetic that loads it (diffexp.model.meta)."""
    checkpoint = write_checkpoint(tiny_decoder("diff_v1"), tmp_path / "tiny.ckpt")
    runs = [["--help"], ["bench", "--help"], ["variants"],
            ["params", str(REPO / "recipes/tiny/diff_v1.yaml"), str(REPO / "recipes/gpu/size/125m.yaml")],
            ["generate", str(checkpoint), "--prompt", "the", "--max-new-tokens", "4", "--device", "cpu"],
            ["export", str(checkpoint), str(tmp_path / "exported")]]
    seen = run_in_turn(runs, heavy=("torch._dynamo", "torch._inductor"))
    last = seen[-1]
    assert not last["heavy"], f"`diffexp {' '.join(last['argv'])}` imported {', '.join(last['heavy'][:5])}"
    assert [s["argv"] for s in seen] == runs and all(s["code"] == 0 for s in seen), seen

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
from tests.helpers import REPO, one_thread_env, tiny_decoder, write_checkpoint

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
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in heavy)
    seen.append({"argv": argv, "code": code, "heavy": loaded})
    if loaded:
        break
print(json.dumps(seen))
"""


def run_in_turn(invocations: list[list[str]]) -> list[dict]:
    done = subprocess.run([sys.executable, "-c", RUN_IN_TURN, json.dumps(HEAVY), json.dumps(invocations)],
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
    # `params RECIPE` is left out: it reads a recipe through the LightningCLI parser that `fit` uses
    # (diffexp.training.cli.parse_config), so that its counts are those of the run the recipe makes
    runs = [["variants"],
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


"""Sweeps: spec checking, several workers on one storage, a killed worker, compare on real logs."""

from __future__ import annotations

import csv
import json
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml

from diffexp.compare import main as compare_main
from diffexp.secrets import mask_url
from diffexp.sweep import SpecError, parse_spec
from diffexp.sweep.runner import main as sweep_main
from diffexp.sweep.spec import load_spec
from tests.helpers import (
    REPO,
    TINY_OVERRIDES,
    exit_code,
    run_cli,
    subprocess_env,
    trials_by_state,
    write_recipe,
    write_spec,
)


def start_worker(spec: Path, cwd: Path) -> subprocess.Popen:
    env = subprocess_env()
    return subprocess.Popen([sys.executable, "-m", "diffexp", "sweep", "--config", str(spec)], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


# two whole workers (about a minute): heavy; test_racing_workers_never_claim_one_trial_twice keeps the claim
# protocol in the default run
@pytest.mark.heavy
@pytest.mark.parametrize("kind", ["sqlite", "journal"])
def test_two_workers_finish_each_point_exactly_once(tmp_path, kind):
    url = f"sqlite:///{tmp_path}/study.db" if kind == "sqlite" else f"journal:{tmp_path}/study.log"
    paper = {"source": "a paper, Table 1", "values": {"head_norm=true": {"val/loss": 3.0},
                                                       "head_norm=false": {"val/loss": 3.1}}}
    spec = write_spec(tmp_path, f"two-{kind}", storage=url, paper=paper)
    workers = [start_worker(spec, tmp_path) for _ in range(2)]
    outputs = [w.communicate(timeout=400)[0] for w in workers]
    assert [w.returncode for w in workers] == [0, 0], outputs
    states = trials_by_state(url, f"two-{kind}")
    assert sorted(states) == ["head-norm-false/seed0", "head-norm-false/seed1",
                              "head-norm-true/seed0", "head-norm-true/seed1"]
    assert all(counts == Counter({"COMPLETE": 1}) for counts in states.values()), states
    for output in outputs:
        assert "trials finished" in output
    if kind == "sqlite":  # compare on the real logs: one row per case, both seeds
        out = tmp_path / "cmp"
        assert compare_main([str(tmp_path / f"runs/two-{kind}"), "--out", str(out)]) == 0
        rows = list(csv.DictReader((out / "compare.csv").open()))
        assert [r["case"] for r in rows] == ["head_norm=true", "head_norm=false"]
        assert [r["n_complete"] for r in rows] == ["2", "2"]
        assert all(float(r["val/loss_mean"]) > 0 for r in rows)
        assert (out / "val_loss_curves.png").stat().st_size > 10_000
        # the spec's paper numbers travel through sweep.json to compare
        assert json.loads((tmp_path / f"runs/two-{kind}/sweep.json").read_text())["paper"] == paper
        assert "## Paper: a paper, Table 1" in (out / "compare.md").read_text()


CLAIM_ALL = """
import sys, time
from diffexp.sweep.runner import SweepRunner
from diffexp.sweep.spec import load_spec
runner = SweepRunner(load_spec(sys.argv[1]), worker_name=sys.argv[3])
while time.time() < float(sys.argv[2]):
    pass
claimed = []
while (trial := runner.claim()) is not None:
    claimed.append(trial._trial_id)
print(claimed)
"""


def test_racing_workers_never_claim_one_trial_twice(tmp_path):
    """SQLite ignores Optuna's row lock: without the file lock both workers could own one waiting trial."""
    spec = write_spec(tmp_path, "race", storage=f"sqlite:///{tmp_path}/study.db", seeds=list(range(15)))
    start = time.time() + 8  # both workers open the study first, then claim at once
    workers = [subprocess.Popen([sys.executable, "-c", CLAIM_ALL, str(spec), str(start), f"w{i}"], cwd=tmp_path,
                                env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for i in range(2)]
    results = [w.communicate(timeout=120) for w in workers]
    assert [w.returncode for w in workers] == [0, 0], [err for _, err in results]
    claimed = [json.loads(out.strip().splitlines()[-1]) for out, _ in results]
    assert not set(claimed[0]) & set(claimed[1]), claimed
    assert len(set(claimed[0] + claimed[1])) == 30  # every point claimed, by one worker


@pytest.mark.heavy  # a whole sweep killed and rerun (over a minute); the default run kills one trial below
def test_killed_worker_is_resumed_without_duplicates(tmp_path):
    spec = write_spec(tmp_path, "killed", stale_after_s=3)
    url = f"sqlite:///{tmp_path / 'runs/killed/study.db'}"
    worker = start_worker(spec, tmp_path)
    deadline = time.time() + 300
    in_flight = False
    while time.time() < deadline and worker.poll() is None:  # kill it in the middle of its second trial
        done = list((tmp_path / "runs/killed").glob("*/seed*/trial.json"))
        # a trial's log is opened when its process starts; trial.json is written when it ends
        started = [p.parent for p in (tmp_path / "runs/killed").glob("*/seed*/trial-1.log")]
        in_flight = any(not (d / "trial.json").exists() for d in started)
        if done and in_flight:
            break
        time.sleep(0.1)
    assert in_flight, "never saw a second trial in flight"
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    before = trials_by_state(url, "killed")
    assert sum(c["RUNNING"] for c in before.values()) == 1, before

    rerun = start_worker(spec, tmp_path)
    output = rerun.communicate(timeout=400)[0]
    assert rerun.returncode == 0, output
    after = trials_by_state(url, "killed")
    assert len(after) == 4
    assert all(c["COMPLETE"] == 1 for c in after.values()), after
    assert sum(c["FAIL"] for c in after.values()) == 1  # the killed attempt, marked stale
    # the earlier finished trials were not re-run
    for key, counts in before.items():
        if counts["COMPLETE"]:
            assert after[key] == counts


@pytest.mark.parametrize(
    "change, message",
    [
        ({"colour": "red"}, "unknown key(s) 'colour'"),
        ({"seeds": "three"}, "seeds='three' has the wrong type"),
        ({"grid": {"model.arch.head_norm": []}}, "grid['model.arch.head_norm'] is empty"),
        ({"grid": {}, "cases": None}, "no trials"),
        ({"objective": {"metric": "val/accuracy"}}, "objective.metric='val/accuracy'"),
        ({"grid": {"head_norm": [True]}}, "'head_norm' must start with model."),
        ({"search": {"model.optim.lr": {"type": "float", "low": 1.0, "high": 0.1}}}, "low=1.0 must be below"),
        ({"base": "recipes/nope.yaml"}, "base='recipes/nope.yaml': recipe not found"),
        ({"grid": {}, "cases": {}}, "no trials: `cases` is empty and there is no `grid`"),
        ({"seeds": [0, 1, 0]}, "seeds=[0, 1, 0]: seed(s) 0 listed more than once"),
        ({"seeds": [-1]}, "seeds=[-1]: -1 out of range"),
        ({"grid": {"seed_everything": [1, 2]}}, "'seed_everything' is set per trial from `seeds`"),
        ({"cases": {"X": {"base": "recipes/nope.yaml"}}}, "cases['X'].base='recipes/nope.yaml': recipe not found"),
        ({"cases": {"X": {"base": 3}}}, "cases['X'].base=3 has the wrong type"),
    ],
)
def test_bad_spec_fails_before_any_trial(tmp_path, change, message, capsys):
    raw = yaml.safe_load(write_spec(tmp_path, "bad").read_text())
    raw.update(change)
    raw = {k: v for k, v in raw.items() if v is not None}
    with pytest.raises(SpecError) as err:
        parse_spec(raw)
    assert message in str(err.value)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert exit_code(["sweep", "--config", str(path)]) == 2
    assert message in capsys.readouterr().err  # whole: never wrapped, whatever the terminal width
    assert not (tmp_path / "runs").exists()


def test_every_bad_row_is_reported_before_anything_is_created(tmp_path, capsys):
    """Values `diffexp fit` refuses fail the sweep at once, all together, not trial by trial."""
    spec = write_spec(tmp_path, "rows", grid={"model.arch.lambda_init": [0.5, 1.5]}, cases={
        "DIFF": {},
        "Shared r0": {"model.arch.attention": "shared_diff", "model.arch.rank": 0},
        "typo": {"model.arch.nope": 1},
        "no steps": {"trainer.max_steps": 0}})
    assert exit_code(["sweep", "--config", str(spec)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {spec}: 7 of 8 trial configurations would be refused by `diffexp fit`")
    lines = [line for line in err.splitlines() if line.startswith("  - ")]
    assert len(lines) == 7
    row = {line.split(": ", 1)[0][4:]: line.split(": ", 1)[1] for line in lines}
    assert "model.arch.lambda_init=1.5 is invalid" in row["case 'DIFF', grid model.arch.lambda_init=1.5"]
    assert "case 'DIFF', grid model.arch.lambda_init=0.5" not in row
    assert row["case 'Shared r0', grid model.arch.lambda_init=0.5"] == \
        "model.arch.rank=0 is invalid: expected a positive integer"
    assert "unknown key(s) model.arch.nope" in row["case 'typo', grid model.arch.lambda_init=0.5"]
    assert "trainer.max_steps=0" in row["case 'no steps', grid model.arch.lambda_init=0.5"]
    assert not (tmp_path / "runs").exists()  # no study.db, no sweep.json, no run directory


def test_search_bounds_and_choices_are_checked(tmp_path, capsys):
    search = {"model.arch.n_layers": {"type": "int", "low": 0, "high": 2},
              "model.arch.integral": {"type": "categorical", "choices": ["softmax", "mean", "sideways"]}}
    spec = write_spec(tmp_path, "bounds", grid={}, cases={"DINT": {"model.arch.attention": "dint"}}, n_trials=3,
                      search=search)
    assert exit_code(["sweep", "--config", str(spec)]) == 2
    err = capsys.readouterr().err
    assert "2 of 3 trial configurations would be refused" in err
    low = next(line for line in err.splitlines() if "search model.arch.n_layers low=0" in line)
    assert low.endswith(": model.arch.n_layers=0 is invalid: expected a positive integer")
    choice = next(line for line in err.splitlines() if "search model.arch.integral choice sideways" in line)
    assert "sideways" in choice.split(": ", 1)[1]
    assert not (tmp_path / "runs").exists()


def test_each_distinct_trial_config_is_checked_once(tmp_path, monkeypatch):
    from diffexp.sweep import check

    checked = []
    monkeypatch.setattr(check, "validate_fit_args", checked.append)
    spec = load_spec(write_spec(tmp_path, "many", cases={"A": {}, "B": {}, "C": {"model.arch.head_norm": False}},
                                grid={"model.arch.lambda_init": [0.5, 0.8]}, seeds=[0, 1, 2]))
    assert len(spec.points()) == 18
    check.check_trials(spec)
    assert len(checked) == 4  # A and B set the same values; seeds do not change what is checked


def test_duplicate_case_names_are_refused_with_their_lines(tmp_path, capsys):
    path = write_spec(tmp_path, "dupes", grid={}, cases={"DIFF": {}})
    text = path.read_text().replace("  DIFF: {}\n", "  DIFF: {}\n  Shared: {model.arch.attention: shared_diff}\n"
                                                  "  DIFF: {model.arch.head_norm: false}\n")
    path.write_text(text)
    lines = text.splitlines()
    first, second = [i + 1 for i, line in enumerate(lines) if line.startswith("  DIFF:")]
    with pytest.raises(SpecError, match="duplicate key 'DIFF' in cases"):
        load_spec(path)
    assert exit_code(["sweep", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"duplicate key 'DIFF' in cases at line {second} (first at line {first})" in err
    assert not (tmp_path / "runs").exists()


def test_a_spec_with_several_kinds_of_error_reports_them_all_in_one_message(tmp_path, capsys):
    """Repeated seeds, an objective no trial records, an unregistered variant, a clash and a row `diffexp fit`
    refuses: one message names each, nothing is created."""
    spec = write_spec(tmp_path, "many_errors", seeds=[0, 0], objective={"metric": "val/accuracy"},
                      grid={"model.optim.lr": [1.0e-2]}, cases={
                          "A": {"model.optim.lr": 3.0e-3},
                          "V3": {"model.arch.attention": "diff_v3"},
                          "no steps": {"trainer.max_steps": 0}})
    assert exit_code(["sweep", "--config", str(spec)]) == 2
    err = capsys.readouterr().err
    head, *lines = err.split("\n(DIFFEXP_DEBUG")[0].splitlines()
    assert head == (f"error: {spec}: 4 problem(s) in the spec and 1 of 2 trial configurations would be refused by "
                    "`diffexp fit`; nothing was started or written:")
    assert lines[0].startswith("  - seeds=[0, 0]: seed(s) 0 listed more than once")
    assert lines[1].startswith("  - objective.metric='val/accuracy' is not a metric trials record")
    assert lines[2].startswith("  - cases['V3']: model.arch.attention='diff_v3' is not a variant; known: baseline,")
    assert lines[3].startswith("  - cases['A'] sets model.optim.lr=0.003 and grid sets it too (grid: [0.01])")
    assert lines[4].startswith("  - case 'no steps', grid model.optim.lr=0.01: trainer.max_steps=0 is invalid")
    assert len(lines) == 5  # the unregistered variant's rows are not refused a second time
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("where, variant", [
    ({"cases": {"V3": {"model.arch.attention": "diff_v3"}}}, "cases['V3']"),
    ({"grid": {"model.arch.attention": ["diff_v1", "diff_v3"]}}, "grid"),
    ({"overrides": {"model.arch.attention": "diff_v3"}}, "overrides"),
    ({"search": {"model.arch.attention": {"type": "categorical", "choices": ["diff_v3"]}}}, "search"),
])
def test_a_spec_naming_an_unregistered_variant_is_refused(tmp_path, where, variant):
    raw = {"study": "v3", "base": str(REPO / "recipes/tiny/diff_v1.yaml"), "cases": {"A": {}}, **where}
    with pytest.raises(SpecError) as err:
        parse_spec(raw)
    assert str(err.value).startswith(f"{variant}: model.arch.attention='diff_v3' is not a variant; known: baseline, "
                                     "diff_v1, diff_v2")


@pytest.mark.parametrize("change, message", [
    ({"cases": {"A": {"model.optim.lr": 3.0e-3}}, "grid": {"model.optim.lr": [1.0e-2]}},
     "cases['A'] sets model.optim.lr=0.003 and grid sets it too (grid: [0.01]): the grid's value would replace the "
     "one cases['A'] sets, in every row; set model.optim.lr in one place"),
    ({"overrides": {"model.optim.lr": 3.0e-3}, "grid": {"model.optim.lr": [1.0e-2]}},
     "overrides sets model.optim.lr=0.003 and grid sets it too"),
    ({"cases": {"A": {"model.optim.lr": 3.0e-3}}, "n_trials": 2,
      "search": {"model.optim.lr": {"type": "float", "low": 1.0e-4, "high": 1.0e-2}}},
     "cases['A'] sets model.optim.lr=0.003 and search sets it too"),
    ({"grid": {"model.optim.lr": [1.0e-2]}, "n_trials": 2,
      "search": {"model.optim.lr": {"type": "float", "low": 1.0e-4, "high": 1.0e-2}}},
     "grid sets model.optim.lr ([0.01]) and search draws it too"),
])
def test_a_key_one_place_of_the_spec_would_silently_replace_is_refused_naming_both(change, message):
    raw = {"study": "clash", "base": str(REPO / "recipes/tiny/diff_v1.yaml"), "cases": {"A": {}}, **change}
    with pytest.raises(SpecError) as err:
        parse_spec(raw)
    assert message in str(err.value)


def test_a_shared_variant_flag_reaches_only_the_cases_whose_variant_reads_it(tmp_path):
    """lambda_init (overrides) and head_norm (grid) are DIFF's: the Transformer's trials get neither, and it has one
    row (not one per head_norm), which `compare` sets against DIFF at each grid point; `diffexp fit` accepts every
    row. A shared flag no case reads is refused."""
    from diffexp.sweep.check import check_trials, trial_configs

    spec = load_spec(write_spec(tmp_path, "mixed", seeds=[0], cases={
        "Transformer": {"model.arch.attention": "baseline"}, "DIFF": {}, "Sink": {
            "base": str(REPO / "recipes/tiny/softmax_sink.yaml")}},
        overrides={**TINY_OVERRIDES, "data.cache_dir": str(tmp_path / "cache"), "model.arch.lambda_init": 0.5},
        search={"model.arch.sink": {"type": "categorical", "choices": ["zero", "learned"]}}, n_trials=2))
    assert sorted(label for label, _ in spec.rows()) == ["DIFF, head_norm=false", "DIFF, head_norm=true", "Sink",
                                                         "Transformer"]
    assert spec.grid_views() == {f"head_norm={v}": {"Transformer": "Transformer", "DIFF": f"DIFF, head_norm={v}",
                                                    "Sink": "Sink"} for v in ("true", "false")}
    configs = {config.where: config.overrides for config in trial_configs(spec)}
    assert "model.arch.lambda_init" not in configs["case 'Transformer'"]
    assert "model.arch.sink" not in configs["case 'Transformer'"]
    assert configs["case 'DIFF', grid model.arch.head_norm=true"]["model.arch.lambda_init"] == 0.5
    assert configs["case 'Sink', search model.arch.sink choice learned"]["model.arch.sink"] == "learned"
    assert "model.arch.lambda_init" not in configs["case 'Sink', search model.arch.sink choice learned"]
    assert len(configs) == 5  # the Transformer once, not once per search corner
    check_trials(spec)
    with pytest.raises(SpecError, match=r"overrides: model.arch.sink is read by softmax_sink only, and no trial of "
                                        r"this spec trains it \(they train baseline, diff_v1\)"):
        parse_spec({"study": "s", "base": str(REPO / "recipes/tiny/diff_v1.yaml"), "overrides": {
            "model.arch.sink": "learned"}, "cases": {"Transformer": {"model.arch.attention": "baseline"}, "DIFF": {}}})


def test_storage_password_is_masked():
    assert mask_url("postgresql://alice:s3cret@db.example/optuna") == "postgresql://alice:***@db.example/optuna"
    assert "s3cret" not in mask_url("mysql+pymysql://bob:s3cret@host:3306/x")
    assert mask_url("sqlite:///runs/x/study.db") == "sqlite:///runs/x/study.db"


@pytest.mark.heavy  # two sampled trials end to end with compare (about 30 s); bounds are checked by default above
def test_search_space_is_sampled_per_trial_and_reaches_the_run(tmp_path):
    spec = write_spec(tmp_path, "search", grid={}, cases={"DIFF": {}}, seeds=[0], n_trials=2,
                      search={"model.optim.lr": {"type": "float", "low": 1.0e-4, "high": 1.0e-2, "log": True}},
                      pruner={"type": "median", "n_warmup_steps": 0})
    assert sweep_main(["--config", str(spec)]) == 0
    records = [json.loads(p.read_text()) for p in (tmp_path / "runs/search/diff").glob("*/trial.json")]
    assert sorted(p.parent.name for p in (tmp_path / "runs/search/diff").glob("*/trial.json")) == \
        ["seed0", "seed0-draw1"]
    lrs = [r["overrides"]["model.optim.lr"] for r in records]
    assert len(set(lrs)) == 2 and all(1e-4 <= lr <= 1e-2 for lr in lrs)
    configs = [yaml.safe_load(p.read_text()) for p in (tmp_path / "runs/search/diff").glob("*/config.yaml")]
    assert sorted(c["model"]["optim"]["lr"] for c in configs) == sorted(lrs)
    # the HParams dashboard: one row per trial with its case, seed, size, every varied key and its results
    for path in (tmp_path / "runs/search/diff").glob("*/trial.json"):
        record = json.loads(path.read_text())
        hparams, metric_tags = hparams_of(path.parent)
        assert hparams["case"] == "DIFF" and hparams["seed"] == 0 and hparams["params/total"] > 0
        assert hparams["model.optim.lr"] == pytest.approx(record["overrides"]["model.optim.lr"])
        assert hparams["data.seq_len"] == 32 and hparams["trainer.max_steps"] == 6
        assert "val/loss" in metric_tags and "train/loss" in metric_tags  # the run's own curves
        assert not [tag for tag in scalar_tags(path.parent) if tag.startswith("hparams/")]  # no copies sorting first
        assert "step" not in record["metrics"]  # the x of the validation metrics, not a result
    # every view counts steps as the CLI prints them, the optimizer steps done: validation after 3 and 6 steps
    from diffexp.compare import load_study_runs

    for trial in load_study_runs(tmp_path / "runs/search").trials.values():
        assert [step for step, _ in trial.curves["val/loss"]] == [3, 6]
    # compare finds both draws: the runner and compare name trial directories the same way
    assert compare_main([str(tmp_path / "runs/search"), "--out", str(tmp_path / "cmp"), "--no-plots"]) == 0
    rows = list(csv.DictReader((tmp_path / "cmp/compare.csv").open()))
    assert [(r["case"], r["n_expected"], r["n_complete"]) for r in rows] == [("DIFF", "2", "2")]
    assert float(rows[0]["val/loss_mean"]) == pytest.approx(
        statistics.fmean(json.loads(p.read_text())["metrics"]["val/loss"]
                         for p in (tmp_path / "runs/search/diff").glob("*/trial.json")))


def hparams_of(run_dir: Path) -> tuple[dict, list[str]]:
    """The HParams a run's TensorBoard events hold: (session hparams, metric tags of the experiment)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import metadata

    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    content = acc.PluginTagToContent(metadata.PLUGIN_NAME)
    session = metadata.parse_session_start_info_plugin_data(content[metadata.SESSION_START_INFO_TAG])
    experiment = metadata.parse_experiment_plugin_data(content[metadata.EXPERIMENT_TAG])
    values = {}
    for key, value in session.hparams.items():
        kind = value.WhichOneof("kind")
        values[key] = getattr(value, kind)
    return values, [info.name.tag for info in experiment.metric_infos]


def scalar_tags(run_dir: Path) -> list[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    return acc.Tags()["scalars"]


def test_saved_config_values_look_through_init_args(tmp_path):
    from diffexp.sweep.trial import saved_config_values

    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({
        "trainer": {"max_steps": 300}, "model": {"arch": {"attention": "diff_v1", "n_kv_heads": None}},
        "data": {"class_path": "diffexp.data.TextDataModule", "init_args": {"seq_len": 128}}}))
    keys = ["model.arch.attention", "model.arch.n_kv_heads", "data.seq_len", "trainer.max_steps", "model.arch.nope"]
    assert saved_config_values(config, keys) == {"model.arch.attention": "diff_v1", "model.arch.n_kv_heads": None,
                                              "data.seq_len": 128, "trainer.max_steps": 300}
    assert saved_config_values(tmp_path / "missing.yaml", keys) == {}


def test_trial_killed_after_its_last_checkpoint_still_records_its_result(tmp_path):
    """The resumed run starts at max_steps and validates nothing; its result comes from the checkpoint."""
    recipe = write_recipe(tmp_path, max_steps=12)
    sweep_cb = {"class_path": "diffexp.sweep.trial.SweepTrialCallback",
                "init_args": {"study": "s", "trial_id": 0, "case": "c", "seed": 7, "overrides": {}}}
    kill = {"class_path": "tests.helpers.KillAtFitEnd", "init_args": {"path": str(tmp_path / "killed.json")}}
    proc = run_cli(["fit", "--config", str(recipe), f"--trainer.callbacks+={json.dumps(kill)}",
                    f"--trainer.callbacks+={json.dumps(sweep_cb)}"], tmp_path, check=False)
    assert proc.returncode == 137, proc.stderr[-2000:]
    run_dir = tmp_path / "runs/run/version_0"
    assert not (run_dir / "trial.json").exists()
    killed = json.loads((tmp_path / "killed.json").read_text())
    assert killed["step"] == 12

    run_cli(["fit", "--config", str(recipe), "--ckpt_path", "last", f"--trainer.callbacks+={json.dumps(sweep_cb)}"],
            tmp_path)
    record = json.loads((run_dir / "trial.json").read_text())
    assert record["global_step"] == 12 and record["validated_step"] == 12
    assert record["metrics"]["val/loss"] == pytest.approx(killed["val/loss"])


@pytest.mark.parametrize("path", sorted((REPO / "sweeps").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_sweep_spec_parses_and_every_row_is_a_valid_config(path, monkeypatch):
    """Sweeps are data: each row of each shipped spec must be a config `diffexp fit` accepts and can build. The GPU
    specs read a directory `diffexp data prepare` makes once (not here): their data check is stood in for."""
    from diffexp.data import identity
    from diffexp.sweep.check import check_trials
    from diffexp.sweep.tune import tuning_spec

    real_check = identity.check_text_data

    def check(data_args):
        source = str(data_args.get("source", ""))
        if not (source.startswith("data/") and not Path(source).exists()):
            real_check(data_args)

    monkeypatch.setattr(identity, "check_text_data", check)
    spec = load_spec(path)
    check_trials(spec)  # every row and search bound, as the runner checks it before starting
    if spec.tune_lr:
        check_trials(tuning_spec(spec))  # and its short runs at every lr


def test_every_trial_records_every_key_the_study_varies(tmp_path):
    from diffexp.sweep.runner import SweepRunner

    spec = load_spec(REPO / "sweeps/table6.yaml")
    assert set(spec.varied_keys()) == {"trainer.max_steps", "trainer.val_check_interval", "model.arch.attention",
                                       "model.arch.head_norm", "model.arch.lambda_init", "model.arch.rank",
                                       "model.arch.lowrank_scope", "model.arch.base_sharing"}
    spec.runs_dir = tmp_path
    runner = SweepRunner(spec)
    point = next(p for p in spec.points() if p.case == "DIFF")  # the row that overrides nothing
    command = runner._command(runner.study.ask(), point, tmp_path / "run", None)
    callback = json.loads(next(a for a in command if a.startswith("--trainer.callbacks+=")).split("=", 1)[1])
    assert set(callback["init_args"]["hparam_keys"]) == set(spec.varied_keys())
    assert callback["init_args"]["overrides"] == spec.overrides


def test_a_case_may_start_from_its_own_recipe(tmp_path):
    """`base` inside a case: that row's trials start from its recipe; the others from the spec's base."""
    from diffexp.sweep.check import check_trials
    from diffexp.sweep.command import fit_args
    from diffexp.sweep.runner import SweepRunner

    plain = load_spec(write_spec(tmp_path, "own", grid={}, cases={"DIFF": {}, "DINT": {}}))
    spec = load_spec(write_spec(tmp_path, "own", grid={}, cases={
        "DIFF": {}, "DINT": {"base": "recipes/tiny/dint.yaml", "model.arch.integral": "mean"}}), repo_root=REPO)
    assert spec.case_bases == {"DINT": REPO / "recipes/tiny/dint.yaml"}
    assert spec.cases["DINT"] == {"model.arch.integral": "mean"}  # `base` is not an override
    assert "base" not in spec.varied_keys()
    bases = {p.case: fit_args(spec, p, p.overrides)[1] for p in spec.points()}
    assert bases == {"DIFF": str(REPO / "recipes/tiny/diff_v1.yaml"), "DINT": str(REPO / "recipes/tiny/dint.yaml")}
    assert spec.fingerprint() != plain.fingerprint()
    check_trials(spec)  # model.arch.integral is valid on DINT's recipe
    SweepRunner(spec)  # writes sweep.json: each case with its recipe
    cases = json.loads((tmp_path / "runs/own/sweep.json").read_text())["cases"]
    assert [c.get("base") for c in cases] == [None, str(REPO / "recipes/tiny/dint.yaml")]


def test_a_spec_without_case_recipes_keeps_its_fingerprint(tmp_path):
    """Studies made before cases could name a recipe resume: their fingerprint is computed as it was."""
    import hashlib

    spec = load_spec(write_spec(tmp_path, "old"))
    payload = {"base": str(spec.base), "rows": spec.rows(), "seeds": spec.seeds, "overrides": spec.overrides,
               "search": spec.search, "n_trials": spec.n_trials, "objective": spec.objective_metric}
    assert spec.fingerprint() == hashlib.sha256(json.dumps(payload, sort_keys=True, default=str)
                                                .encode()).hexdigest()[:16]


def test_a_seed_sets_the_data_order_and_the_cases_of_one_seed_read_the_same_batches(tmp_path, monkeypatch):
    """Paired within a seed (every case reads the same batches), varied across seeds (another order): the
    spread over seeds then includes data-order noise, as the intervals `compare` draws assume."""
    import torch

    from diffexp.sweep.command import fit_args
    from diffexp.training.cli import build_fit

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)  # restored after: building a run seeds this process
    spec = load_spec(write_spec(tmp_path, "order", grid={}, cases={"DIFF": {}, "DINT": {
        "base": "recipes/tiny/dint.yaml"}}), repo_root=REPO)
    batches = {}
    for point in spec.points():
        _, data, _ = build_fit(fit_args(spec, point, {**spec.overrides, **point.overrides}))
        batches[point.case, point.seed] = torch.cat([b for b, _ in zip(data.train_dataloader(), range(3))])
    assert set(batches) == {("DIFF", 0), ("DINT", 0), ("DIFF", 1), ("DINT", 1)}
    for seed in (0, 1):
        assert torch.equal(batches["DIFF", seed], batches["DINT", seed])
    assert not torch.equal(batches["DIFF", 0], batches["DIFF", 1])


def test_the_order_seed_is_data_order_seed_else_the_run_seed_else_data_seed(monkeypatch):
    from diffexp.data.loader import training_order_seed

    monkeypatch.setenv("PL_GLOBAL_SEED", "7")  # what seed_everything(7) leaves
    assert training_order_seed(None, 1234) == 7
    assert training_order_seed(3, 1234) == 3  # a recipe that fixes data.order_seed keeps one order for all seeds
    monkeypatch.delenv("PL_GLOBAL_SEED")
    assert training_order_seed(None, 1234) == 1234


def test_synthetic_tasks_order_by_the_run_seed_and_keep_their_examples(monkeypatch):
    """MQAR's and the needle task's examples come from data.seed; their training order follows the run's seed,
    as the text data's does: a sweep's seeds vary the order, not the task."""
    import torch

    from diffexp.data.mqar import MQARDataModule

    def first_batch(run_seed):
        monkeypatch.setenv("PL_GLOBAL_SEED", str(run_seed))
        data = MQARDataModule(vocab_size=64, seq_len=32, num_kv_pairs=4, train_size=64, val_size=8, batch_size=8)
        return next(iter(data.train_dataloader()))["tokens"], data.dataset("train")[0]["tokens"]

    batch_0, example_0 = first_batch(0)
    batch_1, example_1 = first_batch(1)
    assert torch.equal(example_0, example_1) and not torch.equal(batch_0, batch_1)
    assert torch.equal(first_batch(0)[0], batch_0)

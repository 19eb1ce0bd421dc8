"""Storage URLs of sweep and compare: where the URL comes from, and a password that never reaches the user.

The URLs point at a port where nothing listens, so every test here fails to connect, as a wrong host
would; tests/test_sweep_postgres.py runs sweeps on a real server.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from diffexp.secrets import mask_url
from diffexp.sweep.storage import STORAGE_URL_ENV, resolve_url
from tests.helpers import REPO, TINY_OVERRIDES, exit_code, subprocess_env

PASSWORD = "s3cr3t-Pw9"
URL_FORMS = {  # every form a password takes in a SQLAlchemy/libpq URL
    "user:pw@": f"postgresql+psycopg://alice:{PASSWORD}@127.0.0.1:1/optuna",
    ":pw@": f"postgresql+psycopg://:{PASSWORD}@127.0.0.1:1/optuna",
    "?password=": f"postgresql+psycopg://alice@127.0.0.1:1/optuna?sslmode=disable&password={PASSWORD}",
}


def small_spec(tmp_path, **extra) -> str:
    spec = {"study": "s", "base": str(REPO / "recipes/tiny/diff_v1.yaml"), "runs_dir": str(tmp_path / "runs"),
            "overrides": {**TINY_OVERRIDES, "data.cache_dir": str(tmp_path / "cache")},
            "cases": {"DIFF": {}}, "seeds": [0], **extra}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


@pytest.mark.parametrize("url", [*URL_FORMS.values(),
                                 f"postgresql+psycopg://alice@db/optuna?sslmode=verify-full&sslpassword={PASSWORD}"])
def test_mask_url_hides_the_password_and_keeps_the_rest(url):
    masked = mask_url(url)
    assert PASSWORD not in masked and "***" in masked
    assert masked.replace("***", PASSWORD) == url


def test_storage_url_precedence(monkeypatch):
    monkeypatch.delenv(STORAGE_URL_ENV, raising=False)
    assert resolve_url(None, None) == (None, "")
    assert resolve_url(None, "journal:spec.log") == ("journal:spec.log", "storage")
    monkeypatch.setenv(STORAGE_URL_ENV, "sqlite:///env.db")
    assert resolve_url(None, "journal:spec.log") == ("sqlite:///env.db", STORAGE_URL_ENV)
    assert resolve_url("sqlite:///flag.db", "journal:spec.log") == ("sqlite:///flag.db", "--storage")


@pytest.mark.parametrize("form", URL_FORMS)
@pytest.mark.parametrize("via", ["--storage", STORAGE_URL_ENV, "spec"])
def test_sweep_on_an_unreachable_storage_fails_cleanly_without_the_password(tmp_path, monkeypatch, capsys, form,
                                                                             via):
    url = URL_FORMS[form]
    monkeypatch.delenv(STORAGE_URL_ENV, raising=False)
    args = ["--config", small_spec(tmp_path, **({"storage": url} if via == "spec" else {}))]
    if via == "--storage":
        args += ["--storage", url]
    elif via == STORAGE_URL_ENV:
        monkeypatch.setenv(STORAGE_URL_ENV, url)
    assert exit_code(["sweep", *args]) == 2
    out, err = capsys.readouterr()
    assert PASSWORD not in out + err
    assert err.startswith("error: ") and "Traceback" not in err
    origin = "storage" if via == "spec" else via
    assert f"{origin}={mask_url(url)!r}: cannot open the storage" in err  # which URL, from where, masked
    assert "127.0.0.1" in err and "port 1" in err  # the driver's reason
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("form", URL_FORMS)
@pytest.mark.parametrize("via", ["--storage", STORAGE_URL_ENV])
def test_compare_on_an_unreachable_storage_fails_cleanly_without_the_password(monkeypatch, capsys, form, via):
    url = URL_FORMS[form]
    monkeypatch.delenv(STORAGE_URL_ENV, raising=False)
    args = ["--study", "s"]
    if via == "--storage":
        args += ["--storage", url]
    else:
        monkeypatch.setenv(STORAGE_URL_ENV, url)
    assert exit_code(["compare", *args]) == 2
    out, err = capsys.readouterr()
    assert PASSWORD not in out + err
    assert err.startswith("error: ") and "Traceback" not in err
    assert f"{via}={mask_url(url)!r}: cannot open the storage" in err


def test_compare_study_needs_a_storage(monkeypatch, capsys):
    monkeypatch.delenv(STORAGE_URL_ENV, raising=False)
    assert exit_code(["compare", "--study", "table6"]) == 2
    err = capsys.readouterr().err
    assert "--study 'table6' needs the study's storage" in err and STORAGE_URL_ENV in err


@pytest.mark.parametrize("form", URL_FORMS)
def test_sweep_json_holds_the_storage_masked(tmp_path, form):
    from diffexp.sweep.runner import SweepRunner
    from diffexp.sweep.spec import load_spec

    runner = SweepRunner(load_spec(small_spec(tmp_path)))
    runner.url = URL_FORMS[form]  # as if the study lived on that server
    runner._write_sweep_json()
    text = (tmp_path / "runs/s/sweep.json").read_text()
    assert PASSWORD not in text
    assert json.loads(text)["storage"] == mask_url(URL_FORMS[form])


@pytest.mark.heavy  # three fresh processes (about 35 s); the same errors are tested in process by default
def test_user_errors_reach_the_terminal_whole_and_without_traceback(tmp_path):
    """`diffexp sweep` and `diffexp compare` as the user runs them, output piped, in a narrow terminal."""
    env = subprocess_env(COLUMNS="40", **{STORAGE_URL_ENV: URL_FORMS[":pw@"]})
    env.pop("DIFFEXP_DEBUG", None)

    def diffexp(*args: str) -> subprocess.CompletedProcess:
        proc = subprocess.run([sys.executable, "-m", "diffexp", *args], env=env, cwd=tmp_path, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr
        assert PASSWORD not in proc.stdout + proc.stderr
        return proc

    # a spec that does not parse: the message, with the spec's path, on one line despite the 40 columns
    bad_seeds = small_spec(tmp_path, seeds="three")
    assert f"error: {bad_seeds}: seeds='three' has the wrong type: expected list/int\n" in \
        diffexp("sweep", "--config", bad_seeds).stderr
    # a row `diffexp fit` would refuse: one line per bad row with the case name, the key and its value
    bad_rank = small_spec(tmp_path, cases={"Shared DIFF rank 0 with a long name": {
        "model.arch.attention": "shared_diff", "model.arch.rank": 0}})
    sweep = diffexp("sweep", "--config", bad_rank)
    assert f"{bad_rank}: 1 of 1 trial configurations would be refused" in sweep.stderr
    line = next(line for line in sweep.stderr.splitlines() if "Shared DIFF rank 0 with a long name" in line)
    assert line.endswith(": model.arch.rank=0 is invalid: expected a positive integer")
    # a storage that cannot be reached: the masked URL whole
    compare_run = diffexp("compare", "--study", "table6")
    assert f"{STORAGE_URL_ENV}={mask_url(URL_FORMS[':pw@'])!r}: cannot open the storage" in compare_run.stderr
    assert not (tmp_path / "runs").exists()


def test_a_trial_finished_by_another_worker_between_read_and_claim_is_skipped(tmp_path, monkeypatch):
    """The race a shared server storage allows: our list says WAITING, another worker has already run (or
    dropped as a duplicate) that trial. The claim moves on instead of crashing the worker."""
    import optuna
    from optuna.trial import TrialState

    from diffexp.sweep.runner import SweepRunner
    from diffexp.sweep.spec import load_spec

    runner = SweepRunner(load_spec(small_spec(tmp_path, seeds=[0, 1])))
    study_id = runner.study._study_id
    stale = runner.storage.get_all_trials(study_id, deepcopy=False, states=(TrialState.WAITING,))
    assert len(stale) >= 2
    gone = stale[0]._trial_id
    runner.storage.set_trial_state_values(gone, state=TrialState.RUNNING)  # the other worker's claim ...
    runner.storage.set_trial_state_values(gone, state=TrialState.FAIL)  # ... and its end
    real = runner.storage.get_all_trials
    monkeypatch.setattr(runner.storage, "get_all_trials",
                        lambda *a, **k: stale if k.get("states") == (TrialState.WAITING,) else real(*a, **k))
    with pytest.raises(optuna.exceptions.UpdateFinishedTrialError):  # what a naive claim of the stale trial meets
        runner.storage.set_trial_state_values(gone, state=TrialState.RUNNING)
    claimed = runner._claim()
    assert claimed is not None and claimed._trial_id != gone

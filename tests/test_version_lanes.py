"""The lowest version lane (`.ci/lane lowest`) pins what pyproject declares, and docs/versions.md says it.

The lane installs each direct dependency at its lower bound from `.ci/lower_bounds.py`'s constraints; a
dependency without a floor would go untested at the low end, and a floor changed in pyproject without the lane's
record in docs/versions.md would make the page claim versions that were never run."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

REPO = Path(__file__).resolve().parents[1]


def _lower_bounds():
    spec = importlib.util.spec_from_file_location("lower_bounds", REPO / ".ci" / "lower_bounds.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _declared() -> list[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return [*project["dependencies"], *project["optional-dependencies"]["dev"]]


def _name(requirement: str) -> str:
    return re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1).lower()


def test_every_direct_dependency_is_pinned_at_its_floor():
    pins = {_name(pin): pin for pin in _lower_bounds().floors(REPO / "pyproject.toml")}
    for requirement in _declared():
        floor = re.search(r">=\s*([^,;\s]+)", requirement)
        assert floor is not None, f"{requirement!r} has no lower bound, so the lowest lane cannot test it"
        pin = pins[_name(requirement)]
        assert pin.split(";")[0].strip() == f"{_name(requirement)}=={floor.group(1)}", (requirement, pin)
        if ";" in requirement:  # a platform marker travels with the pin
            assert pin.split(";", 1)[1].strip() == requirement.split(";", 1)[1].strip(), (requirement, pin)


def test_the_constraints_file_is_what_the_lane_reads():
    """The lane runs the script as a program (`python3 .ci/lower_bounds.py > constraints`)."""
    printed = subprocess.run([sys.executable, str(REPO / ".ci" / "lower_bounds.py")], capture_output=True,
                             text=True, check=True).stdout.splitlines()
    assert printed == _lower_bounds().floors(REPO / "pyproject.toml")
    assert all(re.fullmatch(r"[a-z0-9._-]+==[0-9][\w.]*( ; .+)?", line) for line in printed), printed


def test_an_unreadable_requirement_is_refused(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[project]\ndependencies = ["@@not a requirement"]\n'
                                             '[project.optional-dependencies]\ndev = []\n')
    with pytest.raises(SystemExit, match="cannot read the requirement '@@not a requirement'"):
        _lower_bounds().floors(tmp_path / "pyproject.toml")


def test_the_versions_page_states_pyprojects_floors():
    """docs/versions.md's table: each package's lowest-lane version is pyproject's floor for it."""
    floors = {_name(requirement): re.search(r">=\s*([^,;\s]+)", requirement).group(1) for requirement in _declared()}
    rows = re.findall(r"^\| ([a-z][\w-]*) \| ([0-9][\w.]*)[^|]* \| [^|]+ \|$",
                      (REPO / "docs" / "versions.md").read_text(), flags=re.M)
    assert len(rows) >= 10, rows
    for package, lowest in rows:
        assert package in floors, f"docs/versions.md lists {package}, which pyproject does not declare"
        declared = floors[package]
        assert lowest == declared or lowest.startswith(declared + ".") and set(lowest[len(declared):]) <= set(".0"), (
            f"docs/versions.md: the lowest lane ran {package} {lowest}, pyproject's floor is {declared}")


@pytest.mark.heavy  # a fresh environment per lane (several GB, minutes to install), then the whole default suite
@pytest.mark.parametrize("lane", ["lowest", "newest"])
def test_the_suite_passes_in_each_version_lane(lane):
    """`bash .ci/lane LANE` as docs/versions.md gives it: the default suite, in that lane's own environment."""
    done = subprocess.run(["bash", str(REPO / ".ci" / "lane"), lane], cwd=REPO, capture_output=True, text=True,
                          timeout=4 * 3600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

"""Print a pip/uv constraints file pinning each of pyproject's direct dependencies (the dev extra's included) at its
lower bound, for `.ci/lane lowest`. A requirement without a `>=` bound is left to the resolver."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib

REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*([^;]*?)\s*(;.*)?$")


def floors(pyproject: Path) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    pins: dict[str, str] = {}
    for requirement in [*project["dependencies"], *project["optional-dependencies"]["dev"]]:
        match = REQUIREMENT.match(requirement)
        if match is None:
            sys.exit(f"lower_bounds.py: cannot read the requirement {requirement!r} in {pyproject}")
        name, specifiers, marker = match.group(1).lower(), match.group(2), match.group(3) or ""
        lower = [spec.strip()[2:].strip() for spec in specifiers.split(",") if spec.strip().startswith(">=")]
        if lower:
            pins[name] = f"{name}=={lower[0]}{' ' + marker if marker else ''}"
    return list(pins.values())


if __name__ == "__main__":
    print("\n".join(floors(Path(__file__).resolve().parent.parent / "pyproject.toml")))

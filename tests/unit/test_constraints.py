"""constraints.txt: the exact releases `make venv` installs (see its header)."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from consumer_sdk.jobs import deferred

ROOT = Path(__file__).resolve().parents[2]


def pins() -> dict[str, str]:
    found: dict[str, str] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and version, f"constraints.txt: {line!r} is not name==version"
            assert canonicalize_name(name) not in found, f"constraints.txt: {name} twice"
            found[canonicalize_name(name)] = version
    return found


def requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    listed = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        listed += [r for r in extra if not r.startswith(project["name"])]
    return [Requirement(r) for r in listed]


def test_every_requirement_is_pinned_inside_its_range() -> None:
    pinned = pins()
    for req in requirements():
        name = canonicalize_name(req.name)
        assert name in pinned, f"{req.name} has no pin in constraints.txt"
        assert req.specifier.contains(pinned[name], prereleases=True), (
            f"constraints.txt pins {req.name} {pinned[name]}, outside pyproject.toml's {req.specifier}")


def test_the_pinned_psycopg_is_the_release_the_deferred_fence_was_tested_with() -> None:
    pinned = pins()
    assert pinned["psycopg"] == pinned["psycopg-binary"]
    release = tuple(int(part) for part in pinned["psycopg"].split(".")[:2])
    assert release == deferred.TESTED_PSYCOPG, (
        f"constraints.txt pins psycopg {pinned['psycopg']}; the deferred fence is on only for "
        f"{deferred.TESTED_PSYCOPG}: test it on the new release and move TESTED_PSYCOPG with the pin")


def test_the_environment_is_the_pinned_one() -> None:
    """`make venv` installed with the constraints (reinstalling when they change)."""
    for name, version in pins().items():
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # pinned for another platform's or another extra's dependency tree
        assert installed == version, f"{name} {installed} installed, constraints.txt pins {version}"

"""pyproject.toml's version floors are versions cembed is tested with (issue 32, item 7): each floor is
the lowest version that runs somewhere: CI's environment (this one, pinned by constraints.txt, so a new
upstream release does not move it), the GPU image's packages as read
there (scripts/gpu_check/image_packages.txt, "seen" lines) or the GPU bundle's fallback datasets
(scripts/gpu_bundle.sh). A floor above all of them claims support nobody tested the day it was raised; a
floor below all of them claims support nobody tests at all."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
REPO = Path(__file__).resolve().parents[1]


def requirements() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = [r for reqs in project["optional-dependencies"].values() for r in reqs]
    return [Requirement(r) for r in project["dependencies"] + extras]


def floor(req: Requirement) -> Version:
    (spec,) = [s for s in req.specifier if s.operator == ">="]
    return Version(spec.version)


def pinned(name: str) -> Version:
    """The version constraints.txt pins ``name`` to: what ``make install`` (and CI) installs with it."""
    for line in (REPO / "constraints.txt").read_text().splitlines():
        req = line.split("#")[0].strip()
        if req and Requirement(req).name.lower() == name.lower():
            return Version(req.split("==")[1])
    raise AssertionError(f"{name} is not pinned in constraints.txt")


def installed_or_pinned(name: str) -> Version:
    """This environment's version of ``name``; for an extra that ``make test`` does not install (the docs
    extra, installed by ``make docs`` only) the version constraints.txt pins, which is what that target
    installs. A fresh clone's ``make test`` then judges every floor without the docs packages."""
    try:
        return Version(metadata.version(name))
    except metadata.PackageNotFoundError:
        return pinned(name)


def versions_run(name: str) -> list[Version]:
    """Where ``name`` runs: this environment (or its pin, see :func:`installed_or_pinned`), the GPU image
    (seen), the GPU bundle's fallback."""
    found = [installed_or_pinned(name)]
    for line in (REPO / "scripts" / "gpu_check" / "image_packages.txt").read_text().splitlines():
        if line.startswith(f"{name}==") and line.endswith("# seen"):
            found.append(Version(line.split("==")[1].split()[0]))
    fallback = re.search(r'^FALLBACK="([^"]*)"', (REPO / "scripts" / "gpu_bundle.sh").read_text(), re.M).group(1)
    found += [Version(s.split("==")[1]) for s in fallback.split() if s.split("==")[0] == name]
    return found


@pytest.mark.parametrize("req", requirements(), ids=str)
def test_each_floor_is_the_lowest_tested_version(req):
    lowest = min(versions_run(req.name))
    # the floor names as many release parts as it needs: torch>=2.11 is met by 2.11.0 and is its floor
    assert floor(req).release == lowest.release[: len(floor(req).release)], (
        f"{req}: the lowest version tested is {lowest} (CI's {installed_or_pinned(req.name)}, the GPU image's or "
        "bundle's); set the floor to it"
    )
    assert all(floor(req) <= v for v in versions_run(req.name))


def test_every_requirement_is_pinned_by_the_constraints():
    """``make install`` installs with ``-c constraints.txt``: a requirement without a pin there would
    take whatever PyPI released that day, and the floor test above would judge a moving target."""
    pins = {
        Requirement(line.split("#")[0]).name.lower()
        for line in (REPO / "constraints.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    missing = sorted({r.name.lower() for r in requirements()} - pins - {"torch"})  # torch: Makefile pins it
    assert not missing, f"not pinned in constraints.txt: {missing}; refresh it (see its header)"

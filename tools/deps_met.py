"""Whether an install step of the Makefile has anything to do, without pip or the network.

    python tools/deps_met.py "torch>=2.11"              # this requirement is met
    python tools/deps_met.py --project --extra dev      # this checkout is installed (pip -e),
                                                        # with pyproject.toml's dependencies
                                                        # and those of the extras named

Exit status 0 when everything is installed at a version the requirement allows (markers
evaluated for this interpreter), else 1 with one line on stderr naming the first thing that
is not. `make train` runs pip only when this says so, so a second `make train` installs
nothing and prints one line instead of pip's resolution of every package; the first one (or
one after pyproject.toml changed) still shows pip's downloads. It checks the requirements
named, not their own dependencies (pip installed those with them).
"""

from __future__ import annotations

import json
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# pip's vendored copies: present wherever pip is, which the Makefile's steps need anyway.
try:
    from packaging.requirements import Requirement
except ImportError:  # a fresh venv has pip but not always packaging
    from pip._vendor.packaging.requirements import Requirement

try:
    import tomllib
except ImportError:  # Python 3.10
    from pip._vendor import tomli as tomllib


def unmet(requirement: str) -> str | None:
    """Why `requirement` is not met here, or None."""
    req = Requirement(requirement)
    if req.marker is not None and not req.marker.evaluate():
        return None  # not for this interpreter or platform
    try:
        version = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        return f"{req.name} is not installed"
    if req.specifier and not req.specifier.contains(version, prereleases=True):
        return f"{req.name} {version} is installed; {requirement} is required"
    return None


def project_unmet(extras: list[str]) -> str | None:
    """Why this checkout's editable install (with `extras`) is not complete, or None."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    name = project["name"]
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return f"{name} is not installed"
    if dist.version != project["version"]:
        return f"{name} {dist.version} is installed; pyproject.toml says {project['version']}"
    url = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
    if url.rstrip("/") != ROOT.as_uri():
        return f"{name} is installed from {url or 'an index'}, not from {ROOT} (pip install -e)"
    optional = project.get("optional-dependencies", {})
    for extra in extras:
        if extra not in optional:
            return f"pyproject.toml has no extra {extra!r}"
    for requirement in [
        *project.get("dependencies", []),
        *(r for e in extras for r in optional[e]),
    ]:
        if (why := unmet(requirement)) is not None:
            return why
    return None


def main(argv: list[str]) -> int:
    extras, requirements, project = [], [], False
    args = iter(argv)
    for arg in args:
        if arg == "--project":
            project = True
        elif arg == "--extra":
            extras.append(next(args, ""))
        else:
            requirements.append(arg)
    why = project_unmet(extras) if project else None
    for requirement in requirements:
        why = why or unmet(requirement)
    if why:
        print(f"== install needed: {why}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

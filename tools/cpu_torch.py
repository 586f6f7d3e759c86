"""The newest CPU build of torch that pip's configured sources offer, for a requirement.

    python tools/cpu_torch.py "torch>=2.11"      # prints e.g. torch==2.13.0+cpu

`make torch` asks this on a machine without an NVIDIA GPU when PyTorch's CPU index cannot be
reached: pip's configured sources (an index, a mirror, `find-links` folders) may still hold a
CPU build, while a plain `pip install torch` would take their newest torch, on Linux the CUDA
build from PyPI (GBs of nvidia-* packages). A CPU build is a version with the local label
`+cpu`, as PyTorch's CPU index names them. The versions come from `pip index versions torch`
(every source pip is configured with, find-links included). Exit status 0 with the pinned
requirement on stdout, or 1 with one line on stderr when there is none.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

try:
    from packaging.requirements import Requirement
    from packaging.version import InvalidVersion, Version
except ImportError:  # a fresh venv has pip but not always packaging
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.version import InvalidVersion, Version


def offered_versions(pip: list[str], name: str) -> list[str]:
    """The versions of `name` that `pip index versions` lists (empty when it lists none)."""
    r = subprocess.run(
        [*pip, "index", "versions", name], capture_output=True, text=True, timeout=300
    )
    found = re.search(r"^Available versions: (.*)$", r.stdout, flags=re.M)
    return [v.strip() for v in found.group(1).split(",")] if found else []


def newest_cpu_build(requirement: str, versions: list[str]) -> str | None:
    """`name==V` for the newest `V` with the `+cpu` label that `requirement` allows."""
    req = Requirement(requirement)
    builds = []
    for v in versions:
        try:
            version = Version(v)
        except InvalidVersion:
            continue
        cpu = (version.local or "").split(".")[0] == "cpu"  # also +cpu.cxx11.abi
        if cpu and req.specifier.contains(version, prereleases=False):
            builds.append(version)
    return f"{req.name}=={max(builds)}" if builds else None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(
            "usage: cpu_torch.py REQUIREMENT  (pip: $PIP, default python -m pip)", file=sys.stderr
        )
        return 2
    pip = shlex.split(os.environ.get("PIP", f"{sys.executable} -m pip"))
    requirement = args[0]
    pinned = newest_cpu_build(requirement, offered_versions(pip, Requirement(requirement).name))
    if pinned is None:
        print(
            f"pip's configured sources offer no CPU build (+cpu) of {requirement}", file=sys.stderr
        )
        return 1
    print(pinned)
    return 0


if __name__ == "__main__":
    sys.exit(main())

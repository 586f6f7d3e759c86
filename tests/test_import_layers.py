"""The import layers of docs/ARCHITECTURE.md (pyproject.toml, [tool.importlinter]) hold, and an
import that runs the wrong way breaks them, inside a function too: `make lint` runs the same
check (tools/lint_imports.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def lint_imports(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "tools" / "lint_imports.py"), *args, "--no-logo"]
    return subprocess.run(cmd, capture_output=True, text=True)


def test_the_layers_hold():
    r = lint_imports()
    assert r.returncode == 0 and "Contracts: 2 kept, 0 broken." in r.stdout, r.stdout + r.stderr


def test_a_wrong_way_import_breaks_them(tmp_path):
    """This repository, but runtime.py imports config (a higher layer) and optim imports data
    (one beside it), each inside a function."""
    wrong = {"runtime.py": "config", "optim.py": "data"}
    for path in ROOT.iterdir():
        if path.name not in wrong and not path.name.startswith("."):
            (tmp_path / path.name).symlink_to(path)
    for name, imported in wrong.items():
        text = (ROOT / name).read_text() + f"\n\ndef _wrong_way():\n    import {imported}\n"
        (tmp_path / name).write_text(text)
    r = lint_imports("--root", str(tmp_path))
    assert r.returncode == 1 and "Contracts: 1 kept, 1 broken." in r.stdout, r.stdout + r.stderr
    assert "runtime is not allowed to import config" in r.stdout
    assert "optim is not allowed to import data" in r.stdout

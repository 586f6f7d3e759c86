"""`make lint`'s import check: import-linter's contracts (pyproject.toml, [tool.importlinter],
the layers of docs/ARCHITECTURE.md) over this repository, every import counted (those inside
functions too).

    python tools/lint_imports.py              # exit 1 and the broken contract when one is
    python tools/lint_imports.py --verbose    # any lint-imports option

import-linter builds its graph with grimp, which takes packages only, and this repository's
top level is also single modules imported by name (train.py, config.py, ...). So the
contracts run over a mirror of the top level in a temporary folder: a module `x.py` is there a
package `x/` whose `__init__.py` links to it, a folder links to itself; the names and import
statements are the repository's own. `--root DIR` checks another tree (the tests' wrong-way
import) against this repository's contracts.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def mirror(root: Path, into: Path) -> None:
    """`root`'s top-level modules as packages in `into`, its folders of Python files as links."""
    for path in sorted(root.iterdir()):
        if path.suffix == ".py":
            (into / path.stem).mkdir()
            (into / path.stem / "__init__.py").symlink_to(path.resolve())
        elif path.is_dir() and not path.name.startswith(".") and any(path.glob("*.py")):
            (into / path.name).symlink_to(path.resolve())


def main(argv: list[str]) -> int:
    root = ROOT
    if argv[:1] == ["--root"]:
        root, argv = Path(argv[1]), argv[2:]
    with tempfile.TemporaryDirectory(prefix="lint_imports_") as tmp:
        mirror(root, Path(tmp))
        # From the mirror: lint-imports finds the root packages on the current directory.
        run = "from importlinter.cli import lint_imports_command as c; c()"
        cmd = [sys.executable, "-c", run, str(ROOT / "pyproject.toml"), "--no-cache", *argv]
        return subprocess.run(cmd, cwd=tmp).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

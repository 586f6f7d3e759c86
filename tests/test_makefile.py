"""The Makefile's install steps run pip only when something is missing (tools/deps_met.py):
a second `make train` prints one line per step instead of pip's output. Checked with a pip
stand-in that records its calls, and this checkout's install faked by a dist-info folder
first on the path (what `pip install -e .` leaves in site-packages)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.deps_met import ROOT, unmet

VERSION = "0.1.0"
MAKE_OVERRIDES = ("TORCH_SPEC", "TORCH_INDEX", "FORCE_INSTALL", "HAS_GPU")


def fake_install(where: Path, url: str, version: str = VERSION) -> Path:
    info = where / f"te_llama_recipe-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: te-llama-recipe\nVersion: {version}\n"
    )
    (info / "direct_url.json").write_text(f'{{"url": "{url}", "dir_info": {{"editable": true}}}}')
    return where


def make(target: str, site: Path, log: Path, *extra: str) -> subprocess.CompletedProcess:
    pip = log.with_suffix(".sh")  # records its arguments, one call a line
    pip.write_text(f'#!/bin/sh\necho "$*" >>"{log}"\n')
    pip.chmod(0o755)
    # The caller's own Makefile overrides (CI exports TORCH_SPEC/TORCH_INDEX) are not this
    # test's: it checks the Makefile's defaults.
    inherited = {k: v for k, v in os.environ.items() if k not in MAKE_OVERRIDES}
    env = {**inherited, "PYTHONPATH": str(site), "HAS_GPU": "no"}
    return subprocess.run(
        ["make", "-s", target, f"PYTHON={sys.executable}", f"PIP={pip}", *extra],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_requirements():
    assert unmet("torch>=2.0") is None
    assert unmet("torch>=999").startswith("torch ") and "torch>=999 is required" in unmet(
        "torch>=999"
    )
    assert unmet("no-such-package-xyz>=1") == "no-such-package-xyz is not installed"
    assert unmet('no-such-package-xyz; sys_platform == "nowhere"') is None  # not for here


@pytest.mark.parametrize("target", ["setup", "setup-dev"])
def test_second_setup_runs_no_pip(tmp_path, target):
    log = tmp_path / "pip.log"
    site = fake_install(tmp_path / "site", ROOT.as_uri())
    r = make(target, site, log)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not log.exists(), log.read_text()  # everything installed: pip never ran
    lines = r.stdout.splitlines()
    assert lines[0] == "== torch: torch>=2.11 already installed"
    assert lines[1].startswith("== torch 2.")
    assert lines[2].endswith("already installed") and len(lines) == 3, r.stdout


def test_setup_installs_what_is_missing(tmp_path):
    log = tmp_path / "pip.log"
    # This checkout installed from elsewhere (another clone): pip install -e . runs here.
    r = make("setup", fake_install(tmp_path / "other", "file:///elsewhere"), log)
    assert r.returncode == 0, r.stdout + r.stderr
    assert log.read_text() == "install -e .\n"
    assert "== install needed: te-llama-recipe is installed from file:///elsewhere" in r.stderr
    # A version of torch the project does not allow; and FORCE_INSTALL=1 runs every step.
    log.unlink()
    site = fake_install(tmp_path / "site", ROOT.as_uri())
    r = make("setup", site, log, "TORCH_SPEC=torch>=999", "TORCH_INDEX=")
    assert log.read_text() == "install torch>=999\n", r.stdout + r.stderr
    log.unlink()
    r = make("setup-dev", site, log, "FORCE_INSTALL=1")
    assert log.read_text().splitlines()[-1] == "install -e .[dev]", r.stdout + r.stderr

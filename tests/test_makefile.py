"""The Makefile's install steps run pip only when something is missing (tools/deps_met.py):
a second `make train` prints one line per step instead of pip's output. Checked with a pip
stand-in that records its calls, and this checkout's install faked by a dist-info folder
first on the path (what `pip install -e .` leaves in site-packages)."""

from __future__ import annotations

import contextlib
import http.server
import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tools.deps_met import ROOT, unmet

VERSION = "0.1.0"
MAKE_OVERRIDES = ("TORCH_SPEC", "TORCH_INDEX", "FORCE_INSTALL", "HAS_GPU", "INDEX_PROBE_S")


def fake_install(where: Path, url: str, version: str = VERSION) -> Path:
    info = where / f"te_llama_recipe-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: te-llama-recipe\nVersion: {version}\n"
    )
    (info / "direct_url.json").write_text(f'{{"url": "{url}", "dir_info": {{"editable": true}}}}')
    return where


#: What the pip stand-in lists for `pip index versions torch` (the sources pip is configured
#: with): PyPI-like versions and CPU builds such as find-links or a mirror may hold.
OFFERED = "1000.0, 999.1+cpu, 999.0+cpu, 2.13.0+cpu, 2.13.0"


def make(
    target: str, site: Path, log: Path, *extra: str, offered: str = OFFERED
) -> subprocess.CompletedProcess:
    pip = log.with_suffix(".sh")  # records its arguments, one call a line
    pip.write_text(
        f'#!/bin/sh\necho "$*" >>"{log}"\n'
        f'[ "$1" = index ] && echo "torch (1000.0)" && echo "Available versions: {offered}"\n'
        "exit 0\n"
    )
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


@contextlib.contextmanager
def index_server(answer: bool):
    """A local stand-in for a package index: one that answers every request (HTTP 200), or one
    that accepts connections and never answers (a host behind a firewall that drops replies)."""
    if answer:

        class Index(http.server.BaseHTTPRequestHandler):
            def do_HEAD(self):  # noqa: N802 (http.server's name)
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        server = http.server.HTTPServer(("127.0.0.1", 0), Index)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}/whl/cpu"
        finally:
            server.shutdown()
            server.server_close()
    else:
        with socket.socket() as silent:
            silent.bind(("127.0.0.1", 0))
            silent.listen(8)  # the kernel completes connections; nothing ever reads or replies
            yield f"http://127.0.0.1:{silent.getsockname()[1]}/whl/cpu"


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/whl/cpu"  # nobody listens once closed


@pytest.mark.parametrize("where", ["closed port", "no answer"])
def test_an_unreachable_torch_index_is_probed_once_then_its_cpu_build_found(tmp_path, where):
    """TORCH_INDEX that cannot be reached, no GPU: one probe of at most INDEX_PROBE_S seconds,
    then the newest CPU build (+cpu) that pip's configured sources offer for TORCH_SPEC (not
    their newest torch, on Linux the CUDA build), instead of pip's five retries of every
    request (issue #53: 523 s and 134 warning lines)."""
    log = tmp_path / "pip.log"
    site = fake_install(tmp_path / "site", ROOT.as_uri())
    with contextlib.ExitStack() as stack:
        if where == "closed port":
            url = closed_port_url()
        else:
            url = stack.enter_context(index_server(answer=False))
        r = make(
            "setup", site, log, "TORCH_SPEC=torch>=999", f"TORCH_INDEX={url}", "INDEX_PROBE_S=2"
        )
    assert r.returncode == 0, r.stdout + r.stderr
    assert log.read_text() == "index versions torch\ninstall torch==999.1+cpu\n", r.stdout
    probe = [line for line in r.stderr.splitlines() if line.startswith(url)]
    assert len(probe) == 1, r.stderr
    seconds = float(re.search(r"\(after ([\d.]+) s\)$", probe[0]).group(1))
    if where == "closed port":
        assert "ConnectionRefusedError" in probe[0] and seconds < 2, probe
    else:
        assert "no answer in 2 s" in probe[0] and 2 <= seconds < 4, probe
    assert (
        f"== torch: {url} cannot be reached; its CPU build torch==999.1+cpu is in pip's "
        "configured sources"
    ) in r.stdout, r.stdout
    assert "installing torch==999.1+cpu from pip's configured sources" in r.stdout, r.stdout


def test_an_unreachable_torch_index_without_a_cpu_build_elsewhere_stops_in_one_line(tmp_path):
    """No CPU build in pip's configured sources: one line naming TORCH_INDEX and the ways out,
    nothing installed (pip's own choice would be GBs of CUDA packages); a GPU machine takes
    pip's configured index."""
    log = tmp_path / "pip.log"
    site = fake_install(tmp_path / "site", ROOT.as_uri())
    url = closed_port_url()
    args = ("TORCH_SPEC=torch>=999", f"TORCH_INDEX={url}")
    r = make("setup", site, log, *args, offered="1000.0, 2.13.0+cpu")
    assert r.returncode != 0 and log.read_text() == "index versions torch\n", r.stdout + r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: TORCH_INDEX={url} cannot be reached and pip's configured sources offer no CPU "
        "build of torch>=999; set TORCH_INDEX to a reachable copy of it, or TORCH_INDEX= for "
        "pip's own choice (on Linux the CUDA build: GBs)"
    ], r.stderr
    log.unlink()
    r = make("setup", site, log, *args, "HAS_GPU=yes")
    assert r.returncode == 0 and log.read_text() == "install torch>=999\n", r.stdout + r.stderr
    assert f"== torch: {url} cannot be reached; going on with pip's configured index" in r.stdout


def test_a_reachable_torch_index_is_used(tmp_path):
    log = tmp_path / "pip.log"
    site = fake_install(tmp_path / "site", ROOT.as_uri())
    with index_server(answer=True) as url:
        r = make("setup", site, log, "TORCH_SPEC=torch>=999", f"TORCH_INDEX={url}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert log.read_text() == f"install torch>=999 --index-url {url}\n", r.stdout + r.stderr
    assert "cannot be reached" not in r.stdout + r.stderr
    assert f"installing torch>=999 from {url} " in r.stdout, r.stdout


def test_newest_cpu_build():
    from tools.cpu_torch import newest_cpu_build

    offered = ["2.15.0", "2.15.0rc1+cpu", "2.14.1", "2.13.0+cpu.cxx11.abi", "2.12.0+cpu", "x"]
    assert newest_cpu_build("torch>=2.11", offered) == "torch==2.13.0+cpu.cxx11.abi"
    assert newest_cpu_build("torch<2.13", offered) == "torch==2.12.0+cpu"
    assert newest_cpu_build("torch>=2.14", offered) is None  # 2.14.1 is no CPU build

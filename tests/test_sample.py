"""tools/sample.py: text from a trained tiny run's checkpoint and from its Hugging Face export.
The two sources hold the same weights, so greedy decoding gives the same tokens (and the
logits agree); sampling is a function of the seed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from checkpoint.hf import export_checkpoint
from runtime import ROOT, launch
from tests.helpers import CPU_ENV, TINY_RUN
from tools.sample import load


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("sample")
    r = launch(
        [*TINY_RUN, "train.steps=30", "optim.warmup_steps=3", f"run.root={root}", "run.name=t"],
        env=CPU_ENV,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    export_checkpoint(root / "t" / "checkpoints", root / "hf")
    return root / "t", root / "hf"


@pytest.mark.slow
def test_greedy_from_export_equals_greedy_from_run(trained):
    run, export = trained
    ours, theirs = load(run), load(export)
    assert ours.cfg.vocab_size == theirs.cfg.vocab_size == 258
    prompt = "def main("
    assert ours.encode(prompt) == theirs.encode(prompt) and ours.bos_id == theirs.bos_id
    ids = torch.tensor([[ours.bos_id, *ours.encode(prompt)]])
    with torch.no_grad():
        a, b = ours.model(ids)[..., :258], theirs.model(ids)[..., :258]
    assert torch.allclose(a, b, atol=1e-5, rtol=0), (a - b).abs().max()
    greedy = ours.generate(prompt, max_new_tokens=40)
    assert len(greedy) >= 1 and greedy == theirs.generate(prompt, max_new_tokens=40)


@pytest.mark.slow
def test_export_files_have_the_usual_mode(trained):
    """Every exported file, the safetensors weights included, is written with the mode a new
    file gets under the umask (0644 usually): others on a shared filesystem can read them."""
    _, export = trained
    mask = os.umask(0)
    os.umask(mask)
    modes = {f.name: oct(f.stat().st_mode & 0o777) for f in export.iterdir()}
    assert "model.safetensors" in modes and "config.json" in modes
    assert set(modes.values()) == {oct(0o666 & ~mask)}, modes


@pytest.mark.slow
def test_sampling_is_a_function_of_the_seed(trained):
    run, _ = trained
    s = load(run)
    kw = dict(max_new_tokens=40, temperature=1.0, top_k=50)
    first = s.generate("import ", seed=5, **kw)
    assert first == s.generate("import ", seed=5, **kw)
    assert first != s.generate("import ", seed=6, **kw)
    assert len(set(first)) > 1  # sampled, not a repeated argmax
    # top-k 1 is greedy whatever the temperature.
    assert s.generate("import ", max_new_tokens=20, temperature=2.0, top_k=1, seed=9) == (
        s.generate("import ", max_new_tokens=20)
    )


def sample(*args, env=None) -> subprocess.CompletedProcess:
    """`python tools/sample.py ARGS` from the repository root, its output captured."""
    cmd = [sys.executable, "tools/sample.py", *map(str, args)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)


@pytest.mark.slow
def test_command_line(trained):
    run, export = trained
    args = ["--prompt", "class ", "--max-new-tokens", "30", "--temperature", "0.9"]
    cmd = [run, *args, "--top-k", "20", "--seed", "1"]
    cpu = {**os.environ, **CPU_ENV}
    a = sample(*cmd, env=cpu)
    b = sample(*cmd, env=cpu)
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout and a.stdout.startswith("class ")
    assert "rope_parameters" not in a.stderr
    assert a.stderr.startswith(f"sample: checkpoint {run}/checkpoints/step_0000030, ")
    # The defaults sample (temperature 0.8, top-k 20, seed 0): what those flags give.
    plain = [run, "--prompt", "class "]
    flags = ["--max-new-tokens", "30", "--temperature", "0.8", "--top-k", "20", "--seed", "0"]
    d = sample(*plain, "--max-new-tokens", "30", env=cpu)
    f = sample(*plain, *flags, env=cpu)
    assert d.returncode == 0 and d.stdout == f.stdout, d.stderr
    assert "(temperature 0.8, top-k 20, seed 0)" in d.stderr, d.stderr
    bad = sample(run.parent / "nope")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert bad.stderr.startswith(f"error: {run.parent / 'nope'} does not exist; pass a run")
    e = sample(export, "--prompt", "x", "--max-new-tokens", "5")
    assert e.returncode == 0 and "rope_parameters" not in e.stderr, e.stderr

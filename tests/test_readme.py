"""The README's quick start output is what the default run prints.

`make train` runs `python train.py` in the user's environment (no OMP_NUM_THREADS set, so
train.py picks the thread count itself); this test does the same, in a temporary run.root, and
compares the README's quoted lines with the output: the corpus size, the start of the model
line, and for each quoted step line its step, loss, grad_norm and lr, which do not depend on
the machine's speed or load. The embedded corpus is the running Python's standard library,
so the README's figures hold for the Python it names (the corpus line tells another Python
apart first).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from runtime import ROOT

#: The fields of a step line that are the same on every machine with the same software.
EXACT = ("loss", "grad_norm", "lr")


def readme_output() -> list[str]:
    """The quick start's example output: the code block after "one line per log step"."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"one line per log step:\n\n```\n(.*?)```", text, flags=re.S)
    assert block, "README.md: no example output after 'one line per log step:'"
    return block.group(1).splitlines()


def step_fields(line: str) -> tuple[int, dict[str, str]]:
    """`step 10/300 | loss 4.2434 | ...` -> (10, {"loss": "4.2434", ...})."""
    head, *parts = [p.strip() for p in line.split("|")]
    step = int(re.match(r"step\s+(\d+)/\d+", head).group(1))
    return step, dict(p.split(" ", 1) for p in parts)


@pytest.mark.slow
def test_readme_quick_start_output_is_the_default_runs(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # as `make train`
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    r = subprocess.run(
        [sys.executable, "train.py", f"run.root={tmp_path}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    printed = r.stdout.splitlines()
    quoted = readme_output()

    corpus = [line for line in quoted if line.startswith("data: ready in ")]
    samples = re.search(r"\(([\d,]+) samples per epoch\)", corpus[0]).group(1)
    ran = next(line for line in printed if line.startswith("data: ready in "))
    assert f"({samples} samples per epoch)" in ran, (
        f"another corpus than the README's: {ran!r} (the README's figures are for the Python "
        "it names; its standard library is the text)"
    )

    model = next(line for line in quoted if line.startswith("model "))
    start, _, rest = model.partition(" ... ")
    ran = next(line for line in printed if line.startswith("model "))
    assert ran.startswith(start + " "), ran
    # The same fields, but run_dir (a temporary root here) and the thread count (the load's).
    words = [w for w in rest.split() if "=" in w and not w.startswith(("run_dir=", "threads="))]
    assert words and all(w in ran.split() for w in words), (model, ran)
    assert re.search(r" threads=[12] \(\d+ cores, load [\d.]+: \d+ idle\) ", ran), ran

    steps = {step_fields(line)[0]: line for line in printed if line.startswith("step ")}
    checked = 0
    for line in quoted:
        if not line.startswith("step "):
            continue
        step, want = step_fields(line)
        got = step_fields(steps[step])[1]
        assert {k: got[k] for k in EXACT} == {k: want[k] for k in EXACT}, (
            f"README.md quotes step {step} as\n  {line}\nthe default run printed\n  {steps[step]}"
        )
        checked += 1
    assert checked >= 2
    assert any(line.startswith("done: step 300 in ") for line in printed)

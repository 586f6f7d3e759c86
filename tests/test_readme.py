"""The README's quick start output is what the default run prints.

`make train` runs `python train.py` in the user's environment (no OMP_NUM_THREADS set, so
train.py picks the thread count itself); this test does the same, in a temporary run.root, and
compares the README's quoted lines with the output: the corpus line (which Python's standard
library, its files and their hash), the start of the model line, and for each quoted step line
its step, loss, grad_norm and lr, which do not depend on the machine's speed or load.

How close the figures must be. The lr is exact (the schedule's arithmetic). The loss and
grad_norm depend in their last digits on the CPU: its maker, the vector width ATen's kernels
use, MKL's code path for it (and, with MKL's default mode, the thread count; a run computes
MKL's products in its strict mode, whose results do not: runtime.CPU_ARITHMETIC). Step 10 was
the same everywhere; by step 300 the differences had grown. docs/RUNS.md (CPU arithmetic) has
the table of every default run measured, on an Intel Xeon and an AMD EPYC, with 1 and 2
threads, each capability ATen offers and each MKL code path: this test reads that table, and
the README must quote step 300 as the range the table spans (`loss 1.75-1.77`, at the printed
digits that range needs), so the README, the table and this test say the same.

The tolerance is derived from that table, figure by figure: the measured values span [lo, hi];
a run must print a value within its centre +- twice its half-width, i.e. [lo - w/2, hi + w/2]
with w = hi - lo. The measured points use half of that band; the other half is for CPUs not
measured. (Were the runs' differences a normal spread, the range of the table's 17 rows would
be about 3.6 of its standard deviations, and a band of twice that, 3.6 on each side of the
centre, is missed by fewer than one run in a thousand.) Where the table shows no spread (step 10), the band is one unit of the last printed
digit: the printed rounding of an unmeasured CPU may fall on the other side of a boundary.

CI runs the default run once, as `make train`, and hands its output to this test through
DEFAULT_RUN_LOG instead of training the 300 steps a second time.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime import ROOT

#: The run's own variables for its arithmetic and threads: the test runs as `make train` does,
#: so a value left in the environment running the tests does not change the figures.
RUN_SETS_ITSELF = ("OMP_NUM_THREADS", "ATEN_CPU_CAPABILITY", "MKL_CBWR")
#: The figures compared within the measured spread; the lr is compared as printed.
SPREAD = ("loss", "grad_norm")


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


def measured_runs() -> list[dict[str, str]]:
    """The rows of docs/RUNS.md's table of default runs (CPU arithmetic), as dicts."""
    text = (ROOT / "docs" / "RUNS.md").read_text()
    section = text[text.index("### CPU arithmetic") :]
    header = re.search(r"^\| machine \|.*step 300 loss.*\|$", section, flags=re.M)
    assert header, "docs/RUNS.md, CPU arithmetic: no table with a 'step 300 loss' column"
    names = [c.strip() for c in header.group(0).strip("|").split("|")]
    rows = []
    for line in section[header.end() :].strip().splitlines()[1:]:  # past the --- line
        if not line.startswith("|"):
            break
        rows.append(dict(zip(names, (c.strip() for c in line.strip("|").split("|")))))
    return rows


def measured(step: int, figure: str) -> list[float]:
    """Every run's printed `figure` at `step` (10 or 300) from the table."""
    column = {10: f"step 10 {figure}", 300: f"step 300 {figure}"}[step]
    return [float(row[column]) for row in measured_runs()]


def decimals(printed: str) -> int:
    return len(printed.partition(".")[2])


def allowed(values: list[float], printed_decimals: int) -> tuple[float, float]:
    """The band a run's figure must fall in: the centre of the measured range +- twice its
    half-width, at least one unit of the last printed digit (module docstring)."""
    lo, hi = min(values), max(values)
    centre, half = (lo + hi) / 2, max((hi - lo) / 2, 10.0**-printed_decimals / 2)
    return centre - 2 * half, centre + 2 * half


def default_run(tmp_path: Path) -> list[str]:
    """The lines `python train.py` prints: CI's `make train` output (DEFAULT_RUN_LOG), or a
    run of this test's own, in the environment `make train` gives it."""
    if log := os.environ.get("DEFAULT_RUN_LOG"):
        lines = Path(log).read_text().splitlines()
        # `make train` echoes its command: no overrides, or it was not the default run
        commands = [line for line in lines if re.search(r"\btrain\.py\b", line)]
        assert commands and re.search(r"train\.py\s*$", commands[-1]), (
            f"DEFAULT_RUN_LOG={log} is not the output of `make train` without ARGS: {commands}"
        )
        return lines
    env = {k: v for k, v in os.environ.items() if k not in RUN_SETS_ITSELF}
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
    return r.stdout.splitlines()


def test_readme_quotes_the_measured_range_at_step_300():
    """The README's step 300 figures are the range of docs/RUNS.md's table (rounded to the
    digits the README prints), and its step 10 figures what every run of the table printed."""
    quoted = {step_fields(x)[0]: step_fields(x)[1] for x in readme_output() if x.startswith("step")}
    assert set(quoted) == {10, 300}, quoted
    assert len(measured_runs()) >= 10
    for figure in SPREAD:
        lo, _, hi = quoted[300][figure].partition("-")
        d = decimals(lo)
        values = measured(300, figure)
        assert (lo, hi) == (f"{min(values):.{d}f}", f"{max(values):.{d}f}"), (figure, values)
        assert {f"{v:.{decimals(quoted[10][figure])}f}" for v in measured(10, figure)} == {
            quoted[10][figure]
        }, (figure, measured(10, figure))


@pytest.mark.slow
def test_readme_quick_start_output_is_the_default_runs(tmp_path):
    printed = default_run(tmp_path)
    quoted = readme_output()

    # The corpus, named exactly: another Python release is another text, not other arithmetic.
    corpus = next(line for line in quoted if line.startswith("data: preparing "))
    ran = next(line for line in printed if line.startswith("data: preparing "))
    assert ran == corpus, (
        f"another corpus than the README's:\n  {ran}\nthe README's figures are for\n  {corpus}"
    )
    samples = next(line for line in quoted if line.startswith("data: ready in "))
    samples = re.search(r"\(([\d,]+) samples per epoch\)", samples).group(1)
    ran = next(line for line in printed if line.startswith("data: ready in "))
    assert f"({samples} samples per epoch)" in ran, ran

    model = next(line for line in quoted if line.startswith("model "))
    start, _, rest = model.partition(" ... ")
    ran = next(line for line in printed if line.startswith("model "))
    assert ran.startswith(start + " "), ran
    # The same fields, but run_dir (a temporary root here), the thread count (the load's) and
    # ATen's kernels (this CPU's).
    skip = ("run_dir=", "threads=", "cpu=")
    words = [w for w in rest.split() if "=" in w and not w.startswith(skip)]
    assert words and all(w in ran.split() for w in words), (model, ran)
    assert re.search(r" threads=[12] \(\d+ cores, load [\d.]+: \d+ idle\) ", ran), ran
    own = torch.backends.cpu.get_cpu_capability().lower()
    assert f" cpu={own} " in ran, f"ATen's kernels are not this CPU's own ({own}): {ran}"

    steps = {step_fields(line)[0]: line for line in printed if line.startswith("step ")}
    for line in quoted:
        if not line.startswith("step "):
            continue
        step, want = step_fields(line)
        got = step_fields(steps[step])[1]
        assert got["lr"] == want["lr"], (line, steps[step])
        for figure in SPREAD:
            digits = decimals(want[figure].partition("-")[0])
            low, high = allowed(measured(step, figure), digits)
            assert low <= float(got[figure]) <= high, (
                f"step {step} {figure} {got[figure]} is outside [{low:.4f}, {high:.4f}], twice "
                f"the spread of the runs measured (docs/RUNS.md, CPU arithmetic; the README "
                f"quotes {want[figure]}):\n  {steps[step]}"
            )
    assert any(line.startswith("done: step 300 in ") for line in printed)

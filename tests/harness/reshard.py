"""Resharding chain of one recipe: a checkpoint saved on 4 processes resumed on 2, that one on 1;
and one saved on 1 resumed on 4, each against its uninterrupted run.

    python -m tests.harness.reshard --root /tmp/r --gpus 0,1,2,3 --one-gpu 0 --jsonl rows.jsonl \\
        --name fp8_cs+q -- recipe=fp8_cs recipe.quantized_init=true model=tiny       # 4 GPUs
    python -m tests.harness.reshard --root /tmp/r -- model=tiny model.impl=torch     # CPU, gloo

(from the repository root). train.py runs, parallel=fsdp, 30 steps, a checkpoint every 10:

    A4     4 processes, uninterrupted (saves 10, 20, 30)        R1   1 process, uninterrupted
    B2     A4's directory with only step 10, resumed on 2       D4   R1's with only step 10,
    C1     B2's directory with only step 20, resumed on 1            resumed on 4

(A4 beside R1, then B2 beside D4, then C1; --copy as tests/harness/resume.py's
keep_only_checkpoint.) Different process counts sum in different orders, so the curves are
compared with tolerances, not bitwise: the first resumed step's loss within STEP1_RTOL of the
uninterrupted run's at that step (the state carried over: the curve continues), every later
step within CURVE_RTOL (relative; the values of tests/harness/parity.py, whose layouts differ
from one GPU the same way). A row per resume, and one for A4 against R1 (the same comparison
without a checkpoint, for scale). Rows (tests/harness/multitier.py's) go to --jsonl; exit
status 1 when any failed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

STEPS, INTERVAL = 30, 10
#: tests/harness/parity.py's tolerances (relative loss difference), by recipe name.
STEP1_RTOL = {"bf16": 5e-3, "fp8_delayed": 1e-2, "fp8_cs": 1e-2, "fp8_block": 1e-2}
CURVE_RTOL = {"bf16": 2e-2, "fp8_delayed": 3e-2, "fp8_cs": 3e-2, "fp8_block": 3e-2}


def recipe_of(overrides: list[str]) -> str:
    names = [o.split("=", 1)[1] for o in overrides if o.startswith("recipe=")]
    return names[-1] if names else "bf16"


def start(nproc: int, overrides: list[str], log: Path, gpus: str | None) -> subprocess.Popen:
    from runtime import command
    from tests.harness import resume

    env = None if gpus is None else {"CUDA_VISIBLE_DEVICES": gpus}
    return resume.start(command(overrides, nproc), log, env)


def finish(procs: dict[str, subprocess.Popen], timeout: float) -> dict[str, str | None]:
    """Wait for every run; None, or why it failed ('timeout after N s', 'exit status N')."""
    import signal

    deadline = time.time() + timeout
    out = {}
    for name, p in procs.items():
        try:
            rc = p.wait(timeout=max(1.0, deadline - time.time()))
            out[name] = None if rc == 0 else f"run {name}: exit status {rc}"
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            out[name] = f"run {name}: timeout after {timeout:g} s"
    return out


def compare(ref: dict, got: dict, after_step: int, recipe: str) -> tuple[bool, str]:
    """`got`'s steps after `after_step` against `ref`'s: the first within STEP1_RTOL, all
    within CURVE_RTOL (relative)."""
    steps = sorted(s for s in set(ref) & set(got) if s > after_step)
    want = list(range(after_step + 1, STEPS + 1))
    if steps != want:
        return False, f"steps {steps[:1]}..{steps[-1:]} compared, wanted {after_step + 1}..{STEPS}"
    rel = [abs(got[s]["loss"] - ref[s]["loss"]) / abs(ref[s]["loss"]) for s in steps]
    s1, c = STEP1_RTOL.get(recipe, 1e-2), CURVE_RTOL.get(recipe, 3e-2)
    ok = rel[0] <= s1 and max(rel) <= c
    first = steps[0]
    return ok, (
        f"step {first} loss {got[first]['loss']:.4f} vs {ref[first]['loss']:.4f} "
        f"(rel {rel[0]:.2e} <= {s1:g}); max rel {max(rel):.2e} <= {c:g} over {len(steps)} steps"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--root", type=Path, required=True)
    ap.add_argument("--name", default=None, help="the recipe variant's name in the rows")
    ap.add_argument("--gpus", default=None, help="CUDA_VISIBLE_DEVICES of the 4-process runs")
    ap.add_argument("--one-gpu", default=None, help="CUDA_VISIBLE_DEVICES of the 1-process runs")
    ap.add_argument("--jsonl", type=Path, default=None)
    ap.add_argument("--part", default="reshard")
    ap.add_argument("--timeout", type=float, default=150, help="per phase, seconds")
    ap.add_argument("--logs", type=Path, default=None)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)

    from runlog import load_run
    from tests.harness.multitier import emit_row, row
    from tests.harness.resume import keep_only_checkpoint, resumed

    recipe = recipe_of(a.overrides)
    name = a.name or recipe
    logs = a.logs or a.root
    a.root.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    two = ",".join(a.gpus.split(",")[:2]) if a.gpus else None
    rows = []

    def emit(case: str, ok: bool, detail: str) -> None:
        result = "passed" if ok else "failed"
        emit_row(rows, row(a.part, f"{name}: {case}", result, detail), 0, a.jsonl)

    def args(run: str) -> list[str]:
        return [
            "parallel=fsdp",
            "checkpoint=async",
            f"checkpoint.interval={INTERVAL}",
            "checkpoint.keep_last=4",
            f"train.steps={STEPS}",
            "train.log_every=1",
            "optim.lr=1e-3",  # tests/gpu/suite.sh scale: 3e-3 spikes early, amplifying rounding
            f"run.root={a.root}",
            *a.overrides,
            f"run.name={run}",
        ]

    def launch(runs: dict[str, tuple[int, str | None]]) -> dict[str, str | None]:
        procs = {
            r: start(n, args(r), logs / f"reshard_{name}_{r}.log", g) for r, (n, g) in runs.items()
        }
        return finish(procs, a.timeout)

    def copy(src: str, dst: str, step: int) -> None:
        keep_only_checkpoint(a.root / src, a.root / dst, step)

    def check(case: str, ref: str, run: str, at: int, failed: dict) -> None:
        bad = failed.get(run) or failed.get(ref)
        if bad:
            emit(case, False, bad)
            return
        if at and not resumed(a.root / run):
            emit(case, False, f"{run} did not resume (its metrics.jsonl was moved aside)")
            return
        ok, detail = compare(load_run(a.root / ref), load_run(a.root / run), at, recipe)
        emit(case, ok, detail)

    failed = launch({"A4": (4, a.gpus), "R1": (1, a.one_gpu)})
    check(
        "4 procs vs 1, uninterrupted (no checkpoint; scale of the tolerance)", "R1", "A4", 0, failed
    )
    phase2 = {}
    if not failed["A4"]:
        copy("A4", "B2", INTERVAL)
        phase2["B2"] = (2, two)
    if not failed["R1"]:
        copy("R1", "D4", INTERVAL)
        phase2["D4"] = (4, a.gpus)
    failed.update(launch(phase2) if phase2 else {})
    failed.setdefault("B2", "A4 failed: nothing to resume")
    failed.setdefault("D4", "R1 failed: nothing to resume")
    check(f"saved on 4, resumed on 2 at step {INTERVAL}", "A4", "B2", INTERVAL, failed)
    check(f"saved on 1, resumed on 4 at step {INTERVAL}", "R1", "D4", INTERVAL, failed)
    if not failed["B2"]:
        copy("B2", "C1", 2 * INTERVAL)
        failed.update(launch({"C1": (1, a.one_gpu)}))
    failed.setdefault("C1", "B2 failed: nothing to resume")
    check(f"4 -> 2 -> 1: resumed on 1 at step {2 * INTERVAL}", "A4", "C1", 2 * INTERVAL, failed)
    return 0 if all(r["result"] == "passed" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

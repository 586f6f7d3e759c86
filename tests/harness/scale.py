"""Table of the GPU suite's `scale` stage (tests/gpu/suite.sh): layout parity and reshard resumes.

    python -m tests.harness.scale /tmp/gpu-suite-scale [--resume-step 20]     # repository root

The stage leaves, per recipe R, the run directories R-1gpu, R-hsdp (4 GPUs, saved at the
resume step), R-fsdp_tp (4 GPUs), R-hsdp-to-fsdp_tp (R-hsdp's checkpoint resumed on 4 GPUs
with fsdp_tp) and R-hsdp-to-fsdp2 (resumed on 2 GPUs with fsdp). Rows:

    parity   R-hsdp and R-fsdp_tp against R-1gpu, every step
    resume   R-hsdp-to-* against R-hsdp (the uninterrupted run), the steps after the resume

Prints the loss at the first, resume and last step, and max absolute / relative loss
difference (tests/harness/resume.py's `loss_parity`). Exit status 1 when a run is missing or
has no steps to compare.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from runlog import load_run
from tests.harness.resume import after, loss_parity

PAIRS = (
    ("parity", "1gpu", "hsdp", 0),
    ("parity", "1gpu", "fsdp_tp", 0),
    ("resume", "hsdp", "hsdp-to-fsdp_tp", None),
    ("resume", "hsdp", "hsdp-to-fsdp2", None),
)


def losses(run: dict, kind: str, resume_step: int) -> str:
    """Loss at the first, resume (parity rows) and last step of `run`."""
    steps = sorted(run)
    if not steps:
        return "-"
    picked = (steps[0], resume_step, steps[-1]) if kind == "parity" else (steps[0], steps[-1])
    return "/".join(f"{run[i]['loss']:.4f}" for i in picked if i in run)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root")
    ap.add_argument("--resume-step", type=int, default=20)
    a = ap.parse_args(argv)
    root = Path(a.root)
    recipes = sorted({p.name.rsplit("-1gpu", 1)[0] for p in root.glob("*-1gpu")})
    print(
        "| recipe | kind | reference | run | steps | ref loss first/resume/last | "
        "loss first/resume/last | max abs diff | max rel diff |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    ok = bool(recipes)
    for r in recipes:
        for kind, ref, run, start in PAIRS:
            start = a.resume_step if start is None else start
            try:
                runs = {k: after(load_run(root / f"{r}-{k}"), start) for k in (ref, run)}
            except Exception as e:  # a run that failed leaves no metrics
                print(f"| {r} | {kind} | {ref} | {run} | missing: {e} | | | | |")
                ok = False
                continue
            if not runs[ref] or not runs[run]:  # e.g. a resumed run that failed at once
                empty = run if runs[ref] else ref
                print(
                    f"| {r} | {kind} | {ref} | {run} | {empty}: no steps after step {start} | | | | |"
                )
                ok = False
                continue
            d = loss_parity(runs[ref], runs[run])
            print(
                f"| {r} | {kind} | {ref} | {run} | {d['steps']} | {losses(runs[ref], kind, a.resume_step)} "
                f"| {losses(runs[run], kind, a.resume_step)} "
                f"| {d['max_abs']:.3g} | {d['max_rel']:.3g} |"
            )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""The divergence check's study (divergence.py): how far above its level a clean run's loss
comes, and when runs that diverge would be stopped.

    python tools/divergence_study.py /tmp/div-study                       # CPU, ~5 min
    python tools/divergence_study.py /tmp/div-study /tmp/guard-study runs/tiny-bf16-fsdp

Trains RUNS (every step logged, the check off, so each runs to its end) unless DIR holds them
already, then judges them and every other run directory given (their metrics.jsonl, logged
every step: the resume guard study's runs, a default run with train.log_every=1) with the
check's own `Divergence`, as if checked every step and every 10th: at each check the
largest loss since the last one against the level, and the streak of exactly-0 gradient
norms with a flat loss. Prints, per run, the largest ratio to the level and the step the
default rule (train.divergence_ratio=3) would stop at, or "no stop".
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from divergence import DEAD_STEPS, FLAT, Divergence, StepStats  # noqa: E402
from tools.benchlib import train_here  # noqa: E402

_SMALL = ["model=tiny", "data.seq_len=64", "data.max_bytes=400000", "train.global_batch_size=8"]
#: name -> overrides: lr from clean to diverged, with the default warmup (30 steps).
RUNS: dict[str, list[str]] = {
    **{f"lr{lr}": [*_SMALL, "train.steps=60", f"optim.lr={lr}"] for lr in ("1e-2", "3e-2", "0.1")},
    "lr0.3-spike": [*_SMALL, "train.steps=60", "optim.lr=0.3"],
    "lr1-plateau": [*_SMALL, "train.steps=60", "optim.lr=1"],
    "lr3": [*_SMALL, "train.steps=60", "optim.lr=3"],
    **{f"lr{lr}": [*_SMALL, "train.steps=8", f"optim.lr={lr}"] for lr in ("10", "100", "1e3")},
}
_BASE = ["train.device=cpu", "checkpoint=none", "train.log_every=1", "train.divergence_ratio=0"]


def judge(records: list[dict], every: int, ratio: float = 3.0) -> dict:
    """The check over a run logged every step, as if it checked every `every` steps:
    {"max_ratio": the largest loss over its level at a check, "stop": the step it stops at
    (None: none), "line": the stop line}."""
    steps = sorted({r["step"]: r for r in records if "loss" in r}.items())
    rule = Divergence(ratio=ratio, lr=0.0)
    first = steps[0][1]["loss"]
    peak, peak_step, dead, dead_loss, worst = -float("inf"), None, 0, 0.0, 0.0
    for step, r in steps:
        loss, norm = r["loss"], r.get("grad_norm")
        if loss > peak:
            peak, peak_step = loss, step
        if norm == 0 and dead and abs(loss - dead_loss) <= FLAT * abs(dead_loss):
            dead += 1
        elif norm == 0:
            dead, dead_loss = 1, loss
        else:
            dead = 0
        if step % every and step != steps[-1][0]:
            continue
        stats = StepStats(peak, peak_step, first, dead, step - dead + 1, dead_loss)
        worst = max(worst, peak / rule.reference(stats))
        line = rule.judge(step, stats)
        if line is not None:
            return {"max_ratio": worst, "stop": step, "line": line}
        rule.logged(loss)
        peak = -float("inf")
    return {"max_ratio": worst, "stop": None, "line": None}


def main(argv: list[str] | None = None) -> int:
    from runlog import read_metrics

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("root", type=Path, help="where RUNS go (reused when there)")
    p.add_argument("more", type=Path, nargs="*", help="run directories, or folders of them")
    a = p.parse_args(argv)
    for name, overrides in RUNS.items():
        if not (a.root / name / "metrics.jsonl").exists():
            train_here(a.root, name, [*_BASE, *overrides])
    dirs = [a.root / n for n in RUNS]
    for d in a.more:
        dirs += [d] if (d / "metrics.jsonl").exists() else sorted(d.glob("*/metrics.jsonl"))
    for d in dirs:
        d = d.parent if d.name == "metrics.jsonl" else d
        records = read_metrics(d / "metrics.jsonl")
        cells = []
        for every in (1, 10):
            j = judge(records, every)
            stop = f"stops at step {j['stop']}" if j["stop"] else "no stop"
            cells.append(f"log_every={every}: max {j['max_ratio']:.3g} x its level, {stop}")
        print(f"{d.name}: " + "; ".join(cells), flush=True)
    print(f"(a stop: above 3 x the level and 1 nat above it, or {DEAD_STEPS} zero-gradient steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

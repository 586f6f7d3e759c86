"""The resume guard's false-alarm study (checkpoint/health.py): how far above its limit a clean
resume's first losses come, and whether a model reset to chance is caught.

    python tools/resume_guard_study.py /tmp/guard-study            # the full study (CPU, ~15 min)
    python tools/resume_guard_study.py /tmp/guard-study --quick    # its smallest form (the test)

Each run trains uninterrupted on CPU and logs every loss (or every 5th). A resume at a logged
step replays bit for bit the losses the uninterrupted run logged after it (the repo's exact
resume), so the guard is judged at every logged step with enough history before it and
FIRST logged losses after it: each is one clean resume. A few real resumes (from the
checkpoints of one run, through train.py) confirm the equivalence: their losses equal the
uninterrupted run's bitwise and the guard says healthy. For each clean resume:

- z: the smallest of the first FIRST resumed losses minus the predicted level (+ rising
  trend), in the measured step-to-step noise; the guard stops only when it exceeds
  NOISE_UNITS and the relative excess (rel) exceeds MIN_MARGIN;
- reset: the same with the run's first FIRST losses (the untrained model's) in place of the
  resumed ones: what a model reset to chance would show; counted as caught or missed.

Prints one line per run and the totals; exit status 1 when a clean resume stops.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import sys
from contextlib import redirect_stdout
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from checkpoint.health import FIRST, Recent, logged_losses  # noqa: E402

_BASE = ["train.device=cpu", "checkpoint=none", "train.log_every=1"]
_TINY = ["model=tiny", "data.seq_len=64", "data.max_bytes=400000", "train.global_batch_size=8"]

#: name -> overrides of the uninterrupted runs of the full study.
RUNS: dict[str, list[str]] = {
    "tiny": [*_TINY, "train.steps=60"],
    "tiny-nomask": [*_TINY, "train.steps=60", "data.document_mask=false", "train.seed=7"],
    "tiny-lr1e-2": [*_TINY, "train.steps=60", "optim.lr=1e-2", "optim.warmup_steps=10"],
    "tiny-lr1e-3": [*_TINY, "train.steps=60", "optim.lr=1e-3", "data.document_mask=false"],
    "tiny-batch2": [*_TINY, "train.steps=60", "train.global_batch_size=2", "train.seed=3"],
    "tiny-warmup2": [*_TINY, "train.steps=40", "optim.warmup_steps=2"],
    "tiny-seq256": ["model=tiny", "data.max_bytes=400000", "train.steps=40",
                    "train.global_batch_size=4"],
    "tiny-log5": [*_TINY, "train.steps=200", "train.log_every=5", "data.document_mask=false"],
    "tiny-synthetic": ["model=tiny", "data=synthetic", "data.seq_len=64", "data.doc_len=16",
                       "train.global_batch_size=8", "train.steps=30"],
    "small": ["model=small", "data.seq_len=32", "data.max_bytes=400000",
              "train.global_batch_size=4", "train.steps=24", "optim.warmup_steps=8"],
    "small-nomask": ["model=small", "data.seq_len=32", "data.max_bytes=400000",
                     "train.global_batch_size=4", "train.steps=24", "optim.warmup_steps=8",
                     "data.document_mask=false", "train.seed=5"],
}  # fmt: skip
#: The real resumes: a run with checkpoints every RESUME_EVERY steps, resumed from each.
RESUMED = [*_TINY, "train.steps=20", "checkpoint=sync", "checkpoint.keep_last=10"]
RESUME_EVERY = 4

QUICK_RUNS = {"tiny": [*_TINY, "train.steps=12"]}
QUICK_RESUMED = [*_TINY, "train.steps=12", "checkpoint=sync", "checkpoint.keep_last=10"]


def _train(root: Path, name: str, overrides: list[str]) -> str:
    """train.py in this process; its stdout."""
    import train
    from checkpoint.manager import close_open
    from config import compose_config

    out = io.StringIO()
    try:
        with redirect_stdout(out):
            status = train.run(compose_config([f"run.root={root}", f"run.name={name}", *overrides]))
    finally:
        close_open()
    if status != 0:
        raise SystemExit(f"{name}: train.py returned {status}:\n{out.getvalue()}")
    return out.getvalue()


def judge(points: list[tuple[int, float]]) -> list[dict]:
    """The guard at every logged step of an uninterrupted run: one dict per clean resume."""
    untrained = [v for _, v in points[:FIRST]]
    samples = []
    for i in range(len(points) - FIRST):
        recent = Recent.from_losses(points[: i + 1])
        if recent is None:
            continue
        judged = [v for _, v in points[i + 1 : i + 1 + FIRST]]
        base = recent.level + recent.rise
        samples.append(
            {
                "step": points[i][0],
                "z": (min(judged) - base) / recent.noise if recent.noise > 0 else float("-inf"),
                "z1": (judged[0] - base) / recent.noise if recent.noise > 0 else float("-inf"),
                "rel": (min(judged) - base) / abs(recent.level),
                "stop": all(v > recent.limit for v in judged),
                "reset_z": (min(untrained) - base) / recent.noise if recent.noise else 0.0,
                "reset_caught": all(v > recent.limit for v in untrained),
                "learned": (untrained[0] - recent.level) / untrained[0],
            }
        )
    return samples


def real_resumes(root: Path, overrides: list[str], every: int) -> list[dict]:
    """Train `overrides` with a checkpoint every `every` steps, then resume a copy of the run
    from each checkpoint: the resumed losses against the uninterrupted ones, and the
    guard's line."""
    base_dir = root / "resumed-base"
    shutil.rmtree(base_dir, ignore_errors=True)
    _train(root, base_dir.name, [*overrides, f"checkpoint.interval={every}"])
    base = dict(logged_losses(_records(base_dir), 10**9))
    results = []
    for ckpt in sorted((base_dir / "checkpoints").glob("step_*")):
        step = int(ckpt.name.split("_")[1])
        if step == max(base):
            continue
        name = f"resumed-{step}"
        shutil.rmtree(root / name, ignore_errors=True)
        shutil.copytree(base_dir, root / name)
        # The resumed run's own metrics: those of the base run up to the checkpoint.
        kept = [r for r in _records(base_dir) if r.get("step", 0) <= step]
        (root / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
        path = root / name / "checkpoints" / ckpt.name
        out = _train(
            root, name, [*overrides, f"checkpoint.interval={every}", f"checkpoint.resume={path}"]
        )
        after = {s: v for s, v in logged_losses(_records(root / name), 10**9) if s > step}
        verdict = [x for x in out.splitlines() if x.startswith("checkpoint: resumed segment")]
        results.append(
            {
                "step": step,
                "bitwise": after == {s: v for s, v in base.items() if s > step},
                "healthy": len(verdict) == 1 and "healthy" in verdict[0],
                "line": verdict[0] if verdict else "(no verdict)",
            }
        )
    return results


def _records(run_dir: Path) -> list[dict]:
    from runlog import read_metrics

    return read_metrics(run_dir / "metrics.jsonl")


def _quantiles(values: list[float]) -> str:
    v = sorted(values)
    at = lambda q: v[min(len(v) - 1, int(q * (len(v) - 1) + 0.5))]  # noqa: E731
    return f"median {at(0.5):+.2f}, p99 {at(0.99):+.2f}, max {v[-1]:+.3f}"


def study(root: Path, runs: dict[str, list[str]], resumed: list[str], every: int) -> dict:
    """Every run, the guard at each of its logged steps, and the real resumes; prints the
    report and returns the totals."""
    root.mkdir(parents=True, exist_ok=True)
    everything: list[dict] = []
    for name, overrides in runs.items():
        if not (root / name / "metrics.jsonl").exists():
            _train(root, name, [*_BASE, *overrides])
        samples = judge(logged_losses(_records(root / name), 10**9))
        everything += samples
        zs = [s["z"] for s in samples]
        print(
            f"{name}: {len(samples)} clean resumes, {sum(s['stop'] for s in samples)} stops; "
            f"z {_quantiles(zs)}; rel max {max(s['rel'] for s in samples):+.3f}; reset caught "
            f"{sum(s['reset_caught'] for s in samples)}/{len(samples)}",
            flush=True,
        )
    real = real_resumes(root, [*_BASE, *resumed], every)
    for r in real:
        print(f"real resume from step {r['step']}: bitwise={r['bitwise']}; {r['line']}")
    learned = [s for s in everything if s["learned"] > 0.15]
    totals = {
        "resumes": len(everything) + len(real),
        "stops": sum(s["stop"] for s in everything) + sum(not r["healthy"] for r in real),
        "real_bitwise": all(r["bitwise"] for r in real),
        "z_max": max(s["z"] for s in everything),
        "rel_max": max(s["rel"] for s in everything),
        "reset_caught": sum(s["reset_caught"] for s in learned),
        "reset_judged": len(learned),
    }
    print(
        f"total: {totals['resumes']} clean resumes ({len(real)} real), {totals['stops']} stops; "
        f"z (min of the first {FIRST} minus the level, in noises) "
        f"{_quantiles([s['z'] for s in everything])}; first loss alone "
        f"{_quantiles([s['z1'] for s in everything])}; relative "
        f"{_quantiles([s['rel'] for s in everything])}; a reset to chance caught in "
        f"{totals['reset_caught']}/{totals['reset_judged']} resumes of runs that had learned "
        f"15% of their loss (reset z {_quantiles([s['reset_z'] for s in learned])})"
    )
    return totals


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("root", type=Path, help="where the study's runs go (reused when there)")
    p.add_argument("--quick", action="store_true", help="one short run and 2 real resumes")
    a = p.parse_args(argv)
    if a.quick:
        totals = study(a.root, QUICK_RUNS, QUICK_RESUMED, RESUME_EVERY)
    else:
        totals = study(a.root, RUNS, RESUMED, RESUME_EVERY)
    return 1 if totals["stops"] or not totals["real_bitwise"] else 0


if __name__ == "__main__":
    sys.exit(main())

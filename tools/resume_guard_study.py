"""The resume guard's study (checkpoint/health.py): how far above its limit a clean resume's
first losses come (false alarms), and which damaged checkpoints it catches.

    python tools/resume_guard_study.py /tmp/guard-study            # the full study (CPU, ~20 min)
    python tools/resume_guard_study.py /tmp/guard-study --quick    # its smallest form (the test)

Each run trains uninterrupted on CPU and logs every loss (or every 5th). A resume at a logged
step replays bit for bit the losses the uninterrupted run logged after it (the repo's exact
resume), so the guard is judged at every logged step with enough history before it and
FIRST logged losses after it: each is one clean resume, judged by the guard's own
`ResumeWatch`. Real resumes through train.py confirm the equivalence (their losses equal the
uninterrupted run's bitwise and the guard says healthy) and add what an uninterrupted run
cannot show: a finished run extended past the end of its schedule (`train.steps` raised with
`resume.accept=[train.steps]`, the lr rising again). For each clean resume:

- z: the ABOVE-th largest of the first FIRST resumed losses minus the predicted level
  (+ rising trend), in the measured step-to-step noise; the guard stops when it exceeds
  NOISE_UNITS and the relative excess (rel) exceeds MIN_MARGIN;
- reset: the same with the run's first FIRST losses (the untrained model's) in place of the
  resumed ones: what a model reset to chance would show; counted as caught or missed.

Damage (`DAMAGE`): each checkpoint of the real-resume run but the first, changed as each kind
says with its files' hashes rewritten (every check of a load passes), resumed through train.py
for FIRST steps: caught (the run stops in one line) or missed, with z. Prints one line per run
and kind and the totals; exit status 1 when a clean resume stops.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from checkpoint.health import ABOVE, FIRST, Recent, ResumeWatch, logged_losses  # noqa: E402
from tools.benchlib import train_here  # noqa: E402

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
    # Past the end of its 40-step schedule, at its final lr: resumes from step 40 on.
    "tiny-past-end": [*_TINY, "train.steps=60", "optim.schedule_steps=40", "train.seed=11"],
    "small": ["model=small", "data.seq_len=32", "data.max_bytes=400000",
              "train.global_batch_size=4", "train.steps=24", "optim.warmup_steps=8"],
    "small-nomask": ["model=small", "data.seq_len=32", "data.max_bytes=400000",
                     "train.global_batch_size=4", "train.steps=24", "optim.warmup_steps=8",
                     "data.document_mask=false", "train.seed=5"],
}  # fmt: skip
#: The real resumes: a run with checkpoints every RESUME_EVERY steps, resumed from each (its
#: schedule given, so that a damaged resume may stop after FIRST steps without changing it).
RESUMED = [
    *_TINY,
    "train.steps=20",
    "optim.schedule_steps=20",
    "optim.warmup_steps=4",
    "checkpoint=sync",
    "checkpoint.keep_last=10",
]
RESUME_EVERY = 4
#: The real-resume run's end, extended to this step: `train.steps` raised past the schedule
#: it finished, the schedule stretched to it (the lr rises again).
EXTEND_TO = 28

QUICK_RUNS = {"tiny": [*_TINY, "train.steps=12"]}
QUICK_EXTEND_TO = 15
QUICK_RESUMED = [
    *_TINY,
    "train.steps=12",
    "optim.schedule_steps=12",
    "optim.warmup_steps=4",
    "checkpoint=sync",
    "checkpoint.keep_last=10",
]


def _scale_all(t: torch.Tensor, fqn: str, g: torch.Generator, early) -> torch.Tensor:
    return t * 0.5


#: Damage that passes every check of a load (name -> how a model tensor changes, given the
#: tensor, its name, a seeded generator, and the same tensor in the run's first checkpoint).
DAMAGE: dict[str, Callable] = {
    "weights x0.5": _scale_all,
    "weights of the first checkpoint": lambda t, fqn, g, early: early,
    "output head x0.5": lambda t, fqn, g, early: t * 0.5 if fqn == "model.lm_head.weight" else t,
    "noise 10% of each std": lambda t, fqn, g, early: t + 0.1 * t.std() * torch.randn(
        t.shape, generator=g
    ),
    "each tensor x U(0.9, 1.1)": lambda t, fqn, g, early: t * (0.9 + 0.2 * torch.rand((), generator=g)),
}  # fmt: skip
QUICK_DAMAGE = ["weights x0.5", "output head x0.5"]


# -- damage that passes every check -------------------------------------------------------------


def saved_item(ckpt: Path, fqn: str) -> tuple[Path, int, int]:
    """(file, offset, length) of a tensor's record in a checkpoint."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(ckpt)).read_metadata()
    info = next(v for k, v in md.storage_data.items() if k.fqn == fqn)
    return ckpt / info.relative_path, info.offset, info.length


def saved_tensor(ckpt: Path, fqn: str) -> torch.Tensor:
    """The tensor `fqn` as saved (a record of torch.save's uncompressed zip)."""
    path, offset, length = saved_item(ckpt, fqn)
    with path.open("rb") as f:
        f.seek(offset)
        return torch.load(io.BytesIO(f.read(length)), weights_only=True)


def model_tensors(ckpt: Path) -> list[str]:
    """The names of the model's tensors in a checkpoint."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(ckpt)).read_metadata()
    return sorted(k for k in md.state_dict_metadata if k.startswith("model."))


def rewrite_hash(ckpt: Path, name: str) -> None:
    """The manifest entry of file `name` rewritten to the hash of its bytes as they are now."""
    from checkpoint import hashing, store

    manifest = store.read_manifest(ckpt)
    entry = manifest["files"][name]
    algorithm, _ = hashing.recorded(entry)
    entry[algorithm] = hashing.hash_file(ckpt / name, algorithm)
    (ckpt / store.MANIFEST).write_text(json.dumps(manifest))


def rewrite_tensor(
    ckpt: Path, fqn: str, change: Callable[[torch.Tensor], torch.Tensor], rehash: bool = True
) -> None:
    """The saved values of `fqn` replaced by `change(saved)` (same shape and dtype), in place,
    and (`rehash`) its file's hash rewritten: every check of a load passes."""
    path, offset, length = saved_item(ckpt, fqn)
    data = bytearray(path.read_bytes())
    record = bytes(data[offset : offset + length])
    tensor = torch.load(io.BytesIO(record), weights_only=True)
    raw = tensor.numpy().tobytes()
    at = offset + record.index(raw)
    new = change(tensor.clone()).to(tensor.dtype).contiguous()
    if new.shape != tensor.shape:
        raise ValueError(f"{fqn}: {tuple(new.shape)} in place of {tuple(tensor.shape)}")
    data[at : at + len(raw)] = new.numpy().tobytes()
    path.write_bytes(bytes(data))
    if rehash:
        rewrite_hash(ckpt, path.name)


def damage(ckpt: Path, kind: str, early: Path | None = None, seed: int = 0) -> None:
    """Change every model tensor of `ckpt` as DAMAGE[kind] says (`early`: the checkpoint
    whose tensors "weights of the first checkpoint" takes)."""
    g = torch.Generator().manual_seed(seed)
    for fqn in model_tensors(ckpt):
        before = saved_tensor(early, fqn) if early is not None else None
        rewrite_tensor(ckpt, fqn, lambda t, fqn=fqn, before=before: DAMAGE[kind](t, fqn, g, before))


# -- the study ----------------------------------------------------------------------------------


def _z(values: list[float], recent: Recent) -> float:
    """The ABOVE-th largest of `values` above the level (+ rising trend), in noises."""
    if not recent.noise:
        return float("-inf")
    return (sorted(values)[-ABOVE] - recent.level - recent.rise) / recent.noise


def _stops(recent: Recent, values: list[float]) -> bool:
    """The guard's verdict (ResumeWatch) on a resume whose first losses are `values`."""
    watch = ResumeWatch(recent, seen=[(0, v) for v in values])
    return watch.decide() == "unhealthy"


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
                "z": _z(judged, recent),
                "z1": (judged[0] - base) / recent.noise if recent.noise > 0 else float("-inf"),
                "rel": (sorted(judged)[-ABOVE] - base) / abs(recent.level),
                "stop": _stops(recent, judged),
                "reset_z": _z(untrained, recent) if recent.noise else 0.0,
                "reset_caught": _stops(recent, untrained),
                "learned": (untrained[0] - recent.level) / untrained[0],
            }
        )
    return samples


def _verdict(out: str) -> str:
    lines = [x for x in out.splitlines() if x.startswith(("checkpoint: resumed segment", "error:"))]
    return lines[0] if lines else "(no verdict)"


def _copy_run(base_dir: Path, dest: Path, step: int) -> Path:
    """A copy of `base_dir` whose metrics stop at `step`; its checkpoint of `step`."""
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(base_dir, dest)
    kept = [r for r in _records(base_dir) if r.get("step", 0) <= step]
    (dest / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    return dest / "checkpoints" / f"step_{step:07d}"


def real_resumes(root: Path, overrides: list[str], every: int, extend_to: int) -> list[dict]:
    """Train `overrides` with a checkpoint every `every` steps, then resume a copy of the run
    from each checkpoint: the resumed losses against the uninterrupted ones, and the
    guard's line; then the run's end extended past its schedule, to step `extend_to`."""
    base_dir = root / "resumed-base"
    shutil.rmtree(base_dir, ignore_errors=True)
    args = [*overrides, f"checkpoint.interval={every}"]
    train_here(root, base_dir.name, args)
    base = dict(logged_losses(_records(base_dir), 10**9))
    results = []
    for ckpt in sorted((base_dir / "checkpoints").glob("step_*")):
        step = int(ckpt.name.split("_")[1])
        name = f"resumed-{step}"
        path = _copy_run(base_dir, root / name, step)
        if step == max(base):  # the end: extended past its schedule
            extend = [f"train.steps={extend_to}", f"optim.schedule_steps={extend_to}"]
            out = train_here(root, name, [*args, *extend, "resume.accept=[optim.schedule_steps]"])
            results.append({"step": step, "extended": True, "bitwise": True})
        else:
            out = train_here(root, name, [*args, f"checkpoint.resume={path}"])
            after = {s: v for s, v in logged_losses(_records(root / name), 10**9) if s > step}
            want = {s: v for s, v in base.items() if s > step}
            results.append({"step": step, "extended": False, "bitwise": after == want})
        verdict = _verdict(out)
        results[-1].update(healthy=verdict.startswith("checkpoint: resumed segment healthy"))
        results[-1]["line"] = verdict
    return results


def damaged_resumes(root: Path, overrides: list[str], every: int, kinds: list[str]) -> list[dict]:
    """Each checkpoint of the real-resume run (resumed-base) but its first, damaged as each of
    `kinds` says, resumed for FIRST steps: whether the guard stopped the run, and z."""
    base_dir = root / "resumed-base"
    args = [*overrides, f"checkpoint.interval={every}"]
    steps = sorted(int(p.name.split("_")[1]) for p in (base_dir / "checkpoints").glob("step_*"))
    early = base_dir / "checkpoints" / f"step_{steps[0]:07d}"
    results = []
    for kind in kinds:
        for step in steps[1:-1]:
            name = "damaged"
            path = _copy_run(base_dir, root / name, step)
            damage(path, kind, early)
            out = train_here(
                root,
                name,
                [*args, f"train.steps={step + FIRST}", f"checkpoint.resume={path}"],
                ok=(0, 2),
            )
            losses = [v for s, v in logged_losses(_records(root / name), 10**9) if s > step]
            recent = Recent.from_records(_records(base_dir), step)
            results.append(
                {
                    "kind": kind,
                    "step": step,
                    "caught": _verdict(out).startswith("error: the loss after resuming"),
                    "z": _z(losses, recent),
                    "line": _verdict(out),
                }
            )
    shutil.rmtree(root / "damaged", ignore_errors=True)
    return results


def _records(run_dir: Path) -> list[dict]:
    from runlog import read_metrics

    return read_metrics(run_dir / "metrics.jsonl")


def _quantiles(values: list[float]) -> str:
    v = sorted(values)
    at = lambda q: v[min(len(v) - 1, int(q * (len(v) - 1) + 0.5))]  # noqa: E731
    return f"median {at(0.5):+.2f}, p99 {at(0.99):+.2f}, max {v[-1]:+.3f}"


def study(
    root: Path,
    runs: dict[str, list[str]],
    resumed: list[str],
    every: int,
    kinds: list[str] | None = None,
    extend_to: int = EXTEND_TO,
) -> dict:
    """Every run, the guard at each of its logged steps, the real resumes and the damaged
    ones (`kinds`, default: every kind of DAMAGE); prints the report and returns the totals."""
    root.mkdir(parents=True, exist_ok=True)
    everything: list[dict] = []
    for name, overrides in runs.items():
        if not (root / name / "metrics.jsonl").exists():
            train_here(root, name, [*_BASE, *overrides])
        samples = judge(logged_losses(_records(root / name), 10**9))
        everything += samples
        zs = [s["z"] for s in samples]
        print(
            f"{name}: {len(samples)} clean resumes, {sum(s['stop'] for s in samples)} stops; "
            f"z {_quantiles(zs)}; rel max {max(s['rel'] for s in samples):+.3f}; reset caught "
            f"{sum(s['reset_caught'] for s in samples)}/{len(samples)}",
            flush=True,
        )
    real = real_resumes(root, [*_BASE, *resumed], every, extend_to)
    for r in real:
        what = "extended past its schedule" if r["extended"] else f"bitwise={r['bitwise']}"
        print(f"real resume from step {r['step']} ({what}): {r['line']}", flush=True)
    damaged = damaged_resumes(
        root, [*_BASE, *resumed], every, list(DAMAGE) if kinds is None else kinds
    )
    caught: dict[str, list[dict]] = {}
    for d in damaged:
        caught.setdefault(d["kind"], []).append(d)
    for kind, ds in caught.items():
        each = ", ".join(
            f"step {d['step']} z {d['z']:+.1f} {'caught' if d['caught'] else 'missed'}" for d in ds
        )
        print(
            f"damage {kind}: caught {sum(d['caught'] for d in ds)}/{len(ds)} ({each})", flush=True
        )
    learned = [s for s in everything if s["learned"] > 0.15]
    totals = {
        "resumes": len(everything) + len(real),
        "stops": sum(s["stop"] for s in everything) + sum(not r["healthy"] for r in real),
        "real_bitwise": all(r["bitwise"] for r in real),
        "z_max": max(s["z"] for s in everything),
        "rel_max": max(s["rel"] for s in everything),
        "reset_caught": sum(s["reset_caught"] for s in learned),
        "reset_judged": len(learned),
        "damage": {k: (sum(d["caught"] for d in ds), len(ds)) for k, ds in caught.items()},
    }
    print(
        f"total: {totals['resumes']} clean resumes ({len(real)} real), {totals['stops']} stops; "
        f"z (the {ABOVE}nd largest of the first {FIRST} minus the level, in noises) "
        f"{_quantiles([s['z'] for s in everything])}; first loss alone "
        f"{_quantiles([s['z1'] for s in everything])}; relative "
        f"{_quantiles([s['rel'] for s in everything])}; a reset to chance caught in "
        f"{totals['reset_caught']}/{totals['reset_judged']} resumes of runs that had learned "
        f"15% of their loss (reset z {_quantiles([s['reset_z'] for s in learned])}); damage "
        + ", ".join(f"{k} {c}/{n}" for k, (c, n) in totals["damage"].items())
    )
    return totals


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("root", type=Path, help="where the study's runs go (reused when there)")
    p.add_argument("--quick", action="store_true", help="one short run, its real resumes, 2 kinds")
    a = p.parse_args(argv)
    if a.quick:
        totals = study(
            a.root, QUICK_RUNS, QUICK_RESUMED, RESUME_EVERY, QUICK_DAMAGE, QUICK_EXTEND_TO
        )
    else:
        totals = study(a.root, RUNS, RESUMED, RESUME_EVERY)
    return 1 if totals["stops"] or not totals["real_bitwise"] else 0


if __name__ == "__main__":
    sys.exit(main())

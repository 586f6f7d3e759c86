"""Resume parity: an uninterrupted run vs the same run resumed from its middle checkpoint.

    python -m tests.harness.resume --steps 20 -- model=tiny data.seq_len=64          # CPU
    python -m tests.harness.resume --modes sync async --recipes bf16 fp8_cs --quantized-init both \
        -- model=small                                                             # one GPU
    python -m tests.harness.resume --nproc 4 --resume-nproc 2 --resume-overrides parallel=fsdp \
        -- model=small parallel=fsdp                                               # reshard 4 -> 2
    python -m tests.harness.resume --copy-checkpoint runs/a runs/b 20              # the copy only

(from the repository root). The one resume-parity harness; the protocol, `resume_case`:

    run A     train `steps` steps, a checkpoint every steps/2, one log record per step
    copy      A's run directory to B's with only the checkpoint of step steps/2 (what a run
              killed right after that save would have left: `keep_only_checkpoint`)
    run B     the same command (or another process count / layout) on B's directory: it
              must resume from the middle checkpoint (`resumed`)
    compare   the losses after the middle, B against A, must be bitwise equal (`second_half`)

Who runs it how: this command line starts each run as a train.py subprocess (`runtime.launch`,
one table row per recipe x quantized_init x checkpoint mode); tests/harness/matrix.py runs
train.run() in-process inside one torchrun job; tests/harness/scale.py compares the runs of
tests/gpu/suite.sh's scale stage (launched by the script, copied by `--copy-checkpoint`) with
`loss_parity`. Exit status: 0 when every case resumed and is bitwise equal, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from runlog import Run, compare, load_run

#: run(overrides, label) -> None on success, else a one-line error. label: "A" or "B".
Runner = Callable[[list[str], str], "str | None"]


def replace_overrides(base: list[str], new: list[str]) -> list[str]:
    """`base` with `new` applied: an override in `new` replaces every base override of the
    same key or below it (`parallel=tp` drops `parallel=fsdp` and `parallel.dp_shard=2`)."""
    keys = [o.split("=", 1)[0] for o in new]
    kept = [
        o for o in base if not any(o.split("=", 1)[0] == k or o.startswith(k + ".") for k in keys)
    ]
    return kept + list(new)


def keep_only_checkpoint(src: Path, dst: Path, step: int) -> None:
    """Copy run directory `src` to `dst` with only the checkpoint of `step` (what a run killed
    right after that save would have left)."""
    shutil.copytree(src, dst)
    for d in (dst / "checkpoints").iterdir():
        if d.is_dir() and d.name != f"step_{step:07d}":
            shutil.rmtree(d)


def resumed(run_b: Path) -> bool:
    """Whether run B resumed the copied checkpoint: a fresh start would have moved the copied
    metrics.jsonl aside (logger.py) instead of trimming it to the checkpoint's step."""
    return (run_b / "metrics.jsonl").is_file() and not list(run_b.glob("metrics.*.jsonl"))


def after(run: Run, step: int) -> Run:
    """The records of `run` after `step`."""
    return {s: r for s, r in run.items() if s > step}


def loss_parity(run_a: Run, run_b: Run) -> dict:
    """B's loss against A's on their common steps: steps compared, max absolute and relative
    difference, bitwise equality (some step compared, none differs), first differing step."""
    report = compare({"A": run_a, "B": run_b}, metrics=("loss",), rtol=0, atol=0)
    d = report.diffs[0]
    return dict(
        steps=d.common_steps,
        max_abs=d.max_abs,
        max_rel=d.max_rel,
        bitwise=report.ok,
        first_diff=d.first_diff_step,
    )


def second_half(run_a: Path, run_b: Path, half: int) -> dict:
    """`loss_parity` of the run directories' steps after `half`."""
    return loss_parity(after(load_run(run_a), half), after(load_run(run_b), half))


def case_overrides(
    recipe: str, qinit: bool, mode: str, steps: int, root: Path, extra: list[str]
) -> tuple[str, list[str]]:
    """Name and train.py overrides of one resume case: save every steps/2, log every step."""
    name = f"{recipe}{'-q' if qinit else ''}-{mode}"
    return name, [
        f"recipe={recipe}",
        f"recipe.quantized_init={str(qinit).lower()}",
        f"checkpoint={mode}",
        f"checkpoint.interval={steps // 2}",
        "checkpoint.keep_last=4",
        f"train.steps={steps}",
        "train.log_every=1",
        f"run.root={root}",
        *extra,
    ]


def resume_case(
    run: Runner,
    root: Path,
    name: str,
    overrides: list[str],
    half: int,
    *,
    resume_overrides: Sequence[str] = (),
    leader: bool = True,
    sync: Callable[[], None] = lambda: None,
) -> dict:
    """Run A (`overrides`, run.name=<name>-A), copy it to <name>-B keeping only the checkpoint
    of step `half`, run B (`overrides` with `resume_overrides` applied, run.name=<name>-B) and
    compare the losses after `half`. Returns the seconds of each run and, on the `leader`
    (the one process that copies and compares; `sync` is called around the copy so the
    others wait for it), `resumed` and `second_half`'s keys; or `error` when a run failed."""
    run_a, run_b = root / f"{name}-A", root / f"{name}-B"
    row: dict = {}
    for label, args in (("A", overrides), ("B", replace_overrides(overrides, [*resume_overrides]))):
        t0 = time.perf_counter()
        error = run([*args, f"run.name={name}-{label}"], label)
        row[f"seconds_{label.lower()}"] = time.perf_counter() - t0
        if error is not None:
            return dict(row, error=error)
        if label == "A":
            sync()
            if leader:
                keep_only_checkpoint(run_a, run_b, half)
            sync()
    if leader:
        row["resumed"] = resumed(run_b)
        row.update(second_half(run_a, run_b, half))
    return row


def format_table(rows: list[dict], keys: tuple[str, ...] = ("case",), timing: bool = False) -> str:
    """Markdown table of resume rows: the `keys` columns, then the comparison (and the seconds
    runs A + B took with `timing`). Rows with `error` or `refused` say so instead."""
    head = [*keys, "resumed", "steps compared", "max abs loss diff", "bitwise"]
    head += ["s (A+B)"] if timing else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    blanks = " |" * (len(head) - len(keys) - 1)
    for r in rows:
        first = "| " + " | ".join(str(r.get(k, "")) for k in keys) + " |"
        if "refused" in r:
            lines.append(f"{first} refused by the config check: {r['refused']} |{blanks}")
        elif "error" in r:
            lines.append(f"{first} failed: {r['error']} |{blanks}")
        else:
            cells = [r["resumed"], r["steps"], f"{r['max_abs']:.3g}", r["bitwise"]]
            cells += [f"{r['seconds_a'] + r['seconds_b']:.0f}"] if timing else []
            lines.append(f"{first} " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def start(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`cmd` in the background from the repository root, its output to `log`, in a process
    group of its own (killpg reaches every rank); `env` adds to this process's environment."""
    return subprocess.Popen(
        cmd,
        cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        stdout=open(log, "w"),  # noqa: SIM115 - the child keeps it
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def subprocess_runner(nproc: int, resume_nproc: int | None = None) -> Runner:
    """Each run as a train.py subprocess: A on `nproc` processes, B on `resume_nproc`."""
    from runtime import launch

    def run(overrides: list[str], label: str) -> str | None:
        n = nproc if label == "A" else resume_nproc or nproc
        r = launch(overrides, nproc=n)
        if r.returncode == 0:
            return None
        return (r.stderr.strip().splitlines() or [f"{label} failed"])[-1]

    return run


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--recipes", nargs="+", default=["bf16"])
    ap.add_argument("--quantized-init", choices=["false", "true", "both"], default="false")
    ap.add_argument("--modes", nargs="+", default=["sync"])
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--resume-nproc", type=int, default=None)
    ap.add_argument("--resume-overrides", nargs="*", default=[])
    ap.add_argument(
        "--copy-checkpoint",
        nargs=3,
        metavar=("SRC", "DST", "STEP"),
        help="only copy run directory SRC to DST keeping the checkpoint of STEP, and exit",
    )
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)
    if a.copy_checkpoint:
        src, dst, step = a.copy_checkpoint
        keep_only_checkpoint(Path(src), Path(dst), int(step))
        return 0
    qinits = {"false": [False], "true": [True], "both": [False, True]}[a.quantized_init]
    run = subprocess_runner(a.nproc, a.resume_nproc)
    half = a.steps // 2
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for recipe in a.recipes:
            for q in [False] if recipe == "bf16" else qinits:
                for mode in a.modes:
                    name, common = case_overrides(recipe, q, mode, a.steps, Path(tmp), a.overrides)
                    row = resume_case(
                        run, Path(tmp), name, common, half, resume_overrides=a.resume_overrides
                    )
                    rows.append(dict(case=name, **row))
                    print(rows[-1], flush=True)
    print("\n" + format_table(rows))
    return 0 if all(r.get("bitwise") and r.get("resumed") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

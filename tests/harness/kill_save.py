"""kill -9 of one rank while its async save is in flight, then the same command resumes exactly.

    python -m tests.harness.kill_save --root /tmp/k --jsonl rows.jsonl -- model=tiny \\
        train.deterministic=true                                          # 2 GPUs (default)
    python -m tests.harness.kill_save --root /tmp/k -- model=tiny model.impl=torch   # CPU, gloo
    python -m tests.harness.kill_save --root /tmp/k --interval 2 -- model=tiny   # CPU, 8 steps

(from the repository root). Three torchrun jobs of train.py on --nproc processes, with
checkpoint=async every --interval (I, default 5) steps, 4 I steps, parallel=fsdp (the overrides
after `--` add to or replace these). Below, for I = 5:

    reference   the uninterrupted run (started beside the killed one, same devices)
    killed      the same command under this file as the program (KILL_SAVE_MARKER set): the
                save of step 10 writes every rank's data, then each rank's writer thread
                hangs before the commit and writes KILL_SAVE_MARKER.rank<r> (its pid). Once
                both ranks are there and training went on to step 12 (2 I + 2), rank 0 gets
                SIGKILL;
                torchrun tears down the other rank (the harness kills what is left after 90 s).
                Then only step 5 is committed and step_0000010.tmp holds uncommitted data.
    resumed     the same train.py command on the killed run's directory: it must resume from
                step 5, finish, leave step_0000010.tmp removed, and its losses (steps 1-20 of
                metrics.jsonl) must equal the reference's bit for bit (GPU: with
                train.deterministic=true).

Rows (tests/harness/multitier.py's: part, case, result, detail) go to --jsonl; exit status 1
when any failed.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def schedule(interval: int) -> tuple[int, int, int]:
    """(the step whose save hangs, the step training must reach before the kill, the steps of
    every run) for a checkpoint every `interval` steps."""
    return 2 * interval, 2 * interval + 2, 4 * interval


def hang_after_write(marker: str, step: int) -> None:
    """In this process: the async save of `step` writes its data, then hangs before the commit
    (the writer thread sleeps), after writing `<marker>.rank<RANK>` with this process's pid."""
    # The writer of every save (checkpoint/save.py): on the `ckpt-write` thread for
    # checkpoint=async, so training goes on while it sleeps.
    from checkpoint.save import Saver

    write = Saver._write_here

    def slow(self, state, tmp, save_id):
        out = write(self, state, tmp, save_id)
        if f"step_{step:07d}" in str(tmp):
            rank = os.environ.get("RANK", "0")
            Path(f"{marker}.rank{rank}").write_text(str(os.getpid()))
            time.sleep(3600)
        return out

    Saver._write_here = slow


def as_train_py() -> None:
    """torchrun's program for the killed run: train.py as __main__, with the hanging save."""
    import runpy

    train = ROOT / "train.py"
    sys.path[0] = str(ROOT)  # as if train.py had been started itself
    hang_after_write(os.environ["KILL_SAVE_MARKER"], int(os.environ["KILL_SAVE_STEP"]))
    sys.argv[0] = str(train)
    runpy.run_path(str(train), run_name="__main__")


def torchrun(nproc: int, program: str, overrides: list[str], log: Path, env=None):
    from tests.harness.resume import start

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return start([*cmd, f"--nproc_per_node={nproc}", program, *overrides], log, env)


def last_step(run_dir: Path) -> int:
    from runlog import read_metrics

    steps = [m.get("step", 0) for m in read_metrics(run_dir / "metrics.jsonl")]
    return max(steps, default=0)


def wait_or_kill(proc: subprocess.Popen, timeout: float) -> int:
    """proc's exit status; its whole process group SIGKILLed first if it outlives `timeout`."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--root", type=Path, required=True, help="run directories go here")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--jsonl", type=Path, default=None)
    ap.add_argument("--part", default="kill9")
    ap.add_argument("--timeout", type=float, default=240, help="per run, seconds")
    ap.add_argument("--interval", type=int, default=5, help="checkpoint every N steps (>= 1)")
    ap.add_argument("--logs", type=Path, default=None, help="job logs (default: --root)")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)
    if a.interval < 1:
        ap.error("--interval must be at least 1")
    interval = a.interval
    kill_step, after_step, steps = schedule(interval)

    from checkpoint import store
    from runlog import load_run
    from tests.harness.multitier import emit_row, row
    from tests.harness.resume import loss_parity, resumed

    logs = a.logs or a.root
    a.root.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    base = [
        "parallel=fsdp",
        "checkpoint=async",
        f"checkpoint.interval={interval}",
        "checkpoint.keep_last=4",
        f"train.steps={steps}",
        "train.log_every=1",
        f"run.root={a.root}",
        *a.overrides,
    ]
    ref_dir, run_dir = a.root / "reference", a.root / "killed"
    marker = a.root / "writing"
    rows = []

    def emit(case: str, ok: bool, detail: str) -> None:
        emit_row(rows, row(a.part, case, "passed" if ok else "failed", detail), 0, a.jsonl)

    t0 = time.time()
    ref = torchrun(a.nproc, "train.py", [*base, "run.name=reference"], logs / "kill9_reference.log")
    killed = torchrun(
        a.nproc,
        str(Path(__file__).resolve()),
        [*base, "run.name=killed"],
        logs / "kill9_killed.log",
        env={"KILL_SAVE_MARKER": str(marker), "KILL_SAVE_STEP": str(kill_step)},
    )
    wanted = [Path(f"{marker}.rank{r}") for r in range(a.nproc)]
    landed, why = False, ""
    while True:
        if all(p.exists() for p in wanted) and last_step(run_dir) >= after_step:
            landed = True
            break
        if killed.poll() is not None:
            why = (
                f"the run exited (status {killed.returncode}) before its step-{kill_step} save hung"
            )
            break
        if time.time() - t0 > a.timeout:
            why = f"the step-{kill_step} save did not hang with step {after_step} reached in {a.timeout:g} s"
            break
        time.sleep(0.2)
    if landed:
        pid = int(wanted[0].read_text())
        os.kill(pid, signal.SIGKILL)  # rank 0, mid-save: its writer thread sleeps before the commit
        t_kill = time.time()
        rc = wait_or_kill(killed, 90)
        torn = time.time() - t_kill
        complete = [c.step for c in store.list_complete(run_dir / "checkpoints")]
        partial = run_dir / "checkpoints" / f"step_{kill_step:07d}.tmp"
        ok = complete == [interval] and partial.is_dir()
        emit(
            f"kill -9 rank 0 during the async save of step {kill_step} ({a.nproc} procs)",
            ok,
            f"killed at step {last_step(run_dir)}; torchrun exit {rc} after {torn:.0f} s; "
            f"committed {complete}, {partial.name} {'left' if partial.is_dir() else 'missing'}",
        )
    else:
        if killed.poll() is None:
            wait_or_kill(killed, 0.1)
        emit(
            f"kill -9 rank 0 during the async save of step {kill_step} ({a.nproc} procs)",
            False,
            why,
        )
    rc_ref = wait_or_kill(ref, max(1.0, a.timeout - (time.time() - t0)))
    emit("uninterrupted reference run", rc_ref == 0, f"exit status {rc_ref}")
    if not landed:
        return 1

    again = torchrun(a.nproc, "train.py", [*base, "run.name=killed"], logs / "kill9_resumed.log")
    rc = wait_or_kill(again, a.timeout)
    complete = [c.step for c in store.list_complete(run_dir / "checkpoints")]
    partial = run_dir / "checkpoints" / f"step_{kill_step:07d}.tmp"
    start = _resumed_from(logs / "kill9_resumed.log")
    ok = rc == 0 and resumed(run_dir) and not partial.exists() and start == interval
    emit(
        "same command resumes",
        ok,
        f"exit {rc}; resumed from step {start}; committed {complete}; "
        f"{partial.name} {'removed' if not partial.exists() else 'still there'}",
    )
    if rc_ref == 0 and rc == 0:
        d = loss_parity(load_run(ref_dir), load_run(run_dir))
        ok = d["bitwise"] and d["steps"] == steps
        emit(
            f"losses of steps 1-{steps} equal the uninterrupted run's, bitwise",
            ok,
            f"{d['steps']} steps compared, max abs diff {d['max_abs']:.3g}, first diff "
            f"{d['first_diff']}",
        )
    else:
        emit(
            f"losses of steps 1-{steps} equal the uninterrupted run's, bitwise",
            False,
            "a run failed",
        )
    return 0 if all(r["result"] == "passed" for r in rows) else 1


def _resumed_from(log: Path) -> int | None:
    """The step train.py's log says it resumed from (its 'resume: from ... (step N)' line)."""
    import re

    text = log.read_text(errors="replace") if log.is_file() else ""
    m = re.search(r"resumed_from_step=(\d+)", text) or re.search(
        r"resume: from \S+ \(step (\d+)\)", text
    )
    return int(m.group(1)) if m else None


if __name__ == "__main__":
    if os.environ.get("KILL_SAVE_MARKER"):
        as_train_py()
    else:
        sys.exit(main())

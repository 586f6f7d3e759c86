"""Ctrl-C (issue 37, item 5), as a terminal sends it: SIGINT to the whole foreground process
group of a train.py run (1 rank) or of its launcher (2 ranks: slurm/launch.py, torchrun run in
its own process, which forwards the signal to the trainers it started in sessions of their
own). Each run starts in a session of its own, so the signal reaches nothing else.

- First press: the step ends, a checkpoint is committed, one line, status 130; no traceback.
- Second press, more than runtime.DOUBLE_PRESS_S later, while that checkpoint's commit is held
  back (tests/harness/slow_commit.py), in a run of the same command that resumed the first
  press's checkpoint (its losses bit for bit those of an uninterrupted run): the run stops at
  once, with one line naming what is committed and what is not; the checkpoints committed
  before stay intact and the run lock is released.
- A first press that lands inside a save: that save commits, then the next log step's, status
  130 (2 ranks, sync and async_process).

Every checkpoint mode on 1 and 2 ranks; the second press in three of the cases (it does not
depend on the mode beyond what those cover: a save in the main thread, in a writer thread,
in a writer process, a rank waiting for another in a barrier).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from checkpoint import store
from runlog import read_metrics
from runtime import DOUBLE_PRESS_S, EXIT_INTERRUPTED
from tests.ckpt_harness import committed
from tests.harness.resume import second_half
from tests.helpers import CPU_ENV, LAUNCHED_RUN, forwarded_receivers

ROOT = Path(__file__).resolve().parents[1]
STEPS = 24
TRAIN = [
    *LAUNCHED_RUN,
    f"train.steps={STEPS}",
    f"optim.schedule_steps={STEPS}",
    "checkpoint.interval=4",
    "checkpoint.keep_last=10",
]
#: Output of the project that says a run failed badly, or of Python or torch on a signal.
NOISE = ("Traceback", "KeyboardInterrupt", "SignalException", "error:")
LAUNCHER_LINE = (
    "launcher: got SIGINT: forwarded it to the trainers and waited for them to exit "
    "(their lines above say what was saved)"
)


def start(nproc: int, args: list[str], program=("train.py",), env=None) -> subprocess.Popen:
    cmd = [sys.executable]
    if nproc > 1:
        cmd += ["slurm/launch.py", "--standalone", f"--nproc-per-node={nproc}"]
    return subprocess.Popen(
        [*cmd, *program, *args],
        cwd=ROOT,
        env={**os.environ, **CPU_ENV, "PYTHONUNBUFFERED": "1", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: the "terminal" of this run
    )


def logged(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [r["step"] for r in read_metrics(path)] if path.exists() else []


def press_after(proc: subprocess.Popen, run_dir: Path, step: int) -> int:
    """Ctrl-C (SIGINT to the process group) once `step` is logged; the last step logged then."""
    deadline = time.monotonic() + 240
    while not (logged(run_dir) and logged(run_dir)[-1] >= step):
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "the run did not reach the step in time"
        time.sleep(0.05)
    last = logged(run_dir)[-1]
    os.killpg(proc.pid, signal.SIGINT)
    return last


def wait_for_mark(proc: subprocess.Popen, mark: Path, what: str) -> int:
    """Until tests/harness/slow_commit.py has written a save's step to `mark` as the save
    began; that step. The stop save's mark (STOP_SAVE_MARK) says the ranks have agreed to stop,
    so each has run its handler of the press. A rank that was waiting in a collective when the
    press arrived runs it only when the collective returns, and times a second press from then
    (runtime.StopSignal). The stop save is of the step the press came after, when the press
    lands before that step's stop agreement, or of the next log step."""
    deadline = time.monotonic() + 240
    while not mark.exists() or not mark.read_text().endswith("\n"):
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, f"{what} did not start in time"
        time.sleep(0.05)
    return int(mark.read_text())


def check_quiet(out: str, nproc: int) -> None:
    assert not any(word in out for word in NOISE), out
    if nproc > 1:  # the launcher's own line comes last
        assert out.rstrip().splitlines()[-1] == LAUNCHER_LINE, out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted runs, one per process count, made when first asked for."""
    made: dict[int, Path] = {}

    def get(nproc: int) -> Path:
        if nproc not in made:
            runs = tmp_path_factory.mktemp(f"reference{nproc}")
            args = [*TRAIN, "train.steps=10", "checkpoint=none", f"run.root={runs}", "run.name=r"]
            proc = start(nproc, args)
            out, _ = proc.communicate(timeout=300)
            assert proc.returncode == 0, out
            made[nproc] = runs / "r"
        return made[nproc]

    return get


@pytest.mark.parametrize(
    "nproc, mode, again",
    [
        (1, "sync", True),
        (1, "async", True),
        (1, "async_process", False),
        (2, "sync", False),
        (2, "async", False),
        (2, "async_process", True),
    ],
)
def test_ctrl_c_commits_and_a_second_stops_at_once(tmp_path, reference, nproc, mode, again):
    runs = tmp_path / "runs"
    run_dir, root = runs / "c", runs / "c" / "checkpoints"
    args = [*TRAIN, f"checkpoint={mode}", f"run.root={runs}", "run.name=c"]

    # First press: the step ends, its checkpoint is committed, status 130.
    proc = start(nproc, args)
    press_after(proc, run_dir, 2)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == EXIT_INTERRUPTED, out
    stopped = logged(run_dir)[-1]
    lines = [
        f"stop signal SIGINT (received by {who}): checkpoint at step {stopped} saved; every rank "
        "exits with status 130 (stopped by hand: not for requeue; run the same command to resume)"
        for who in forwarded_receivers(nproc)
    ]
    said = [ln for ln in out.splitlines() if ln.startswith("stop signal")]
    assert len(said) == 1 and said[0] in lines, out
    check_quiet(out, nproc)
    assert committed(root)[-1] == stopped and store.verify(root / store.step_name(stopped)) is None
    assert not list(root.glob("*.tmp"))
    if not again:
        return

    # Second press, while the save the first asked for waits to commit: stops at once.
    # (It also resumes the first press's checkpoint: its steps must match an uninterrupted run.)
    before = {s: store.verify(root / store.step_name(s)) for s in committed(root)}
    mark = tmp_path / "stop-save"
    env = {"SLOW_COMMIT_S": "60", "STOP_SAVE_MARK": str(mark)}
    proc = start(nproc, args, ("tests/harness/slow_commit.py",), env)
    pressed_after = press_after(proc, run_dir, stopped + 2)
    assert wait_for_mark(proc, mark, "the stop save") >= pressed_after
    time.sleep(DOUBLE_PRESS_S + 0.5)
    os.killpg(proc.pid, signal.SIGINT)
    pressed = time.monotonic()
    out, _ = proc.communicate(timeout=120)
    assert time.monotonic() - pressed < 20, out  # the commit would have waited 60 s
    assert proc.returncode == EXIT_INTERRUPTED, out
    at = logged(run_dir)[-1]
    newest = committed(root)[-1]  # saves of this run before the first press commit as usual
    assert stopped <= newest < at, (stopped, newest, at)
    lost = f"steps {newest + 1}-{at}" if at > newest + 1 else f"step {at}"
    line = (
        f"interrupted: stopped at once after step {at}; checkpoint {root / store.step_name(newest)}"
        f" committed; {lost} not saved (the save of step {at} in flight was abandoned); run the "
        "same command to resume from it"
    )
    assert [ln for ln in out.splitlines() if ln.startswith("interrupted")] == [line], out
    assert not any(ln.startswith("stop signal") for ln in out.splitlines()), out
    check_quiet(out, nproc)
    assert {s: before[s] for s in committed(root) if s in before} == before  # all kept, intact
    assert all(store.verify(root / store.step_name(s)) is None for s in committed(root))
    assert not (run_dir / ".lock").exists()  # released
    assert f"resumed_from_step={stopped}" in out, out
    parity = second_half(reference(nproc), run_dir, stopped)
    assert parity["steps"] == at - stopped and parity["bitwise"], parity


@pytest.mark.parametrize("mode", ["sync", "async_process"])
def test_a_ctrl_c_during_a_save_saves_the_next_step(tmp_path, reference, mode):
    """A first Ctrl-C that lands inside a save (2 ranks; the save of step 4 is held 5 s before
    it starts, tests/harness/slow_commit.py, and pressed once that hold began, so after step
    4's stop agreement): that save commits as usual, the run trains to the next log step,
    saves it and exits with status 130; its losses are an uninterrupted run's. (The Ctrl-C
    test above met this only by chance, under load, and the harness then held the commit the
    press landed in.)"""
    runs = tmp_path / "runs"
    run_dir, root = runs / "c", runs / "c" / "checkpoints"
    args = [*TRAIN, f"checkpoint={mode}", f"run.root={runs}", "run.name=c"]
    mark = tmp_path / "slow-save"
    env = {
        "SLOW_SAVE_STEP": "4",
        "SLOW_SAVE_S": "5",
        "SLOW_SAVE_MARK": str(mark),
        "SLOW_COMMIT_S": "0",
    }
    proc = start(2, args, ("tests/harness/slow_commit.py",), env)
    assert wait_for_mark(proc, mark, "the held save of step 4") == 4
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == EXIT_INTERRUPTED, out
    lines = out.splitlines()
    first = {}
    for key in ("stopping: SIGINT", "checkpoint: step 4 committed"):
        at = [i for i, ln in enumerate(lines) if ln.startswith(key)]
        assert at, f"no line starts with {key!r}:\n{out}"
        first[key] = at[0]
    assert first["stopping: SIGINT"] < first["checkpoint: step 4 committed"], out  # inside it
    assert logged(run_dir)[-1] == 5, out
    assert committed(root) == [4, 5], out
    assert all(store.verify(root / store.step_name(s)) is None for s in committed(root))
    said = [ln for ln in lines if ln.startswith("stop signal")]
    assert len(said) == 1 and "checkpoint at step 5 saved" in said[0], out
    check_quiet(out, 2)
    ref = [r["loss"] for r in read_metrics(reference(2) / "metrics.jsonl")][:5]
    assert [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")] == ref

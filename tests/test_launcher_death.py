"""Trainers whose launcher dies stop (issue 55, item 4): a 2-rank CPU run under real torchrun
(`python -m torch.distributed.run --standalone`, which hosts the rendezvous store the
trainers joined), whose agent is killed (SIGKILL) or dies of a signal it does not handle
(SIGUSR1, as a stock torchrun does). Before, both trainers trained on, saving, with nobody to
stop them. Now the kernel tells each trainer (runtime.StopSignal: PR_SET_PDEATHSIG), and
they save at the next log step (the stop agreement and the save use the process groups
made at start, not the store that died) and exit within seconds, in one line; with
checkpoint=none they stop at once, saying nothing was saved. The same under Slurm:
tests/test_slurm_real.py.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from checkpoint import store
from runlog import read_metrics
from runtime import PARENT_DEATH_SIGNAL, StopSignal, child_pids, pid_alive
from tests.ckpt_harness import committed
from tests.helpers import CPU_ENV, LAUNCHED_RUN

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("sig, mode", [(signal.SIGKILL, "sync"), (signal.SIGUSR1, "none")])
def test_trainers_stop_when_their_launcher_dies(tmp_path, sig, mode):
    run_dir = tmp_path / "o"
    args = [*LAUNCHED_RUN, "train.steps=400", f"checkpoint={mode}", "checkpoint.interval=100"]
    agent = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        + ["train.py", *args, f"run.root={tmp_path}", "run.name=o"],
        cwd=ROOT,
        env={**os.environ, **CPU_ENV, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    trainers: list[int] = []
    try:
        deadline = time.monotonic() + 240
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and len(read_metrics(metrics)) >= 3):
            assert agent.poll() is None, agent.communicate()[0]
            assert time.monotonic() < deadline, "the run did not reach step 3 in time"
            time.sleep(0.1)
        trainers = child_pids(agent.pid)
        assert len(trainers) == 2
        os.kill(agent.pid, sig)
        killed = time.monotonic()
        out, _ = agent.communicate(timeout=120)  # until the trainers close the pipe too
        while any(map(pid_alive, trainers)) and time.monotonic() - killed < 60:
            time.sleep(0.05)
        took = time.monotonic() - killed
    finally:
        for pid in [agent.pid, *trainers]:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert agent.returncode == -sig
    assert not any(map(pid_alive, trainers)) and took < 30, (took, out)  # ~2-7 s measured
    assert "Traceback" not in out and "error:" not in out, out
    logged = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")]
    assert logged == list(range(1, logged[-1] + 1)) and logged[-1] < 100, out
    if mode == "none":
        said = [x for x in out.splitlines() if x.startswith(("stopping:", "interrupted:"))]
        assert len(said) == 1, out
        m = re.fullmatch(
            r"interrupted: its launcher died \(checkpoint=none: nothing to save\); stopped at "
            rf"once after step (\d+); no checkpoint committed in {re.escape(str(run_dir))}"
            r"/checkpoints; steps 1-\1 not saved",
            said[0],
        )
        assert m and int(m[1]) in (logged[-1], logged[-1] + 1), out
        return
    said = [x for x in out.splitlines() if x.startswith("stopping:")]
    assert len(said) == 1 and said[0].startswith(
        f"stopping: the launcher of this node's trainers (pid {agent.pid}) is gone, so "
        "nothing would stop them: stopping during step "
    ), out
    stop = (
        f"stop signal SIGTERM (this node's launcher died; received by every rank): checkpoint "
        f"at step {logged[-1]} saved; every rank exits with status 3 for requeue"
    )
    assert stop in out.splitlines(), out
    root = run_dir / "checkpoints"
    assert (
        committed(root) == [logged[-1]] and store.verify(root / store.step_name(logged[-1])) is None
    )


def test_a_launcher_gone_before_the_handler_counts_and_restore_disarms():
    """A launcher pid that is not this process's parent: gone already, the stop is due at
    once; the launcher alive: its threads' ends are ignored; restore takes the kernel's
    signal back (PR_GET_PDEATHSIG reads 0), so later runs in this process are not stopped."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    value = ctypes.c_int(-1)

    def pdeathsig() -> int:
        assert libc.prctl(2, ctypes.byref(value), 0, 0, 0) == 0  # PR_GET_PDEATHSIG
        return value.value

    gone = StopSignal(save=True, launcher=os.getppid() + 100_000)
    try:
        assert gone.orphaned and gone.received == signal.SIGTERM
        assert pdeathsig() == PARENT_DEATH_SIGNAL
    finally:
        gone.restore()
    assert pdeathsig() == 0
    alive = StopSignal(save=True, launcher=os.getppid())
    try:
        os.kill(os.getpid(), PARENT_DEATH_SIGNAL)  # as when a thread of the launcher ends
        time.sleep(0.1)
        assert not alive.orphaned and alive.received is None
    finally:
        alive.restore()
    plain = StopSignal(save=True)  # not a launcher's worker: nothing asked of the kernel
    try:
        assert pdeathsig() == 0 and plain.launcher is None
    finally:
        plain.restore()

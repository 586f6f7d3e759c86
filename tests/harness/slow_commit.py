"""train.py whose checkpoint commits wait SLOW_COMMIT_S seconds (default 60) for the saves that
start after the process got a Ctrl-C: the save a first Ctrl-C asks for is still in flight when
a test presses Ctrl-C again (tests/test_ctrl_c.py). Saves started before the Ctrl-C commit as
usual, also one the Ctrl-C lands in (the press comes when a step is logged, which is just
before that step's save; slowing that save's commit held rank 0 inside it while the other
ranks went on to the next step's collectives).

SLOW_SAVE_STEP=N (with SLOW_SAVE_S, default 5): the save of step N waits that long before it
starts, so a Ctrl-C pressed once step N is logged lands inside a save (tests/test_ctrl_c.py).

    python tests/harness/slow_commit.py <train.py overrides>
    python slurm/launch.py --standalone --nproc-per-node=2 tests/harness/slow_commit.py ...

train.py runs in this process as __main__ (runpy, as slurm/run_trainer.py runs it), so Hydra
finds its config as when train.py is started itself.
"""

from __future__ import annotations

import faulthandler
import os
import runpy
import signal
import sys
import threading
import time
from pathlib import Path

TRAIN = Path(__file__).resolve().parents[2] / "train.py"
sys.path[0] = str(TRAIN.parent)  # as if train.py had been started itself

import runtime  # noqa: E402
from checkpoint.save import Committer, Saver  # noqa: E402

#: Set by the first SIGINT this process's StopSignal handles.
_INTERRUPTED = threading.Event()


def main() -> None:
    delay = float(os.environ.get("SLOW_COMMIT_S", "60"))
    handle, save, commit = runtime.StopSignal._handle, Saver.save, Committer.commit
    after_press: set[int] = set()  # steps whose save started after the first Ctrl-C

    def noting_handle(self, signum, frame):
        if signum == signal.SIGINT and not _INTERRUPTED.is_set():
            _INTERRUPTED.set()
            # Where every thread is, should this process still run 25 s after the first press
            # (a test's whole run ends seconds after it; torchrun kills its workers at 30 s):
            # the stacks of a rare hang of tests/test_ctrl_c.py, not yet understood.
            faulthandler.dump_traceback_later(25, file=sys.__stderr__)
        return handle(self, signum, frame)

    slow_step = int(os.environ.get("SLOW_SAVE_STEP", "-1"))
    slow_save_s = float(os.environ.get("SLOW_SAVE_S", "5"))

    def noting_save(self, step, state):
        if _INTERRUPTED.is_set():
            after_press.add(step)
        elif step == slow_step:
            time.sleep(slow_save_s)
        return save(self, step, state)

    def slow_commit(self, tmp, step, *args, **kwargs):
        if step in after_press:
            time.sleep(delay)
        return commit(self, tmp, step, *args, **kwargs)

    runtime.StopSignal._handle = noting_handle
    Saver.save = noting_save
    Committer.commit = slow_commit
    sys.argv[0] = str(TRAIN)
    runpy.run_path(str(TRAIN), run_name="__main__")


if __name__ == "__main__":
    main()

"""train.py whose stop save (the save a first Ctrl-C asks for, taken at the step where the ranks
agree to stop) commits only after SLOW_COMMIT_S seconds (default 60): it is still in flight when
a test presses Ctrl-C again (tests/test_ctrl_c.py). Every other save commits as usual, also one
that a press lands in or that starts between the press and the agreement (holding those held
rank 0 in a commit while the other rank went on to the next step's collectives). When the stop
save starts, rank 0 writes its step to the file STOP_SAVE_MARK, if set, for the test to wait on
(the stop is agreed at the next log step: the step a press came after, or a later one).

SLOW_SAVE_STEP=N (with SLOW_SAVE_S, default 5): the save of step N waits that long before it
starts, so that a Ctrl-C lands inside a save (tests/test_ctrl_c.py). As the wait begins, rank 0
writes N to the file SLOW_SAVE_MARK, if set: every rank is then past step N's stop agreement
(a collective), so a press from then on is not seen before step N is saved. (A press as soon as
step N is logged can reach a rank before that agreement, and the run then stops at step N.)

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
    mark, slow_mark = os.environ.get("STOP_SAVE_MARK"), os.environ.get("SLOW_SAVE_MARK")
    handle, agreed = runtime.StopSignal._handle, runtime.StopSignal.agreed
    save, commit = Saver.save, Committer.commit
    stop_saves: set[int] = set()  # the steps of saves taken once the ranks agreed to stop
    stopping = threading.Event()

    def noting_handle(self, signum, frame):
        if signum == signal.SIGINT and not _INTERRUPTED.is_set():
            _INTERRUPTED.set()
            # Where every thread is, should this process still run 25 s after the first press
            # (a test's whole run ends seconds after it; torchrun kills its workers at 30 s).
            faulthandler.dump_traceback_later(25, file=sys.__stderr__)
        return handle(self, signum, frame)

    def noting_agreed(self, device):
        if (out := agreed(self, device)) and self.name == "SIGINT":
            stopping.set()
        return out

    slow_step = int(os.environ.get("SLOW_SAVE_STEP", "-1"))
    slow_save_s = float(os.environ.get("SLOW_SAVE_S", "5"))

    def noting_save(self, step, state):
        def write_mark(path):  # rank 0, for the test to wait on
            if path and self.ctx.rank == 0:
                Path(path).write_text(f"{step}\n")

        if stopping.is_set():
            stop_saves.add(step)
            write_mark(mark)
        elif step == slow_step:
            write_mark(slow_mark)
            time.sleep(slow_save_s)
        return save(self, step, state)

    def slow_commit(self, tmp, step, *args, **kwargs):
        if step in stop_saves:
            time.sleep(delay)
        return commit(self, tmp, step, *args, **kwargs)

    runtime.StopSignal._handle = noting_handle
    runtime.StopSignal.agreed = noting_agreed
    Saver.save = noting_save
    Committer.commit = slow_commit
    sys.argv[0] = str(TRAIN)
    runpy.run_path(str(TRAIN), run_name="__main__")


if __name__ == "__main__":
    main()

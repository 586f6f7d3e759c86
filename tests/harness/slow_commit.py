"""train.py whose checkpoint commits wait SLOW_COMMIT_S seconds (default 60) once the process
got a Ctrl-C: the save a first Ctrl-C asks for is still in flight when a test presses Ctrl-C
again (tests/test_ctrl_c.py). Saves before the Ctrl-C commit as usual.

    python tests/harness/slow_commit.py <train.py overrides>
    python slurm/launch.py --standalone --nproc-per-node=2 tests/harness/slow_commit.py ...

train.py runs in this process as __main__ (runpy, as slurm/run_trainer.py runs it), so Hydra
finds its config as when train.py is started itself.
"""

from __future__ import annotations

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
from checkpoint.save import Committer  # noqa: E402

#: Set by the first SIGINT this process's StopSignal handles.
_INTERRUPTED = threading.Event()


def main() -> None:
    delay = float(os.environ.get("SLOW_COMMIT_S", "60"))
    handle, commit = runtime.StopSignal._handle, Committer.commit

    def noting_handle(self, signum, frame):
        if signum == signal.SIGINT:
            _INTERRUPTED.set()
        return handle(self, signum, frame)

    def slow_commit(self, *args, **kwargs):
        if _INTERRUPTED.is_set():
            time.sleep(delay)
        return commit(self, *args, **kwargs)

    runtime.StopSignal._handle = noting_handle
    Committer.commit = slow_commit
    sys.argv[0] = str(TRAIN)
    runpy.run_path(str(TRAIN), run_name="__main__")


if __name__ == "__main__":
    main()

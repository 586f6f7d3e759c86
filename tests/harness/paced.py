"""train.py that sleeps PACE_S seconds before each step of a fresh run (one that starts at
step 0); a run that resumes a checkpoint steps at full speed. The Slurm tests' jobs wait on
Slurm's clock (a signal due minutes before the limit, a time limit of one minute): paced,
a tiny run is still mid-way when the signal or the limit comes, without spending a core on
it, and the requeued or next job, which resumes, finishes before the next one comes. A sleep
between steps changes no loss.

    TRAIN_SCRIPT=tests/harness/paced.py PACE_S=2 sbatch slurm/train.sbatch <overrides>
    PACE_S=1 python tests/harness/paced.py <train.py overrides>

train.py runs in this process as __main__ (runpy, as slurm/run_trainer.py runs it).
"""

from __future__ import annotations

import os
import runpy
import sys
import time
from pathlib import Path

TRAIN = Path(__file__).resolve().parents[2] / "train.py"
sys.path[0] = str(TRAIN.parent)  # as if train.py had been started itself

import logger  # noqa: E402
import steps  # noqa: E402


def main() -> None:
    pace = float(os.environ.get("PACE_S", "0"))
    start, train_step = logger.MetricsLogger.start, steps.train_step
    fresh = []  # [True] once the run started at step 0

    def noting_start(self, start_step, *args, **kwargs):
        fresh.append(start_step == 0)
        return start(self, start_step, *args, **kwargs)

    def paced_step(*args, **kwargs):
        if fresh and fresh[0]:
            time.sleep(pace)
        return train_step(*args, **kwargs)

    logger.MetricsLogger.start = noting_start
    steps.train_step = paced_step  # before train.py's `from steps import train_step`
    sys.argv[0] = str(TRAIN)
    runpy.run_path(str(TRAIN), run_name="__main__")


if __name__ == "__main__":
    main()

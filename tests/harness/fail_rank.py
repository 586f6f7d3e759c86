"""train.py in which one rank fails in a chosen step while the others go on into the step's
collectives: the case of a run whose ranks do not fail together (one GPU out of memory, a
rank's own bug). The job must end, with the failing rank's error, instead of hanging.

    FAIL_RANK=1 FAIL_STEP=2 torchrun --nproc_per_node=2 tests/harness/fail_rank.py <overrides>

FAIL_RANK (default 1): the rank that fails; FAIL_STEP (default 2): in which step (the n-th
call of steps.train_step, counting from the first step this process trains); FAIL_KIND:
"oom" (default) raises torch.OutOfMemoryError with the shape of CUDA's message, "error" a
plain RuntimeError (an unexpected exception: its traceback is printed). Issue 56's cp=4 case:
two ranks out of memory in step 1 sat in destroy_process_group while the others waited in an
all-reduce, so no process ended and torchrun never learned of the failure.

train.py runs in this process as __main__ (runpy), as slurm/run_trainer.py runs it.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

TRAIN = Path(__file__).resolve().parents[2] / "train.py"
sys.path[0] = str(TRAIN.parent)  # as if train.py had been started itself

import torch  # noqa: E402

import steps  # noqa: E402

#: The message CUDA's allocator gives (its first sentences), marked as injected.
OOM_MESSAGE = (
    "CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity of 79.19 GiB "
    "of which 512.00 MiB is free. (injected by tests/harness/fail_rank.py)"
)


def main() -> None:
    rank = int(os.environ.get("RANK", 0))
    fail_rank = int(os.environ.get("FAIL_RANK", "1"))
    fail_step = int(os.environ.get("FAIL_STEP", "2"))
    kind = os.environ.get("FAIL_KIND", "oom")
    train_step = steps.train_step
    calls = [0]

    def failing_train_step(*args, **kwargs):
        calls[0] += 1
        if rank == fail_rank and calls[0] == fail_step:
            if kind == "oom":
                raise torch.OutOfMemoryError(OOM_MESSAGE)
            raise RuntimeError(f"injected failure on rank {rank} (tests/harness/fail_rank.py)")
        return train_step(*args, **kwargs)

    steps.train_step = failing_train_step  # train.py imports it from steps when it runs
    sys.argv[0] = str(TRAIN)
    runpy.run_path(str(TRAIN), run_name="__main__")


if __name__ == "__main__":
    main()

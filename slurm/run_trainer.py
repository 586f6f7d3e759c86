"""torchrun's entry point in slurm/train.sbatch: run a training script in this process and
record its exit status.

    TRAIN_STATUS_DIR=runs/x/.exit/123.0 torchrun ... slurm/run_trainer.py train.py <overrides>

torchrun (torch 2.13) reports any worker that exits non-zero as its own exit status 1, so
the batch script cannot see train.py's EXIT_REQUEUE (3: checkpoint saved on a stop signal,
requeue me) in srun's status. Each worker writes its status to $TRAIN_STATUS_DIR/rank<RANK>
instead (the directory must be shared by the nodes, as the run directory is). The script
runs in this very process (runpy), so the signals torchrun and the batch script send reach
its handlers exactly as with `torchrun train.py`; SIGUSR1 and SIGTERM are held (blocked)
until they are installed.
"""

from __future__ import annotations

import signal

# Held until the script installs its handlers (runtime.StopSignal unblocks them): a stop
# signal that comes while a trainer imports torch (Slurm's warning due at the job's start,
# forwarded as soon as the trainers exist) would otherwise end it with SIGUSR1's default
# action, before it can save, and the job would fail instead of requeueing.
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1, signal.SIGTERM})

import os  # noqa: E402
import runpy  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: run_trainer.py SCRIPT [ARGS...]  (status in $TRAIN_STATUS_DIR)")
    script = os.path.abspath(sys.argv[1])
    sys.argv = [sys.argv[1], *sys.argv[2:]]
    sys.path[0] = os.path.dirname(script)  # as if the script had been run directly
    status: int = 1  # an exception other than SystemExit is a failure
    try:
        runpy.run_path(script, run_name="__main__")
        status = 0
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        raise
    finally:
        status_dir = os.environ.get("TRAIN_STATUS_DIR")
        if status_dir:
            path = Path(status_dir) / f"rank{os.environ.get('RANK', '0')}"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"{status}\n")


if __name__ == "__main__":
    main()

"""torchrun, for slurm/train.sbatch: the same launcher (torch.distributed.run, in this
process), with two differences for a scheduler's signals.

    python slurm/launch.py --nnodes=2 --nproc-per-node=8 ... slurm/run_trainer.py train.py ...

- SIGUSR1 is handled and forwarded to the trainers unless `--signals-to-handle` is given:
  torchrun's default list leaves it out, and a stock agent dies of it (its default action)
  while its trainers train on, unsupervised.
- A handled signal ends the launcher in one line instead of torch's `SignalException`
  traceback. torchrun forwards the signal to its trainers and waits for them
  (`--shutdown-timeout`) before it raises; the trainers' own lines say what they saved.
  The exit status is 128 + the signal's number, as for a process the signal ended.
- A trainer that failed (or stopped with status 3), and a rendezvous lost because the
  launcher hosting it (the first node's) died, end it in one line too (status 1, as
  torchrun's), instead of torchrun's traceback and failure summary: the trainers' own lines
  above say why (train.py: one `error:` line, e.g. a collective whose peer node died,
  docs/SLURM.md).
"""

from __future__ import annotations

import signal
import sys

#: What torchrun handles by default, plus Slurm's early warning.
SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


def launcher_args(argv: list[str]) -> list[str]:
    """`argv` with SIGNALS handled, unless the command line chooses its own list."""
    if any(a.split("=", 1)[0] in ("--signals-to-handle", "--signals_to_handle") for a in argv):
        return argv
    return [f"--signals-to-handle={SIGNALS}", *argv]


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import main as torchrun

    try:
        torchrun(launcher_args(argv))
    except ChildFailedError as e:
        statuses = ", ".join(
            f"rank {rank}: {f.signal_name() if f.exitcode < 0 else f.exitcode}"
            for rank, f in sorted(e.failures.items())
        )
        print(
            f"launcher: trainer exit statuses {statuses} (their lines above say why)",
            file=sys.stderr,
            flush=True,
        )
        return 1
    except RendezvousError as e:
        print(
            f"launcher: lost the rendezvous ({type(e).__name__}): the launcher hosting it (the "
            "first node's) died? this node's trainers were stopped (their lines above)",
            file=sys.stderr,
            flush=True,
        )
        return 1
    except SignalException as e:
        name = signal.Signals(e.sigval).name
        print(
            f"launcher: got {name}: forwarded it to the trainers and waited for them to exit "
            "(their lines above say what was saved)",
            file=sys.stderr,
            flush=True,
        )
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

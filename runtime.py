"""The process a run lives in: its device, stop signals, peak memory, exit statuses, and
starting train.py as a subprocess (for tools and test harnesses that need whole runs).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from errors import ConfigError

#: Exit status after a checkpoint saved on a stop signal (Slurm's --signal or SIGTERM);
#: slurm/train.sbatch turns it into `scontrol requeue`.
EXIT_REQUEUE = 3

ROOT = Path(__file__).resolve().parent


def pick_device(name: str) -> torch.device:
    """train.device: auto (CUDA when visible), cpu or cuda (this process's LOCAL_RANK GPU)."""
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("train.device=cuda but no CUDA GPU is visible; use train.device=auto")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A CPU tensor on `device`. To a GPU through pinned memory without waiting: a copy from
    pageable memory may first wait for every kernel already queued (CUDA's rule for pageable
    host-to-device copies), which would stall the step where the copy is made."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def peak_memory_gb(device: torch.device) -> float:
    """Peak allocated GPU memory, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB


class StopSignal:
    """Turns SIGUSR1 (Slurm's early warning) and SIGTERM (preemption) into a flag the loop
    checks at log steps (where it syncs anyway), so every rank stops after the same step and
    the checkpoint is written between steps, never inside one."""

    def __init__(self):
        self.received: int | None = None
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.received = signum

    def agreed(self, device) -> bool:
        """All ranks stop at the same step if any rank got the signal."""
        flag = torch.tensor([float(self.received is not None)], device=device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def report_error(line: str) -> None:
    """A run that cannot go on, in one line: printed by rank 0 (every rank usually finds the
    same error) as `error: <line>`, and, under torchrun, written to this worker's error file,
    so the launcher's failure summary (which follows the worker's output) names this line as
    the failure's cause instead of pointing at how to get a traceback."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"error: {line}", file=sys.stderr, flush=True)
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path and not os.path.exists(path):
        import json
        import time

        info = {"py_callstack": f"error: {line}", "timestamp": str(int(time.time()))}
        try:
            with open(path, "w") as f:
                json.dump({"message": {"message": f"error: {line}", "extraInfo": info}}, f)
        except OSError:
            pass


def exit_status(statuses: list[int]) -> int:
    """0 when every job succeeded; else the failing jobs' status when they agree, else 1."""
    failed = sorted({s for s in statuses if s != 0})
    return 0 if not failed else failed[0] if len(failed) == 1 else 1


def launch(
    args: list[str],
    *,
    nproc: int = 1,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
    program: tuple[str, ...] = ("train.py",),
) -> subprocess.CompletedProcess:
    """Run `program` (train.py, or e.g. ("-m", "tests.harness.matrix")) with `args` (for
    train.py: Hydra overrides) in a new process from the repository root, under `torchrun
    --standalone --nproc_per_node=<nproc>` when nproc > 1; stdout and stderr are captured as
    text. `env` adds to (or replaces in) this process's environment."""
    cmd = [sys.executable]
    if nproc > 1:
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return subprocess.run(
        [*cmd, *program, *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# -- process identity: lock files name their holder ------------------------------------------


def host_id() -> str:
    """This host and its pid namespace: pids are comparable only between equal host ids."""
    try:
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return socket.gethostname()
    return f"{socket.gethostname()}/pidns:{ns}"


def host_name(host: str) -> str:
    """The host name part of a `host_id()` value, for messages."""
    return str(host).split("/")[0]


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (Linux), else None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_start(pid: int) -> str | None:
    """The start time of process `pid` in clock ticks since boot (Linux), else None: with the
    pid it names one process, whose pid the system may later give to another."""
    fields = _stat_fields(pid)
    return fields[19] if fields and len(fields) > 19 else None


def pid_alive(pid: int) -> bool:
    """Whether process `pid` of this host id runs (a zombie, killed but not yet reaped by its
    parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    fields = _stat_fields(pid)
    return not fields or fields[0] != "Z"

"""Run a function on N gloo processes so multi-process tests read like unit tests.

    def _check(rank, world_size, tmp):      # runs in every process
        ...
    def test_something(tmp_path):
        run_distributed(_check, 2, str(tmp_path))

The function must be importable (module level). Each process gets RANK/WORLD_SIZE/
LOCAL_RANK/MASTER_ADDR/MASTER_PORT set and a default gloo process group; an exception in
any rank fails the test with that rank's traceback.

The processes are forked from one server process per test session that has imported torch
and the project once (multiprocessing's forkserver, PRELOAD), so a rank starts in
milliseconds instead of the ~6 s a fresh interpreter takes to import them: like a spawned
process, a rank shares no state with the test process or with earlier ranks, and it gets the
test process's environment of the moment (not the server's).
"""

from __future__ import annotations

import atexit
import os
import runpy
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing.connection import wait
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: What the server imports before it forks any rank: what nearly every rank imports.
PRELOAD = ["torch", "torch.distributed.tensor", "datasets", "train", "tests.helpers"]


def _torchrun_env(rank: int, nproc: int, port: int) -> dict[str, str]:
    """What `torchrun --standalone --nproc_per_node=NPROC` gives worker `rank` (its variables
    that the trainer and torch.distributed read), with rank 0 hosting the rendezvous store."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "ROLE_WORLD_SIZE": str(nproc),
        "GROUP_WORLD_SIZE": "1",
        "ROLE_NAME": "default",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": "none",
        "TORCHELASTIC_USE_AGENT_STORE": "False",
    }


def _worker(rank, world_size, port, fn, args, errors, env):
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(_torchrun_env(rank, world_size, port))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        fn(rank, world_size, *args)
        dist.barrier()  # no rank tears down while another still talks to it
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # Success: leave without interpreter teardown, where gloo's background threads have been
    # seen to abort the process ("terminate called without an active exception", exit -6)
    # after the test body had passed.
    os._exit(0)


def run_distributed(fn, world_size: int, *args, timeout: float = 300.0) -> None:
    ctx = _context()
    errors = ctx.SimpleQueue()
    port = free_port()
    env = dict(os.environ)
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, errors, env))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
    if not errors.empty():
        rank, tb = errors.get()
        raise AssertionError(f"rank {rank} failed:\n{tb}")
    bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise AssertionError(f"processes exited abnormally (rank, exitcode): {bad}")


def _train_main(
    program: tuple[str, ...], args: list[str], env: dict[str, str], cwd: str, out: str, err: str
) -> None:
    """In a forked process: `python PROGRAM ARGS` (train.py, or `-m module`) from `cwd` with
    `env`, its output appended to the files `out` and `err` (which the ranks of one run
    share, as torchrun's workers share its stdout and stderr); leaves with the program's exit
    status, after what an interpreter does at exit (joining threads, atexit handlers,
    flushing)."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - line by line, as
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115 - PYTHONUNBUFFERED
    module = program[1] if program[0] == "-m" else None
    sys.argv = [module or program[0], *args]
    sys.path[0] = cwd
    code = 0
    try:
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(program[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    threading._shutdown()  # noqa: SLF001 - the interpreter's own exit step: non-daemon threads
    atexit._run_exitfuncs()  # noqa: SLF001 - and the atexit handlers
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _wait(procs: list, timeout: float | None) -> list[int | None]:
    """Wait for every rank, as torchrun's agent does: when one fails, the others get SIGTERM
    (then SIGKILL after 5 s); at `timeout`, all are killed. Returns the exit codes (None: was
    still running at the timeout)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    stop_at = None
    while any(p.exitcode is None for p in procs):
        now = time.monotonic()
        if deadline is not None and now > deadline:
            codes = [p.exitcode for p in procs]
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()
            return codes
        failed = any(p.exitcode not in (None, 0) for p in procs)
        if failed and stop_at is None:
            stop_at = now + 5
            for p in procs:
                if p.is_alive():
                    p.terminate()
        elif stop_at is not None and now > stop_at:
            for p in procs:
                if p.is_alive():
                    p.kill()
        wait([p.sentinel for p in procs if p.exitcode is None], timeout=0.05)
    return [p.exitcode for p in procs]


#: Variables read when a module is imported or the interpreter starts (the import path, the
#: Hugging Face libraries' endpoints and caches, torch's and MKL's settings): a run whose
#: environment differs from the server's in one of these starts a new interpreter instead.
READ_AT_IMPORT = ("PYTHON", "HF_", "HUGGINGFACE", "TRANSFORMERS", "DATASETS", "TORCH", "ATEN_")
READ_AT_IMPORT += ("MKL_", "LD_", "WANDB_")
_server_env: dict[str, str] = {}


def _context():
    """The forkserver context, its server started on first use with PRELOAD and this process's
    environment of that moment, which `launch_forked` compares each run's with."""
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    if not _server_env:
        ctx.set_forkserver_preload(PRELOAD)
        _server_env.update(os.environ)
        forkserver.ensure_running()
    return ctx


#: Variables that may differ from the server's without changing the run: PYTHONUNBUFFERED (the
#: forked run's stdout and stderr are line-buffered by `_train_main` itself) and
#: TORCHINDUCTOR_CACHE_DIR (torch writes its default into the environment of a process that
#: compiled something; the run computes the same default). Counting either made every later
#: run of the test process start new interpreters.
_NOT_COMPARED = ("PYTHONUNBUFFERED", "TORCHINDUCTOR_CACHE_DIR")


def _imported_env_differs(env: dict[str, str]) -> bool:
    keys = {k for k in (*env, *_server_env) if k.startswith(READ_AT_IMPORT)}
    keys -= set(_NOT_COMPARED)
    return any(env.get(k) != _server_env.get(k) for k in keys)


def launch_forked(
    args: list[str],
    *,
    nproc: int = 1,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
    program: tuple[str, ...] = ("train.py",),
) -> subprocess.CompletedProcess | None:
    """runtime.launch for train.py or `-m module`, its processes forked from the PRELOAD
    server instead of new interpreters (tests/conftest.py installs it): one process, or nproc
    ranks with torchrun's worker environment; the same CompletedProcess (exit status: the
    rank's, or 1 when any of several failed, as torchrun's; stdout and stderr as text, the
    ranks' together); killed after `timeout` as subprocess.run would be. Returns None, which
    leaves the run to new processes, for another program, for a run whose environment changes
    what is read at import (READ_AT_IMPORT), and for TEST_LAUNCH=subprocess in `env` (a test of
    what torchrun itself prints)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    if program != ("train.py",) and not (len(program) == 2 and program[0] == "-m"):
        return None
    if full_env.get("TEST_LAUNCH") == "subprocess":
        return None
    ctx = _context()
    if _imported_env_differs(full_env):
        return None
    root = str(Path(__file__).resolve().parents[1])
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="launch-") as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        out.touch()
        err.touch()
        procs = []
        for rank in range(nproc):
            rank_env = full_env if nproc == 1 else {**full_env, **_torchrun_env(rank, nproc, port)}
            proc = ctx.Process(
                target=_train_main, args=(program, args, rank_env, root, str(out), str(err))
            )
            proc.start()
            procs.append(proc)
        codes = _wait(procs, timeout)
        if None in codes:
            raise subprocess.TimeoutExpired([*program, *args], timeout, out.read_text())
        code = codes[0] if nproc == 1 else int(any(codes))  # torchrun's: 1 if any rank failed
        return subprocess.CompletedProcess(
            [*program, *args], code, out.read_text(), err.read_text()
        )

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
import traceback
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: What the server imports before it forks any rank: what nearly every rank imports.
PRELOAD = ["torch", "torch.distributed.tensor", "datasets", "train", "tests.helpers"]


def _worker(rank, world_size, port, fn, args, errors, env):
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
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


def _train_main(args: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    """In a forked process: `python train.py ARGS` from `cwd` with `env`, its output in the
    files `out` and `err`; leaves with train.py's exit status, after what an interpreter does
    at exit (joining threads, atexit handlers, flushing)."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - line by line, as
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115 - PYTHONUNBUFFERED
    sys.argv = ["train.py", *args]
    sys.path[0] = cwd
    code = 0
    try:
        runpy.run_path("train.py", run_name="__main__")
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


#: Read at start-up, but what it sets the forked run sets itself (`_train_main`'s line-buffered
#: stdout and stderr): it may differ from the server's. (Counting it made every run start a new
#: interpreter wherever the tests' own environment has PYTHONUNBUFFERED=1.)
_SET_BY_THE_RUN = ("PYTHONUNBUFFERED",)


def _imported_env_differs(env: dict[str, str]) -> bool:
    keys = {k for k in (*env, *_server_env) if k.startswith(READ_AT_IMPORT)}
    keys -= set(_SET_BY_THE_RUN)
    return any(env.get(k) != _server_env.get(k) for k in keys)


def launch_forked(
    args: list[str], *, env: dict[str, str] | None = None, timeout: float | None = None
) -> subprocess.CompletedProcess:
    """runtime.launch for a one-process train.py, forked from the PRELOAD server instead of a
    new interpreter (tests/conftest.py installs it): the same CompletedProcess (return code,
    stdout, stderr as text); killed after `timeout` as subprocess.run would be. A run whose
    environment changes what is read at import (READ_AT_IMPORT) gets a new interpreter."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    ctx = _context()
    if _imported_env_differs(full_env):
        return subprocess.run(
            [sys.executable, "train.py", *args],
            cwd=Path(__file__).resolve().parents[1],
            env=full_env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    root = str(Path(__file__).resolve().parents[1])
    with tempfile.TemporaryDirectory(prefix="launch-") as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        proc = ctx.Process(target=_train_main, args=(args, full_env, root, str(out), str(err)))
        proc.start()
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired(["train.py", *args], timeout, out.read_text())
        code = proc.exitcode if proc.exitcode is not None else -9
        return subprocess.CompletedProcess(
            ["train.py", *args], code, out.read_text(), err.read_text()
        )

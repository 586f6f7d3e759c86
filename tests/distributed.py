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

import os
import socket
import traceback

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
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # used when the server starts: the session's first call
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

"""checkpoint.mode=async_process: one writer process per rank, started with the manager.

    writer = WriterProcess(rank, world_size, pg)     # spawns now; the child starts meanwhile
    writer.set_buffers(buffers, version)             # shared-memory staging buffers, once
    out = writer.save(request)                       # a thread of the manager waits here

The child imports torch and this package, joins a gloo group of the writer processes of all
ranks (world > 1; its TCPStore is served by rank 0's trainer and its address broadcast over
the manager's group) and then serves save requests in order: each names a staging buffer and
carries the staged state's structure and slots (checkpoint/staging.py); the child builds the
state dict over its mapping of the buffer and runs the same `write_checkpoint` a thread would.
The buffers are passed once (torch shares their memory with the child), so a request costs a
few kilobytes of pickling. A world of one needs no process group (DCP's no_dist).

Errors come back as (type, message, errno): an OSError keeps its errno (ENOSPC is reported as
such by the manager). A child that dies fails the save that waits on it with its exit code.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager, suppress
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from checkpoint.writer import os_error_in

_TIMEOUT = timedelta(minutes=30)


def _portable(e: BaseException) -> tuple[str, str, int | None]:
    os_err = os_error_in(e)
    return (
        type(e).__name__,
        str(e).strip().splitlines()[0][:2000] if str(e) else "",
        (os_err.errno if os_err is not None else None),
    )


def _rebuild(kind: str, message: str, err: int | None) -> BaseException:
    if err is not None:
        return OSError(err, message)
    return RuntimeError(f"{kind}: {message}")


def _main(conn, rank: int, world_size: int, rendezvous) -> None:
    """The writer process."""
    # The trainer decides what a Ctrl-C means (a save to finish, or stopping at once, when it
    # kills this process); a KeyboardInterrupt here would lose the save in flight. (SIGINT is
    # ignored from the start, WriterProcess.__init__; again here in case that changes.)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        if world_size > 1:
            addr, port, prefix = rendezvous
            store = dist.TCPStore(addr, port, None, False, timeout=_TIMEOUT)
            dist.init_process_group(
                "gloo",
                store=dist.PrefixStore(prefix, store),
                rank=rank,
                world_size=world_size,
                timeout=_TIMEOUT,
            )
        conn.send(("ready", os.getpid()))
    except BaseException as e:
        with suppress(OSError):  # the trainer is gone
            conn.send(("error", _portable(e)))
        return

    from checkpoint.staging import make_views, materialize
    from checkpoint.writer import write_checkpoint

    buffers: list = []
    version = -1
    views: dict[int, list] = {}
    try:
        while True:
            try:
                msg = conn.recv()
            except EOFError:  # the trainer is gone
                break
            if msg is None:
                break
            if msg[0] == "buffers":
                _, buffers, version = msg
                views.clear()
                continue
            req = msg[1]
            try:
                if req["version"] != version:
                    raise RuntimeError("staging buffers out of date in the writer process")
                b = req["buffer"]
                if b not in views:
                    views[b] = make_views(buffers[b], req["slots"])
                sd = materialize(req["skeleton"], views[b], req["copied"], req["slots"])
                out = write_checkpoint(
                    sd,
                    Path(req["path"]),
                    save_id=req["save_id"],
                    algorithm=req["algorithm"],
                    thread_count=req["threads"],
                    sync_files=req["sync_files"],
                    no_dist=world_size == 1,
                )
                reply = ("ok", out)
            except BaseException as e:
                reply = ("error", _portable(e))
            try:
                conn.send(reply)
            except OSError:  # the trainer is gone
                break
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@contextmanager
def _main_module_hidden():
    """Spawn re-imports the parent's __main__ (train.py and all it imports, TE included) in
    the child unless it looks like an interactive session; the writer needs none of it."""
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__spec__", "__file__") if k in main.__dict__}
    try:
        main.__dict__.pop("__file__", None)
        main.__spec__ = None
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


class WriterProcess:
    """The trainer's side of one rank's writer process."""

    def __init__(self, rank: int, world_size: int, pg=None):
        self.rank = rank
        rendezvous = None
        self._store = None
        if world_size > 1:
            info: list[Any] = [None]
            if rank == 0:
                addr = os.environ.get("MASTER_ADDR") or socket.gethostname()
                self._store = dist.TCPStore(addr, 0, None, True, wait_for_workers=False)
                info = [(addr, self._store.port, f"ckpt-writer-{secrets.token_hex(6)}/")]
            dist.broadcast_object_list(info, src=0, group=pg)
            rendezvous = info[0]
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_main,
            args=(child, rank, world_size, rendezvous),
            name=f"ckpt-writer-{rank}",
            daemon=True,
        )
        # A Ctrl-C at the terminal reaches every process of its foreground group (and
        # torchrun signals its worker's group): the child starts with SIGINT ignored (an
        # ignored signal stays ignored through fork and exec, and Python then installs no
        # KeyboardInterrupt handler), so not even its start-up imports can die of one. A
        # SIGINT meanwhile waits, blocked, for this process's own handler.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            with _main_module_hidden():
                self._proc.start()
        finally:
            signal.signal(signal.SIGINT, handler)
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        child.close()
        self._send_lock = threading.Lock()
        self._ready = False
        self._closed = False

    def _send(self, msg) -> None:
        with self._send_lock:
            self._conn.send(msg)

    def _recv(self):
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            self._proc.join(5)
            raise RuntimeError(
                f"the checkpoint writer process of rank {self.rank} died "
                f"(exit code {self._proc.exitcode})"
            ) from None

    def set_buffers(self, buffers: list, version: int) -> None:
        self._send(("buffers", list(buffers), version))

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Whether the child has started (waits up to `timeout` seconds; call only while no
        save is in flight)."""
        if not self._ready and self._conn.poll(timeout):
            reply = self._recv()
            if reply[0] != "ready":
                raise _rebuild(*reply[1])
            self._ready = True
        return self._ready

    def save(self, request: dict) -> dict:
        """Run one save in the child (call from one thread at a time); its result (with
        start_wait_s: how long it waited for the child to start) or its error."""
        t0 = time.perf_counter()
        self.wait_ready()
        waited = time.perf_counter() - t0
        self._send(("save", request))
        reply = self._recv()
        if reply[0] == "error":
            raise _rebuild(*reply[1])
        return {**reply[1], "start_wait_s": waited}

    def kill(self) -> None:
        """End the child now (its save, if any, is abandoned uncommitted)."""
        self._closed = True
        if self._proc.is_alive():
            self._proc.kill()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with suppress(OSError):
            self._send(None)
        self._proc.join(60)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(5)
        self._conn.close()

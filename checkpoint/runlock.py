"""One run at a time per run directory: `<run_dir>/.lock`, held by rank 0 of the run.

    lock = RunLock.acquire(run_dir)      # ConfigError naming the holder if another run has it
    ...
    lock.release()                       # also at interpreter exit

The lock file is created with O_CREAT|O_EXCL (atomic on local filesystems and NFSv3+), so of
two runs started at once exactly one gets it. It holds JSON: host, pid, the process start
time (/proc, to tell a reused pid apart), the start time of the run and a token. While held, a
daemon thread touches the file every HEARTBEAT_S seconds.

A lock is stale, and taken over with a line saying whose it was and why, when its holder is
on this host and its process is gone (or the pid now belongs to another process), or when it
is on another host and the file has not been touched for STALE_S seconds (a killed job on
another node, after a crash). A holder that is this very process (a previous `run()` in the
same interpreter that raised) is reused. A takeover renames the stale file aside first (one
rename wins when several runs race for it) and then creates the lock like a fresh start.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import threading
import time
from pathlib import Path
from typing import Any

from errors import ConfigError
from runtime import host_id, host_name, pid_alive, process_start

LOCK_NAME = ".lock"
HEARTBEAT_S = 30.0
STALE_S = 300.0

#: Locks this process holds, by path.
_HELD: dict[Path, RunLock] = {}


def _describe(info: dict[str, Any]) -> str:
    started = info.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if started else "?"
    return f"host {host_name(info.get('host', '?'))}, pid {info.get('pid', '?')}, started {when}"


def _read(path: Path) -> tuple[dict | None, float | None]:
    """(holder info, or None when unreadable; seconds since the file was last touched, or
    None when there is no file)."""
    try:
        age = time.time() - path.stat().st_mtime
    except OSError:
        return None, None
    try:
        info = json.loads(path.read_text())
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError):
        return None, age
    return (info if isinstance(info, dict) else None), age


def _stale_reason(info: dict | None, age: float | None) -> str | None:
    """Why the lock described by `info` is stale (None: it is held)."""
    host = host_id()
    if info is None:
        if age is not None and age > STALE_S:
            return f"its file is unreadable and untouched for {age:.0f}s"
        return None
    if info.get("host") == host:
        pid = int(info.get("pid", -1))
        if pid == os.getpid() and info.get("proc_start") == process_start(pid):
            return "it is held by this process (an earlier run in it ended without releasing)"
        if not pid_alive(pid):
            return "its process is no longer running"
        start = info.get("proc_start")
        if start is not None and process_start(pid) not in (None, start):
            return "its pid now belongs to another process"
        return None
    if age is not None and age > STALE_S:
        return f"its heartbeat stopped {age:.0f}s ago (more than {STALE_S:.0f}s)"
    return None


def _in_use(what: str, holder: dict | None, path: Path) -> ConfigError:
    who = _describe(holder) if holder else "a run that is starting"
    return ConfigError(
        f"{what} is in use by another run ({who}; lock file "
        f"{path}); wait for it to end or use another run.name (a lock whose "
        f"holder died is taken over automatically: on this host at once, from "
        f"another host after {STALE_S:.0f}s without heartbeat)"
    )


class RunLock:
    def __init__(self, path: Path, info: dict[str, Any]):
        self.path = path
        self.info = info
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="run-lock-heartbeat", daemon=True)
        self._thread.start()
        _HELD[path] = self

    @classmethod
    def acquire(cls, run_dir: Path, log=print, what: str | None = None) -> RunLock:
        """`what`: the directory as the refusal names it (default: "run directory <dir>")."""
        path = Path(run_dir) / LOCK_NAME
        what = what or f"run directory {run_dir}"
        info = {
            "host": host_id(),
            "pid": os.getpid(),
            "proc_start": process_start(os.getpid()),
            "started": time.time(),
            "token": secrets.token_hex(8),
        }
        for _ in range(10):
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder, age = _read(path)
                for _ in range(20):  # just created: its holder is writing it
                    if holder is not None or age is None or age > 2.0:
                        break
                    time.sleep(0.1)
                    holder, age = _read(path)
                if holder is None and age is None:
                    continue  # released meanwhile: try again
                reason = _stale_reason(holder, age)
                if reason is None:
                    raise _in_use(what, holder, path) from None
                aside = path.with_name(f"{LOCK_NAME}.stale-{info['token']}")
                try:
                    os.rename(path, aside)
                except FileNotFoundError:
                    continue  # another run took it over first
                moved, _ = _read(aside)
                if moved is not None and holder is not None and moved != holder:
                    # We moved a lock created after our look: give it back, we lost the race.
                    with contextlib.suppress(OSError):
                        os.link(aside, path)
                    aside.unlink(missing_ok=True)
                    continue
                aside.unlink(missing_ok=True)
                if holder is None or holder.get("pid") != os.getpid():
                    who = _describe(holder) if holder else "unknown holder"
                    log(f"run lock: took over the stale lock of {path} ({who}): {reason}")
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(info, f)
                f.flush()
                os.fsync(f.fileno())
            return cls(path, info)
        raise ConfigError(f"could not take the lock {path} (several runs keep racing for it)")

    @staticmethod
    def check(directory: Path, what: str | None = None) -> str:
        """What `acquire` would do, without taking or changing anything (the dry run): raises
        its refusal while a live run holds the lock; else says whether the lock is free or a
        stale one would be taken over."""
        path = Path(directory) / LOCK_NAME
        holder, age = _read(path)
        if holder is None and age is None:
            return f"{path} is free"
        reason = _stale_reason(holder, age)
        if reason is None:
            raise _in_use(what or f"run directory {directory}", holder, path)
        who = _describe(holder) if holder else "unknown holder"
        return f"{path}: a start would take over the stale lock ({who}: {reason})"

    @staticmethod
    def release_all() -> None:
        """Release every lock this process holds."""
        for lock in list(_HELD.values()):
            lock.release()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def held(self) -> bool:
        holder, _ = _read(self.path)
        return holder is not None and holder.get("token") == self.info["token"]

    def release(self) -> None:
        """Remove the lock file if it is still ours. Idempotent."""
        self._stop.set()
        if _HELD.get(self.path) is self:
            del _HELD[self.path]
            try:
                if self.held():
                    self.path.unlink(missing_ok=True)
            except OSError as e:  # e.g. the filesystem turned read-only: not worth a traceback
                print(
                    f"run lock: could not remove {self.path} ({e.strerror or e}); the next run "
                    "takes it over (its holder is gone)",
                    flush=True,
                )


atexit.register(RunLock.release_all)

"""Run directory checks before any expensive work (train.py step 1, before the model).

    run_dir, lock = prepare_run_dir(root, name, checkpoint_cfg, model_cfg, quantized, rank, world)

Every rank: the checkpoint fields are valid; the run directory (and the checkpoint directory)
can be created and written (a probe made and removed again where it would be created); with
checkpoints on, the checkpoint filesystem has room for checkpoint.keep_last + 1 checkpoints
(those kept plus the one being written; the ones already there count), each estimated from
the model config (parameters x 12 bytes: fp32 weights and two fp32 Adam moments; 13 with
quantized weights, whose fp32 masters live in the optimizer), and for async modes this node's
host memory (and for async_process /dev/shm) can hold one staging copy. Rank 0 then takes the
run directory's lock (checkpoint/runlock.py), and the checkpoint directory's when it lies
outside the run directory (an absolute checkpoint.dir that several runs may name). Each
failure is one ConfigError, and nothing is left behind before every check that needs no
lasting write has passed (`check_run_dir`, which `train.dry_run` runs too, with
`check_locks`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
from pathlib import Path

from checkpoint import staging, store
from checkpoint.config import CheckpointConfig, validate
from checkpoint.context import checkpoint_root
from checkpoint.runlock import RunLock
from errors import ConfigError
from model.config import ModelConfig
from model.flops import parameter_count

GiB = 2**30


def format_bytes(n: float) -> str:
    """A byte count in the unit that shows it (B, KiB, MiB, GiB, TiB): never "0.0 GiB"."""
    if n != n:  # nan: unknown
        return "? bytes"
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def estimate_checkpoint_bytes(m: ModelConfig, quantized_weights: bool = False) -> int:
    """Bytes of one checkpoint of the whole run (all ranks), roughly."""
    return parameter_count(m) * (13 if quantized_weights else 12)


def _nearest_existing(path: Path) -> Path:
    """`path` itself, or its closest ancestor that exists (what creating `path` would write in)."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _check_writable(path: Path, field: str) -> None:
    """That `path` can be created and written, leaving nothing behind: it, or the closest
    ancestor that exists (where it would be created), is a directory this process may write
    into, and a probe made there (a directory in the ancestor, or a file in `path` when it
    exists) is created and removed again. The probe gives the real reason for root too, whom
    `os.access` always lets through (/proc, a read-only or root-squashed mount)."""
    full = Path(os.path.abspath(path))
    existing = _nearest_existing(full)
    where = "" if existing == full else f" in {existing}"
    problem = None
    if not existing.is_dir():
        problem = f"{existing} is not a directory"
    elif not os.access(existing, os.W_OK | os.X_OK):
        problem = ("Read-only file system" if _read_only(existing) else "Permission denied") + where
    else:
        probe = existing / f".write-probe-{socket.gethostname()}-{os.getpid()}"
        try:
            if existing == full:
                probe.write_bytes(b"ok")
                probe.unlink()
            else:
                probe.mkdir()
                probe.rmdir()
        except OSError as e:
            what = "a file" if existing == full else "a directory"
            problem = f"creating {what} in {existing} fails: {e.strerror or e}"
    if problem:
        raise ConfigError(
            f"{field}: cannot write to {path} ({problem}); choose a writable directory"
        )


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _create(path: Path, field: str, created: list[Path]) -> None:
    """mkdir -p `path` (each directory made is appended to `created`), then a probe file."""
    missing = []
    p = Path(path)
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    try:
        for d in reversed(missing):
            d.mkdir(exist_ok=True)
            created.append(d)
        probe = path / f".write-probe-{socket.gethostname()}-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise ConfigError(
            f"{field}: cannot write to {path} ({e.strerror or e}); choose a writable directory"
        ) from None


#: The directories the last `prepare_run_dir` of this process made (those missing before).
_CREATED: list[Path] = []


def remove_created(created: list[Path] | None = None) -> None:
    """Undo `prepare_run_dir`'s directories after a refusal (default: those of its last call):
    the run locks this process holds are released, then each directory made that is still
    empty is removed, deepest first (one that got content meanwhile stays)."""
    made = _CREATED if created is None else created
    if made:
        RunLock.release_all()
    for d in reversed(made):
        with contextlib.suppress(OSError):
            d.rmdir()
    made.clear()


def check_run_dir(
    run_root: str, run_name: str, ck: CheckpointConfig, m: ModelConfig, quantized: bool, world: int
) -> tuple[Path, str]:
    """Every check of `prepare_run_dir` that needs no lasting write: the checkpoint fields,
    that the run directory (run.root / run.name) and the checkpoint directory can be created
    and written, the room for the checkpoints of model `m` (`quantized`: recipe.quantized_init)
    and, for async modes, for one staging copy. Leaves nothing behind (its probes are removed
    again; the dry run calls it too). Returns the run directory and a line saying what was
    found."""
    validate(ck)
    run_dir = Path(run_root) / run_name
    _check_writable(run_dir, f"run.root={run_root}")
    state = "exists" if run_dir.is_dir() else "would be created"
    line = f"run directory: {run_dir} ({state}) is writable"
    if ck.mode == "none":
        return run_dir, line
    root = checkpoint_root(ck, run_dir)
    _check_writable(root, f"checkpoint.dir={ck.dir}")
    need = estimate_checkpoint_bytes(m, quantized)
    # At the steady state keep_last checkpoints exist while the next one is written (the
    # oldest is pruned after the commit); those already here take no more room (unless
    # resume=none moves them aside: kept, never pruned).
    have = len(store.list_complete(root)) if str(ck.resume) != "none" and root.is_dir() else 0
    count = max(1, ck.keep_last + 1 - have)
    free = shutil.disk_usage(_nearest_existing(root)).free
    if free < count * need:
        held = f"; {have} of them are here already" if have else ""
        raise ConfigError(
            f"checkpoint.dir={ck.dir}: {root} has {format_bytes(free)} free, {count} more "
            f"checkpoint{'s' if count > 1 else ''} of model {m.name} "
            f"need{'' if count > 1 else 's'} about "
            f"{format_bytes(count * need)} ({format_bytes(need)} each: "
            f"{parameter_count(m) / 1e6:.1f}M parameters x "
            f"{13 if quantized else 12} bytes; checkpoint.keep_last={ck.keep_last} kept "
            f"plus the one being written{held}); free space, lower checkpoint.keep_last or "
            "point checkpoint.dir to a larger filesystem"
        )
    if ck.mode in ("async", "async_process"):
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        per_node = need // max(world, 1) * min(local, world)
        available = staging.host_memory_available()
        if available is not None and per_node > available:
            raise ConfigError(
                f"checkpoint.mode={ck.mode}: staging this node's share of a checkpoint "
                f"needs about {format_bytes(per_node)} of host memory, "
                f"{format_bytes(available)} are available; use checkpoint=sync or more nodes"
            )
        shm = staging.shared_memory_free() if ck.mode == "async_process" else None
        if shm is not None and per_node > shm:
            raise ConfigError(
                f"checkpoint.mode=async_process: staging this node's share of a checkpoint "
                f"needs about {format_bytes(per_node)} of shared memory, /dev/shm has "
                f"{format_bytes(shm)} free; enlarge /dev/shm (docker --shm-size) or use "
                "checkpoint=async"
            )
    checkpoints = f"checkpoint{'s' if count > 1 else ''}"
    line += (
        f"; {root} has {format_bytes(free)} free, room for the {count} more {checkpoints} "
        f"it needs ({format_bytes(need)} each)"
    )
    return run_dir, line


def _outside_checkpoint_root(ck: CheckpointConfig, run_dir: Path) -> Path | None:
    """The checkpoint directory when it lies outside the run directory (an absolute
    checkpoint.dir that several runs of different run.name may share), else None."""
    if ck.mode == "none":
        return None
    root = checkpoint_root(ck, run_dir).resolve()
    return None if root.is_relative_to(run_dir.resolve()) else root


def check_locks(ck: CheckpointConfig, run_dir: Path) -> str:
    """The dry run's look at the run locks (the run directory's, and the checkpoint
    directory's when it lies outside): the refusal a start would give while a live run holds
    one, as a ConfigError; else a line saying what a start would do. Takes nothing."""
    parts = [RunLock.check(run_dir)]
    if (root := _outside_checkpoint_root(ck, run_dir)) is not None:
        what = f"checkpoint.dir={ck.dir} ({root}, outside the run directory)"
        parts.append(RunLock.check(root, what=what))
    return "lock: " + "; ".join(parts)


def prepare_run_dir(
    run_root: str, run_name: str, ck, m, quantized: bool, rank: int, world: int, *, log=print
) -> tuple[Path, RunLock | None]:
    """Check (`check_run_dir`, the same arguments), then create the run directory; rank 0
    locks it. Returns (run_dir, lock or None). Nothing is created before every check passed; a
    refusal after that (a probe write, the lock) removes the directories made here, and so does
    `remove_created()` for a run refused later (train.main, on a ConfigError)."""
    _CREATED.clear()
    run_dir, _ = check_run_dir(run_root, run_name, ck, m, quantized, world)
    made = _CREATED
    try:
        _create(run_dir, f"run.root={run_root}", made)
        if ck.mode != "none":
            _create(checkpoint_root(ck, run_dir), f"checkpoint.dir={ck.dir}", made)
        lock = RunLock.acquire(run_dir, log=log) if rank == 0 else None
    except BaseException:
        remove_created(made)
        raise
    if lock is not None and (root := _outside_checkpoint_root(ck, run_dir)) is not None:
        # Several runs may name one absolute checkpoint.dir: one run at a time there too (and
        # a resume refuses another run's checkpoints: CheckpointManager.plan_resume).
        try:
            lock = _Locks(
                lock,
                RunLock.acquire(
                    root,
                    log=log,
                    what=f"checkpoint.dir={ck.dir} ({root}, outside the run directory)",
                ),
            )
        except BaseException:
            lock.release()
            remove_created(made)
            raise
    return run_dir, lock


class _Locks:
    """The run directory's lock and the checkpoint directory's, released together."""

    def __init__(self, *locks: RunLock):
        self.locks = locks

    def held(self) -> bool:
        return all(lock.held() for lock in self.locks)

    def release(self) -> None:
        for lock in reversed(self.locks):
            lock.release()

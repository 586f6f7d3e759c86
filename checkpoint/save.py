"""The save side of a CheckpointManager: when a save is taken (interval, a busy writer),
staging it, writing it (here, on a writer thread, or in the writer process), waiting for the
saves in flight, committing, pruning, and the numbers of every save.

    saver = Saver(ctx, check_finite=...)   # checkpoint/context.py; the manager's loss check
    saver.start()                          # the writer process, staging buffers, threads
    saver.maybe_save(step, state)          # every step
    saver.finish(step, state); saver.close()

Four classes, each one job (checkpoint/manager.py's docstring tells the modes and the
policy):
- `Saver`: the policy and the pipeline: maybe_save/save, the staging buffers (`_stager`,
  checkpoint/staging.py), the writers (`_write_here`, `_write` on the `ckpt-write` thread,
  checkpoint/writer_process.py's process), close.
- `InFlight`: the async saves handed to the writer thread, settled in order (failures raised
  on every rank at the same step).
- `Committer`: what becomes of a written save: rank 0's commit (manifest, rename), the
  pruning of old checkpoints on a thread of its own (held while a resumed segment is
  judged), and the one-line error of a failed save.
- `SaveRecords`: each save's timings: the log line, checkpoint_saves.jsonl, `stats()`.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import secrets
import shutil
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from checkpoint import hashing, staging, store
from checkpoint.context import ERRORS, Context, find, first_line
from checkpoint.preflight import format_bytes
from checkpoint.state import ModelState, TrainState
from checkpoint.writer import os_error_in, write_checkpoint
from errors import ConfigError

#: CPython's GIL switch interval while an `async` save is written by threads of the training
#: process. A writer thread takes the GIL back after each hash or write call; while the
#: training thread runs Python it gets it only when the interval (5 ms by default) runs out.
_WRITE_SWITCH_INTERVAL_S = 5e-4


@dataclass
class _Pending:
    step: int
    future: Future  # the write (and on rank 0 the commit); its result: the writer's numbers
    start: float
    blocking_s: float
    wait_s: float  # of blocking_s: waiting for a free staging buffer
    staging: dict[str, float]  # of blocking_s: drain_s, state_dict_s, alloc_s, stage_s
    bytes: int
    buffer: int
    end: list[float] = field(default_factory=list)


class SaveRecords:
    """The numbers of every save, skip and deferral: logged, appended to the saves log (rank
    0), and the newest completed save kept for `stats`."""

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self._completed: list[dict[str, float]] = []

    def record(self, step: int, **numbers: float) -> None:
        """A completed save: its log line, its saves-log record, kept for `stats`."""
        mode = self.ctx.cfg.mode
        record = {"save_step": step, "save_mode": mode}
        record.update({f"save_{k}": v for k, v in numbers.items()})
        self._completed.append(record)
        nbytes = numbers.get("bytes", 0)
        rate = lambda n, s: f"{n / s / 1e9:.2f} GB/s" if s and n else "-"  # noqa: E731
        self.ctx.log(
            f"step {step} saved ({mode}): blocking {numbers['blocking_s']:.3f}s"
            + (
                f" (staging {numbers['stage_s']:.3f}s, {rate(nbytes, numbers['stage_s'])})"
                if "stage_s" in numbers
                else ""
            )
            + f", write {numbers['write_s']:.3f}s ({rate(nbytes, numbers['write_s'])} "
            f"from this rank), total {numbers['total_s']:.3f}s"
        )
        self.ctx.append_log({"event": "saved", **record})

    def note(self, message: str, record: dict) -> None:
        """A skip or a deferral: logged and appended to the saves log."""
        self.ctx.log(message)
        self.ctx.append_log({**record, "save_mode": self.ctx.cfg.mode})

    def take_newest(self) -> dict[str, float]:
        """The newest save completed since the last call (without save_mode), or {}."""
        done, self._completed = self._completed, []
        if not done:
            return {}
        last = dict(done[-1])
        last.pop("save_mode", None)
        return last  # save_step lets the logger release records the checkpoint covers


class Committer:
    """Rank 0's commit of a written save, the pruning of old checkpoints, and the error a
    failed save raises. Pruning keeps the newest confirmed checkpoint while newer ones are
    unconfirmed (a resume not judged yet: store.UNCONFIRMED, read from disk at each prune)."""

    def __init__(self, ctx: Context, algorithm: str | None):
        self.ctx = ctx
        self._algorithm = algorithm
        # Rank 0 deletes old checkpoints on a thread of its own: the next save need not wait
        # for it (deleting a 14 GiB checkpoint took ~4.5 s on an H200 host's disk).
        self._pruner: ThreadPoolExecutor | None = None

    def commit(self, tmp: Path, step: int, hashes: dict, save_id: str) -> int:
        """Rank 0, after every rank's data is written: manifest, rename, prune. Returns the
        checkpoint's size in bytes."""
        ctx = self.ctx
        manifest = store.write_manifest(
            tmp,
            step=step,
            world_size=ctx.world_size,
            checksum=ctx.cfg.checksum,
            extra={
                "mode": ctx.cfg.mode,
                "torch": torch.__version__,
                **({"corpus": ctx.corpus} if ctx.corpus else {}),
            },
            hashes=hashes,
            algorithm=self._algorithm or "crc32",
            save_id=save_id,
        )
        final = ctx.root / store.step_name(step)
        store.commit(tmp, final)
        size = sum(f["size"] for f in manifest["files"].values())
        ctx.log(f"step {step} committed to {final} ({size / 2**20:.1f} MiB)")
        if self._pruner is None:
            self._pruner = ThreadPoolExecutor(1, thread_name_prefix="ckpt-prune")
        self._pruner.submit(self.prune)
        return size

    def prune(self) -> None:
        """Rank 0's pruner thread: delete committed checkpoints beyond keep_last (never the
        newest; `.tmp` directories being written are not listed)."""
        ctx = self.ctx
        failed: list[tuple[Path, Path, str]] = []
        try:
            record = store.read_unconfirmed(ctx.root)
            unconfirmed_from = record["resumed_from"] if record else None
            pruned = store.prune(ctx.root, ctx.cfg.keep_last, failed, unconfirmed_from)
        except store.UnreadableRecord as e:  # which one is confirmed is unknown: keep all
            ctx.log(f"not pruning: cannot read which checkpoints are unconfirmed ({e})")
            return
        except OSError as e:  # a checkpoint left behind costs space, never a run
            ctx.log(f"could not prune old checkpoints in {ctx.root}: {e}")
            return
        if pruned:
            ctx.log(f"pruned {', '.join(p.name for p in pruned)}")
        for path, left, error in failed:
            ctx.log(
                f"could not prune {path.name}: {error}; it is left as {left} (ignored by resume, "
                "taking space until removed); training goes on"
            )

    def prune_again(self) -> None:
        """Every checkpoint was confirmed: prune what was kept for them (rank 0, if it
        pruned)."""
        if self.ctx.rank == 0 and self._pruner is not None:
            self._pruner.submit(self.prune)

    def wait_pruned(self) -> None:
        if self._pruner is not None:
            self._pruner.submit(lambda: None).result()

    def close(self) -> None:
        if self._pruner is not None:
            self._pruner.shutdown(wait=True)

    def failure(self, step: int, tmp: Path, e: BaseException, rank_bytes: int) -> BaseException:
        """The error a failed save raises: a one-line ConfigError for a full disk."""
        ctx = self.ctx
        if ctx.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        os_err = os_error_in(e)
        if os_err is not None and os_err.errno == 28:  # ENOSPC
            try:
                free = shutil.disk_usage(ctx.root).free
            except OSError:
                free = math.nan
            need = rank_bytes * ctx.world_size
            return ConfigError(
                f"checkpoint save of step {step} failed: no space left on device under "
                f"{ctx.root} ({format_bytes(free)} free; this checkpoint needs about "
                f"{format_bytes(need)}, {format_bytes(rank_bytes)} of it from rank "
                f"{ctx.rank}); nothing was committed and the earlier checkpoints are intact; "
                "free space or set checkpoint.dir to a larger filesystem"
            )
        if os_err is not None and os_err.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            where = os_err.filename or ctx.root
            return ConfigError(
                f"checkpoint save of step {step} failed: {os_err.strerror or os_err} ({where}); "
                "nothing was committed and the earlier checkpoints are intact; make "
                f"{ctx.root} writable (or set checkpoint.dir to a writable filesystem) and "
                "resume"
            )
        return RuntimeError(f"checkpoint save of step {step} failed: {first_line(e)}")


class InFlight:
    """The async saves handed to the writer thread, oldest first. Each is settled in order:
    its numbers recorded, or its failure raised (after the saves queued behind it ended, on
    every rank alike). A save stays listed while it is waited for (stopped_line)."""

    def __init__(self, ctx: Context, records: SaveRecords, committer: Committer):
        self.ctx = ctx
        self.records = records
        self.committer = committer
        self.pending: deque[_Pending] = deque()

    def __bool__(self) -> bool:
        return bool(self.pending)

    def add(self, pending: _Pending) -> None:
        self.pending.append(pending)

    def busy(self) -> int:
        """How many are still being written (each holds its staging buffer)."""
        return sum(1 for p in self.pending if not p.future.done())

    def busy_buffers(self) -> set[int]:
        return {p.buffer for p in self.pending if not p.future.done()}

    def running_steps(self) -> set[int]:
        return {p.step for p in self.pending if not p.future.done()}

    def failed(self) -> bool:
        """Whether a listed save has failed (not raised yet)."""
        return any(p.future.done() and p.future.exception() for p in self.pending)

    def settle(self, pending: _Pending) -> None:
        try:
            out = pending.future.result()
        except ERRORS as e:
            # The run stops: let the saves queued behind this one end first (on every rank, so
            # no rank's writer is left inside a collective); their outcome is not raised.
            while self.pending:
                self.pending.popleft().future.exception()
            raise self.committer.failure(
                pending.step,
                self.ctx.root / (store.step_name(pending.step) + store.TMP_SUFFIX),
                e,
                pending.bytes,
            ) from None
        end = pending.end[0] if pending.end else time.perf_counter()
        self.records.record(
            pending.step,
            blocking_s=pending.blocking_s,
            total_s=end - pending.start,
            wait_prev_s=pending.wait_s,
            **pending.staging,
            queue_s=max(0.0, out["write_start"] - (pending.start + pending.blocking_s)),
            **({"start_wait_s": out["start_wait_s"]} if "start_wait_s" in out else {}),
            write_s=out["write_s"],
            **({"commit_s": out["commit_s"]} if "commit_s" in out else {}),
            bytes=pending.bytes,
            checkpoint_bytes=out.get("checkpoint_bytes", 0),
            **out["times"],
        )

    def poll(self) -> None:
        """Settle the saves that finished, in order, up to the first failed one: failures are
        raised where every rank raises them at the same step (Saver._agree, blocking waits)."""
        while self.pending and self.pending[0].future.done():
            if self.pending[0].future.exception() is not None:
                return
            self.settle(self.pending.popleft())

    def wait_while(self, full: Callable[[], bool]) -> float:
        """Settle the oldest saves while `full()` (no free staging buffer), then poll; the
        seconds waited."""
        t0 = time.perf_counter()
        while self.pending and full():
            self.settle(self.pending[0])  # listed while waited for (stopped_line)
            self.pending.popleft()
        self.poll()
        return time.perf_counter() - t0

    def wait_all(self) -> float:
        """Wait for every save listed (settled in order; a failure raised)."""
        t0 = time.perf_counter()
        while self.pending:
            self.settle(self.pending[0])  # listed while waited for (stopped_line)
            self.pending.popleft()
        return time.perf_counter() - t0


class Saver:
    """When and how each save is taken, and the saves in flight. `check_finite(step)`: the
    manager's loss check, run before every save (it stops the run, closing the manager, when
    a loss so far was not finite)."""

    def __init__(self, ctx: Context, check_finite: Callable[[int], None]):
        self.ctx = ctx
        self._check_finite = check_finite
        # The save id prefix and hash algorithm: rank 0's, so every rank writes the same.
        self._token, self._algorithm = ctx.broadcast(
            (secrets.token_hex(6), hashing.default_algorithm() if ctx.cfg.checksum else None)
        )
        self.records = SaveRecords(ctx)
        self.committer = Committer(ctx, self._algorithm)
        self.in_flight = InFlight(ctx, self.records, self.committer)
        self._deferred: int | None = None
        self.last_saved_step: int | None = None
        self._saves = 0
        self._executor: ThreadPoolExecutor | None = None
        self._stager = None
        self._writer = None
        self._writers_up = False  # async_process: every rank's writer process has started
        self._buffer_version = 0
        self._sync_staged: bool | None = None  # sync: staging decided (on the first use)
        self._saving_here: int | None = None  # the step of a save in the main thread

    def start(self) -> None:
        """The writer process (async_process), the staging buffers and the writer thread of
        this mode. What it started before a failure is stopped by `close`."""
        cfg, rank = self.ctx.cfg, self.ctx.rank
        # a placement this rank decides alone (a reallocation) is said by every rank
        warn = (
            self.ctx.log
            if rank == 0
            else (lambda msg: print(f"checkpoint: rank {rank}: {msg}", flush=True))
        )
        agree = self.ctx.minimum if self.ctx.ctl is not None else None
        if cfg.mode in ("async", "async_process"):
            process = cfg.mode == "async_process"
            if process:
                from checkpoint.writer_process import WriterProcess

                self._writer = WriterProcess(rank, self.ctx.world_size, self.ctx.pg)
            self._stager = staging.Stager(
                buffers=cfg.staging_buffers,
                shared=process,
                log=self.ctx.log,
                warn=warn,
                on_allocate=self._buffers_allocated,
                before_reallocate=self.wait_all,
                agree=agree,
            )
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="ckpt-write")
            # Its thread starts now, not inside the first save's `submit`: a Ctrl-C landing
            # in a thread start there left a worker the executor never recorded, which the
            # interpreter then waited for at exit (a hang with the run lock held).
            self._executor.submit(lambda: None).result()
        elif cfg.mode == "sync":
            # The async writer's path, waited for: one staging buffer (copied at the save, by
            # large pinned copies) written by the writer threads from host memory. Writing
            # straight from device tensors copied each tensor to pageable memory inside the
            # writer (0.98 GB/s against async's 1.8 on an H200 host). Without room in host
            # memory for the copy, sync writes from the device tensors as before (_sync_staging).
            self._stager = staging.Stager(buffers=1, log=self.ctx.log, warn=warn, agree=agree)

    # -- when -----------------------------------------------------------------------------------

    def maybe_save(
        self, step: int, state: Mapping[str, Any], force: bool = False
    ) -> dict[str, float] | None:
        """CheckpointManager.maybe_save: at the interval, forced, or a deferred save due."""
        cfg = self.ctx.cfg
        if not self.ctx.saving or step == self.last_saved_step:
            self.in_flight.poll()
            return None
        due = force or (cfg.interval > 0 and step % cfg.interval == 0)
        if not due and self._deferred is None:
            self.in_flight.poll()
            if self._stager is not None and self._sync_staging(state):
                self._stager.prepare(state)  # once: buffers ready before the first save
            return None
        if cfg.mode == "sync" or force or cfg.when_busy == "wait":
            return self.save(step, state)
        if self._agree():
            if self._deferred is not None:
                self.records.note(
                    f"step {step}: saving (deferred from step {self._deferred}: the writer was busy)",
                    {"event": "deferred_taken", "step": step, "due_step": self._deferred},
                )
                self._deferred = None
            return self.save(step, state)
        busy = ", ".join(str(p.step) for p in self.in_flight.pending)
        if cfg.when_busy == "skip":
            self.records.note(
                f"step {step}: save skipped, the writer is busy with step(s) {busy} "
                "(checkpoint.when_busy=skip)",
                {"event": "skipped", "step": step},
            )
        elif due and self._deferred is None:
            self._deferred = step
            self.records.note(
                f"step {step}: save deferred, the writer is busy with step(s) {busy}; it is "
                "taken at the first step a staging buffer is free (checkpoint.when_busy=defer)",
                {"event": "deferred", "step": step},
            )
        return None

    def _agree(self) -> bool:
        """Whether every rank has a free staging buffer (a collective on `ctl`). When a save
        failed on any rank, every rank waits for its own saves and raises the failure here,
        at the same step (a failed DCP save fails on every rank)."""
        self.in_flight.poll()
        failed = self.in_flight.failed()
        free, all_ok = self.ctx.minimum([self._free_buffers(), int(not failed)])
        if not all_ok:
            self.wait_all()
        return free > 0

    def _buffer_count(self) -> int:
        n = len(self._stager.buffers) if self._stager is not None else 0
        return n or self.ctx.cfg.staging_buffers

    def _free_buffers(self) -> int:
        return max(0, self._buffer_count() - self.in_flight.busy())

    def _free_index(self) -> int:
        busy = self.in_flight.busy_buffers()
        return next(i for i in range(self._buffer_count()) if i not in busy)

    def _buffers_allocated(self, buffers: list[torch.Tensor]) -> None:
        self._buffer_version += 1
        if self._writer is not None:
            self._writer.set_buffers(buffers, self._buffer_version)

    def _sync_staging(self, state: Mapping[str, Any]) -> bool:
        """Whether this manager stages its saves: always in async modes; in sync mode when a
        copy of the state fits in half of the host memory available on every rank (decided
        once, by all ranks alike: a collective on `ctl` at the first call, which every rank
        makes at the same step). Otherwise sync writes from the device tensors, logged."""
        if self.ctx.cfg.mode != "sync":
            return True
        if self._sync_staged is None:
            need = _state_bytes(state) * int(os.environ.get("LOCAL_WORLD_SIZE", 1))
            available = staging.host_memory_available()
            fits = available is None or need <= available // 2
            self._sync_staged = bool(self.ctx.minimum([int(fits)])[0])
            if not self._sync_staged:
                self.ctx.log(
                    f"sync saves write from the device tensors (slower): a staging copy of "
                    f"{need / 2**30:.1f} GiB per node exceeds half of the host memory available"
                )
                self._stager = None
        return self._sync_staged

    def _writer_starting(self, step: int) -> bool:
        """async_process: whether the writer process of some rank has not started yet (all
        ranks agree, on `ctl`). Until every one has, saves are written by this process as in
        sync mode: a save due while the writers start (seconds: the child imports torch) is
        taken at its step, never deferred behind them. No save is in a writer meanwhile, so
        polling its pipe here is safe."""
        if self._writer is None or self._writers_up:
            return False
        (ready,) = self.ctx.minimum([int(self._writer.wait_ready(0))])
        self._writers_up = bool(ready)
        if not ready:
            self.ctx.log(
                f"step {step}: saving from the training process (sync): the writer process "
                "is still starting"
            )
        return not ready

    # -- how ------------------------------------------------------------------------------------

    def save(self, step: int, state: Mapping[str, Any]) -> dict[str, float]:
        """Save `step` now (on every rank), waiting for a staging buffer if all are busy."""
        t0 = time.perf_counter()
        mode = self.ctx.cfg.mode
        planned = None
        # sync, and async_process while its writer processes start, write at the step; sync
        # through the staging buffer when it has one (_sync_staging).
        direct = mode == "sync" or self._writer_starting(step)
        staged_direct = mode == "sync" and self._stager is not None
        if (not direct or staged_direct) and self._sync_staging(state):
            # CPU work first, while the device finishes the step: what to copy, where.
            planned = staging.plan(state)
            self._agree()  # raises an earlier failure on every rank alike
        drain = _drain_device()  # the steps already queued on the device
        self._check_finite(step)
        waited = self.in_flight.wait_while(lambda: self._free_buffers() == 0)
        tmp = self.ctx.root / (store.step_name(step) + store.TMP_SUFFIX)
        if self.ctx.rank == 0:
            tmp.mkdir(parents=True, exist_ok=True)
            train = find(state, TrainState)
            if train is not None and train.config_yaml:
                (tmp / store.CONFIG_FILE).write_text(train.config_yaml)
        self._saves += 1  # the same count on every rank: save ids need no collective
        save_id = f"{self._token}-{self._saves}-step{step}"
        if direct:
            blocking = self._save_here(step, state, planned, tmp, save_id, t0, drain)
        else:
            blocking = self._save_staged(step, planned, tmp, save_id, t0, drain, waited)
        self.last_saved_step = step
        return {"save_blocking_s": blocking, "save_wait_prev_s": waited}

    def _save_here(
        self,
        step: int,
        state: Mapping[str, Any],
        planned: Any,
        tmp: Path,
        save_id: str,
        t0: float,
        drain: float,
    ) -> float:
        """A save the loop waits for (sync, or async_process while its writers start):
        staged (`planned`) or from the device tensors, written and committed here. Returns
        the seconds the loop waited."""
        staged_times = {}
        self._saving_here = step  # for stopped_line: a save the main thread is in
        try:
            if planned is not None:
                staged = self._stager.stage(planned, 0)
                staged_times = {
                    "state_dict_s": staged.state_dict_s,
                    "alloc_s": staged.alloc_s,
                    "stage_s": staged.stage_s,
                }
                out = self._write_here(self._stager.state_dict(staged), tmp, save_id)
            else:
                out = self._write_here(state, tmp, save_id)
        except ERRORS as e:
            raise self.committer.failure(step, tmp, e, _state_bytes(state)) from None
        t_commit = time.perf_counter()
        rank0 = self.ctx.rank == 0
        size = self.committer.commit(tmp, step, out["file_hashes"], save_id) if rank0 else 0
        self._saving_here = None
        blocking = total = time.perf_counter() - t0
        commit = time.perf_counter() - t_commit
        self.records.record(
            step,
            blocking_s=blocking,
            total_s=total,
            drain_s=drain,
            **staged_times,
            write_s=out["write_s"],
            commit_s=commit,
            bytes=out["bytes"],
            checkpoint_bytes=size,
            **out["times"],
        )
        return blocking

    def _save_staged(
        self,
        step: int,
        planned: Any,
        tmp: Path,
        save_id: str,
        t0: float,
        drain: float,
        waited: float,
    ) -> float:
        """An async save: staged into a free buffer here, written (and on rank 0 committed) by
        the writer thread; listed in flight. Returns the seconds the loop waited."""
        index = self._free_index()
        staged = self._stager.stage(planned, index)
        blocking = time.perf_counter() - t0
        future = self._executor.submit(self._write, staged, tmp, step, save_id)
        pending = _Pending(
            step,
            future,
            t0,
            blocking,
            waited,
            {
                "drain_s": drain,
                "state_dict_s": staged.state_dict_s,
                "alloc_s": staged.alloc_s,
                "stage_s": staged.stage_s,
            },
            staged.nbytes,
            staged.buffer,
        )
        future.add_done_callback(lambda _: pending.end.append(time.perf_counter()))
        self.in_flight.add(pending)
        return blocking

    def _write_here(self, state: Mapping[str, Any], tmp: Path, save_id: str) -> dict[str, Any]:
        """Write `state` (device tensors, or a staging buffer's views) into `tmp` from this
        process: the DCP save with this manager's writer settings."""
        cfg = self.ctx.cfg
        return write_checkpoint(
            state,
            tmp,
            save_id=save_id,
            algorithm=self._algorithm,
            thread_count=cfg.write_threads,
            sync_files=cfg.sync_files,
            process_group=self.ctx.pg,
            no_dist=not self.ctx.dist,
        )

    def _write(self, staged, tmp: Path, step: int, save_id: str) -> dict[str, Any]:
        """The writer thread: one save from a staging buffer, then (rank 0) its commit."""
        cfg = self.ctx.cfg
        t_start = time.perf_counter()
        try:
            if self._writer is not None:
                out = self._writer.save(
                    {
                        "version": self._buffer_version,
                        "buffer": staged.buffer,
                        "skeleton": staged.skeleton,
                        "slots": staged.slots,
                        "copied": staged.copied,
                        "path": str(tmp),
                        "save_id": save_id,
                        "algorithm": self._algorithm,
                        "threads": cfg.write_threads,
                        "sync_files": cfg.sync_files,
                    }
                )
            else:
                with _switch_interval(_WRITE_SWITCH_INTERVAL_S):
                    out = self._write_here(self._stager.state_dict(staged), tmp, save_id)
        except BaseException:
            if self.ctx.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)  # nothing committed; give the space back
            raise
        out["write_start"] = t_start
        if self.ctx.rank == 0:
            t_commit = time.perf_counter()
            out["checkpoint_bytes"] = self.committer.commit(tmp, step, out["file_hashes"], save_id)
            out["commit_s"] = time.perf_counter() - t_commit
        return out

    # -- end ------------------------------------------------------------------------------------

    def wait_all(self) -> float:
        """Wait for every save in flight (settled in order; a failure raised)."""
        return self.in_flight.wait_all()

    def finish(self, step: int, state: Mapping[str, Any], save: bool = True) -> None:
        """The final save (checkpoint.save_at_end, unless `save=False` or it was just saved),
        then every save in flight and the pruning waited for."""
        cfg = self.ctx.cfg
        if save and self.ctx.saving and cfg.save_at_end and step != self.last_saved_step:
            self.save(step, state)
        self.wait_all()
        self.committer.wait_pruned()

    def stats(self) -> dict[str, float]:
        """CheckpointManager.stats: the newest save completed since the last call."""
        self.in_flight.poll()
        return self.records.take_newest()

    def stopped_line(self, step: int) -> str:
        """CheckpointManager.stopped_line: what a run stopped at once after `step` leaves."""
        in_flight = self.in_flight.running_steps()
        if self._saving_here is not None:
            in_flight.add(self._saving_here)
        return stopped_line(self.ctx.root, step, sorted(in_flight))

    def abandon(self) -> None:
        """Stop the writer process without waiting for any save (a second Ctrl-C)."""
        if self._writer is not None:
            self._writer.kill()

    def close(self) -> None:
        """Wait for saves in flight, then stop the writers and free the buffers."""
        try:
            if self.in_flight:
                self.wait_all()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
            self.committer.close()
            if self._writer is not None:
                self._writer.close()
            if self._stager is not None:
                self._stager.close()


def stopped_line(root: Path, step: int, in_flight: list[int]) -> str:
    """The line of a run stopped at once after `step` (rank 0 reads `root`): the newest
    committed checkpoint, the steps not saved, the saves `in_flight` that are abandoned."""
    newest = store.newest_step(root)
    if newest is None:
        line = f"stopped at once after step {step}; no checkpoint committed in {root}"
        if step:
            line += f"; steps 1-{step} not saved"
    elif newest.step >= step:
        line = f"stopped at once after step {step}; checkpoint {newest.path} committed"
    else:
        lost = f"{newest.step + 1}-{step}" if step > newest.step + 1 else str(step)
        line = (
            f"stopped at once after step {step}; checkpoint {newest.path} committed; "
            f"step{'s' if '-' in lost else ''} {lost} not saved"
        )
    if in_flight:
        steps = ", ".join(map(str, in_flight))
        line += f" (the save of step {steps} in flight was abandoned)"
    if newest is not None:
        line += "; run the same command to resume from it"
    return line


def _drain_device() -> float:
    """Wait for the work queued on this rank's GPU (the step just launched); its seconds.
    Part of what the loop waits for at a save, but time the device was busy anyway."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return 0.0
    t0 = time.perf_counter()
    torch.cuda.current_stream().synchronize()
    return time.perf_counter() - t0


def _state_bytes(state: Mapping[str, Any]) -> int:
    """This rank's bytes of model parameters and optimizer states (for the full-disk
    message; no state_dict() calls, which may run collectives)."""
    from checkpoint.state import OptimizerState
    from model.memory import tensor_bytes

    model, optim = find(state, ModelState), find(state, OptimizerState)
    tensors = list(model.model.parameters()) if model is not None else []
    if optim is not None:
        tensors += [
            v
            for st in optim.optimizer.state.values()
            for v in st.values()
            if isinstance(v, torch.Tensor)
        ]
    return sum(tensor_bytes(getattr(t, "_local_tensor", t)) for t in tensors)


@contextlib.contextmanager
def _switch_interval(seconds: float):
    """The GIL switch interval at most `seconds` for the block (process-wide), then restored."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(min(before, seconds))
    try:
        yield
    finally:
        sys.setswitchinterval(before)

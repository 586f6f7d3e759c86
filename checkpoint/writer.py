"""DCP storage writer: a rank's files written in parallel, each hashed while it is written.

`CheckpointWriter` is torch's FileSystemWriter with its file-writing step replaced; the format
stays DCP's (items serialized with torch.save at the offsets `.metadata` records), so stock
DCP readers and tools load the result. What changes:

- the rank's items are split into `thread_count` files by size (DCP's own split), each written
  by a thread of its own; empty files are not created;
- every byte goes through a hasher (xxh3-64 or CRC32, checkpoint/hashing.py) on its way to
  the file: no file is read back to compute its checksum;
- torch.save's zip CRC32 is switched off (process-wide: torch.load never checks it, and the
  file hash above covers the same bytes); it cost a pass over the data at about 3 GB/s;
- a plain tensor's zip framing (the bytes torch.save writes before and after its data) is
  recorded from its first torch.save and reused for every later tensor of the same dtype and
  shape (`_Framing`): a tensor then costs one hash call instead of the ~40 Python callbacks
  of torch.save's zip writer, and its data goes out with others' in one os.writev of up to
  256 MiB (small writes are copied and gathered). Each call that releases the GIL has to take
  it back from the training thread in `async` mode, which can take a switch interval
  (checkpoint/save.py shortens it while such a write runs);
- short writes are retried, and the first OSError (e.g. ENOSPC) is kept and raised as is once
  torch.save returns (later writes of that file are dropped so torch's zip writer can finish
  its bookkeeping instead of reporting "unexpected pos");
- each file ends with a 64-byte trailer naming the save id and the file (checkpoint/store.py);
- with `sync_files`, the disk is set writing while the file is still being written: every
  `WRITEBACK_BYTES` the written range is handed to the kernel's writeback (`start_writeback`:
  posix_fadvise DONTNEED starts it without waiting, and drops the pages once clean), so the
  closing fsync waits for the tail only. Without it the kernel starts writing a checkpoint
  only when its dirty-page threshold (a tenth of RAM) is reached, or at the fsync: the disk
  sat idle while a sync save's first gigabytes went to the page cache;
- the save id is fixed by the caller, the same on every rank, and lands in DCP's metadata;
- rank 0's `finish` keeps every rank's file hashes (`file_hashes`) for the manifest.

`write_checkpoint` runs one `dcp.save` with it; the manager calls it inline (sync), on a
thread (async) or in its writer process (async_process).
"""

from __future__ import annotations

import dataclasses
import errno
import os
import queue
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from checkpoint import hashing, store
from checkpoint.planners import BlockSavePlanner

#: Most bytes and buffers per write system call (os.writev). Each hash and write call releases
#: the GIL and takes it back after; in `async` mode the training thread holds it between its
#: own releases, so every take-back can wait up to the switch interval. Fewer, larger calls
#: keep those waits rare.
_CHUNK = 1 << 28
_MAX_BUFFERS = 512
#: Writes smaller than this are copied and gathered; they go out with the next batch.
_SMALL = 1 << 20
#: Tensors with fewer bytes than this are written by torch.save directly (no framing reuse).
_FRAMED_MIN = 1 << 12
#: Bytes between two hand-offs of a file's written range to the kernel's writeback.
WRITEBACK_BYTES = 1 << 28
#: The per-rank timings a save reports (CheckpointWriter.times).
WRITE_TIMES = ("file_s", "write_calls_s", "hash_s", "fsync_s")
#: The write system call (tests replace it to simulate short writes and a full disk).
_os_writev = os.writev


def start_writeback(fd: int, start: int, end: int) -> bool:
    """Have the kernel start writing bytes [start, end) of `fd` to disk without waiting
    (posix_fadvise DONTNEED, which also drops those pages once clean). A hint: False where
    the system or the file system refuses it, and the fsync writes everything anyway."""
    if not hasattr(os, "posix_fadvise"):
        return False
    try:
        os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)
    except OSError:
        return False
    return True


@dataclasses.dataclass
class _HashedStorageInfo(_StorageInfo):
    """DCP's per-item storage info plus the hash of the whole file, carried to rank 0 with the
    write results; `finish` turns it back into a plain _StorageInfo before `.metadata`."""

    file_hash: tuple[str, Any] | None = None


class _HashingFile:
    """Write-only file for torch.save: bytes go through the hasher and to `fd`, batched into
    few os.writev calls (short writes retried). `write` copies writes under _SMALL bytes into a
    gathering buffer and writes larger ones (with everything before them) at once, since their
    memory is the caller's only for the call; `write_owned` queues a view without copying, for
    memory that stays unchanged until `drain()` (a staged tensor's data). The first OSError is
    kept and later writes are dropped; `check()` raises it."""

    def __init__(self, fd: int, hasher, writeback: bool = False):
        self.fd = fd
        self.hasher = hasher
        self.pos = 0
        #: Start the kernel's writeback of what was written (see the module doc), if it can.
        self.writeback = writeback
        self._written = 0  # bytes in the file
        self._handed = 0  # bytes handed to writeback
        self.error: OSError | None = None
        self._pending = bytearray()
        self._batch: list[memoryview] = []
        self._batch_bytes = 0
        self.write_calls_s = 0.0  # time inside write system calls
        self.hash_s = 0.0  # time inside the hasher

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        if n < _SMALL:
            self._pending += view
            if len(self._pending) >= _SMALL:
                self._gather()
        else:
            self._queue(view)
            self._flush()
        self.pos += n
        return n

    def write_owned(self, view: memoryview) -> None:
        self._queue(view)
        self.pos += len(view)
        if self._batch_bytes >= _CHUNK or len(self._batch) >= _MAX_BUFFERS:
            self._flush()

    def drain(self) -> None:
        """Write everything queued."""
        self._gather()
        self._flush()

    def _gather(self) -> None:
        if self._pending:
            self._batch.append(memoryview(self._pending))
            self._batch_bytes += len(self._pending)
            self._pending = bytearray()

    def _queue(self, view: memoryview) -> None:
        self._gather()  # the gathered small writes come first
        self._batch.append(view)
        self._batch_bytes += len(view)

    def _flush(self) -> None:
        batch, self._batch, self._batch_bytes = self._batch, [], 0
        if self.error is not None or not batch:
            return
        try:
            t0 = time.perf_counter()
            if self.hasher is not None:
                for piece in batch:
                    self.hasher.update(piece)
            t1 = time.perf_counter()
            self.hash_s += t1 - t0
            total = sum(len(piece) for piece in batch)
            i = 0
            while i < len(batch):
                written = _os_writev(self.fd, batch[i : i + _MAX_BUFFERS])
                if written <= 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                while i < len(batch) and written >= len(batch[i]):
                    written -= len(batch[i])
                    i += 1
                if written:  # a short write ended inside batch[i]
                    batch[i] = batch[i][written:]
            self._written += total
            if self.writeback and self._written - self._handed >= WRITEBACK_BYTES:
                # A file system that refuses the hint gets none for the rest of the file.
                self.writeback = start_writeback(self.fd, self._handed, self._written)
                self._handed = self._written
            self.write_calls_s += time.perf_counter() - t1
        except OSError as e:
            self.error = e

    def flush(self) -> None:
        pass  # torch.save calls this after every tensor; gathered writes go out with the next

    def tell(self) -> int:
        return self.pos

    def check(self) -> None:
        if self.error is not None:
            raise self.error


def _address(view: memoryview) -> int:
    return np.frombuffer(view, dtype=np.uint8).ctypes.data


def _raw(t: torch.Tensor) -> np.ndarray:
    """A contiguous tensor's bytes, without a copy (numpy has no bfloat16, bytes have a dtype)."""
    return t.reshape(-1).view(torch.uint8).numpy()


class _FramingRecorder:
    """File object for one torch.save of `t`: passes every write on to `out` and keeps the
    bytes before and after the one write of t's data."""

    def __init__(self, out: _HashingFile, t: torch.Tensor):
        self.out = out
        self.data_at = t.data_ptr()
        self.data_len = t.nbytes
        self.before = bytearray()
        self.after = bytearray()
        self.data_writes = 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if len(view) == self.data_len and _address(view) == self.data_at:
            self.data_writes += 1
        else:
            (self.after if self.data_writes else self.before).extend(view)
        return self.out.write(view)

    def flush(self) -> None:
        pass


class _Framing:
    """torch.save's output for a plain contiguous CPU tensor is its data between bytes that
    depend only on dtype, shape and strides (zip headers, the pickled rebuild call, the central
    directory), as long as the zip CRC32 is off. `write(f, t)` torch.saves the first tensor of
    each kind through a recorder and writes later ones as recorded prefix + data + suffix:
    the same bytes (tests/test_checkpoint_async.py compares the files)."""

    def __init__(self):
        self._known: dict[tuple, tuple[bytes, bytes]] = {}

    @staticmethod
    def _key(t: torch.Tensor) -> tuple | None:
        if (
            type(t) is not torch.Tensor
            or t.device.type != "cpu"
            or t.layout != torch.strided
            or t.is_quantized
            or t.requires_grad
            or t.is_conj()
            or t.is_neg()
            or t.nbytes < _FRAMED_MIN
            or t.storage_offset() != 0
            or not t.is_contiguous()
            or t.untyped_storage().nbytes() != t.nbytes
            or torch.serialization.get_crc32_options()
        ):
            return None
        return (t.dtype, tuple(t.shape), tuple(t.stride()))

    def write(self, f: _HashingFile, t: torch.Tensor) -> None:
        key = self._key(t)
        known = self._known.get(key) if key is not None else None
        if known is not None:
            f.write(known[0])
            f.write_owned(memoryview(_raw(t)))
            f.write(known[1])
        elif key is None:
            torch.save(t, f)
        else:
            rec = _FramingRecorder(f, t)
            torch.save(t, rec)
            if rec.data_writes == 1:
                self._known[key] = (bytes(rec.before), bytes(rec.after))


#: Shared by all writers of the process (the framing depends on the torch build only).
_FRAMING = _Framing()


def _exact(t: torch.Tensor) -> torch.Tensor:
    """A tensor torch.save writes without extra bytes: torch.save writes a tensor's whole
    storage, so a view into a larger buffer gets a storage of its own bytes (no copy when it
    is contiguous). Tensor subclasses (TE quantized tensors) are left to torch.save."""
    if type(t) is not torch.Tensor:
        return t
    if t.is_contiguous() and t.untyped_storage().nbytes() == t.nbytes:
        return t
    if not t.is_contiguous() or t.numel() == 0:
        return t.contiguous() if not t.is_contiguous() else t.clone()
    return torch.frombuffer(_raw(t), dtype=t.dtype).view(t.shape)


class CheckpointWriter(FileSystemWriter):
    def __init__(
        self,
        path: str | os.PathLike,
        *,
        save_id: str,
        algorithm: str | None,
        thread_count: int = 4,
        sync_files: bool = True,
    ):
        super().__init__(path, single_file_per_rank=True, sync_files=sync_files)
        self.thread_count = thread_count
        self.fixed_save_id = save_id
        self.save_id = save_id
        self.algorithm = algorithm
        self.file_hashes: dict[str, tuple[str, Any]] = {}
        self.bytes_written = 0
        #: Where this rank's file writing went, summed over its files (threads run side by
        #: side, so the sums can exceed the save's wall time): file_s (open to close),
        #: write_calls_s, hash_s, fsync_s; the rest of file_s is Python and torch.save,
        #: including waits for the GIL.
        self.times = dict.fromkeys(WRITE_TIMES, 0.0)

    def reset(self, checkpoint_id=None) -> None:
        super().reset(checkpoint_id)
        self.save_id = self.fixed_save_id

    # FileSystemWriter.write_data splits the plan into thread_count buckets and hands them
    # here as (path, file name, items).
    def _write_data(self, planner, file_queue: queue.Queue) -> Future:
        jobs = []
        while True:
            try:
                path, name, items = file_queue.get_nowait()
            except queue.Empty:
                break
            if items:
                jobs.append((Path(path), name, items))
        if len(jobs) > 1:
            with ThreadPoolExecutor(len(jobs), thread_name_prefix="ckpt-file") as pool:
                outs = list(pool.map(lambda job: self._write_file(planner, *job), jobs))
        else:
            outs = [self._write_file(planner, *job) for job in jobs]
        results = [r for out, _ in outs for r in out]
        for _, times in outs:
            for k, v in times.items():
                self.times[k] += v
        self.bytes_written = sum(p.stat().st_size for p, _, _ in jobs)
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def _write_file(self, planner, path: Path, name: str, items):
        t_open = time.perf_counter()
        fsync_s = 0.0
        hasher = hashing.new_hasher(self.algorithm) if self.algorithm else None
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        results = []
        try:
            f = _HashingFile(fd, hasher, writeback=self.sync_files)
            # Pickled objects first, then tensors (DCP's order).
            for item in sorted(items, key=lambda i: i.type != WriteItemType.BYTE_IO):
                data = planner.resolve_data(item)
                offset = f.pos
                if item.type == WriteItemType.BYTE_IO:
                    f.write(data.getbuffer())
                else:
                    t = data.detach()
                    if t.device.type != "cpu":
                        t = t.to("cpu")
                    _FRAMING.write(f, _exact(t))
                f.check()
                length = f.pos - offset
                results.append(
                    WriteResult(
                        index=item.index,
                        size_in_bytes=length,
                        storage_data=_StorageInfo(name, offset, length),
                    )
                )
            f.write(store.trailer(self.save_id, name))
            f.drain()
            f.check()
            if self.sync_files:
                t_sync = time.perf_counter()
                os.fsync(fd)
                fsync_s = time.perf_counter() - t_sync
        finally:
            os.close(fd)
        times = {
            "file_s": time.perf_counter() - t_open,
            "write_calls_s": f.write_calls_s,
            "hash_s": f.hash_s,
            "fsync_s": fsync_s,
        }
        digest = (self.algorithm, hasher.result()) if hasher is not None else None
        first = results[0]
        info = first.storage_data
        results[0] = WriteResult(
            index=first.index,
            size_in_bytes=first.size_in_bytes,
            storage_data=_HashedStorageInfo(
                info.relative_path, info.offset, info.length, None, digest
            ),
        )
        return results, times

    def finish(self, metadata, results) -> None:
        hashes: dict[str, tuple[str, Any]] = {}
        plain = []
        for per_rank in results:
            out = []
            for r in per_rank:
                info = r.storage_data
                if isinstance(info, _HashedStorageInfo):
                    if info.file_hash is not None:
                        hashes[info.relative_path] = tuple(info.file_hash)
                    info = _StorageInfo(
                        info.relative_path, info.offset, info.length, info.transform_descriptors
                    )
                out.append(
                    WriteResult(index=r.index, size_in_bytes=r.size_in_bytes, storage_data=info)
                )
            plain.append(out)
        super().finish(metadata, plain)
        self.file_hashes = hashes


def write_checkpoint(
    state_dict: dict,
    path: Path,
    *,
    save_id: str,
    algorithm: str | None,
    thread_count: int,
    sync_files: bool,
    process_group=None,
    no_dist: bool = False,
) -> dict[str, Any]:
    """One DCP save of `state_dict` (live, or staged by checkpoint/staging.py) into `path`.
    Returns write_s, bytes (this rank's files), the writer's `times` (CheckpointWriter) and,
    on the coordinator, file_hashes."""
    # Process-wide: torch.load never checks the zip CRC32, the writer's file hash covers the
    # bytes, and the framing reuse needs it off (its headers would otherwise vary with the data).
    torch.serialization.set_crc32_options(False)
    writer = CheckpointWriter(
        path,
        save_id=save_id,
        algorithm=algorithm,
        thread_count=thread_count,
        sync_files=sync_files,
    )
    t0 = time.perf_counter()
    dcp.save(
        state_dict,
        storage_writer=writer,
        planner=BlockSavePlanner(),
        process_group=process_group,
        no_dist=no_dist,
    )
    return {
        "write_s": time.perf_counter() - t0,
        "bytes": writer.bytes_written,
        "file_hashes": writer.file_hashes,
        "times": writer.times,
    }


def os_error_in(exc: BaseException | None) -> OSError | None:
    """The first OSError with an errno among an exception, its causes and, for DCP's
    CheckpointException, the failures of every rank."""
    seen: set[int] = set()
    stack = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            stack += [v[0] if isinstance(v, tuple) else v for v in failures.values()]
        stack += [e.__cause__, e.__context__]
    return None

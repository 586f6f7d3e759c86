"""DCP storage reader that verifies the checkpoint's hashes with the bytes it loads.

Resume used to read every data file twice: once to hash it against the manifest, then again
to load it (13.8 GiB: 8.2 s of hashing, then the load; 17.7 s in all on an H200 host whose disk
reads one copy in about 7 s). `CheckpointReader` reads each byte once:

- planning (`prepare_global_plan`, on the coordinator with every rank's read plan): each data
  file with a recorded hash is given to one rank to verify, the rank that reads most of its
  bytes (at the same world size, the rank that wrote it), so the bytes a verifier reads beyond
  its own items are few; a file no rank reads goes round robin;
- reading (`read_data`): this rank's files in parallel (`threads`), each front to back, with a
  read-ahead thread per file (`_ReadAhead`) reading the next item while the file's thread
  hashes and loads the previous one. A file this rank verifies is read whole, in order: every
  item it loads goes through the hasher, and the bytes between and after them (other ranks'
  items, the trailer) are hashed as they pass; the other files are read item by item. Each
  saved item is read once, however many of this rank's read requests cover it (a reshard),
  and a tensor item is a view of its bytes in the read buffer (`_ItemTensors`), so the copy
  into the model's tensor is the only copy;
- a file that fails its hash, or an item that cannot be deserialized, is recorded in
  `problems` (the file's hash is still completed, so a corrupted item is reported as a hash
  failure, not as a torch.load error) and `read_data` raises `DamagedCheckpoint` after the
  files: DCP fails the load on every rank, and the manager turns the recorded problems (all
  ranks') into its one line naming the checkpoint.

So verification ends with the load, not before it: a damaged checkpoint may have put part of
its values into the model before the error, and the resume stops there (nothing trains, nothing
is saved; the manager raises before any Stateful's load_state_dict runs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import queue
import sys
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from checkpoint import hashing, store
from errors import ConfigError

#: Bytes per read call for the parts of a verified file this rank does not load.
_SKIP_CHUNK = 1 << 24
#: Most bytes one read system call returns on Linux.
_MAX_READ = 0x7FFFF000


def _narrow(t: torch.Tensor, offsets, lengths) -> torch.Tensor:
    """The part of a saved item a read request asks for (DCP's storage offsets and lengths)."""
    for dim, (start, length) in enumerate(zip(offsets, lengths)):
        if start != 0 or length != t.size(dim):
            t = t.narrow(dim, start, length)
    return t


class DamagedCheckpoint(RuntimeError):
    """A file failed its hash, or an item could not be read (`CheckpointReader.problems`)."""


class _ItemBuffer:
    """One growing bytearray that a file's items are read into in turn. A fresh `bytes` per
    item (and torch.load's own storage) costs a page fault per 4 KiB on every item: measured
    on a 2-core VM, reading 3.4 GB of items into fresh buffers took 1.8 s from the page cache,
    into one reused buffer 0.35 s."""

    def __init__(self):
        self._buf = bytearray()

    def get(self, n: int) -> memoryview:
        if len(self._buf) < n:
            self._buf = bytearray(n)
        return memoryview(self._buf)[:n]


class _Phases:
    """Seconds spent per phase of a file's read (`CheckpointReader.phase_s` sums them)."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - t0

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] += seconds


_END = object()


class _ReadAhead:
    """One file's bytes in file order, read on a thread of its own one segment ahead of the
    consumer: each item (with its read requests) into one of two item buffers, and for a
    verified file the bytes between and after the items in `_SKIP_CHUNK` pieces (requests
    None: hashed only). Iterating gives (bytes, requests); a segment's buffer is handed back
    when the next one is asked for, so a file holds at most twice its largest item. A read
    error or a short file is raised to the consumer where the segment would have come."""

    def __init__(self, path: Path, items: list, verify: bool):
        self._f = open(path, "rb", buffering=0)
        self._items = items
        self._verify = verify
        self._free_items: queue.SimpleQueue = queue.SimpleQueue()
        self._free_chunks: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(2):
            self._free_items.put(_ItemBuffer())
            self._free_chunks.put(bytearray(_SKIP_CHUNK))
        self._ready: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self.read_s = 0.0  # in read calls (the read-ahead thread)
        self.wait_s = 0.0  # the consumer waiting for a segment (reading is the bottleneck)
        self.nbytes = 0
        self._thread = threading.Thread(target=self._run, name="ckpt-read-ahead", daemon=True)
        self._thread.start()

    def __iter__(self):
        while True:
            t0 = time.perf_counter()
            entry = self._ready.get()
            self.wait_s += time.perf_counter() - t0
            if entry is _END:
                return
            if isinstance(entry, BaseException):
                raise entry
            data, group, home, buf = entry
            yield data, group
            home.put(buf)

    def close(self) -> None:
        self._stop.set()
        self._free_items.put(None)
        self._free_chunks.put(None)
        self._thread.join()
        self._f.close()

    def _take(self, free: queue.SimpleQueue):
        buf = free.get()
        return None if buf is None or self._stop.is_set() else buf

    def _read(self, view: memoryview, n: int) -> int:
        t0 = time.perf_counter()
        try:
            got = 0
            while got < n:
                more = self._f.readinto(view[got : got + min(n - got, _MAX_READ)])
                if not more:
                    break
                got += more
            self.nbytes += got
            return got
        finally:
            self.read_s += time.perf_counter() - t0

    def _run(self) -> None:
        try:
            pos = 0
            for (offset, length), group in self._items:
                if self._verify:
                    if not self._skip(offset - pos):
                        return
                else:
                    self._f.seek(offset)
                buf = self._take(self._free_items)
                if buf is None:
                    return
                view = buf.get(length)
                got = self._read(view, length)
                if got < length:
                    raise EOFError(f"file ends {length - got} bytes early")
                self._ready.put((view, group, self._free_items, buf))
                pos = offset + length
            if self._verify and not self._skip(None):
                return
            self._ready.put(_END)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            self._ready.put(e)

    def _skip(self, n: int | None) -> bool:
        """Queue the next `n` bytes (None: to the end of the file) for hashing only; False
        when stopped."""
        done = 0
        while n is None or done < n:
            buf = self._take(self._free_chunks)
            if buf is None:
                return False
            want = _SKIP_CHUNK if n is None else min(_SKIP_CHUNK, n - done)
            got = self._read(memoryview(buf), want)
            if got:
                self._ready.put((memoryview(buf)[:got], None, self._free_chunks, buf))
                done += got
            else:
                self._free_chunks.put(buf)
            if got < want:
                if n is not None:
                    raise EOFError(f"file ends {n - done} bytes early")
                break
        return True


class _ViewFile(io.RawIOBase):
    """A read-only file over a memoryview: torch.load and torch's zip reader read an item
    through it without the copy io.BytesIO would make."""

    def __init__(self, data: memoryview):
        super().__init__()
        self._data = data
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = max(0, min(len(b), len(self._data) - self._pos))
        memoryview(b).cast("B")[:n] = self._data[self._pos : self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._data)}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos


class _ItemTensors:
    """Tensors of saved items without torch.load's copy. A saved tensor item is torch.save's
    zip archive; its storage's bytes are one record of it. torch.load with the meta device
    reads only the pickled description (dtype, shape, strides, storage offset) and says where
    the storage's record starts (`_checkpoint_offset`, torch's own record offset); the tensor
    is that description laid over the record's bytes in the item buffer, which is what
    torch.load would have copied out when the archive's byte order is this machine's.
    Anything else (other objects, several storages, another byte order, a torch that gives no
    offset) goes through torch.load."""

    def __init__(self):
        self.views = 0  # items given as views of their record (no torch.load copy)
        self.loads = 0  # items copied out by torch.load

    def tensor(self, data: memoryview):
        view = self._view(data)
        if view is not None:
            self.views += 1  # under the GIL: exact enough for a count
            return view
        self.loads += 1
        return torch.load(_ViewFile(data), map_location="cpu", weights_only=True)

    @staticmethod
    def _view(data: memoryview) -> torch.Tensor | None:
        meta = torch.load(_ViewFile(data), map_location="meta", weights_only=True)
        if type(meta) is not torch.Tensor or meta.layout != torch.strided:
            return None
        storage = meta.untyped_storage()
        start = getattr(storage, "_checkpoint_offset", None)
        if start is None or not 0 < storage.nbytes() <= len(data) - start:
            return None
        if meta.is_conj() or meta.is_neg():
            return None
        archive = torch._C.PyTorchFileReader(_ViewFile(data))
        records = archive.get_all_records()
        if sum(r.split("/")[-2:-1] == ["data"] for r in records) != 1:
            return None  # one storage: the one described
        if "byteorder" not in records or archive.get_record("byteorder") != sys.byteorder.encode():
            return None  # torch.load would byte-swap, or assume an order
        end = start + storage.nbytes()
        raw = torch.frombuffer(data[start:end], dtype=torch.uint8).view(meta.dtype)
        return raw.as_strided(meta.shape, meta.stride(), meta.storage_offset())


class CheckpointReader(FileSystemReader):
    def __init__(
        self,
        path: str | os.PathLike,
        *,
        manifest: dict | None,
        verify: bool,
        threads: int = 4,
    ):
        super().__init__(path)
        self.root = Path(path)
        self.manifest = manifest or {"files": {}}
        self.verify = verify
        self.threads = max(1, threads)
        #: (file, problem in a few words) of this rank; `kind` "damaged" or "error" (an
        #: environment problem, e.g. xxhash missing, reported as is).
        self.problems: list[tuple[str, str, str]] = []
        self.verified: list[str] = []  # files this rank hashed
        self.bytes_read = 0
        #: Seconds per phase, summed over the files: read (the read-ahead threads' read
        #: calls), wait (consumers waiting for bytes), hash, deserialize, copy (into place).
        self.phase_s: dict[str, float] = {}
        self._lock = threading.Lock()
        self._tensors = _ItemTensors()

    def phases(self) -> str:
        """Where this rank's read time went, summed over its files (they are read in parallel,
        so the sums exceed the wall time): e.g. `per file, summed: read 30.1s, waiting for
        bytes 5.2s, hash 1.0s, deserialize 0.4s, copy 3.9s`."""
        order = ("read", "wait", "hash", "deserialize", "copy")
        names = {"wait": "waiting for bytes"}
        parts = [f"{names.get(k, k)} {self.phase_s[k]:.1f}s" for k in order if k in self.phase_s]
        return "per file, summed: " + ", ".join(parts) if parts else "nothing read"

    # -- planning -----------------------------------------------------------------------------

    def _hashed_files(self) -> list[str]:
        return sorted(
            rel
            for rel, entry in self.manifest["files"].items()
            if rel.endswith(store.DATA_SUFFIX) and hashing.recorded(entry) is not None
        )

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        plans = super().prepare_global_plan(plans)
        if not self.verify:
            return plans
        files = self._hashed_files()
        reads = {f: [0] * len(plans) for f in files}
        for rank, plan in enumerate(plans):
            for item in plan.items:
                info = self.storage_data[item.storage_index]
                if info.relative_path in reads:
                    reads[info.relative_path][rank] += info.length
        mine: dict[int, list[str]] = defaultdict(list)
        for i, f in enumerate(files):
            counts = reads[f]
            best = max(range(len(plans)), key=lambda r: (counts[r], -r)) if any(counts) else None
            mine[best if best is not None else i % len(plans)].append(f)
        return [
            dataclasses.replace(plan, storage_data={"verify": mine.get(rank, [])})
            for rank, plan in enumerate(plans)
        ]

    # -- reading ------------------------------------------------------------------------------

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        verify = set((plan.storage_data or {}).get("verify", [])) if self.verify else set()
        per_file: dict[str, list] = defaultdict(list)
        for req in plan.items:
            per_file[self.storage_data[req.storage_index].relative_path].append(req)
        if any(
            self.storage_data[r.storage_index].transform_descriptors for r in plan.items
        ):  # written by another writer (compressed streams): DCP's own reading
            fut = super().read_data(plan, planner)
            self._verify_only(sorted(verify))
            return fut
        jobs = [
            (rel, per_file.get(rel, []), rel in verify) for rel in sorted(set(per_file) | verify)
        ]
        device = torch.cuda.current_device() if torch.cuda.is_initialized() else None

        def run(job):
            if device is not None:
                torch.cuda.set_device(device)
            self._read_file(planner, *job)

        if len(jobs) > 1 and self.threads > 1:
            with ThreadPoolExecutor(min(self.threads, len(jobs)), "ckpt-read") as pool:
                list(pool.map(run, jobs))
        else:
            for job in jobs:
                run(job)
        if self.problems:
            raise DamagedCheckpoint("; ".join(f"{f}: {p}" for f, p, _ in self.problems))
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _verify_only(self, files: list[str]) -> None:
        for rel in files:
            self._read_file(None, rel, [], True)
        if self.problems:
            raise DamagedCheckpoint("; ".join(f"{f}: {p}" for f, p, _ in self.problems))

    def _problem(self, rel: str, problem: str, kind: str = "damaged") -> None:
        with self._lock:
            self.problems.append((rel, problem, kind))

    def _read_file(self, planner, rel: str, reqs: list, verify: bool) -> None:
        """Read one file: its requested items (each once) and, when verifying, every other byte
        too, hashed in file order; record a failed hash or an unreadable item. A read-ahead
        thread reads the file's segments in order (`_ReadAhead`) while this thread hashes and
        loads the previous one, so the disk is kept busy while items are copied into place."""
        items: dict[tuple[int, int], list] = defaultdict(list)
        for req in reqs:
            info = self.storage_data[req.storage_index]
            items[(info.offset, info.length)].append(req)
        hasher = expected = algorithm = None
        if verify:
            algorithm, expected = hashing.recorded(self.manifest["files"][rel])
            try:
                hasher = hashing.new_hasher(algorithm)
            except ConfigError as e:
                self._problem(rel, str(e), "error")
                hasher, verify = None, False
        failure: BaseException | None = None
        timer = _Phases()
        ahead = None
        try:
            ahead = _ReadAhead(self.root / rel, sorted(items.items()), verify)
            for data, group in ahead:
                if hasher is not None:
                    with timer("hash"):
                        hasher.update(data)
                if group is not None and failure is None:
                    try:
                        self._load_item(planner, group, data, self._tensors, timer)
                    except Exception as e:  # a corrupted item: the hash decides below
                        failure = e
                        if not verify:
                            raise
        except OSError as e:
            self._problem(rel, f"file {rel} cannot be read ({e.strerror or e})")
            return
        except Exception as e:
            failure = e
        finally:
            if ahead is not None:
                ahead.close()
                timer.add("read", ahead.read_s)
                timer.add("wait", ahead.wait_s)
            with self._lock:
                self.bytes_read += ahead.nbytes if ahead is not None else 0
                for phase, seconds in timer.seconds.items():
                    self.phase_s[phase] = self.phase_s.get(phase, 0.0) + seconds
        if verify and hasher is not None:
            if hasher.result() != expected:
                self._problem(
                    rel, f"file {rel} fails its {hashing.LABELS[algorithm]} check (corrupted)"
                )
                return
            with self._lock:
                self.verified.append(rel)
        if failure is not None:
            self._problem(
                rel, f"an item of file {rel} cannot be read ({type(failure).__name__}: {failure})"
            )

    @staticmethod
    def _load_item(
        planner, group: list, data: memoryview, tensors: _ItemTensors, timer: _Phases
    ) -> None:
        if planner is None:
            return
        if group[0].type == LoadItemType.BYTE_IO:
            for req in group:
                planner.load_bytes(req, io.BytesIO(data))
            return
        with timer("deserialize"):
            tensor = tensors.tensor(data)  # a view into `data`: copied into the target below
        for req in group:
            piece = _narrow(tensor, req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            if target.size() != piece.size():
                raise AssertionError(
                    f"req {req.storage_index} mismatch sizes {target.size()} vs {piece.size()}"
                )
            with timer("copy"):
                target.copy_(piece)  # synchronous: `data`'s buffer is reused after this
            planner.commit_tensor(req, target)


def first_problem(problems: list[tuple[str, str, str]]) -> tuple[str, str] | None:
    """(kind, problem) to report from every rank's `problems`: a failed hash first (an item
    that cannot be read is what a corrupted file looks like to a rank that does not verify
    it), then environment errors, then the rest; in file order. None without problems."""
    if not problems:
        return None

    def rank(p):
        rel, problem, kind = p
        return (0 if " check (corrupted)" in problem else 1 if kind == "error" else 2, rel)

    _, problem, kind = min(problems, key=rank)
    return kind, problem

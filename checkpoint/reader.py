"""DCP storage reader that verifies the checkpoint's hashes with the bytes it loads.

Resume used to read every data file twice: once to hash it against the manifest, then again
to load it (13.8 GiB: 8.2 s of hashing, then the load; 17.7 s in all on an H200 host whose disk
reads one copy in about 7 s). `CheckpointReader` reads each byte once:

- planning (`prepare_global_plan`, on the coordinator with every rank's read plan): each data
  file with a recorded hash is given to one rank to verify, the rank that reads most of its
  bytes (at the same world size, the rank that wrote it), so the bytes a verifier reads beyond
  its own items are few; a file no rank reads goes round robin;
- reading (`read_data`): this rank's files in parallel (`threads`), each front to back. A file
  this rank verifies is read whole, in order: every item it loads goes through the hasher on
  its way to torch.load, and the bytes between and after them (other ranks' items, the
  trailer) are hashed as they pass; the other files are read item by item. Each saved item is
  read and deserialized once, however many of this rank's read requests cover it (a reshard);
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

import dataclasses
import io
import os
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
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


def _read_into(f, view: memoryview, n: int) -> memoryview:
    got = 0
    while got < n:
        more = f.readinto(view[got : got + min(n - got, _MAX_READ)])
        if not more:
            raise EOFError(f"file ends {n - got} bytes early")
        got += more
    return view


class _Framing:
    """What one kind of saved tensor item looks like around its data record (`_ItemFraming`)."""

    def __init__(self, data: memoryview, p: int, q: int, t: torch.Tensor):
        self.before = bytes(data[:p])
        self.after = np.frombuffer(bytes(data[q:]), dtype=np.uint8)
        self.varies = np.zeros(len(self.after), dtype=bool)
        self.kind = (t.dtype, tuple(t.shape), tuple(t.stride()))

    def differs(self, data: memoryview) -> np.ndarray:
        """Positions of the bytes after the data record that differ from the kept ones."""
        after = np.frombuffer(data[len(data) - len(self.after) :], dtype=np.uint8)
        return after != self.after


class _ItemFraming:
    """Tensors from saved items without torch.load's copy. A saved tensor item is torch.save's
    zip archive: a data record between bytes that describe it (zip headers, the pickled rebuild
    call with dtype, shape and strides, the central directory, the CRCs and a per-save id).
    The first items of a length are loaded with torch.load; where the result is a plain
    contiguous tensor whose data is the archive's data record (checked byte for byte), the
    bytes before the record and after it are kept. A later item of that length with the same
    bytes before its record (so the same rebuild call, record offset and size) and the same
    bytes after it, except at positions already seen to differ between two items that
    torch.load read to the same dtype, shape and strides (CRCs, ids), gives a view of its data
    record. Any other item is loaded with torch.load (and may add to those positions)."""

    #: Items below this size always go through torch.load (nothing to gain).
    MIN_BYTES = 1 << 16
    #: Framings kept per item length.
    PER_LENGTH = 4

    def __init__(self):
        self._known: dict[int, list[_Framing]] = {}
        self._lock = threading.Lock()
        self.views = 0  # items given as views of their data record (no torch.load)

    def tensor(self, data: memoryview) -> torch.Tensor:
        n = len(data)
        for f in self._known.get(n, ()) if n >= self.MIN_BYTES else ():
            p = len(f.before)
            if data[:p] == f.before and not (f.differs(data) & ~f.varies).any():
                dtype, shape, stride = f.kind
                raw = torch.frombuffer(data[p : n - len(f.after)], dtype=torch.uint8)
                self.views += 1  # under the GIL: exact enough for a count
                return raw.view(dtype).as_strided(shape, stride)
        loaded = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        if n >= self.MIN_BYTES:
            self._learn(data, loaded)
        return loaded

    def _learn(self, data: memoryview, t) -> None:
        """Keep the framing of `data`, which torch.load read to `t`, if its data record is
        `t`'s bytes: a new one, or the positions where it differs from a kept one with the
        same bytes before the record added to that one's varying positions."""
        if (
            type(t) is not torch.Tensor
            or t.layout != torch.strided
            or t.storage_offset() != 0
            or not t.is_contiguous()
            or t.untyped_storage().nbytes() != t.nbytes
            or t.is_conj()
            or t.is_neg()
        ):
            return
        try:
            archive = torch._C.PyTorchFileReader(io.BytesIO(data))
            names = [r for r in archive.get_all_records() if r.endswith("data/0")]
            if len(names) != 1:
                return
            p = archive.get_record_offset(names[0])
        except (AttributeError, RuntimeError):  # a torch without record offsets: torch.load
            return
        q = p + t.nbytes
        raw = t.reshape(-1).view(torch.uint8)
        if q > len(data) or not torch.equal(torch.frombuffer(data[p:q], dtype=torch.uint8), raw):
            return
        kind = (t.dtype, tuple(t.shape), tuple(t.stride()))
        with self._lock:
            kept = self._known.setdefault(len(data), [])
            for f in kept:
                if len(f.before) == p and data[:p] == f.before:
                    if f.kind == kind:
                        f.varies |= f.differs(data)
                    return
            if len(kept) < self.PER_LENGTH:
                kept.append(_Framing(data, p, q, t))


class CheckpointReader(FileSystemReader):
    def __init__(
        self, path: str | os.PathLike, *, manifest: dict | None, verify: bool, threads: int = 4
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
        self.read_s = 0.0
        self._lock = threading.Lock()
        self._framing = _ItemFraming()

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
        t0 = time.perf_counter()
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
        self.read_s = time.perf_counter() - t0
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
        too, hashed in file order; record a failed hash or an unreadable item. Items are read
        into one buffer per call, reused from item to item (`_ItemBuffer`)."""
        buffers = _ItemBuffer()
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
        nbytes = 0
        try:
            with open(self.root / rel, "rb", buffering=0) as f:
                pos = 0
                for (offset, length), group in sorted(items.items()):
                    if verify:
                        pos += self._skip(f, offset - pos, hasher)
                    else:
                        f.seek(offset)
                    data = _read_into(f, buffers.get(length), length)
                    nbytes += length
                    pos = offset + length
                    if hasher is not None:
                        hasher.update(data)
                    if failure is None:
                        try:
                            self._load_item(planner, group, data, self._framing)
                        except Exception as e:  # a corrupted item: the hash decides below
                            failure = e
                            if not verify:
                                raise
                if verify:
                    nbytes += self._skip(f, None, hasher)
        except OSError as e:
            self._problem(rel, f"file {rel} cannot be read ({e.strerror or e})")
            return
        except Exception as e:
            failure = e
        finally:
            with self._lock:
                self.bytes_read += nbytes
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
    def _skip(f, n: int | None, hasher) -> int:
        """Read and hash `n` bytes (None: to the end of the file); returns how many."""
        done = 0
        buf = bytearray(_SKIP_CHUNK)
        view = memoryview(buf)
        while n is None or done < n:
            want = _SKIP_CHUNK if n is None else min(_SKIP_CHUNK, n - done)
            got = f.readinto(view[:want])
            if not got:
                if n is not None:
                    raise EOFError(f"file ends {n - done} bytes early")
                break
            hasher.update(view[:got])
            done += got
        return done

    @staticmethod
    def _load_item(planner, group: list, data: memoryview, framing: _ItemFraming) -> None:
        if planner is None:
            return
        if group[0].type == LoadItemType.BYTE_IO:
            for req in group:
                planner.load_bytes(req, io.BytesIO(data))
            return
        tensor = framing.tensor(data)  # a view into `data`: copied into the target below
        for req in group:
            piece = _narrow(tensor, req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            if target.size() != piece.size():
                raise AssertionError(
                    f"req {req.storage_index} mismatch sizes {target.size()} vs {piece.size()}"
                )
            target.copy_(piece)
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

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


def _read_exact(f, n: int) -> bytes:
    data = f.read(n)
    if len(data) == n:
        return data
    parts = [data]
    got = len(data)
    while got < n:
        more = f.read(min(n - got, _MAX_READ))
        if not more:
            raise EOFError(f"file ends {n - got} bytes early")
        parts.append(more)
        got += len(more)
    return b"".join(parts)


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
        too, hashed in file order; record a failed hash or an unreadable item."""
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
                    data = _read_exact(f, length)
                    nbytes += length
                    pos = offset + length
                    if hasher is not None:
                        hasher.update(data)
                    if failure is None:
                        try:
                            self._load_item(planner, group, data)
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
    def _load_item(planner, group: list, data: bytes) -> None:
        if planner is None:
            return
        if group[0].type == LoadItemType.BYTE_IO:
            for req in group:
                planner.load_bytes(req, io.BytesIO(data))
            return
        tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
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

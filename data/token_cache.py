"""The prepared token cache: a map-style dataset tokenized once into a flat file, memory-mapped.

An entry is three paths in the cache directory (`cache_root`), named by `packing.stream_key`
(dataset fingerprint + tokenizer fingerprint + token dtype + text field + packing version):

    <key>.tokens   the packed token stream, raw little-endian uint16/uint32, exactly the array
                   `packing.pack_dataset` returns (every document as [BOS] + ids + [EOS])
    <key>.json     the meta: the identity above, the source, token and document counts,
                   and how long the preparation took; written last, it is the commit marker
    <key>.lock     present while one process prepares the entry

The sample length is not in the key: samples are cut from the stream when they are read, so
one entry serves every data.seq_len.

Exactly one process prepares an entry. It creates the lock with O_CREAT|O_EXCL (which holds
on a shared filesystem too), tokenizes with `Dataset.map` (data.num_proc workers) into Arrow
shards under <key>.parts/, copies them into <key>.tokens.tmp-<pid>, then renames the tokens
and the meta into place and removes the lock. Every other process polls for the meta (no
collective, so no timeout can expire during a long preparation); local rank 0 prints a
"waiting for" line now and then. A lock whose process is gone (same host: its pid no longer exists) or that
has not been touched for `STALE_AFTER_S` (the preparer touches it every `HEARTBEAT_S`) is
broken and the entry prepared again; Arrow shards the dead preparer completed are reused.
A meta that does not match what the loader expects, or a tokens file of the wrong size, is
not used: the entry is prepared again.

Readers map the tokens file read-only: a batch copies only its rows, so a process's private
memory does not grow with the corpus, and the pages are shared (page cache) by every process
of a node that reads the same file.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from data.config import DataConfig
from data.packing import PACKING_VERSION, stream_key, token_chunks, tokenize_dataset
from data.tokenizer import token_dtype
from errors import ConfigError, one_line
from runtime import fsync_dir, host_id, host_name, pid_alive

if TYPE_CHECKING:  # imported where used: `datasets` (with pandas, pyarrow) costs ~1 s to import
    import datasets

FORMAT = "te-llama-tokens-v1"
SUBDIR = "te-llama-tokens"

# Module-level so tests can shorten them.
POLL_S = 1.0  # waiting processes look for the committed entry after this long, then
POLL_MAX_S = 30.0  # less and less often (a shared filesystem serves every rank's look)
REPORT_S = 60.0  # local rank 0 prints a "waiting for" line this often
HEARTBEAT_S = 30.0  # the preparer touches its lock this often
STALE_AFTER_S = 600.0  # a lock untouched this long (by the waiter's clock) is stale
_BREAK_GUARD_STALE_S = 60.0

Log = Callable[[str], None]


def _print(msg: str) -> None:
    print(msg, flush=True)


def cache_root(cfg: DataConfig) -> Path:
    """<data.cache_dir or the Hugging Face datasets cache>/te-llama-tokens."""
    import datasets

    base = cfg.cache_dir or datasets.config.HF_DATASETS_CACHE
    return Path(os.path.expanduser(str(base))) / SUBDIR


def source_description(cfg: DataConfig) -> dict:
    """Where the documents came from, for people reading the meta (not part of the key)."""
    return {
        "name": cfg.name,
        "path": cfg.path,
        "subset": cfg.subset,
        "split": cfg.split,
        "text_field": cfg.text_field,
    }


@dataclass
class CacheEntry:
    key: str
    root: Path
    identity: dict  # meta fields that must match for the entry to be used

    @classmethod
    def for_dataset(cls, cfg: DataConfig, ds: datasets.Dataset, tok) -> CacheEntry:
        dtype = token_dtype(tok)
        identity = {
            "format": FORMAT,
            "packing_version": PACKING_VERSION,
            "dataset_fingerprint": ds._fingerprint,
            "tokenizer_fingerprint": tok.fingerprint,
            "dtype": dtype.name,
            "byteorder": "little",
            "text_field": cfg.text_field,
        }
        return cls(stream_key(ds, tok, cfg.text_field), cache_root(cfg), identity)

    @property
    def tokens(self) -> Path:
        return self.root / f"{self.key}.tokens"

    @property
    def meta(self) -> Path:
        return self.root / f"{self.key}.json"

    @property
    def lock(self) -> Path:
        return self.root / f"{self.key}.lock"

    @property
    def parts(self) -> Path:
        return self.root / f"{self.key}.parts"

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.identity["dtype"]).newbyteorder("<")

    def committed(self) -> tuple[dict | None, str]:
        """(meta, "") when the entry is complete and matches; else (None, why not)."""
        try:
            meta = json.loads(self.meta.read_text())
        except FileNotFoundError:
            return None, "missing"
        except (OSError, ValueError) as e:
            return None, f"unreadable meta ({one_line(e)})"
        for field, want in self.identity.items():
            if meta.get(field) != want:
                return None, f"meta {field}={meta.get(field)!r} is not the expected {want!r}"
        try:
            size = self.tokens.stat().st_size
        except FileNotFoundError:
            return None, "the tokens file is missing"
        expected = int(meta.get("num_tokens", -1)) * self.dtype.itemsize
        if size != expected:
            return None, f"the tokens file has {size} bytes, the meta says {expected}"
        return meta, ""

    def open(self, meta: dict) -> np.ndarray:
        """The token stream, memory-mapped read-only (no copy)."""
        n = int(meta["num_tokens"])
        if n == 0:  # mmap cannot map an empty file
            return np.empty(0, dtype=self.dtype)
        return np.memmap(self.tokens, dtype=self.dtype, mode="r", shape=(n,))


# --- the lock ------------------------------------------------------------------------------


class _Lock:
    """An O_EXCL lock file that names its holder and is touched by a heartbeat thread."""

    def __init__(self, path: Path, info: dict):
        self.path = path
        self.info = info
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True, name="token-cache-lock")
        self._thread.start()

    @classmethod
    def try_acquire(cls, path: Path) -> _Lock | None:
        info = {
            "host": host_id(),
            "pid": os.getpid(),
            "nonce": uuid.uuid4().hex,
            "since": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return None
        with os.fdopen(fd, "w") as f:
            json.dump(info, f)
        return cls(path, info)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def release(self) -> None:
        self._stop.set()
        self._thread.join()
        # Remove it only if it is still ours (it may have been broken as stale and re-taken).
        with contextlib.suppress(OSError, ValueError):
            if json.loads(self.path.read_text()).get("nonce") == self.info["nonce"]:
                self.path.unlink()


class _Holder:
    """A waiter's view of somebody else's lock: who holds it, and whether it is stale."""

    def __init__(self) -> None:
        self._signature: tuple | None = None
        self._unchanged_since = time.monotonic()

    def look(self, path: Path) -> tuple[str | None, str, str | None]:
        """(the lock's content, who holds it, why it is stale or None); content None: gone."""
        try:
            st = path.stat()
            content = path.read_text()
        except FileNotFoundError:
            return None, "", None
        try:
            info = json.loads(content)
            who = f"pid {info['pid']} on {host_name(info['host'])} since {info['since']}"
        except (ValueError, KeyError, TypeError, AttributeError):
            info, who = None, "a process that has not written its name yet"
        if info and info.get("host") == host_id() and not pid_alive(int(info["pid"])):
            return content, who, f"its process {info['pid']} is gone"
        # Heartbeat: compare with our own clock, not the file's mtime, so clock skew between
        # hosts of a shared filesystem cannot make a live lock look stale.
        signature = (st.st_ino, st.st_mtime_ns, content)
        now = time.monotonic()
        if signature != self._signature:
            self._signature, self._unchanged_since = signature, now
        elif now - self._unchanged_since > STALE_AFTER_S:
            return content, who, f"not touched for {now - self._unchanged_since:.0f} s"
        return content, who, None


def _break_stale(lock: Path, content: str) -> None:
    """Remove `lock` if it still holds `content`. One breaker at a time (an O_EXCL guard), so
    a waiter cannot remove the fresh lock that another waiter took after breaking the same
    stale one."""
    guard = lock.with_name(lock.name + ".break")
    try:
        fd = os.open(guard, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        with contextlib.suppress(OSError):  # a breaker that died in the few lines below
            if time.time() - guard.stat().st_mtime > _BREAK_GUARD_STALE_S:
                guard.unlink()
        return
    os.close(fd)
    try:
        with contextlib.suppress(FileNotFoundError):
            if lock.read_text() == content:
                lock.unlink()
    finally:
        guard.unlink()


# --- preparing -----------------------------------------------------------------------------


def _prepare(entry: CacheEntry, cfg: DataConfig, ds: datasets.Dataset, tok, log: Log) -> dict:
    """Tokenize `ds` into the entry and commit it. The caller holds the entry's lock."""
    import datasets

    # Leftovers of preparers that died (the lock is ours, so nobody else writes them).
    for leftover in glob.glob(glob.escape(str(entry.root / entry.key)) + ".*.tmp-*"):
        with contextlib.suppress(OSError):
            os.unlink(leftover)
    with contextlib.suppress(FileNotFoundError):
        entry.meta.unlink()  # a mismatched entry: not valid while it is being replaced
    entry.parts.mkdir(exist_ok=True)

    src = cfg.path if cfg.name == "hf" else cfg.name
    start = time.perf_counter()
    tokenized = tokenize_dataset(
        ds,
        tok,
        cfg.text_field,
        desc=f"tokenizing {src}",
        num_proc=cfg.num_proc,
        cache_file_name=str(entry.parts / "ids.arrow"),
    )
    tokenize_s = time.perf_counter() - start

    tmp = entry.root / f"{entry.key}.tokens.tmp-{os.getpid()}"
    n = 0
    with open(tmp, "wb") as f:
        for chunk in token_chunks(tokenized, entry.dtype):
            f.write(memoryview(chunk).cast("B"))
            n += len(chunk)
        f.flush()
        os.fsync(f.fileno())
    del tokenized
    os.replace(tmp, entry.tokens)
    seconds = time.perf_counter() - start

    meta = {
        **entry.identity,
        "key": entry.key,
        "num_tokens": n,
        "num_documents": len(ds),
        "source": source_description(cfg),
        "tokenizer": cfg.tokenizer,
        "vocab_size": int(tok.vocab_size),
        "bos_id": tok.bos_id,
        "eos_id": tok.eos_id,
        "prepared": {
            "host": socket.gethostname(),
            "at": time.strftime("%Y-%m-%d %H:%M:%S"),
            "num_proc": cfg.num_proc,
            "seconds": round(seconds, 3),
            "tokenize_seconds": round(tokenize_s, 3),
            "tokens_per_s": round(n / max(seconds, 1e-9)),
            "python": sys.version.split()[0],
            "datasets": datasets.__version__,
        },
    }
    tmp_meta = entry.root / f"{entry.key}.json.tmp-{os.getpid()}"
    with open(tmp_meta, "w") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp_meta, entry.meta)  # the commit
    with contextlib.suppress(OSError):
        fsync_dir(entry.root)
    shutil.rmtree(entry.parts, ignore_errors=True)
    log(
        f"data: prepared {n:,} tokens ({len(ds):,} documents) in {seconds:.1f} s "
        f"({n / max(seconds, 1e-9):,.0f} tokens/s, num_proc={cfg.num_proc}) -> {entry.tokens} "
        f"({n * entry.dtype.itemsize / 2**30:.2f} GiB)"
    )
    return meta


def load_tokens(
    cfg: DataConfig, ds: datasets.Dataset, tok, *, force: bool = False, log: Log = _print
) -> tuple[np.ndarray, dict, CacheEntry]:
    """The packed token stream of `ds`, memory-mapped from the token cache.

    Prepares the entry when it is missing (or does not match, or `force`) if this process
    gets the lock; otherwise waits for the process that has it. Returns (tokens, meta, entry).
    """
    if cfg.num_proc < 1:
        raise ConfigError(
            f"data.num_proc={cfg.num_proc} must be >= 1 (tokenizer processes that prepare the "
            "token cache)"
        )
    entry = CacheEntry.for_dataset(cfg, ds, tok)
    holder = _Holder()
    last_report = None
    delay = POLL_S
    reports = os.environ.get("LOCAL_RANK", "0") in ("", "0")  # one waiting line per node
    while True:
        meta, why = entry.committed()
        if meta is not None and not force:
            return entry.open(meta), meta, entry
        try:
            entry.root.mkdir(parents=True, exist_ok=True)
            lock = _Lock.try_acquire(entry.lock)
            if lock is not None:
                try:
                    meta, why = entry.committed()  # committed between our look and our lock
                    if meta is None or force:
                        if meta is not None:
                            log(f"data: preparing {entry.tokens} again (forced)")
                        elif why != "missing":
                            log(f"data: not using {entry.tokens}: {why}; preparing it again")
                        meta = _prepare(entry, cfg, ds, tok, log)
                finally:
                    lock.release()
                return entry.open(meta), meta, entry
        except OSError as e:
            raise ConfigError(
                f"data.cache_dir: cannot write the token cache {entry.tokens} ({one_line(e)}); "
                "set data.cache_dir to a writable directory with room for 2-4 bytes per token "
                "(twice that while preparing)"
            ) from None
        content, who, stale = holder.look(entry.lock)
        if content is None:
            continue  # released just now: look for the committed entry again
        if stale is not None:
            log(f"data: the lock {entry.lock} of {who} is stale ({stale}); preparing again")
            _break_stale(entry.lock, content)
            continue
        now = time.monotonic()
        if reports and (last_report is None or now - last_report >= REPORT_S):
            log(f"data: waiting for {entry.tokens} (prepared by {who})")
            last_report = now
        time.sleep(delay)
        delay = min(delay * 1.5, POLL_MAX_S)


def list_entries(root: Path) -> list[tuple[Path, dict | None, str]]:
    """(meta path, meta or None, state) of every entry in a cache directory."""
    out = []
    for meta_path in sorted(root.glob("*.json")):
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, ValueError) as e:
            out.append((meta_path, None, f"unreadable ({one_line(e)})"))
            continue
        tokens = meta_path.with_suffix(".tokens")
        size = tokens.stat().st_size if tokens.exists() else -1
        expected = int(meta.get("num_tokens", -1)) * np.dtype(meta.get("dtype", "u1")).itemsize
        state = "ok" if size == expected else f"tokens file has {size} bytes, expected {expected}"
        out.append((meta_path, meta, state))
    for lock in sorted(root.glob("*.lock")):
        out.append((lock, None, "being prepared (or its preparer died)"))
    return out

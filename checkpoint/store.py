"""On-disk layout and commit protocol of checkpoint directories (filesystem only, no torch).

    <root>/step_0000020.tmp/     being written (DCP files); never read by resume
    <root>/step_0000020/         complete: renamed from .tmp by rank 0 after every rank wrote
        .metadata  __<rank>_<i>.distcp   (torch DCP)
        config.yaml                      the resolved config of the run that saved it
        manifest.json                    step, save id, world size, every file with its size
                                         and hash (xxh3-64 or CRC32, computed while writing)

A checkpoint becomes visible to resume by one atomic `rename` of its directory, done once,
after `manifest.json` (written last, fsync'ed) lists every file. So a directory named
`step_XXXXXXX` without `.tmp` is complete by construction, and one without a manifest is
damaged (emptied or partly deleted), never an older format: resume reports it. The manifest
lets resume detect later damage (a missing, truncated, corrupted or swapped file) before
anything is loaded. Each data file ends with a 64-byte trailer naming its save id and file
name (DCP reads items by offset and never sees it), so a file swapped in from another save is
caught even without hashes. Anything else under <root> (`*.tmp` left by a killed run) is
ignored by resume and removed by `clean_partial`.

    <root>/unconfirmed.json      a resumed segment whose first losses are not judged yet:
                                 the step it resumed from; that checkpoint and every newer
                                 one are unconfirmed (checkpoint/health.py)

A resume writes `unconfirmed.json` before its segment saves anything, and the guard's healthy
verdict removes it; both by one atomic rename or unlink. While it is there, `prune` keeps the
newest checkpoint older than the step it names (the newest confirmed one) whatever
`keep_last` says, and the next resume of a newer checkpoint goes on judging the same resume
(the losses logged after that step are what the verdict is about, not history).

Every function here is called on rank 0 only (the manager broadcasts what it decides).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import stat
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from checkpoint import hashing
from runtime import fsync_dir

MANIFEST = "manifest.json"
CONFIG_FILE = "config.yaml"
#: The unconfirmed resume of this checkpoint directory (see the module docstring).
UNCONFIRMED = "unconfirmed.json"
TMP_SUFFIX = ".tmp"
#: Complete checkpoints of an abandoned timeline (a resume from an older step, or resume=none,
#: in a directory that already held newer ones) are renamed with this suffix, never deleted.
ABANDONED_SUFFIX = ".abandoned"
FORMAT_VERSION = 1
_STEP_RE = re.compile(r"^step_(\d+)$")
DATA_SUFFIX = ".distcp"
#: Data file trailer: magic, save id (36 bytes, padded), file name (20 bytes, padded).
TRAILER_MAGIC = b"TLCKPT01"
TRAILER_SIZE = 64


def step_name(step: int) -> str:
    return f"step_{step:07d}"


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int


def dir_step(path: Path) -> int | None:
    m = _STEP_RE.match(path.name)
    return int(m.group(1)) if m else None


def _is_complete(p: Path) -> bool:
    try:
        return p.is_dir() and (p / MANIFEST).is_file()
    except OSError:  # e.g. a directory this process cannot enter
        return False


def list_complete(root: Path) -> list[Checkpoint]:
    """Committed checkpoints under root, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        step = dir_step(p)
        if step is not None and _is_complete(p):
            found.append(Checkpoint(p, step))
    return sorted(found, key=lambda c: c.step)


def newest_complete(root: Path) -> Checkpoint | None:
    done = list_complete(root)
    return done[-1] if done else None


def list_steps(root: Path) -> list[Checkpoint]:
    """Every entry named like a step directory under root (committed or damaged: with or
    without a manifest, or not a directory at all: a file, a symlink loop), oldest first;
    `entry_problem` says what is wrong with one that is not a directory. `.tmp`,
    `.abandoned-*` and other names are not step directories (`renamed_steps`)."""
    if not root.is_dir():
        return []
    found = [Checkpoint(p, s) for p in root.iterdir() if (s := dir_step(p)) is not None]
    return sorted(found, key=lambda c: c.step)


def entry_problem(path: Path) -> str | None:
    """Why the step entry `path` cannot be a checkpoint directory: not a directory, a
    symbolic link loop, or a directory this process cannot read. None: a readable directory."""
    try:
        st = os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return f"it is a symbolic link loop ({path.name} -> {os.readlink(path)})"
        if path.is_symlink():
            return f"it is a dangling symbolic link ({path.name} -> {os.readlink(path)})"
        return f"it cannot be read ({e.strerror or e})"
    if not stat.S_ISDIR(st.st_mode):
        return "it is a file, not a checkpoint directory"
    try:
        os.listdir(path)
    except OSError as e:
        return f"this run cannot read the directory ({e.strerror or e})"
    return None


#: Suffixes this package gives step directories it set aside or is writing.
_OWN_SUFFIXES = re.compile(r"^(\.tmp|\.pruned\.tmp|\.replaced\.tmp|\.abandoned-\d+)$")
_RENAMED_RE = re.compile(r"^step_(\d+)(.+)$")


def renamed_steps(root: Path) -> list[Checkpoint]:
    """Entries named like a step directory plus a suffix this package never writes (e.g.
    `step_0000012.bak`: renamed by someone), oldest first. Resume does not read them."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _RENAMED_RE.match(p.name)
        if m and not _OWN_SUFFIXES.match(m.group(2)):
            found.append(Checkpoint(p, int(m.group(1))))
    return sorted(found, key=lambda c: c.step)


def newest_step(root: Path) -> Checkpoint | None:
    steps = list_steps(root)
    return steps[-1] if steps else None


def clean_partial(root: Path, keep: Path | None = None) -> list[Path]:
    """Remove `*.tmp` directories (saves that never committed). Call only when no save of
    this run is in flight; `keep` protects one path anyway."""
    if not root.is_dir():
        return []
    removed = []
    for p in root.iterdir():
        if p.name.endswith(TMP_SUFFIX) and p.is_dir() and p != keep:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def trailer(save_id: str, name: str) -> bytes:
    """The 64 bytes a data file of save `save_id` ends with."""
    sid = save_id.encode()[:36].ljust(36, b"\0")
    fname = name.encode()[-20:].ljust(20, b"\0")
    return TRAILER_MAGIC + sid + fname


def _trailer_problem(path: Path, rel: str, save_id: str) -> str | None:
    try:
        with path.open("rb") as f:
            f.seek(-TRAILER_SIZE, os.SEEK_END)
            tail = f.read(TRAILER_SIZE)
    except OSError as e:
        return f"file {rel} cannot be read ({e.strerror or e})"
    want = trailer(save_id, path.name)
    if tail == want:
        return None
    return f"file {rel} {_trailer_mismatch(tail, want)}"


def _trailer_fields(tail: bytes) -> tuple[str, str] | None:
    """(save id, file name) of a well-formed trailer, else None."""
    if len(tail) != TRAILER_SIZE or not tail.startswith(TRAILER_MAGIC):
        return None
    try:
        sid = tail[8:44].rstrip(b"\0").decode("ascii")
        name = tail[44:].rstrip(b"\0").decode("ascii")
    except UnicodeDecodeError:
        return None
    if not re.fullmatch(r"[0-9a-f]+-\d+-step\d+", sid) or not name.endswith(DATA_SUFFIX):
        return None
    return sid, name


def _trailer_mismatch(tail: bytes, want: bytes) -> str:
    """What a data file's last 64 bytes say instead of this save's trailer, in a few words:
    another save's (or file's) trailer intact means the file was swapped in or renamed; a
    trailer that does not read as one means its bytes were damaged."""
    got, expected = _trailer_fields(tail), _trailer_fields(want)
    if got is not None and expected is not None:
        if got[0] != expected[0]:
            return (
                f"does not belong to this save: its trailer names save {got[0]}, this "
                f"checkpoint is save {expected[0]} (swapped in from another checkpoint)"
            )
        return f"carries the trailer of file {got[1]} of this save (renamed or copied over)"
    differ = sum(a != b for a, b in zip(tail, want)) + abs(len(want) - len(tail))
    return (
        f"has a damaged trailer ({differ} of its last {TRAILER_SIZE} bytes, which name the "
        "save and file, differ from what this save wrote)"
    )


def write_manifest(
    tmp: Path,
    *,
    step: int,
    world_size: int,
    checksum: bool,
    extra: dict | None = None,
    hashes: Mapping[str, tuple[str, int | str]] | None = None,
    algorithm: str = "crc32",
    save_id: str | None = None,
) -> dict:
    """List every file of the finished save into tmp/manifest.json: its size and, with
    `checksum`, its hash: the one in `hashes` (relative path -> (algorithm, value), computed
    by the writers while writing) or else read back and hashed with `algorithm` (small files:
    .metadata, config.yaml). `save_id`: the DCP save id every data file's trailer names."""
    files = {}
    hashes = hashes or {}
    for p in sorted(tmp.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            rel = p.relative_to(tmp).as_posix()
            files[rel] = {"size": p.stat().st_size}
            if checksum:
                algo, value = hashes.get(rel) or (algorithm, hashing.hash_file(p, algorithm))
                files[rel][algo] = value
    manifest = {
        "format": FORMAT_VERSION,
        "step": step,
        "world_size": world_size,
        "time": time.time(),
        "files": files,
        **({"save_id": save_id} if save_id else {}),
        **(extra or {}),
    }
    path = tmp / MANIFEST
    with path.open("w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    return manifest


def commit(tmp: Path, final: Path) -> None:
    """Make `tmp` visible as `final` with one rename. An existing `final` can only come from an
    abandoned timeline (we resumed from an older step); it is replaced."""
    fsync_dir(tmp)  # the file entries first, then the rename that publishes them
    if final.exists():
        old = final.with_name(final.name + ".replaced" + TMP_SUFFIX)
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    fsync_dir(final.parent)


def read_manifest(path: Path) -> dict | None:
    try:
        return json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def manifest_problem(path: Path) -> str | None:
    """Why `path` has no usable manifest (None: it has one)."""
    if not (path / MANIFEST).exists():
        if path.is_dir() and not any(path.iterdir()):
            return f"the directory is empty ({MANIFEST} and every data file are gone)"
        return f"{MANIFEST} is missing (a committed checkpoint always has one)"
    manifest = read_manifest(path)
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return f"{MANIFEST} is unreadable or not a checkpoint manifest"
    return None


def verify_layout(path: Path) -> str | None:
    """The cheap checks (no data read): a readable manifest, every file present with its
    size, and each data file's trailer naming this save. None when all pass."""
    problem = manifest_problem(path)
    if problem:
        return problem
    manifest = read_manifest(path)
    save_id = manifest.get("save_id")
    for rel in unlisted_files(path, manifest):
        return (
            f"file {rel} is not in {MANIFEST} (its entry was dropped: its size and hash cannot "
            "be verified)"
        )
    for rel, want in manifest["files"].items():
        p = path / rel
        if not p.is_file():
            return f"file {rel} is missing"
        size = p.stat().st_size
        if size != want["size"]:
            how = "truncated" if size < want["size"] else "longer than recorded: appended to"
            return f"file {rel} has {size} bytes, the manifest says {want['size']} ({how})"
        if save_id and rel.endswith(DATA_SUFFIX):
            problem = _trailer_problem(p, rel, save_id)
            if problem:
                return problem
    return None


def unlisted_files(path: Path, manifest: dict) -> list[str]:
    """The files of a checkpoint that its load reads (data files, `.metadata`, config.yaml)
    but its manifest does not list: the load could not verify them. Other files (a note left
    in the directory) are never read and not reported."""
    read = [p for p in path.iterdir() if p.is_file()] if path.is_dir() else []
    return sorted(
        p.name
        for p in read
        if (p.suffix == DATA_SUFFIX or p.name in (".metadata", CONFIG_FILE))
        and p.name not in manifest["files"]
    )


def verify_hashes(path: Path, names: list[str], manifest: dict) -> str | None:
    """Hash `names` (files of `path` listed in `manifest`) and compare with the recorded
    values; None when all match (files without a recorded hash pass)."""
    for rel in names:
        rec = hashing.recorded(manifest["files"][rel])
        if rec is None:
            continue
        algorithm, value = rec
        try:
            got = hashing.hash_file(path / rel, algorithm)
        except OSError as e:
            return f"file {rel} cannot be read ({e.strerror or e})"
        if got != value:
            return f"file {rel} fails its {hashing.LABELS[algorithm]} check (corrupted)"
    return None


def verify(path: Path, checksum: bool = True) -> str | None:
    """None when every file of the manifest is present with its size and trailer (and its
    hash when recorded and `checksum`); else what is wrong, in a few words."""
    problem = verify_layout(path)
    if problem or not checksum:
        return problem
    manifest = read_manifest(path)
    return verify_hashes(path, list(manifest["files"]), manifest)


def prune(
    root: Path,
    keep_last: int,
    failed: list[tuple[Path, Path, str]] | None = None,
    unconfirmed_from: int | None = None,
) -> list[Path]:
    """Delete complete checkpoints beyond the newest `keep_last` (keep_last >= 1, so the
    newest complete one always stays; `.tmp` directories being written are never listed).
    Returns the checkpoints deleted; one whose files could not all be deleted is left renamed
    to `*.pruned.tmp` (ignored by resume) and goes to `failed` as (checkpoint, where it is
    now, the first error) instead. `unconfirmed_from`: the checkpoints from this step on are
    unconfirmed (`read_unconfirmed`), and the newest one older than it is kept whatever
    `keep_last` says."""
    done = list_complete(root)
    victims = done[: max(0, len(done) - max(1, keep_last))]
    confirmed = newest_confirmed(done, unconfirmed_from)
    victims = [c for c in victims if c != confirmed]
    deleted = []
    for c in victims:
        # Rename first so a crash mid-delete leaves an ignored .tmp, not a damaged checkpoint.
        doomed = c.path.with_name(c.path.name + ".pruned" + TMP_SUFFIX)
        os.rename(c.path, doomed)
        errors: list[str] = []
        _rmtree_noting(doomed, errors)
        if errors and doomed.exists():
            if failed is not None:
                failed.append((c.path, doomed, errors[0]))
        else:
            deleted.append(c.path)
    return deleted


def newest_confirmed(done: list[Checkpoint], unconfirmed_from: int | None) -> Checkpoint | None:
    """Of the complete checkpoints `done` (oldest first), the newest one older than
    `unconfirmed_from` (None: nothing is unconfirmed, and nothing is returned)."""
    if unconfirmed_from is None:
        return None
    older = [c for c in done if c.step < unconfirmed_from]
    return older[-1] if older else None


class UnreadableRecord(Exception):
    """`unconfirmed.json` is there but does not read as a record (edited, or a disk error)."""


def read_unconfirmed(root: Path) -> dict | None:
    """The record of the unconfirmed resume of `root` ({"resumed_from": step, ...}), or None
    when there is none; UnreadableRecord when the file is there but is not one."""
    path = root / UNCONFIRMED
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise UnreadableRecord(f"{path}: {e}") from None
    if not isinstance(record, dict) or not isinstance(record.get("resumed_from"), int):
        raise UnreadableRecord(f"{path}: not a record of an unconfirmed resume")
    return record


def write_unconfirmed(root: Path, record: dict) -> None:
    """`record` as `root`'s unconfirmed resume, atomically (a new file renamed over the old
    one) and durably (the file and the directory fsync'ed)."""
    path = root / UNCONFIRMED
    tmp = path.with_name(path.name + TMP_SUFFIX)
    with tmp.open("w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)
    fsync_dir(root)


def clear_unconfirmed(root: Path) -> bool:
    """Remove `root`'s unconfirmed resume (every checkpoint is confirmed); False when there
    was none."""
    try:
        os.unlink(root / UNCONFIRMED)
    except FileNotFoundError:
        return False
    fsync_dir(root)
    return True


def _rmtree_noting(path: Path, errors: list[str]) -> None:
    """shutil.rmtree that goes on past errors and notes each ("<reason>: <path>")."""

    def note(p, e):
        errors.append(f"{getattr(e, 'strerror', None) or e}: {p}")

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=lambda _f, p, e: note(p, e))
    else:
        shutil.rmtree(path, onerror=lambda _f, p, info: note(p, info[1]))


def abandon_newer(root: Path, step: int) -> list[Path]:
    """Rename step directories newer than `step` (complete or damaged) out of resume's sight
    (kept on disk)."""
    moved = []
    for c in list_steps(root):
        if c.step > step:
            dest = c.path.with_name(f"{c.path.name}{ABANDONED_SUFFIX}-{int(time.time())}")
            os.rename(c.path, dest)
            moved.append(dest)
    return moved


def find_checkpoint(spec: Path) -> Checkpoint | None:
    """An explicit resume path: a step directory, or a directory holding step directories
    (its newest one, damaged or not), or a run directory (its checkpoints/ folder)."""
    if not spec.is_dir():
        return None
    if (spec / MANIFEST).is_file():
        manifest = read_manifest(spec)
        step = manifest.get("step") if isinstance(manifest, dict) else None
        step = step if isinstance(step, int) else dir_step(spec)
        return Checkpoint(spec, int(step)) if step is not None else None
    step = dir_step(spec)
    if step is not None:  # a step directory without manifest: damaged, verify says so
        return Checkpoint(spec, step)
    for root in (spec, spec / "checkpoints"):
        c = newest_step(root)
        if c is not None:
            return c
    return None

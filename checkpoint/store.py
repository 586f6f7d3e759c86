"""On-disk layout and commit protocol of checkpoint directories (filesystem only, no torch).

    <root>/step_0000020.tmp/     being written (DCP files); never read by resume
    <root>/step_0000020/         complete: renamed from .tmp by rank 0 after every rank wrote
        .metadata  __<rank>_<i>.distcp   (torch DCP)
        config.yaml                      the resolved config of the run that saved it
        manifest.json                    step, world size, every file with its size (+ CRC32)

A checkpoint becomes visible to resume by one atomic `rename` of its directory, done once,
after `manifest.json` (written last, fsync'ed) lists every file. So a directory named
`step_XXXXXXX` without `.tmp` is complete by construction; the manifest lets resume detect
later damage (a truncated or missing file) before anything is loaded. Anything else under
<root> (`*.tmp` left by a killed run) is ignored by resume and removed by `clean_partial`.

Every function here is called on rank 0 only (the manager broadcasts what it decides).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "manifest.json"
CONFIG_FILE = "config.yaml"
TMP_SUFFIX = ".tmp"
#: Complete checkpoints of an abandoned timeline (a resume from an older step, or resume=none,
#: in a directory that already held newer ones) are renamed with this suffix, never deleted.
ABANDONED_SUFFIX = ".abandoned"
FORMAT_VERSION = 1
_STEP_RE = re.compile(r"^step_(\d+)$")
_CHUNK = 1 << 24


def step_name(step: int) -> str:
    return f"step_{step:07d}"


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int


def _dir_step(path: Path) -> int | None:
    m = _STEP_RE.match(path.name)
    return int(m.group(1)) if m else None


def list_complete(root: Path) -> list[Checkpoint]:
    """Committed checkpoints under root, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        step = _dir_step(p)
        if step is not None and p.is_dir() and (p / MANIFEST).is_file():
            found.append(Checkpoint(p, step))
    return sorted(found, key=lambda c: c.step)


def newest_complete(root: Path) -> Checkpoint | None:
    done = list_complete(root)
    return done[-1] if done else None


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


def _crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(
    tmp: Path, *, step: int, world_size: int, checksum: bool, extra: dict | None = None
) -> dict:
    """List every file of the finished save (sizes, optional CRC32) into tmp/manifest.json."""
    files = {}
    for p in sorted(tmp.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            rel = p.relative_to(tmp).as_posix()
            files[rel] = {"size": p.stat().st_size}
            if checksum:
                files[rel]["crc32"] = _crc32(p)
    manifest = {
        "format": FORMAT_VERSION,
        "step": step,
        "world_size": world_size,
        "time": time.time(),
        "files": files,
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
    if final.exists():
        old = final.with_name(final.name + ".replaced" + TMP_SUFFIX)
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync_dir(final.parent)


def read_manifest(path: Path) -> dict | None:
    try:
        return json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def verify(path: Path, checksum: bool = True) -> str | None:
    """None when every file of the manifest is present with its size (and CRC32 when recorded
    and `checksum`); else what is wrong, in a few words."""
    manifest = read_manifest(path)
    if manifest is None:
        return f"{MANIFEST} is missing or unreadable"
    for rel, want in manifest.get("files", {}).items():
        p = path / rel
        if not p.is_file():
            return f"file {rel} is missing"
        size = p.stat().st_size
        if size != want["size"]:
            return f"file {rel} has {size} bytes, the manifest says {want['size']} (truncated)"
        if checksum and "crc32" in want and _crc32(p) != want["crc32"]:
            return f"file {rel} fails its CRC32 check (corrupted)"
    return None


def prune(root: Path, keep_last: int) -> list[Path]:
    """Delete complete checkpoints beyond the newest `keep_last` (keep_last >= 1, so the
    newest complete one always stays; `.tmp` directories being written are never listed)."""
    done = list_complete(root)
    victims = done[: max(0, len(done) - max(1, keep_last))]
    for c in victims:
        # Rename first so a crash mid-delete leaves an ignored .tmp, not a damaged checkpoint.
        doomed = c.path.with_name(c.path.name + ".pruned" + TMP_SUFFIX)
        os.rename(c.path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    return [c.path for c in victims]


def abandon_newer(root: Path, step: int) -> list[Path]:
    """Rename complete checkpoints newer than `step` out of resume's sight (kept on disk)."""
    moved = []
    for c in list_complete(root):
        if c.step > step:
            dest = c.path.with_name(f"{c.path.name}{ABANDONED_SUFFIX}-{int(time.time())}")
            os.rename(c.path, dest)
            moved.append(dest)
    return moved


def find_checkpoint(spec: Path) -> Checkpoint | None:
    """An explicit resume path: a step directory, or a directory holding step directories
    (its newest complete one), or a run directory (its checkpoints/ folder)."""
    if not spec.is_dir():
        return None
    if (spec / MANIFEST).is_file():
        manifest = read_manifest(spec) or {}
        step = manifest.get("step", _dir_step(spec))
        return Checkpoint(spec, int(step)) if step is not None else None
    for root in (spec, spec / "checkpoints"):
        c = newest_complete(root)
        if c is not None:
            return c
    return None

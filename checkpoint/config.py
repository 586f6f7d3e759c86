"""Checkpoint config (the `checkpoint` group)."""

from __future__ import annotations

from dataclasses import dataclass

from errors import ConfigError

#: checkpoint.mode values.
MODES = ("none", "sync", "async", "async_process")
#: checkpoint.when_busy values: what a periodic save does when every staging buffer still
#: holds a save being written.
BUSY_POLICIES = ("defer", "skip", "wait")


@dataclass
class CheckpointConfig:
    #: none | sync (the loop waits for the write) | async (the loop waits for a copy into
    #: CPU staging buffers; a thread writes) | async_process (the same copy, written by a
    #: writer process of each rank, started with the manager)
    mode: str = "none"
    #: Save every `interval` optimizer steps (0 disables periodic saves).
    interval: int = 100
    #: Keep this many complete checkpoints (the newest complete one is never pruned).
    keep_last: int = 2
    #: Where step directories go; relative paths are inside the run directory.
    dir: str = "checkpoints"
    #: auto: newest checkpoint of this run if any; none: start fresh; or a path (a
    #: step_XXXXXXX directory, or a directory holding them: its newest one). A damaged
    #: checkpoint is never loaded and never skipped: resume stops and names it.
    resume: str = "auto"
    #: Save a checkpoint at the last step (also what tools/convert_hf.py exports).
    save_at_end: bool = True
    #: Hash every file while it is written (xxh3-64 with the xxhash package, else CRC32),
    #: record the hashes in the manifest and check them on resume, with the bytes the load
    #: reads (checkpoint/reader.py). false: sizes and save ids are still checked, bit flips
    #: are not.
    checksum: bool = True
    #: Async modes, a periodic save due while every staging buffer is still being written:
    #: defer (save at the first step a buffer is free; default), skip (drop this save), wait
    #: (block the loop until a buffer is free). Saves on a stop signal and at the end wait.
    when_busy: str = "defer"
    #: Async modes: CPU staging buffers (each a copy of this rank's state), allocated once.
    #: 2 lets a save be staged while the previous one is written; 2 drops to 1 when host
    #: memory is short (logged).
    staging_buffers: int = 2
    #: Files written in parallel per rank (one writer thread each); a resume reads as many at
    #: once, each with a read-ahead thread (host memory: two of the file's largest items).
    write_threads: int = 4
    #: fsync every file before the checkpoint is committed (and start the disk writing each
    #: file every 256 MiB as it is written, so the fsync waits for the tail only).
    sync_files: bool = True


def validate(cfg: CheckpointConfig) -> None:
    """The checkpoint fields on their own; raises ConfigError (one line)."""
    if cfg.mode not in MODES:
        raise ConfigError(f"checkpoint.mode={cfg.mode!r} is not one of {', '.join(MODES)}")
    if cfg.keep_last < 1:
        raise ConfigError(f"checkpoint.keep_last={cfg.keep_last} must be >= 1")
    if cfg.interval < 0:
        raise ConfigError(f"checkpoint.interval={cfg.interval} must be >= 0 (0: no periodic saves)")
    if cfg.when_busy not in BUSY_POLICIES:
        raise ConfigError(
            f"checkpoint.when_busy={cfg.when_busy!r} is not one of {', '.join(BUSY_POLICIES)}"
        )
    if cfg.staging_buffers not in (1, 2):
        raise ConfigError(f"checkpoint.staging_buffers={cfg.staging_buffers} must be 1 or 2")
    if not 1 <= cfg.write_threads <= 64:
        raise ConfigError(f"checkpoint.write_threads={cfg.write_threads} must be in 1..64")

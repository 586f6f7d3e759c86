"""Checkpoint config (the `checkpoint` group)."""

from __future__ import annotations

from dataclasses import dataclass

#: checkpoint.mode values.
MODES = ("none", "sync", "async", "async_process")


@dataclass
class CheckpointConfig:
    #: none | sync (dcp.save) | async (dcp.async_save, thread) | async_process
    mode: str = "none"
    #: Save every `interval` optimizer steps (0 disables periodic saves).
    interval: int = 100
    #: Keep this many complete checkpoints (the newest complete one is never pruned).
    keep_last: int = 2
    #: Where step directories go; relative paths are inside the run directory.
    dir: str = "checkpoints"
    #: auto: newest complete checkpoint of this run if any; none: start fresh; or a path
    #: (a step_XXXXXXX directory, or a directory holding them: its newest complete one).
    resume: str = "auto"
    save_at_end: bool = True
    #: Record a CRC32 of every file in the manifest (rank 0 re-reads the files after each save,
    #: in the background for async modes) and check it on resume. Without it, resume checks
    #: file presence and sizes, which catches truncation but not bit flips.
    checksum: bool = False

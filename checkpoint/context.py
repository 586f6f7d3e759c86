"""What the resume side (checkpoint/resume.py) and the save side (checkpoint/save.py) of one
CheckpointManager share: its settings, where its checkpoints go, its log, its two gloo groups
and the collectives both sides run on them, and a few small helpers.

Why a module of its own: both sides need the same groups (a collective must run on the same
group in the same order on every rank), the same log and the same saves log; a `Context` built
once by the manager and handed to each keeps them from reaching into each other.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from checkpoint.config import CheckpointConfig

#: Log file of every save (rank 0): one JSON record per save, skip and deferral.
SAVES_LOG = "checkpoint_saves.jsonl"
#: What a failed DCP call raises (CheckpointException derives from BaseException).
ERRORS = (Exception, CheckpointException)


def checkpoint_root(cfg: CheckpointConfig, run_dir: str | Path) -> Path:
    """Where this run's step directories go: checkpoint.dir, relative to the run directory."""
    root = Path(cfg.dir).expanduser()
    return root if root.is_absolute() else Path(run_dir) / root


def first_line(e: BaseException) -> str:
    """`Type: first line of the message` (at most 300 characters of it)."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300]}" if text else type(e).__name__


def find(state: Mapping[str, Any], cls: type):
    """The first part of a training state that is a `cls` (None: none is)."""
    return next((v for v in state.values() if isinstance(v, cls)), None)


def default_log(rank: int) -> Callable[[str], None]:
    """Rank 0 prints `checkpoint: <message>`; the other ranks say nothing."""
    if rank == 0:
        return lambda msg: print(f"checkpoint: {msg}", flush=True)
    return lambda msg: None


@dataclass
class Context:
    """One manager's settings, log and groups. `pg`: DCP's collectives (a writer thread in
    async mode) and the resume's agreements; `ctl`: the training loop's agreements (is a
    staging buffer free, was every loss finite). Both None in a single-process run."""

    cfg: CheckpointConfig
    rank: int
    world_size: int
    run_dir: Path
    root: Path
    saving: bool
    corpus: str | None
    log: Callable[[str], None]
    dist: bool
    pg: Any = None
    ctl: Any = None

    @classmethod
    def create(
        cls,
        cfg: CheckpointConfig,
        run_dir: str | Path,
        rank: int,
        world_size: int,
        log: Callable[[str], None] | None,
        corpus: str | None,
    ) -> Context:
        """The context of a manager: its two gloo groups are made here (a collective: every
        rank constructs its manager at the same point)."""
        on = dist.is_available() and dist.is_initialized()
        return cls(
            cfg=cfg,
            rank=rank,
            world_size=world_size,
            run_dir=Path(run_dir),
            root=checkpoint_root(cfg, run_dir),
            saving=cfg.mode != "none",
            corpus=corpus,
            log=log if log is not None else default_log(rank),
            dist=on,
            pg=dist.new_group(backend="gloo") if on else None,
            ctl=dist.new_group(backend="gloo") if on else None,
        )

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (over `pg`)."""
        if self.pg is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.pg)
        return box[0]

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj`, in rank order (over `pg`); None in a single-process run."""
        if self.pg is None:
            return None
        everyone: list[Any] = [None] * dist.get_world_size(self.pg)
        dist.all_gather_object(everyone, obj, group=self.pg)
        return everyone

    def minimum(self, values: list[int]) -> list[int]:
        """The element-wise minimum of `values` over every rank (a collective on `ctl`)."""
        t = torch.tensor(values, dtype=torch.int64)
        if self.ctl is not None:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.ctl)
        return [int(v) for v in t]

    def barrier(self) -> None:
        """Every rank at this point (over `pg`); nothing in a single-process run."""
        if self.dist:
            dist.barrier(group=self.pg)

    def append_log(self, record: dict) -> None:
        """Rank 0: one JSON line in the run directory's saves log (SAVES_LOG)."""
        if self.rank != 0:
            return
        try:
            with (self.run_dir / SAVES_LOG).open("a") as f:
                f.write(json.dumps({"time": time.time(), **record}) + "\n")
        except OSError:
            pass  # a log of timings must not stop a run

"""Metrics: one line per log step on stdout, one JSON record per log step in
<run_dir>/metrics.jsonl, and optionally wandb. Only rank 0 writes.

Resuming from step S keeps the records with step <= S and drops the rest: what a run logged
after its last complete checkpoint is superseded by the resumed run, so metrics.jsonl always
holds one record per step of the loss curve the checkpoints describe.

wandb gets the same curve, as one wandb run per training run across all its resumes (the
id is kept in <run_dir>/wandb_run_id and in the checkpoint; resume="allow"), tagged with
the model, recipe and layout. wandb history cannot be rewritten (`resume_from=
"<id>?_step=<n>"` rewinds are online-only and a private preview), so records past the last
committed checkpoint are held back: a record goes to wandb once a checkpoint covering its
step is complete (`commit(step)`, or a later record carrying the checkpoint manager's
`save_step`), and `finish` sends the rest. A run that dies loses at most the held records,
and its resume re-sends them from metrics.jsonl, so every step reaches wandb exactly once,
with the value of the run that continued. The trade-off: wandb trails the latest step by up
to checkpoint.interval steps (stdout and metrics.jsonl are live). Without checkpoints
(checkpoint=none) nothing can be resumed and records go to wandb at once. On resume, the
last step wandb already has comes from the run's own offline transaction logs (offline) or
from the server (online), which also covers records a killed process never flushed (wandb
buffers about 32 KiB in memory).

Offline runs (logger.wandb.mode=offline) leave one directory per job under <run_dir>/wandb/
(offline-run-<time>-<id>) with disjoint, increasing steps; upload them later as one run with
`wandb sync <run_dir>/wandb/offline-run-*` (segments of one run id are synced in start-time
order, each resuming the run).
"""

from __future__ import annotations

import json
import os
import secrets
import string
import time
from pathlib import Path

from config import LoggerConfig
from runlog import CompareError, read_metrics, read_wandb_segments

LINE_FIELDS = [
    ("step", "{:>6d}"),
    ("loss", "{:.4f}"),
    ("grad_norm", "{:.3f}"),
    ("lr", "{:.2e}"),
    ("tokens_per_s", "{:,.0f}"),
    ("mfu", "{:.1%}"),
    ("mem_gb", "{:.2f}"),
]


def format_line(record: dict) -> str:
    parts = []
    for key, fmt in LINE_FIELDS:
        if record.get(key) is not None:
            parts.append(f"{key} {fmt.format(record[key])}")
    return " | ".join(parts)


def new_run_id() -> str:
    """A wandb-style run id (8 lowercase letters/digits)."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def trim_metrics(path: Path, last_step: int) -> None:
    """Keep records with step <= last_step (atomic rewrite)."""
    if not path.exists():
        return
    keep = [r for r in read_metrics(path) if r.get("step", 0) <= last_step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
    os.replace(tmp, path)


class MetricsLogger:
    def __init__(
        self,
        cfg: LoggerConfig,
        run_dir: Path,
        *,
        rank: int,
        run_name: str,
        config: dict,
        tags: list[str],
    ):
        self.enabled = rank == 0
        self.path = run_dir / "metrics.jsonl"
        self.cfg, self.run_dir, self.run_name, self.config = cfg, run_dir, run_name, config
        self.tags = list(dict.fromkeys([*tags, *cfg.wandb.tags]))
        self.wandb_run = None
        self.wandb_run_id: str | None = None
        # Hold wandb records until a checkpoint covers them, unless nothing can be resumed.
        checkpoint_mode = (config.get("checkpoint") or {}).get("mode", "none")
        self.hold = checkpoint_mode != "none"
        self.pending: list[dict] = []

    def start(self, start_step: int, wandb_run_id: str | None = None) -> str | None:
        """Prepare metrics.jsonl for a run starting after `start_step` and open wandb.
        `wandb_run_id` is the id stored in the checkpoint being resumed (if any).
        Returns the wandb run id to store in the checkpoint (None when wandb is off)."""
        if not self.enabled:
            return wandb_run_id
        if start_step == 0 and self.path.exists() and self.path.stat().st_size > 0:
            # A fresh start over an old run: keep the old curve beside, never overwrite it.
            self.path.rename(self.path.with_name(f"metrics.{int(time.time())}.jsonl"))
        trim_metrics(self.path, start_step)
        if self.cfg.wandb.mode != "disabled":
            self._open_wandb(start_step, wandb_run_id)
        return self.wandb_run_id

    def _open_wandb(self, start_step: int, run_id: str | None) -> None:
        import wandb

        id_file = self.run_dir / "wandb_run_id"
        if start_step == 0:
            run_id = None  # a fresh start is a new training run: a new wandb run too
        elif run_id is None and id_file.exists():
            run_id = id_file.read_text().strip() or None  # checkpoint saved without wandb
        run_id = run_id or new_run_id()
        id_file.write_text(run_id + "\n")
        w = self.cfg.wandb
        logged = self._offline_last_step(run_id) if w.mode == "offline" else 0
        self.wandb_run = wandb.init(
            project=w.project,
            entity=w.entity,
            group=w.group,
            name=self.run_name,
            id=run_id,
            resume="allow",
            mode=w.mode,
            dir=str(self.run_dir),
            config=self.config,
            tags=self.tags,
        )
        self.wandb_run_id = run_id
        if w.mode == "online":
            # The server's next step; wandb drops steps below it on its own.
            logged = max(0, self.wandb_run.starting_step - 1)
        # Steps the checkpoint covers that wandb never got: held back, or lost with a
        # killed process. metrics.jsonl has them (already trimmed to start_step).
        for record in read_metrics(self.path):
            if logged < record["step"] <= start_step:
                self._send(record)

    def _offline_last_step(self, run_id: str) -> int:
        """Last step in the earlier offline segments of this wandb run (0 if none)."""
        wandb_dir = self.run_dir / "wandb"
        if not wandb_dir.is_dir():
            return 0
        try:
            segments = read_wandb_segments(wandb_dir, run_id=run_id)
        except CompareError as e:  # logging must not stop training
            print(f"warning: {e}; wandb may get steps {wandb_dir} already holds", flush=True)
            return 0
        return int(max((row["_step"] for s in segments for row in s.rows), default=0))

    def _send(self, record: dict) -> None:
        values = {k: v for k, v in record.items() if k != "step" and v is not None}
        self.wandb_run.log(values, step=record["step"])

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        print(format_line(record), flush=True)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb_run is not None:
            if self.hold:
                self.pending.append(record)
                # The checkpoint manager's stats name the step of the newest committed save.
                if record.get("save_step") is not None:
                    self.commit(record["save_step"])
            else:
                self._send(record)

    def commit(self, step: int) -> None:
        """A checkpoint at `step` is complete: records up to it are final; send them."""
        if self.wandb_run is None:
            return
        while self.pending and self.pending[0]["step"] <= step:
            self._send(self.pending.pop(0))

    def info(self, message: str) -> None:
        if self.enabled:
            print(message, flush=True)

    def finish(self) -> None:
        """End of the run (done, or stopped after a final checkpoint): send what is held."""
        if self.wandb_run is not None:
            for record in self.pending:
                self._send(record)
            self.pending.clear()
            self.wandb_run.finish()
            self.wandb_run = None

"""Metrics: one line per log step on stdout, one JSON record per log step in
<run_dir>/metrics.jsonl, and optionally wandb. Only rank 0 writes.

Resuming from step S keeps the records with step <= S and drops the rest: what a run logged
after its last complete checkpoint is superseded by the resumed run, so metrics.jsonl always
holds one record per step of the loss curve the checkpoints describe.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from config import LoggerConfig

LINE_FIELDS = [("step", "{:>6d}"), ("loss", "{:.4f}"), ("grad_norm", "{:.3f}"),
               ("lr", "{:.2e}"), ("tokens_per_s", "{:,.0f}"), ("mfu", "{:.1%}"),
               ("mem_gb", "{:.2f}")]


def format_line(record: dict) -> str:
    parts = []
    for key, fmt in LINE_FIELDS:
        if record.get(key) is not None:
            parts.append(f"{key} {fmt.format(record[key])}")
    return " | ".join(parts)


def trim_metrics(path: Path, last_step: int) -> None:
    """Keep records with step <= last_step (atomic rewrite)."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= last_step:
                keep.append(line)
        except json.JSONDecodeError:
            continue  # a line cut by a killed run
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(f"{line}\n" for line in keep))
    os.replace(tmp, path)


class MetricsLogger:
    def __init__(self, cfg: LoggerConfig, run_dir: Path, *, rank: int, run_name: str,
                 config: dict, tags: list[str]):
        self.enabled = rank == 0
        self.path = run_dir / "metrics.jsonl"
        self.cfg, self.run_dir, self.run_name, self.config = cfg, run_dir, run_name, config
        self.tags = list(tags) + list(cfg.wandb.tags)
        self.wandb_run = None
        self.wandb_run_id: str | None = None

    def start(self, start_step: int, wandb_run_id: str | None = None) -> str | None:
        """Prepare metrics.jsonl for a run starting after `start_step` and open wandb.
        Returns the wandb run id to store in the checkpoint (None when wandb is off)."""
        if not self.enabled:
            return wandb_run_id
        if start_step == 0 and self.path.exists() and self.path.stat().st_size > 0:
            # A fresh start over an old run: keep the old curve beside, never overwrite it.
            self.path.rename(self.path.with_name(f"metrics.{int(time.time())}.jsonl"))
        trim_metrics(self.path, start_step)
        if self.cfg.wandb.mode != "disabled":
            self.wandb_run_id = self._open_wandb(wandb_run_id)
        return self.wandb_run_id

    def _open_wandb(self, run_id: str | None) -> str:
        import wandb

        id_file = self.run_dir / "wandb_run_id"
        if run_id is None and id_file.exists():
            run_id = id_file.read_text().strip() or None
        run_id = run_id or wandb.util.generate_id()
        id_file.write_text(run_id)
        w = self.cfg.wandb
        self.wandb_run = wandb.init(
            project=w.project, entity=w.entity, group=w.group, name=self.run_name, id=run_id,
            resume="allow", mode=w.mode, dir=str(self.run_dir), config=self.config,
            tags=self.tags)
        return run_id

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        print(format_line(record), flush=True)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in record.items() if k != "step"},
                               step=record["step"])

    def info(self, message: str) -> None:
        if self.enabled:
            print(message, flush=True)

    def finish(self) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None

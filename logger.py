"""Metrics: one line per log step on stdout, one JSON record per log step in
<run_dir>/metrics.jsonl, and optionally wandb. Only rank 0 writes.

Every record carries `time` (Unix seconds when it was logged). Resuming from step S keeps
the records with step <= S and drops the rest: what a run logged after its last complete
checkpoint is superseded by the resumed run, so metrics.jsonl always holds one record per
step of the loss curve the checkpoints describe.

wandb gets the same curve, as one wandb run per training run across all its resumes (the
id is kept in <run_dir>/wandb_run_id and in the checkpoint), tagged with the model, recipe
and layout; its config is this segment's effective config. What happens to the steps wandb
got past the checkpoint a run resumes from is `logger.wandb.resume`:

- rewind (auto's choice online, when the installed wandb has `wandb.init(resume_from=...)`):
  records go to wandb as they are logged (live), and a resumed run opens the wandb run with
  `resume_from="<id>?_step=<S>"`, which truncates its history to the checkpoint's step.
  If the server refuses the rewind (it is a preview feature that must be enabled for the
  account), the logger says so in one line and falls back to hold for this segment.
- hold (auto's choice offline, where nothing can be rewound): a record goes to wandb once
  a checkpoint covering its step is committed (`commit(step)`, or a later record carrying
  the checkpoint manager's `save_step`), and `finish` sends the rest. A run that dies loses
  at most the held records, and its resume sends them from metrics.jsonl, so every step
  reaches wandb once, with the value of the run that continued. wandb then trails the
  latest step by up to checkpoint.interval steps; held records are sent with their own
  time (`_timestamp` = the record's `time`), not the time they were sent.

Without checkpoints (checkpoint=none) nothing can be resumed and records go to wandb at
once. On resume, the steps wandb already has come from the server (online:
`run.starting_step`) or, offline, from <run_dir>/wandb_sent.json, a small file this logger
rewrites after handing records to wandb ({"run_id", "step"}: the last step handed over);
the steps after it, up to the checkpoint, are sent from metrics.jsonl. wandb's own files
are never read. (Offline, a record handed to wandb is in its transaction log once wandb's
service has written it; a kill of that service itself, not only of the trainer, can lose
its last buffered records from the offline log. metrics.jsonl keeps them.)

Offline runs (logger.wandb.mode=offline) leave one directory per job under <run_dir>/wandb/
(offline-run-<time>-<id>) with increasing steps; upload them later as one run with
`wandb sync <run_dir>/wandb/offline-run-*` (segments of one run id are synced in start-time
order, each resuming the run).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import string
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from errors import ConfigError, one_of, require
from runlog import read_metrics
from runtime import format_duration

WANDB_MODES = ("disabled", "offline", "online")
WANDB_RESUME = ("auto", "rewind", "hold")


@dataclass
class WandbConfig:
    #: disabled | offline | online
    mode: str = "disabled"
    #: wandb project name.
    project: str = "te-llama"
    #: wandb entity (team or user); null: the logged-in user's default.
    entity: str | None = None
    #: wandb run group (e.g. to gather a sweep); null: none.
    group: str | None = None
    #: wandb run tags.
    tags: list[str] = field(default_factory=list)
    #: What a resumed run does about steps wandb got past the checkpoint: rewind (online: the
    #: run is rewound to the checkpoint's step, `wandb.init(resume_from=...)`, and records go
    #: to wandb as they are logged), hold (records wait until a committed checkpoint covers
    #: them, so nothing needs rewinding), auto (rewind when online and the installed wandb
    #: has resume_from, else hold).
    resume: str = "auto"

    def validate(self) -> None:
        one_of(self.mode, WANDB_MODES, "logger.wandb.mode")
        one_of(self.resume, WANDB_RESUME, "logger.wandb.resume")
        require(
            self.resume != "rewind" or self.mode == "online",
            f"logger.wandb.resume=rewind needs logger.wandb.mode=online (mode is "
            f"{self.mode}; offline runs cannot be rewound); use logger.wandb.resume=hold "
            "or auto",
        )


@dataclass
class LoggerConfig:
    #: Weights & Biases logging (stdout and <run_dir>/metrics.jsonl are always written).
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def validate(self) -> None:
        self.wandb.validate()


#: (key, label, format) of the step line after "step <n>/<total>", in order.
LINE_FIELDS = [
    ("loss", "loss", "{:.4f}"),
    ("val_loss", "val_loss", "{:.4f}"),
    ("grad_norm", "grad_norm", "{:.3f}"),
    ("lr", "lr", "{:.2e}"),
    ("tokens_per_s", "tokens_per_s", "{:,.0f}"),
    ("mfu", "mfu", "{:.1%}"),
    ("step_time_s", "step_time", "{:.3f}s"),
    ("eta_s", "eta", None),
    ("mem_gb", "mem_gb", "{:.2f}"),
    ("alloc_retries", "alloc_retries", "{:d}"),
]

SENT_FILE = "wandb_sent.json"


def format_line(record: dict, total_steps: int | None = None) -> str:
    step = f"step {record['step']:>6d}" + (f"/{total_steps}" if total_steps else "")
    parts = [step]
    for key, label, fmt in LINE_FIELDS:
        value = record.get(key)
        if value is not None:
            parts.append(f"{label} {format_duration(value) if fmt is None else fmt.format(value)}")
    return " | ".join(parts)


class StepClock:
    """Step time, throughput, MFU and ETA for the records of the log steps, with evaluations
    timed apart (`evaluation()`): the step time and throughput are training's alone; the ETA
    adds the evaluations still to come. Read `measure(step)` right after the log step's host
    sync, so each interval covers the GPU work of its steps."""

    def __init__(
        self,
        *,
        start_step: int,
        total_steps: int,
        tokens_per_step: int,
        step_flops: Callable[[int, int], float],
        peak_tflops: float | None,
        world_size: int,
        eval_every: int = 0,
    ):
        """step_flops(tokens, attention_pairs): the model FLOPs of that work (model/flops.py)."""
        self.start_step, self.total_steps = start_step, total_steps
        self.tokens_per_step, self.step_flops = tokens_per_step, step_flops
        self.peak, self.world_size, self.eval_every = peak_tflops, world_size, eval_every
        self.pairs = 0  # this rank's attention pairs since the last measure (count())
        self.t_start = self.t_last = time.perf_counter()
        self.step_last = start_step
        self.eval_total = self.eval_interval = self.eval_last = 0.0

    @contextlib.contextmanager
    def evaluation(self):
        t0 = time.perf_counter()
        yield
        self.eval_last = time.perf_counter() - t0
        self.eval_total += self.eval_last
        self.eval_interval += self.eval_last

    def elapsed(self) -> float:
        return time.perf_counter() - self.t_start

    def count(self, attention_pairs: int) -> None:
        """Add one step's attention pairs of this rank's rows (model.flops)."""
        self.pairs += attention_pairs

    def take_pairs(self) -> int:
        """This rank's attention pairs since the last call (the caller sums them over the
        data-parallel ranks, which hold different rows, for `measure`)."""
        pairs, self.pairs = self.pairs, 0
        return pairs

    def measure(self, step: int, attention_pairs: float | None = None) -> dict:
        """attention_pairs: the whole job's, over the steps since the last measure (the
        attention of a long window of short documents is far less than a causal window's);
        None: MFU is not reported."""
        now = time.perf_counter()
        steps = step - self.step_last
        step_time = (now - self.t_last - self.eval_interval) / steps
        train_s = now - self.t_start - self.eval_total
        evals_left = 0
        if self.eval_every:
            evals_left = self.total_steps // self.eval_every - step // self.eval_every
            evals_left += step < self.total_steps and self.total_steps % self.eval_every != 0
        steps_left = self.total_steps - step
        eta = steps_left * train_s / (step - self.start_step) + evals_left * self.eval_last
        tps = self.tokens_per_step / step_time
        per_device = tps / self.world_size
        mfu = None
        if self.peak and attention_pairs is not None:
            flops = self.step_flops(self.tokens_per_step * steps, attention_pairs)
            mfu = flops / (step_time * steps * self.world_size * self.peak * 1e12)
        self.t_last, self.step_last, self.eval_interval = now, step, 0.0
        return dict(
            tokens_per_s=tps,
            tokens_per_s_per_device=per_device,
            mfu=mfu,
            step_time_s=step_time,
            eta_s=eta,
        )


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


def wandb_can_rewind() -> bool:
    """Whether the installed wandb's init takes resume_from (wandb 0.17.1 and later)."""
    import inspect

    import wandb

    return "resume_from" in inspect.signature(wandb.init).parameters


def wandb_resume_policy(cfg: WandbConfig) -> str:
    """rewind or hold (see the module docstring)."""
    if cfg.resume != "auto":
        return cfg.resume
    return "rewind" if cfg.mode == "online" and wandb_can_rewind() else "hold"


def check_logger_config(cfg: LoggerConfig) -> None:
    """What config.validate cannot see: the installed wandb (ConfigError, one line)."""
    w = cfg.wandb
    if w.mode != "disabled" and w.resume == "rewind" and not wandb_can_rewind():
        import wandb

        raise ConfigError(
            f"logger.wandb.resume=rewind needs wandb.init(resume_from=...), which wandb "
            f"{wandb.__version__} lacks (0.17.1+); upgrade wandb or use logger.wandb.resume=hold"
        )


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
        total_steps: int | None = None,
    ):
        self.enabled = rank == 0
        self.path = run_dir / "metrics.jsonl"
        self.cfg, self.run_dir, self.run_name, self.config = cfg, run_dir, run_name, config
        self.total_steps = total_steps
        self.tags = list(dict.fromkeys([*tags, *cfg.wandb.tags]))
        self.wandb_run = None
        self.wandb_run_id: str | None = None
        checkpoint_mode = (config.get("checkpoint") or {}).get("mode", "none")
        self.can_resume = checkpoint_mode != "none"
        #: Hold wandb records until a checkpoint covers them (decided when wandb opens).
        self.hold = False
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
        policy = wandb_resume_policy(w)
        self.hold = self.can_resume and policy == "hold"
        common = dict(
            project=w.project,
            entity=w.entity,
            group=w.group,
            name=self.run_name,
            id=run_id,
            mode=w.mode,
            dir=str(self.run_dir),
            config=self.config,
            tags=self.tags,
        )
        run = None
        if start_step > 0 and policy == "rewind":
            try:
                run = wandb.init(**common, resume_from=f"{run_id}?_step={start_step}")
            except Exception as e:  # not enabled for the account, no such run, ...
                reason = " ".join(str(e).split())[:200]
                print(
                    f"warning: wandb could not rewind run {run_id} to step {start_step} "
                    f"({type(e).__name__}: {reason}); holding records until checkpoints cover "
                    "them instead (logger.wandb.resume=hold)",
                    flush=True,
                )
                self.hold = self.can_resume
        if run is None:
            run = wandb.init(**common, resume="allow")
        self.wandb_run, self.wandb_run_id = run, run_id
        # A resumed wandb run keeps its first config: show this segment's effective values.
        run.config.update(self.config, allow_val_change=True)
        if w.mode == "online":
            # The server's next step; wandb drops steps below it on its own.
            logged = max(0, run.starting_step - 1)
        else:
            logged = self._sent_step(run_id) if start_step > 0 else 0
            if logged > start_step:
                print(
                    f"warning: the offline wandb run {run_id} already has steps up to "
                    f"{logged} of the timeline this resume from step {start_step} replaces; "
                    "wandb sync keeps the first value of each step",
                    flush=True,
                )
        # Steps the checkpoint covers that wandb never got: held back, or lost with a
        # killed process. metrics.jsonl has them (already trimmed to start_step).
        self._send_all(r for r in read_metrics(self.path) if logged < r["step"] <= start_step)

    # -- what wandb has -------------------------------------------------------------------

    def _sent_step(self, run_id: str) -> int:
        """Last step handed to wandb run `run_id` by earlier segments (0 if none)."""
        try:
            sent = json.loads((self.run_dir / SENT_FILE).read_text())
        except (OSError, ValueError):
            return 0
        return int(sent.get("step", 0)) if sent.get("run_id") == run_id else 0

    def _record_sent(self, step: int) -> None:
        path = self.run_dir / SENT_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"run_id": self.wandb_run_id, "step": step}) + "\n")
        os.replace(tmp, path)

    def _send(self, record: dict) -> None:
        values = {k: v for k, v in record.items() if k != "step" and v is not None}
        if "time" in record:
            values["_timestamp"] = record["time"]  # its own time, also when sent late
        self.wandb_run.log(values, step=record["step"])

    def _send_all(self, records) -> None:
        last = None
        for record in records:
            self._send(record)
            last = record["step"]
        if last is not None:
            self._record_sent(last)

    # -- logging ----------------------------------------------------------------------------

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        record = {**record, "time": record.get("time", time.time())}
        print(format_line(record, self.total_steps), flush=True)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb_run is not None:
            if self.hold:
                self.pending.append(record)
                # The checkpoint manager's stats name the step of the newest committed save.
                if record.get("save_step") is not None:
                    self.commit(record["save_step"])
            else:
                self._send_all([record])

    def commit(self, step: int) -> None:
        """A checkpoint at `step` is complete: records up to it are final; send them."""
        if self.wandb_run is None:
            return
        n = 0
        while n < len(self.pending) and self.pending[n]["step"] <= step:
            n += 1
        ready, self.pending = self.pending[:n], self.pending[n:]
        self._send_all(ready)

    def info(self, message: str) -> None:
        if self.enabled:
            print(message, flush=True)

    def finish(self) -> None:
        """End of the run (done, or stopped after a final checkpoint): send what is held."""
        if self.wandb_run is not None:
            self._send_all(self.pending)
            self.pending.clear()
            self.wandb_run.finish()
            self.wandb_run = None

"""wandb across resumes: one wandb run per training run, each step in its history once.

logger.wandb.resume decides what happens to the steps wandb got past the checkpoint a run
resumes from: rewind (online; wandb.init(resume_from=...)), records sent live; hold
(offline), records sent once a committed checkpoint covers them. The end-to-end tests run
train.py: one with a stand-in `wandb` module that records every call (SIGKILL after a
checkpoint, resume: every step reaches wandb exactly once, with its own time), one with
the real wandb in offline mode (the arguments the logger passes are accepted, the sidecar
file says what wandb was handed). Unit tests drive MetricsLogger with a fake run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from runlog import read_metrics
from runtime import launch
from tests.ckpt_harness import committed
from tests.harness.resume import keep_only_checkpoint
from tests.helpers import TINY_RUN

ROOT = Path(__file__).resolve().parents[1]

STEPS = 60
ARGS = [
    "model=tiny",
    *TINY_RUN,
    "train.micro_batch_size=4",
    "optim.warmup_steps=10",
    "train.device=cpu",
    "checkpoint=sync",
    "checkpoint.keep_last=1",
    "logger=wandb",
    "logger.wandb.project=test",
]

#: A stand-in for the wandb package: every init/log/finish is a JSON line in $FAKE_WANDB_LOG,
#: written (and flushed) before the call returns, so a killed process has logged exactly
#: what it handed over.
FAKE_WANDB = """
import json, os

__version__ = "0.0-fake"


def _write(**entry):
    with open(os.environ["FAKE_WANDB_LOG"], "a") as f:
        f.write(json.dumps(entry) + "\\n")


class _Config(dict):
    def update(self, values, allow_val_change=False):
        _write(call="config.update", keys=sorted(values), allow_val_change=allow_val_change)


class _Run:
    starting_step = 0

    def __init__(self):
        self.config = _Config()

    def log(self, values, step=None):
        _write(call="log", step=step, values=values, pid=os.getpid())

    def finish(self):
        _write(call="finish", pid=os.getpid())


def init(project=None, entity=None, group=None, name=None, id=None, resume=None,
         resume_from=None, mode=None, dir=None, config=None, tags=None):
    _write(call="init", id=id, resume=resume, resume_from=resume_from, mode=mode,
           pid=os.getpid(), lr=(config or {}).get("optim", {}).get("lr"))
    return _Run()
"""


def env(**extra):
    return dict(
        os.environ,
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
        WANDB_SILENT="true",
        WANDB_DISABLE_GIT="true",
        PYTHONUNBUFFERED="1",
        **extra,
    )


def logged_steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")]


def test_held_records_reach_wandb_once_across_kill_and_resume(tmp_path):
    fake = tmp_path / "fake"
    (fake / "wandb").mkdir(parents=True)
    (fake / "wandb" / "__init__.py").write_text(FAKE_WANDB)
    calls_log = tmp_path / "wandb_calls.jsonl"
    run_env = env(PYTHONPATH=str(fake), FAKE_WANDB_LOG=str(calls_log))
    run_dir = tmp_path / "w"
    args = [*ARGS, f"train.steps={STEPS}", "checkpoint.interval=20", "logger.wandb.mode=offline"]
    args = [f"run.root={tmp_path}", "run.name=w", *args]
    proc = subprocess.Popen(
        [sys.executable, "train.py", *args],
        cwd=ROOT,
        env=run_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 300
    # Kill once a checkpoint is committed and the trainer has logged 3 more steps past it.
    while proc.poll() is None:
        assert time.monotonic() < deadline, "no checkpoint in time"
        done, logged = committed(run_dir / "checkpoints"), logged_steps(run_dir)
        if done and logged and logged[-1] >= done[-1] + 3:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.05)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, f"the run ended before the kill:\n{out[-3000:]}"
    checkpoint = committed(run_dir / "checkpoints")[-1]
    killed_last = logged_steps(run_dir)[-1]
    assert killed_last > checkpoint  # the killed run logged steps its checkpoint does not cover
    killed_pid = proc.pid

    resumed = launch(args, env=run_env)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resumed_from_step={checkpoint}" in resumed.stdout

    calls = [json.loads(line) for line in calls_log.read_text().splitlines()]
    inits = [c for c in calls if c["call"] == "init"]
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    assert [(c["id"], c["resume"], c["resume_from"]) for c in inits] == [
        (run_id, "allow", None),
        (run_id, "allow", None),  # offline: nothing to rewind, records were held instead
    ]
    logs = [c for c in calls if c["call"] == "log"]
    killed = [c["step"] for c in logs if c["pid"] == killed_pid]
    # The killed run handed wandb only steps its checkpoint covers.
    assert killed == list(range(1, len(killed) + 1)) and 0 < killed[-1] <= checkpoint
    final = [c["step"] for c in logs if c["pid"] != killed_pid]
    assert final == list(range(killed[-1] + 1, STEPS + 1))
    counts = Counter(killed + final)
    assert sorted(counts) == list(range(1, STEPS + 1)) and set(counts.values()) == {1}
    # Every value is the metrics.jsonl record of its step, sent with that record's own time.
    metrics = {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl")}
    for c in logs:
        record = metrics[c["step"]]
        assert c["values"]["loss"] == record["loss"] and c["values"]["lr"] == record["lr"]
        assert c["values"]["_timestamp"] == c["values"]["time"] == record["time"]
    sent = json.loads((run_dir / "wandb_sent.json").read_text())
    assert sent == {"run_id": run_id, "step": STEPS}


def test_real_wandb_offline_segments_and_sidecar(tmp_path):
    args = [a for a in ARGS if not a.startswith("checkpoint.keep_last")]
    args += ["train.steps=4", "checkpoint.interval=2", "logger.wandb.mode=offline"]
    a = launch([f"run.root={tmp_path}", "run.name=a", *args], env=env(), timeout=600)
    assert a.returncode == 0, a.stdout[-3000:] + a.stderr[-3000:]
    run_id = (tmp_path / "a" / "wandb_run_id").read_text().strip()
    sent = json.loads((tmp_path / "a" / "wandb_sent.json").read_text())
    assert sent == {"run_id": run_id, "step": 4}
    assert len(list((tmp_path / "a" / "wandb").glob(f"offline-run-*-{run_id}"))) == 1
    # A resume from step 2 opens a second segment of the same wandb run.
    keep_only_checkpoint(tmp_path / "a", tmp_path / "b", 2)
    (tmp_path / "b" / "wandb_sent.json").write_text(json.dumps({"run_id": run_id, "step": 2}))
    b = launch([f"run.root={tmp_path}", "run.name=b", *args], env=env(), timeout=600)
    assert b.returncode == 0, b.stdout[-3000:] + b.stderr[-3000:]
    assert "resumed_from_step=2" in b.stdout
    assert len(list((tmp_path / "b" / "wandb").glob(f"offline-run-*-{run_id}"))) == 2
    assert json.loads((tmp_path / "b" / "wandb_sent.json").read_text())["step"] == 4


class FakeConfig(dict):
    def update(self, values, allow_val_change=False):
        assert allow_val_change
        super().update(values)


class FakeRun:
    def __init__(self, starting_step=0):
        self.sent: list[int] = []
        self.values: list[dict] = []
        self.starting_step = starting_step
        self.finished = False
        self.config = FakeConfig()

    def log(self, values, step):
        assert "step" not in values and None not in values.values()
        self.sent.append(step)
        self.values.append(values)

    def finish(self):
        self.finished = True


def make_logger(
    tmp_path,
    monkeypatch,
    mode="offline",
    checkpoint_mode="sync",
    starting_step=0,
    resume="auto",
    rewind_fails=False,
):
    import wandb

    from logger import LoggerConfig, MetricsLogger, WandbConfig

    fake = FakeRun(starting_step)
    fake.inits = []

    def init(resume_from=None, **kwargs):  # wandb.init's signature has resume_from (0.17.1+)
        if resume_from is not None:
            kwargs["resume_from"] = resume_from
        fake.inits.append(kwargs)
        if rewind_fails and "resume_from" in kwargs:
            raise RuntimeError("rewind is not enabled for this entity")
        return fake

    monkeypatch.setattr(wandb, "init", init)
    cfg = LoggerConfig(wandb=WandbConfig(mode=mode, resume=resume))
    logger = MetricsLogger(
        cfg,
        tmp_path,
        rank=0,
        run_name="r",
        config={"checkpoint": {"mode": checkpoint_mode}, "optim": {"lr": 0.01}},
        tags=["a"],
        total_steps=10,
    )
    return logger, fake


def record(step, **extra):
    return {"step": step, "loss": 1.0 / step, "mfu": None, **extra}


def write_metrics(tmp_path, steps):
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps(record(s, time=1000.0 + s)) + "\n" for s in steps)
    )


def test_offline_records_wait_for_a_committed_checkpoint_with_their_own_time(tmp_path, monkeypatch):
    logger, fake = make_logger(tmp_path, monkeypatch)
    assert logger.start(0) == (tmp_path / "wandb_run_id").read_text().strip()
    assert logger.hold and fake.inits[0]["resume"] == "allow"
    assert fake.config == {"checkpoint": {"mode": "sync"}, "optim": {"lr": 0.01}}
    for s in (1, 2, 3):
        logger.log(record(s))
    assert fake.sent == []
    logged_at = [r["time"] for r in read_metrics(tmp_path / "metrics.jsonl")]
    time.sleep(0.01)
    logger.log(record(4, save_step=2))  # the manager committed step 2's checkpoint
    assert fake.sent == [1, 2]
    # Sent late, with the time they were logged at.
    assert [v["_timestamp"] for v in fake.values] == [v["time"] for v in fake.values]
    assert [v["time"] for v in fake.values] == logged_at[:2]
    logger.commit(3)
    assert fake.sent == [1, 2, 3]
    logger.log(record(5))
    logger.finish()  # the run ended: nothing more can be superseded
    assert fake.sent == [1, 2, 3, 4, 5] and fake.finished
    sent = json.loads((tmp_path / "wandb_sent.json").read_text())
    assert sent == {"run_id": logger.wandb_run_id, "step": 5}


def test_offline_resume_sends_what_the_sidecar_says_wandb_lacks(tmp_path, monkeypatch):
    write_metrics(tmp_path, range(1, 7))
    (tmp_path / "wandb_sent.json").write_text(json.dumps({"run_id": "abc", "step": 2}))
    logger, fake = make_logger(tmp_path, monkeypatch)
    assert logger.start(4, wandb_run_id="abc") == "abc"
    assert fake.sent == [3, 4]  # 5-6 were logged past the checkpoint: trimmed
    assert [v["_timestamp"] for v in fake.values] == [1003.0, 1004.0]
    # Another wandb run's sidecar says nothing about this one.
    (tmp_path / "wandb_sent.json").write_text(json.dumps({"run_id": "other", "step": 4}))
    logger, fake = make_logger(tmp_path, monkeypatch)
    logger.start(4, wandb_run_id="abc")
    assert fake.sent == [1, 2, 3, 4]


def test_without_checkpoints_records_go_at_once(tmp_path, monkeypatch):
    logger, fake = make_logger(tmp_path, monkeypatch, checkpoint_mode="none")
    logger.start(0)
    logger.log(record(1))
    assert fake.sent == [1]


def test_online_rewinds_to_the_checkpoint_and_logs_live(tmp_path, monkeypatch):
    write_metrics(tmp_path, range(1, 7))
    logger, fake = make_logger(tmp_path, monkeypatch, mode="online", starting_step=5)
    assert logger.start(4, wandb_run_id="abc") == "abc"
    assert fake.inits[0]["resume_from"] == "abc?_step=4" and "resume" not in fake.inits[0]
    assert fake.inits[0]["id"] == "abc" and not logger.hold
    assert fake.sent == []  # the rewound run has steps 1-4 (its next step is 5)
    logger.log(record(5))
    assert fake.sent == [5]  # live: no checkpoint needed
    # A fresh start opens a new run; nothing to rewind.
    logger, fake = make_logger(tmp_path, monkeypatch, mode="online")
    logger.start(0)
    assert fake.inits[0]["resume"] == "allow" and "resume_from" not in fake.inits[0]


def test_online_falls_back_to_hold_when_the_server_refuses_to_rewind(tmp_path, monkeypatch, capsys):
    write_metrics(tmp_path, range(1, 7))
    logger, fake = make_logger(
        tmp_path, monkeypatch, mode="online", starting_step=3, rewind_fails=True
    )
    logger.start(4, wandb_run_id="abc")
    assert "resume_from" in fake.inits[0] and fake.inits[1]["resume"] == "allow"
    assert "could not rewind run abc to step 4" in capsys.readouterr().out
    assert logger.hold and fake.sent == [3, 4]  # what the server lacks, up to the checkpoint
    logger.log(record(5))
    assert fake.sent == [3, 4]


@pytest.mark.parametrize("starting_step, expected", [(0, [1, 2, 3, 4]), (3, [3, 4])])
def test_online_hold_resume_sends_what_the_server_lacks(
    tmp_path, monkeypatch, starting_step, expected
):
    write_metrics(tmp_path, range(1, 7))
    logger, fake = make_logger(
        tmp_path, monkeypatch, mode="online", starting_step=starting_step, resume="hold"
    )
    assert logger.start(4, wandb_run_id="abc") == "abc"
    assert fake.inits[0]["resume"] == "allow"
    # Steps 5-6 were logged past the checkpoint (step 4): trimmed, and never sent.
    assert fake.sent == expected
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]


def test_resume_policy_and_its_config_checks(monkeypatch):
    import wandb

    import logger as logger_module
    from config import ConfigError, compose_config, validate
    from logger import LoggerConfig, WandbConfig

    policy = logger_module.wandb_resume_policy
    assert policy(WandbConfig(mode="online")) == "rewind"  # wandb 0.31 has resume_from
    assert policy(WandbConfig(mode="offline")) == "hold"
    assert policy(WandbConfig(mode="online", resume="hold")) == "hold"
    with pytest.raises(ConfigError, match=r"logger.wandb.resume=rewind needs logger.wandb.mode"):
        validate(
            compose_config(
                ["logger=wandb", "logger.wandb.mode=offline", "logger.wandb.resume=rewind"]
            )
        )
    monkeypatch.setattr(wandb, "init", lambda project=None, resume=None: None)
    assert policy(WandbConfig(mode="online")) == "hold"  # an old wandb: auto holds
    with pytest.raises(ConfigError, match=r"lacks \(0.17.1\+\); upgrade wandb"):
        logger_module.check_logger_config(
            LoggerConfig(wandb=WandbConfig(mode="online", resume="rewind"))
        )


def test_fresh_start_gets_a_new_wandb_run(tmp_path, monkeypatch):
    (tmp_path / "wandb_run_id").write_text("old\n")
    logger, _ = make_logger(tmp_path, monkeypatch)
    new_id = logger.start(0, wandb_run_id=None)
    assert new_id != "old" and (tmp_path / "wandb_run_id").read_text().strip() == new_id
    logger2, _ = make_logger(tmp_path, monkeypatch)
    assert logger2.start(7, wandb_run_id=None) == new_id  # a resume keeps it


def test_step_line():
    from logger import format_duration, format_line

    line = format_line(
        {"step": 7, "loss": 2.5, "val_loss": 2.25, "lr": 1e-3, "step_time_s": 0.25, "eta_s": 3725},
        total_steps=300,
    )
    assert line == (
        "step      7/300 | loss 2.5000 | val_loss 2.2500 | lr 1.00e-03 | step_time 0.250s | "
        "eta 1h02m"
    )
    assert [format_duration(s) for s in (0, 59.4, 61, 3600, 90000)] == [
        "0s",
        "59s",
        "1m01s",
        "1h00m",
        "1d01h",
    ]

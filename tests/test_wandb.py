"""wandb across resumes: one wandb run per training run, each step in its history once.

The end-to-end test trains with logger.wandb.mode=offline, SIGKILLs the trainer after a
checkpoint and a few more logged steps, resumes, and reads the offline transaction logs
back (runlog.py's reader): the steps the killed run logged past its checkpoint
must not appear twice, and the history must equal metrics.jsonl.
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

from runlog import load_run, read_metrics, read_wandb_segments

ROOT = Path(__file__).resolve().parents[1]

STEPS = 1000
ARGS = [
    "model=tiny",
    "model.dim=64",
    "model.n_layers=1",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "model.ffn_dim=128",
    "data.seq_len=32",
    "data.max_bytes=200000",
    "train.global_batch_size=4",
    "train.micro_batch_size=4",
    f"train.steps={STEPS}",
    "train.log_every=1",
    "optim.warmup_steps=10",
    "train.device=cpu",
    "checkpoint=sync",
    "checkpoint.interval=100",
    "checkpoint.keep_last=1",
    "logger=wandb",
    "logger.wandb.mode=offline",
    "logger.wandb.project=test",
]


def env():
    return dict(
        os.environ,
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
        WANDB_SILENT="true",
        WANDB_DISABLE_GIT="true",
        PYTHONUNBUFFERED="1",
    )


def committed_steps(run_dir: Path) -> list[int]:
    ckpts = run_dir / "checkpoints"
    if not ckpts.is_dir():
        return []
    return sorted(
        int(p.name.removeprefix("step_"))
        for p in ckpts.iterdir()
        if p.name.startswith("step_") and p.name.removeprefix("step_").isdigit()
    )


def logged_steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")]


def test_offline_history_has_each_step_once_across_kill_and_resume(tmp_path):
    run_dir = tmp_path / "w"
    cmd = [sys.executable, "train.py", f"run.root={tmp_path}", "run.name=w", *ARGS]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.monotonic() + 300
    # Kill once a checkpoint at step >= 200 is committed (so wandb has been sent ~200 rows,
    # more than it buffers) and the trainer has logged 3 more steps past it.
    while proc.poll() is None:
        assert time.monotonic() < deadline, "no checkpoint at step >= 200 in time"
        committed, logged = committed_steps(run_dir), logged_steps(run_dir)
        if committed and committed[-1] >= 200 and logged and logged[-1] >= committed[-1] + 3:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.05)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, f"the run ended before the kill:\n{out[-3000:]}"
    checkpoint = committed_steps(run_dir)[-1]
    killed_last = logged_steps(run_dir)[-1]
    assert killed_last > checkpoint  # the killed run logged steps its checkpoint does not cover

    resumed = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resumed_from_step={checkpoint}" in resumed.stdout

    run_id = (run_dir / "wandb_run_id").read_text().strip()
    killed, final = read_wandb_segments(run_dir / "wandb")
    assert killed.run_id == final.run_id == run_id  # one wandb run across the resume
    assert {"tiny", "bf16", "fsdp"} <= set(final.tags)
    killed_steps = [row["_step"] for row in killed.rows]
    final_steps = [row["_step"] for row in final.rows]
    # The killed run sent wandb only steps its checkpoint covers (wandb kept a prefix).
    assert killed_steps, (
        "the killed run sent wandb nothing: held records are released when "
        "a record carries save_step (CheckpointManager.stats) or on commit()"
    )
    assert killed_steps == list(range(1, len(killed_steps) + 1))
    assert killed_steps[-1] <= checkpoint
    # The resume sent the rest, from the first step wandb lacked: each step exactly once.
    assert final_steps == list(range(killed_steps[-1] + 1, STEPS + 1))
    counts = Counter(killed_steps + final_steps)
    assert all(counts[s] == 1 for s in range(checkpoint + 1, killed_last + 1))
    assert sorted(counts) == list(range(1, STEPS + 1)) and set(counts.values()) == {1}

    # The wandb history is the metrics.jsonl curve, value for value.
    history, metrics = load_run(run_dir / "wandb"), load_run(run_dir)
    assert sorted(history) == sorted(metrics)
    for step, record in metrics.items():
        for key in ("loss", "grad_norm", "lr"):
            assert history[step][key] == record[key], (step, key)


class FakeRun:
    def __init__(self, starting_step=0):
        self.sent: list[int] = []
        self.starting_step = starting_step
        self.finished = False

    def log(self, values, step):
        assert "step" not in values and None not in values.values()
        self.sent.append(step)

    def finish(self):
        self.finished = True


def make_logger(tmp_path, monkeypatch, mode="offline", checkpoint_mode="sync", starting_step=0):
    import wandb

    from config import LoggerConfig, WandbConfig
    from logger import MetricsLogger

    fake = FakeRun(starting_step)
    monkeypatch.setattr(wandb, "init", lambda **kwargs: fake)
    cfg = LoggerConfig(wandb=WandbConfig(mode=mode))
    logger = MetricsLogger(
        cfg,
        tmp_path,
        rank=0,
        run_name="r",
        config={"checkpoint": {"mode": checkpoint_mode}},
        tags=["a"],
    )
    return logger, fake


def record(step, **extra):
    return {"step": step, "loss": 1.0 / step, "mfu": None, **extra}


def test_records_wait_for_a_committed_checkpoint(tmp_path, monkeypatch):
    logger, fake = make_logger(tmp_path, monkeypatch)
    assert logger.start(0) == (tmp_path / "wandb_run_id").read_text().strip()
    for s in (1, 2, 3):
        logger.log(record(s))
    assert fake.sent == []
    logger.log(record(4, save_step=2))  # the manager committed step 2's checkpoint
    assert fake.sent == [1, 2]
    logger.commit(3)
    assert fake.sent == [1, 2, 3]
    logger.log(record(5))
    logger.finish()  # the run ended: nothing more can be superseded
    assert fake.sent == [1, 2, 3, 4, 5] and fake.finished


def test_without_checkpoints_records_go_at_once(tmp_path, monkeypatch):
    logger, fake = make_logger(tmp_path, monkeypatch, checkpoint_mode="none")
    logger.start(0)
    logger.log(record(1))
    assert fake.sent == [1]


@pytest.mark.parametrize("starting_step, expected", [(0, [1, 2, 3, 4]), (3, [3, 4])])
def test_online_resume_sends_what_the_server_lacks(tmp_path, monkeypatch, starting_step, expected):
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps(record(s)) + "\n" for s in range(1, 7))
    )
    logger, fake = make_logger(tmp_path, monkeypatch, mode="online", starting_step=starting_step)
    assert logger.start(4, wandb_run_id="abc") == "abc"
    # Steps 5-6 were logged past the checkpoint (step 4): trimmed, and never sent.
    assert fake.sent == expected
    assert [
        json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ] == [1, 2, 3, 4]


def test_fresh_start_gets_a_new_wandb_run(tmp_path, monkeypatch):
    (tmp_path / "wandb_run_id").write_text("old\n")
    logger, _ = make_logger(tmp_path, monkeypatch)
    new_id = logger.start(0, wandb_run_id=None)
    assert new_id != "old" and (tmp_path / "wandb_run_id").read_text().strip() == new_id
    logger2, _ = make_logger(tmp_path, monkeypatch)
    assert logger2.start(7, wandb_run_id=None) == new_id  # a resume keeps it

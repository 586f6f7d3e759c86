"""The last silent failures (issue 28): each case gives one line naming the checkpoint or the
field and the fix, or an announced fallback saying why, and never loses a good checkpoint.
Resume decisions are all made before the model is built. CPU; gloo with 2 processes where the
ranks differ (a stop signal to one rank).
"""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch

from checkpoint import preflight, runlock, store
from checkpoint.manager import close_open
from checkpoint.writer_process import WriterProcess
from errors import ConfigError
from runtime import host_id
from tests.ckpt_harness import (
    SMALL,
    Run,
    committed,
    no_model,
    previous_hint,
    refused,
    small_cfg,
    two_checkpoints,
)
from tests.distributed import run_distributed
from tests.helpers import CPU_ENV

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

ROOT = Path(__file__).resolve().parents[1]


# -- the newest step entry is not a checkpoint directory --------------------------------------


def test_step_directory_replaced_by_a_file_isrefused(tmp_path):
    root = two_checkpoints(tmp_path)
    shutil.rmtree(root / "step_0000004")
    (root / "step_0000004").write_text("not a checkpoint")
    assert refused(tmp_path) == (
        f"checkpoint {root / 'step_0000004'} is damaged (it is a file, not a checkpoint "
        f"directory) and was not loaded; {previous_hint(root)}, or move the damaged directory away"
    )
    assert committed(root) == [2] and (root / "step_0000004").read_text() == "not a checkpoint"


def test_symlink_loop_as_newest_step_is_one_line(tmp_path):
    root = two_checkpoints(tmp_path)
    shutil.rmtree(root / "step_0000004")
    (root / "step_0000004").symlink_to("step_0000004")
    assert refused(tmp_path) == (
        f"checkpoint {root / 'step_0000004'} is damaged (it is a symbolic link loop "
        f"(step_0000004 -> step_0000004)) and was not loaded; {previous_hint(root)}, or move the "
        "damaged directory away"
    )
    assert committed(root) == [2] and (root / "step_0000004").is_symlink()


def test_step_directory_the_run_cannot_read_is_one_line(tmp_path, monkeypatch):
    """Permissions: the tests run as root, which reads any directory, so the refusal of the
    directory listing (what a non-root run gets from a chmod 000 directory) is injected."""
    root = two_checkpoints(tmp_path)
    denied = root / "step_0000004"
    real = os.listdir

    def listdir(path="."):
        if Path(path) == denied:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real(path)

    monkeypatch.setattr(os, "listdir", listdir)
    assert refused(tmp_path) == (
        f"checkpoint {denied}: this run cannot read the directory (Permission denied); give "
        f"this run read access to it (chmod/chown), or {previous_hint(root)}"
    )
    assert committed(root) == [2, 4]


def test_unreadable_file_of_a_checkpoint_is_one_line(tmp_path, monkeypatch):
    root = two_checkpoints(tmp_path)
    denied = root / "step_0000004" / store.CONFIG_FILE
    real = Path.read_text

    def read_text(self, *args, **kwargs):
        if self == denied:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)
    assert refused(tmp_path) == (
        f"checkpoint.resume=auto: cannot read {denied} (Permission denied); give this run "
        "access to it (chmod/chown), or pass checkpoint.resume=<another checkpoint>"
    )
    assert committed(root) == [2, 4]


def test_renamed_newest_step_is_announced_and_kept(tmp_path):
    """A step directory renamed by hand (`step_0000004.bak`) is not resumed from, and the run
    says so in one line; the renamed directory stays as it is."""
    root = two_checkpoints(tmp_path)
    (root / "step_0000004").rename(root / "step_0000004.bak")
    run = Run(tmp_path)
    start, _ = run.train(6)
    assert start == 2
    assert (
        f"{root / 'step_0000004.bak'} is not resumed from: its name is not a step directory's "
        f"(renamed?); resuming from {root / 'step_0000002'} (rename it back to step_0000004 to "
        "resume from it)"
    ) in run.messages
    assert committed(root) == [2, 4, 6] and store.verify(root / "step_0000004.bak") is None


# -- misleading lines ---------------------------------------------------------------------------


def _data_file(ckpt: Path) -> Path:
    return sorted(ckpt.glob("*.distcp"))[0]


def test_longer_file_and_damaged_trailer_say_what_was_found(tmp_path):
    root = two_checkpoints(tmp_path)
    path = _data_file(root / "step_0000004")
    size = path.stat().st_size
    with path.open("ab") as f:
        f.write(b"\0" * 10)
    assert refused(tmp_path).startswith(
        f"checkpoint {root / 'step_0000004'} is damaged (file {path.name} has {size + 10} bytes, "
        f"the manifest says {size} (longer than recorded: appended to))"
    )
    with path.open("r+b") as f:
        f.truncate(size)
        f.seek(size - store.TRAILER_SIZE + 20)  # a byte of the save id in the trailer
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    for checksum in (True, False):
        assert refused(tmp_path, checksum=checksum).startswith(
            f"checkpoint {root / 'step_0000004'} is damaged (file {path.name} has a damaged "
            f"trailer (1 of its last {store.TRAILER_SIZE} bytes, which name the save and file, "
            "differ from what this save wrote))"
        )
    assert committed(root) == [2, 4]


def test_nan_weights_with_valid_hashes_name_the_checkpoint(tmp_path):
    """Weights that were non-finite when saved (their hashes match) are named at the load, not
    at the first step as a non-finite loss ("lower optim.lr")."""
    run = Run(tmp_path)
    run.train(4, finish=False)
    with torch.no_grad():
        run.model.lm_head.weight[0, 0] = float("inf")
    run.train_state.step = 6
    run.ckpt.save(6, run.state)
    run.ckpt.finish(6, run.state, save=False)
    root = tmp_path / "checkpoints"
    assert store.verify(root / "step_0000006") is None  # every hash matches
    with pytest.raises(ConfigError) as e:
        Run(tmp_path).train(8)
    assert str(e.value) == (
        f"checkpoint {root / 'step_0000006'} holds non-finite weights (nan or inf in "
        "model.lm_head.weight; its files match their hashes: saved so); pass "
        f"checkpoint.resume={root / 'step_0000004'} to resume from the previous complete "
        "checkpoint"
    )
    assert committed(root) == [2, 4, 6]


# -- saving: async_process start, Ctrl-C in the first save, prune failures, read-only ----------


def test_async_process_saves_while_the_writer_starts_are_taken_at_their_step(tmp_path, monkeypatch):
    """A save due while the writer process is still starting is written by the training
    process at its step (it used to wait behind the start, and the saves after it were
    deferred: a kill then lost many steps). Once the writer is up, saves go to it."""
    started = threading.Event()
    real = WriterProcess.wait_ready

    def wait_ready(self, timeout=None):
        if not started.is_set():  # the child is still importing torch
            return False
        return real(self, timeout)

    monkeypatch.setattr(WriterProcess, "wait_ready", wait_ready)
    root = tmp_path / "checkpoints"
    seen = {}

    def on_step(step):
        seen[step] = committed(root)  # right after maybe_save: what a kill would leave
        if step == 4:
            started.set()
            assert run.ckpt.saver._writer.wait_ready(120)  # the child is up now (no save in it)

    run = Run(tmp_path, mode="async_process", interval=2)
    run.train(8, on_step=on_step)
    assert seen[2] == [2] and seen[4] == [2, 4]  # committed at their step, in this process
    for step in (2, 4):
        assert (
            f"step {step}: saving from the training process (sync): the writer process is "
            "still starting"
        ) in run.messages
    assert not any(m.startswith("step 6: saving from") for m in run.messages)
    records = [json.loads(x) for x in (tmp_path / "checkpoint_saves.jsonl").open()]
    assert [r["save_step"] for r in records if r["event"] == "saved"] == [2, 4, 6, 8]
    by_step = {r["save_step"]: r for r in records if r["event"] == "saved"}
    assert "save_start_wait_s" in by_step[6] and "save_start_wait_s" not in by_step[4]
    assert committed(root) == [2, 4, 6, 8]


def test_write_thread_runs_before_the_first_save(tmp_path):
    """The async writer's thread is started with the manager, so a Ctrl-C can never land in a
    thread start inside the first save's `submit` (it left an unrecorded worker that the
    interpreter waited for at exit: a hang with the run lock held)."""
    before = {t.ident for t in threading.enumerate()}
    run = Run(tmp_path, mode="async")
    writers = [
        t
        for t in threading.enumerate()
        if t.ident not in before and t.name.startswith("ckpt-write")
    ]
    assert len(writers) == 1 and writers[0].is_alive()
    run.ckpt.close()


_CTRL_C = r"""
import sys, threading
from pathlib import Path
from checkpoint.manager import close_open
from checkpoint.runlock import RunLock
from tests.ckpt_harness import Run

run_dir = Path(sys.argv[1])
lock = RunLock.acquire(run_dir)
run = Run(run_dir, mode="async", interval=2)
run.ckpt._lock = lock  # as train.py hands it over
pool = run.ckpt.saver._executor
real_submit, real_start = pool.submit, threading.Thread.start

def submit(*args, **kwargs):  # Ctrl-C inside the first save's submit, once it queued the write
    pool.submit = real_submit
    real_submit(*args, **kwargs)
    raise KeyboardInterrupt

def start(self):  # ... or inside a writer thread's start, had the save to start one
    real_start(self)
    if self.name.startswith("ckpt-write"):
        raise KeyboardInterrupt

pool.submit, threading.Thread.start = submit, start
try:
    run.train(6)
finally:
    close_open()  # train.main's finally
"""


def test_ctrl_c_in_the_first_async_save_exits_and_releases_the_lock(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", _CTRL_C, str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, **CPU_ENV, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,  # the hang this guards against never ended
    )
    # Python ends on an uncaught KeyboardInterrupt by re-raising SIGINT on itself
    assert proc.returncode == -signal.SIGINT and "KeyboardInterrupt" in proc.stderr, proc.stderr
    assert not (tmp_path / runlock.LOCK_NAME).exists()  # released
    root = tmp_path / "checkpoints"
    assert committed(root) == [2] and store.verify(root / "step_0000002") is None
    assert not list(root.glob("*.tmp"))


def test_failed_prune_is_logged_as_such_and_training_goes_on(tmp_path, monkeypatch):
    """A checkpoint whose files cannot be deleted (a read-only step directory; injected: the
    tests run as root) is not reported as pruned; it stays as `*.pruned.tmp`, the run goes on."""
    real = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        if str(path).endswith(".pruned.tmp") and "step_0000002" in str(path):
            file = sorted(Path(path).iterdir())[0]
            err = PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(file))
            callback = kwargs.get("onexc") or kwargs.get("onerror")
            callback(os.unlink, str(file), err if "onexc" in kwargs else (type(err), err, None))
            return
        return real(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    run = Run(tmp_path, keep_last=1)
    run.train(6)
    root = tmp_path / "checkpoints"
    left = root / "step_0000002.pruned.tmp"
    first = sorted(left.iterdir())[0]
    assert (
        f"could not prune step_0000002: Permission denied: {first}; it is left as {left} "
        "(ignored by resume, taking space until removed); training goes on"
    ) in run.messages
    assert not any("pruned step_0000002" in m for m in run.messages)
    assert "pruned step_0000004" in run.messages
    assert committed(root) == [6] and left.is_dir()


def test_read_only_filesystem_in_a_save_is_one_line(tmp_path, monkeypatch):
    import checkpoint.writer as writer

    real = writer._os_writev
    readonly = [False]

    def writev(fd, buffers):
        if readonly[0]:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        return real(fd, buffers)

    monkeypatch.setattr(writer, "_os_writev", writev)

    def on_step(step):
        readonly[0] = step >= 2

    with pytest.raises(ConfigError) as e:
        Run(tmp_path).train(6, on_step=on_step)
    root = tmp_path / "checkpoints"
    assert str(e.value).startswith(
        "checkpoint save of step 4 failed: Read-only file system ("
    ) and str(e.value).endswith(
        f"nothing was committed and the earlier checkpoints are intact; make {root} writable "
        "(or set checkpoint.dir to a writable filesystem) and resume"
    )
    assert committed(root) == [2] and not list(root.glob("*.tmp"))


_READ_ONLY_RUN = r"""
import errno, os, runpy, sys
from pathlib import Path
import logger
from checkpoint import runlock

run_dir = Path(sys.argv[1]) / "ro"
real_log, real_unlink = logger.MetricsLogger.log, Path.unlink

def log(self, record):  # the filesystem turns read-only after step 2
    if record["step"] >= 3:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(run_dir / "metrics.jsonl"))
    return real_log(self, record)

def unlink(self, *args, **kwargs):
    if self.name == runlock.LOCK_NAME:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
    return real_unlink(self, *args, **kwargs)

logger.MetricsLogger.log, Path.unlink = log, unlink
sys.argv = ["train.py", *sys.argv[2:]]
runpy.run_path("train.py", run_name="__main__")  # as `python train.py ...`
"""


def test_read_only_filesystem_mid_run_is_one_line(tmp_path):
    args = [f"run.root={tmp_path}", "run.name=ro", *SMALL, "train.log_every=1", "train.steps=6"]
    r = subprocess.run(
        [sys.executable, "-c", _READ_ONLY_RUN, str(tmp_path), *args],
        cwd=ROOT,
        env={**os.environ, **CPU_ENV, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1] == (
        f"error: Read-only file system: {tmp_path / 'ro' / 'metrics.jsonl'} (rank 0); the run "
        "stopped; committed checkpoints are intact"
    )
    lock = tmp_path / "ro" / runlock.LOCK_NAME
    assert (
        f"run lock: could not remove {lock} (Read-only file system); the next run takes it "
        "over (its holder is gone)"
    ) in r.stdout


# -- a checkpoint.dir shared by two runs ----------------------------------------------------------


def test_shared_checkpoint_dir_is_locked_and_not_resumed_by_another_run(tmp_path, monkeypatch):
    import train

    shared = tmp_path / "shared-ckpts"
    ck = [f"checkpoint.dir={shared}", "checkpoint=sync", "checkpoint.interval=2"]
    assert train.run(small_cfg(tmp_path, "a", "train.steps=2", *ck)) == 0
    assert committed(shared) == [2]

    # Run b, after a: refused before its model is built, a's checkpoint untouched.
    monkeypatch.setattr(train, "build_training", no_model)
    try:
        with pytest.raises(ConfigError) as e:
            train.run(small_cfg(tmp_path, "b", "train.steps=4", *ck))
    finally:
        close_open()  # train.main's finally: the locks go back
    assert str(e.value) == (
        f"checkpoint.dir={shared}: {shared} holds the checkpoints of run a (newest: "
        f"{shared / 'step_0000002'}), not of run.name=b; give this run a checkpoint.dir of its "
        f"own, or resume from it on purpose with checkpoint.resume={shared / 'step_0000002'}"
    )
    assert committed(shared) == [2] and not (tmp_path / "b" / runlock.LOCK_NAME).exists()

    # Run b while another run holds the shared directory: refused by the lock at once.
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (shared / runlock.LOCK_NAME).write_text(
            json.dumps({"host": host_id(), "pid": alive.pid, "started": time.time(), "token": "t"})
        )
        with pytest.raises(ConfigError) as e:
            preflight.prepare_run_dir(*train.run_dir_args(small_cfg(tmp_path, "b", *ck)), 0, 1)
        assert str(e.value).startswith(
            f"checkpoint.dir={shared} ({shared}, outside the run directory) is in use by another "
            f"run (host "
        ) and f"pid {alive.pid}, started " in str(e.value)
        assert not (tmp_path / "b" / runlock.LOCK_NAME).exists()  # b's own lock given back
    finally:
        alive.kill()
        alive.wait()


# -- resume decisions before the model ------------------------------------------------------------


def test_resume_refusals_come_before_the_model_is_built(tmp_path, monkeypatch):
    import train

    ck = ["checkpoint=sync", "checkpoint.interval=2"]
    assert train.run(small_cfg(tmp_path, "r", "train.steps=2", *ck)) == 0
    root = tmp_path / "r" / "checkpoints"
    before = sorted(p.name for p in root.iterdir())

    monkeypatch.setattr(train, "build_training", no_model)
    refusals = {
        "optim.lr=0.01": f"resume: {tmp_path / 'r'} has a checkpoint (step 2) of another "
        "config: optim.lr 0.003 -> 0.01; ",
        f"checkpoint.resume={tmp_path / 'nowhere'}": f"checkpoint.resume={tmp_path / 'nowhere'}: "
        "no checkpoint there",
        "model.n_layers=3": f"model.n_layers: checkpoint has 4, config has 3 (checkpoint "
        f"{root / 'step_0000002'}); resume with the checkpoint's model settings, or train this "
        "model as a separate run with another run.name (checkpoint.resume=none would move this "
        "run's checkpoints aside)",
    }
    for override, line in refusals.items():
        try:
            with pytest.raises(ConfigError) as e:
                train.run(small_cfg(tmp_path, "r", "train.steps=4", *ck, override))
        finally:
            close_open()  # train.main's finally: the lock goes back
        assert str(e.value).startswith(line), str(e.value)
        assert "\n" not in str(e.value)
    assert sorted(p.name for p in root.iterdir()) == before


def test_corpus_of_another_python_is_refused_before_the_model(tmp_path, monkeypatch):
    import train
    from data.sources import corpus_fingerprint

    ck = ["checkpoint=sync", "checkpoint.interval=2", "optim.schedule_steps=4"]
    assert train.run(small_cfg(tmp_path, "c", "train.steps=2", *ck)) == 0
    root = tmp_path / "c" / "checkpoints"
    mine = corpus_fingerprint(small_cfg(tmp_path, "c").data)
    assert mine.startswith("data=embedded from Python 3.") and " files, sha256 " in mine
    assert store.read_manifest(root / "step_0000002")["corpus"] == mine

    other = mine.replace("from Python 3.", "from Python 2.")  # another interpreter's stdlib
    monkeypatch.setattr(train, "corpus_fingerprint", lambda cfg: other)
    built = []
    real = train.build_training
    monkeypatch.setattr(train, "build_training", lambda *a, **k: built.append(1) or real(*a, **k))
    with pytest.raises(ConfigError) as e:
        train.run(small_cfg(tmp_path, "c", "train.steps=4", *ck))
    close_open()
    assert str(e.value) == (
        f"checkpoint {root / 'step_0000002'} was trained on another corpus ({mine}; this run's "
        f"is {other}), so the run would continue on different data; resume with the data it "
        "was trained on (data=embedded: under the Python version it names), or accept the "
        "change on purpose with resume.accept=[data]"
    )
    assert not built
    out = io.StringIO()
    with redirect_stdout(out):
        assert (
            train.run(small_cfg(tmp_path, "c", "train.steps=4", *ck, "resume.accept=[data]")) == 0
        )
    assert (
        f"checkpoint: corpus: {mine} in checkpoint {root / 'step_0000002'}, {other} now; "
        "continuing on the new one (resume.accept)"
    ) in out.getvalue()
    assert committed(root) == [2, 4]


def test_corpus_fingerprint_follows_the_files(tmp_path, monkeypatch):
    import sysconfig

    from data import sources
    from data.config import DataConfig

    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "a.py").write_text("x = 1\n")
    (lib / "b.py").write_text("y = 2\n")
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(lib)})
    cfg = DataConfig(name="embedded", max_bytes=1000)
    fingerprints = []
    for text in ("y = 2\n", "y = 2\n", "y = 3\n"):
        (lib / "b.py").write_text(text)
        sources._stdlib_documents.cache_clear()
        fingerprints.append(sources.corpus_fingerprint(cfg))
    sources._stdlib_documents.cache_clear()
    assert fingerprints[0] == fingerprints[1] != fingerprints[2]
    assert "(2 files, sha256 " in fingerprints[0]
    assert sources.corpus_fingerprint(DataConfig(name="synthetic")) is None


# -- a stop signal to one rank of two ---------------------------------------------------------------


def _stop_one_rank(rank, world_size, tmp):
    import train

    tmp = Path(tmp)
    real = train.train_step
    count = [0]

    def step_then_signal(*a, **k):
        out = real(*a, **k)
        count[0] += 1
        if rank == 1 and count[0] == 3:  # after step 3, rank 1 alone is told to stop
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    train.train_step = step_then_signal
    cfg = small_cfg(
        tmp,
        "stop",
        "train.steps=20",
        "train.log_every=2",
        "checkpoint=sync",
        "checkpoint.interval=100",
    )
    out = io.StringIO()
    with redirect_stdout(out):
        status = train.run(cfg)
    assert status == 3, status
    root = tmp / "stop" / "checkpoints"
    assert committed(root) == [4]
    if rank == 0:
        steps_logged = [json.loads(x)["step"] for x in (tmp / "stop" / "metrics.jsonl").open()]
        assert steps_logged == [2, 4]
        assert (
            "stop signal SIGTERM (received by rank 1 of 2): checkpoint at step 4 saved; every "
            "rank exits with status 3 for requeue"
        ) in out.getvalue(), out.getvalue()
    train.train_step = real

    # The requeued run: a changed config is refused on both ranks before either builds a model.
    real_build, train.build_training = train.build_training, no_model
    try:
        train.run(small_cfg(tmp, "stop", "train.steps=20", "train.log_every=2", "optim.lr=0.01"))
    except ConfigError as e:
        assert str(e).startswith(
            f"resume: {tmp / 'stop'} has a checkpoint (step 4) of another config: "
            "optim.lr 0.003 -> 0.01; "
        ), str(e)
    else:
        raise AssertionError(f"rank {rank} resumed a changed config")
    finally:
        close_open()
        train.build_training = real_build
    # ... and the same config resumes on both ranks (the weights checked finite on each).
    assert (
        train.run(
            small_cfg(tmp, "stop", "train.steps=6", "optim.schedule_steps=20", "train.log_every=2")
        )
        == 0
    )
    assert committed(root) == [4, 6]


def test_stop_signal_to_one_rank_stops_both_at_the_same_step(tmp_path):
    run_distributed(_stop_one_rank, 2, str(tmp_path))

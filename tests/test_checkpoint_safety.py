"""Nothing loads wrongly, nothing good is pruned (issue #14): damaged checkpoints (flipped
bytes, a shard from another save, a deleted manifest, an emptied directory, flipped
`.metadata`, garbage config.yaml) are refused with one line naming the checkpoint; a full disk
says so; a non-finite loss stops the run without committing or pruning; the run directory is
checked and locked before the model is built. CPU; gloo with 2 processes where ranks differ.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from checkpoint import hashing, preflight, runlock, store
from checkpoint.config import CheckpointConfig
from errors import ConfigError, NonFiniteLossError
from model.config import ModelConfig
from model.flops import parameter_count
from runtime import host_id, launch
from tests.ckpt_harness import SMALL, Run, committed, two_checkpoints
from tests.distributed import run_distributed
from tests.helpers import CPU_ENV, FakeLoader
from tools.resume_guard_study import saved_item

#: model=tiny: conf/model/tiny.yaml holds the schema's defaults.
TINY = ModelConfig()

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

ROOT = Path(__file__).resolve().parents[1]


def _patch(path: Path, offset: int, new: bytes) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        f.write(new)


def _flip(path: Path, offset: int, n: int = 64) -> None:
    with path.open("rb") as f:
        f.seek(offset)
        old = f.read(n)
    _patch(path, offset, bytes(b ^ 0xFF for b in old))


def _refused(run_dir: Path, **kw) -> str:
    with pytest.raises(ConfigError) as e:
        Run(run_dir, **kw).train(6)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


# -- damaged checkpoints ---------------------------------------------------------------------


def test_flipped_bytes_are_refused_and_nothing_is_removed(tmp_path):
    root = two_checkpoints(tmp_path)
    path, offset, length = saved_item(root / "step_0000004", "model.lm_head.weight")
    before = path.read_bytes()
    _flip(path, offset + length // 2)
    msg = _refused(tmp_path)
    assert msg.startswith(f"checkpoint {root / 'step_0000004'} is damaged (file {path.name} fails")
    assert "check (corrupted)" in msg
    assert f"checkpoint.resume={root / 'step_0000002'}" in msg
    assert committed(root) == [2, 4] and path.read_bytes() != before  # refused, kept as is


def test_nan_weights_loaded_without_checksums_never_commit_or_prune(tmp_path):
    """The issue's sequence with checksum=false: NaN bytes in the newest checkpoint (which
    used to load, turn the loss nan, and commit the NaN weights over the last good checkpoint)
    are found right after the load (issue 28: named there, not as "lower optim.lr" at the
    first step); nothing is committed or pruned."""
    root = two_checkpoints(tmp_path, keep_last=2)
    path, offset, length = saved_item(root / "step_0000004", "model.lm_head.weight")
    _patch(path, offset + length // 2, b"\xff" * 64)  # fp32 NaNs
    msg = _refused(tmp_path, keep_last=2, checksum=False)
    assert msg == (
        f"checkpoint {root / 'step_0000004'} holds non-finite weights (nan or inf in "
        "model.lm_head.weight); pass "
        f"checkpoint.resume={root / 'step_0000002'} to resume from the previous complete "
        "checkpoint"
    )
    assert committed(root) == [2, 4]  # nothing committed, nothing pruned
    assert not list(root.glob("*.tmp"))


@pytest.mark.parametrize("checksum", [True, False])
def test_shard_from_another_save_is_refused(tmp_path, checksum):
    root = two_checkpoints(tmp_path)
    name = sorted(p.name for p in (root / "step_0000004").glob("*.distcp"))[0]
    shutil.copy(root / "step_0000002" / name, root / "step_0000004" / name)  # same size
    msg = _refused(tmp_path, checksum=checksum)
    assert f"checkpoint {root / 'step_0000004'} is damaged (file {name} does not belong" in msg


def test_deleted_manifest_and_emptied_checkpoint_are_refused(tmp_path):
    root = two_checkpoints(tmp_path)
    (root / "step_0000004" / store.MANIFEST).unlink()
    msg = _refused(tmp_path)
    assert f"checkpoint {root / 'step_0000004'} is damaged (manifest.json is missing" in msg
    assert f"checkpoint.resume={root / 'step_0000002'}" in msg
    for p in (root / "step_0000004").iterdir():
        p.unlink()
    msg = _refused(tmp_path)
    assert f"{root / 'step_0000004'} is damaged (the directory is empty" in msg
    # An explicit path to the damaged checkpoint says the same.
    msg = _refused(tmp_path, resume=str(root / "step_0000004"))
    assert "is damaged (the directory is empty" in msg
    # The previous one, named explicitly, resumes; the damaged one is moved aside.
    start, _ = Run(tmp_path, resume=str(root / "step_0000002")).train(3)
    assert start == 2 and committed(root) == [2, 3]
    assert len(list(root.glob("step_0000004.abandoned-*"))) == 1


@pytest.mark.parametrize("checksum", [True, False])
def test_flipped_metadata_is_refused(tmp_path, checksum):
    root = two_checkpoints(tmp_path)
    _flip(root / "step_0000004" / ".metadata", 0, 64)
    msg = _refused(tmp_path, checksum=checksum)
    damaged = f"checkpoint {root / 'step_0000004'} is damaged ("
    assert msg.startswith(
        damaged + ("file .metadata fails its" if checksum else ".metadata is unreadable")
    )


@pytest.mark.parametrize("checksum", [True, False])
def test_garbage_config_yaml_is_refused(tmp_path, checksum):
    root = two_checkpoints(tmp_path)
    cfg = root / "step_0000004" / store.CONFIG_FILE
    cfg.write_bytes(b"{" * cfg.stat().st_size)  # same size: only a hash or a parse sees it
    msg = _refused(tmp_path, checksum=checksum)
    assert msg.startswith(f"checkpoint {root / 'step_0000004'} is damaged (")
    if checksum:
        assert "file config.yaml fails its" in msg
    else:
        assert "config.yaml is not a readable config (" in msg


def test_hash_algorithm_follows_the_checkpoint(tmp_path, monkeypatch):
    """Without the xxhash package saves record CRC32; a checkpoint that records xxh3-64 then
    stops with one line saying what to install (it is not reported as damaged)."""
    monkeypatch.setattr(hashing, "xxhash", None)
    Run(tmp_path / "crc", interval=2).train(2)
    manifest = store.read_manifest(tmp_path / "crc" / "checkpoints" / "step_0000002")
    assert all("crc32" in e for e in manifest["files"].values())
    monkeypatch.undo()
    start, _ = Run(tmp_path / "crc", interval=2).train(3)  # CRC32 verifies anywhere
    assert start == 2
    if hashing.xxhash is not None:
        Run(tmp_path / "xxh", interval=2).train(2)
        monkeypatch.setattr(hashing, "xxhash", None)
        with pytest.raises(ConfigError) as e:
            Run(tmp_path / "xxh", interval=2).train(3)
        assert "records xxh3-64 hashes but the xxhash package is not installed" in str(e.value)
        assert "damaged" not in str(e.value)


def test_bad_checkpoint_fields_are_one_line():
    from checkpoint.config import validate
    from tests.ckpt_harness import ckpt_cfg

    for kw, match in (
        (dict(when_busy="later"), "checkpoint.when_busy='later' is not one of defer, skip, wait"),
        (dict(staging_buffers=3), "checkpoint.staging_buffers=3 must be 1 or 2"),
        (dict(write_threads=0), r"checkpoint.write_threads=0 must be in 1..64"),
    ):
        with pytest.raises(ConfigError, match=match):
            validate(ckpt_cfg(**kw))


def test_store_layout_checks(tmp_path):
    root = two_checkpoints(tmp_path)
    (root / "step_0000009").mkdir()
    assert [c.step for c in store.list_steps(root)] == [2, 4, 9]
    assert store.newest_step(root).step == 9 and committed(root) == [2, 4]
    assert store.verify(root / "step_0000004") is None
    manifest = store.read_manifest(root / "step_0000004")
    data = [n for n in manifest["files"] if n.endswith(".distcp")]
    assert manifest["save_id"] and data
    for name in data:  # every data file ends with the trailer of its save
        tail = (root / "step_0000004" / name).read_bytes()[-store.TRAILER_SIZE :]
        assert tail == store.trailer(manifest["save_id"], name)


# -- a full disk ------------------------------------------------------------------------------


def _committed_soon(root: Path, step: int, timeout: float = 120.0) -> None:
    deadline = time.time() + timeout
    while step not in committed(root):
        assert time.time() < deadline, f"step {step} was not committed"
        time.sleep(0.01)


def _full_disk_after(monkeypatch, budget: list[int]):
    import checkpoint.writer as writer

    def writev(fd, buffers):
        n = sum(len(b) for b in buffers)
        if budget[0] < n:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        budget[0] -= n
        return os.writev(fd, buffers)

    monkeypatch.setattr(writer, "_os_writev", writev)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_full_disk_says_so_and_keeps_what_was_saved(tmp_path, monkeypatch, mode):
    budget = [10**12]
    _full_disk_after(monkeypatch, budget)

    def on_step(step):
        if step == 2:
            _committed_soon(tmp_path / "checkpoints", 2)
            budget[0] = 1_000_000  # the save of step 4 runs out of space

    run = Run(tmp_path, mode=mode)
    with pytest.raises(ConfigError) as e:
        run.train(8, on_step=on_step)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("checkpoint save of step 4 failed: no space left on device under ")
    # Sizes in the unit that shows them (the tiny model's checkpoint: a few MiB), not "0.0 GiB".
    assert re.search(r"\(\d+\.\d [KMGT]iB free; this checkpoint needs about \d+\.\d [KM]iB, ", msg)
    assert "0.0 GiB" not in msg and "nothing was committed" in msg
    root = tmp_path / "checkpoints"
    assert committed(root) == [2] and not list(root.glob("*.tmp"))


# -- non-finite losses ------------------------------------------------------------------------


def _nan_at(bad_step: int):
    def corrupt(step, loss):
        return loss * float("nan") if step == bad_step else loss

    return corrupt


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_nan_loss_between_log_steps_stops_before_the_save(tmp_path, mode):
    """Step 5's loss alone is nan (later ones are finite): the per-step flag stops the save of
    step 6, which would hold the weights that step produced."""
    run = Run(tmp_path, mode=mode, keep_last=2)
    with pytest.raises(NonFiniteLossError, match=r"not finite \(nan or inf\) at step 5; "):
        run.train(10, corrupt=_nan_at(5))
    root = tmp_path / "checkpoints"
    assert committed(root) == [2, 4] and not list(root.glob("*.tmp"))


def test_nan_loss_at_a_log_step_stops_the_run(tmp_path):
    run = Run(tmp_path, mode="async", interval=4)
    with pytest.raises(NonFiniteLossError, match="at step 3; training stopped at step 3"):
        run.train(10, corrupt=_nan_at(3), log_every=1)
    assert committed(tmp_path / "checkpoints") == []


def test_train_py_nan_loss_is_one_line_and_never_commits(tmp_path, monkeypatch):
    """train.run with a step that poisons the weights (what a diverging step does): the run
    raises NonFiniteLossError (train.py prints it as `error: ...`) and the checkpoints are
    those of the good steps only."""
    import train
    from config import compose_config

    original, calls = train.train_step, [0]

    def poisoned(model, *args, **kwargs):
        loss, norm = original(model, *args, **kwargs)
        calls[0] += 1
        if calls[0] == 5:
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(float("nan"))
        return loss, norm

    monkeypatch.setattr(train, "train_step", poisoned)
    cfg = compose_config(
        [
            f"run.root={tmp_path}",
            "run.name=nan",
            "train.steps=12",
            "train.log_every=5",
            "checkpoint=async",
            "checkpoint.interval=2",
            "checkpoint.keep_last=2",
            "train.device=cpu",
            *SMALL,
        ]
    )
    with pytest.raises(NonFiniteLossError) as e:
        train.run(cfg)
    assert "at step 6" in str(e.value) and "\n" not in str(e.value)
    root = tmp_path / "nan" / "checkpoints"
    assert committed(root) == [2, 4]  # step 6 (nan weights) never saved, 4 never pruned
    assert not (tmp_path / "nan" / runlock.LOCK_NAME).exists()  # released


# -- run directory: writable, room, lock ------------------------------------------------------


def _train_py(tmp: Path, name: str, *overrides: str, wait: bool = True, root: str | None = None):
    args = [f"run.root={root or tmp}", f"run.name={name}", *SMALL, *overrides]
    if wait:
        return launch(args, env=CPU_ENV, timeout=600)
    return subprocess.Popen(  # still running when this returns: the caller kills or waits
        [sys.executable, "train.py", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **CPU_ENV},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def test_unwritable_root_and_no_room_fail_before_the_model(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    r = _train_py(tmp_path, "x", root=str(blocker / "runs"))
    assert r.returncode == 2, r.stderr[-2000:]
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: run.root={blocker / 'runs'}: cannot write to ")
    assert "model tiny" not in r.stdout  # refused before the model was built
    # 10 million layers: far more than any disk; refused in the config step, not by an OOM.
    r = _train_py(tmp_path, "y", "model.n_layers=10000000", "checkpoint=sync")
    assert r.returncode == 2, r.stderr[-2000:]
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("error: checkpoint.dir=checkpoints: ") and "need about" in line
    assert "model tiny" not in r.stdout


def test_a_directory_that_cannot_be_created_says_so_for_root_too(tmp_path):
    """/proc lets nobody create directories; os.access lets root through, so the reason must
    come from trying (a probe, removed again), never from /proc's free space."""
    if os.geteuid() == 0:  # root: os.access says yes, mkdir says no
        reason = "creating a directory in /proc fails: No such file or directory"
    else:
        reason = "Permission denied in /proc"
    for root, ck_dir, field, path in (
        ("/proc/nope", "checkpoints", "run.root=/proc/nope", "/proc/nope/tiny-bf16-fsdp"),
        (str(tmp_path), "/proc/x", "checkpoint.dir=/proc/x", "/proc/x"),
    ):
        ck = CheckpointConfig(mode="sync", dir=ck_dir)
        with pytest.raises(ConfigError) as e:
            preflight.check_run_dir(root, "tiny-bf16-fsdp", ck, TINY, False, 1)
        assert str(e.value) == (
            f"{field}: cannot write to {path} ({reason}); choose a writable directory"
        )
    assert not any(tmp_path.iterdir())  # the probes are gone, no run directory was made
    sync = CheckpointConfig(mode="sync")
    preflight.check_run_dir(str(tmp_path), "tiny-bf16-fsdp", sync, TINY, False, 1)  # passes,
    assert not any(tmp_path.iterdir())  # and leaves nothing either


def test_preflight_checks_space_and_host_memory(tmp_path, monkeypatch):
    run_dir_args = (str(tmp_path), "p", CheckpointConfig(mode="async"), TINY, False)
    need = preflight.estimate_checkpoint_bytes(TINY)
    assert need == parameter_count(TINY) * 12
    free = [0]
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1, 1, free[0]))
    # keep_last (2) checkpoints kept while the next one is written: room for 3 is needed.
    free[0] = 3 * need - 1
    with pytest.raises(ConfigError) as e:
        preflight.prepare_run_dir(*run_dir_args, 0, 1)
    assert str(e.value) == (
        f"checkpoint.dir=checkpoints: {tmp_path / 'p' / 'checkpoints'} has "
        f"{preflight.format_bytes(3 * need - 1)} free, 3 more checkpoints of model tiny need "
        f"about {preflight.format_bytes(3 * need)} ({preflight.format_bytes(need)} each: "
        f"{parameter_count(TINY) / 1e6:.1f}M parameters x 12 bytes; "
        "checkpoint.keep_last=2 kept plus the one being written); free space, lower "
        "checkpoint.keep_last or point checkpoint.dir to a larger filesystem"
    )
    assert "MiB" in str(e.value) and "0.0 GiB" not in str(e.value)  # the tiny model: ~13 MiB
    free[0] = 3 * need
    _, lock = preflight.prepare_run_dir(*run_dir_args, 0, 1)
    lock.release()
    # Checkpoints already there take no more room: with two of them, room for one more will do.
    for step in (2, 4):
        d = tmp_path / "p" / "checkpoints" / store.step_name(step)
        d.mkdir(parents=True)
        (d / store.MANIFEST).write_text("{}")
    free[0] = need - 1
    with pytest.raises(ConfigError, match=r" free, 1 more checkpoint of model tiny needs about"):
        preflight.prepare_run_dir(*run_dir_args, 0, 1)
    free[0] = need
    _, lock = preflight.prepare_run_dir(*run_dir_args, 0, 1)
    lock.release()
    monkeypatch.undo()
    assert [preflight.format_bytes(n) for n in (0, 1023, 1024, 5 * 2**20, 3 * 2**30)] == [
        "0 B",
        "1023 B",
        "1.0 KiB",
        "5.0 MiB",
        "3.0 GiB",
    ]
    monkeypatch.setattr(preflight.staging, "host_memory_available", lambda: need // 2)
    with pytest.raises(ConfigError, match="staging this node's share of a checkpoint needs"):
        preflight.prepare_run_dir(*run_dir_args, 0, 1)
    monkeypatch.undo()
    run_dir, lock = preflight.prepare_run_dir(*run_dir_args, 0, 1)
    assert run_dir == tmp_path / "p" and lock.held()
    lock.release()
    assert not (run_dir / runlock.LOCK_NAME).exists()


def test_llama3_1b_estimate_matches_the_measured_checkpoint():
    from config import compose_config
    from model.llama import Llama

    for overrides in (["model=tiny"], ["model=tiny", "model.tie_embeddings=true"]):
        m = compose_config(overrides).model
        with torch.device("meta"):
            built = sum(p.numel() for p in Llama(m).parameters())
        assert parameter_count(m) == built, overrides
    cfg = compose_config(["model=llama3_1b"])
    n = parameter_count(cfg.model)
    assert 1.23e9 < n < 1.24e9  # Llama 3.2 1B
    gib = preflight.estimate_checkpoint_bytes(cfg.model) / 2**30
    assert abs(gib - 14.1) < 0.5  # issue #14 measured 14.1 GiB


def _lock_file(run_dir: Path, **info) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / runlock.LOCK_NAME
    path.write_text(json.dumps({"started": time.time() - 60, **info}))
    return path


def test_lock_refuses_live_holders_and_takes_over_stale_ones(tmp_path):
    messages: list[str] = []
    here = host_id()  # this host and pid namespace
    # Another host, heartbeat fresh: refused with the holder named.
    path = _lock_file(tmp_path / "a", host="node-17", pid=4242, token="x")
    with pytest.raises(ConfigError, match=r"in use by another run \(host node-17, pid 4242, "):
        runlock.RunLock.acquire(tmp_path / "a", log=messages.append)
    # The same, silent for longer than STALE_S: taken over, with a line saying whose and why.
    old = time.time() - runlock.STALE_S - 10
    os.utime(path, (old, old))
    lock = runlock.RunLock.acquire(tmp_path / "a", log=messages.append)
    assert lock.held() and "node-17" in messages[-1] and "heartbeat stopped" in messages[-1]
    lock.release()
    # This host, a pid that is gone: taken over at once.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _lock_file(tmp_path / "b", host=here, pid=dead.pid, token="y")
    lock = runlock.RunLock.acquire(tmp_path / "b", log=messages.append)
    assert f"pid {dead.pid}" in messages[-1] and "no longer running" in messages[-1]
    # A second acquire while held by a live process on this host (a child of ours).
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _lock_file(tmp_path / "c", host=here, pid=alive.pid, token="z")
        with pytest.raises(ConfigError, match=f"pid {alive.pid}, started "):
            runlock.RunLock.acquire(tmp_path / "c")
    finally:
        alive.kill()
        alive.wait()
    lock.release()
    # A lock file being written (unreadable, just created) is not stale.
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / runlock.LOCK_NAME).write_text("")
    with pytest.raises(ConfigError, match="a run that is starting"):
        runlock.RunLock.acquire(tmp_path / "d")


def test_two_train_py_started_at_once_one_refuses_then_a_stale_lock_is_taken_over(tmp_path):
    long = ["train.steps=100000", "train.log_every=50", "checkpoint=none"]
    procs = [_train_py(tmp_path, "same", *long, wait=False) for _ in range(2)]
    try:
        deadline = time.time() + 300
        while all(p.poll() is None for p in procs):
            assert time.time() < deadline, "neither run refused"
            time.sleep(0.2)
        loser = next(p for p in procs if p.poll() is not None)
        winner = next(p for p in procs if p is not loser)
        assert winner.poll() is None, "both runs exited"
        out, err = loser.communicate(timeout=60)
        assert loser.returncode == 2, err[-3000:]
        line = err.strip().splitlines()[-1]
        assert line.startswith(f"error: run directory {tmp_path / 'same'} is in use by another ")
        assert f"pid {winner.pid}, started " in line and "model tiny" not in out
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # the session this test started
            p.wait()
    lock = tmp_path / "same" / runlock.LOCK_NAME
    assert json.loads(lock.read_text())["pid"] == winner.pid  # left behind by the kill
    r = _train_py(tmp_path, "same", "train.steps=3", "train.log_every=1", "checkpoint=none")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"took over the stale lock of {lock}" in r.stdout
    assert f"pid {winner.pid}" in r.stdout and "no longer running" in r.stdout
    steps = [json.loads(x)["step"] for x in (tmp_path / "same" / "metrics.jsonl").open()]
    assert steps == [1, 2, 3] and not lock.exists()


# -- two ranks ----------------------------------------------------------------------------------


def _two_rank_cases(rank, world_size, tmp):
    import checkpoint.writer as writer

    tmp = Path(tmp)

    def run(sub, **kw):
        return Run(tmp / sub, loader=FakeLoader(rank, world_size), **kw)

    # A flipped byte in a file that rank 1 verifies: both ranks refuse with the same line.
    run("damaged").train(4)
    root = tmp / "damaged" / "checkpoints"
    manifest = store.read_manifest(root / "step_0000004")
    name = sorted(manifest["files"])[1]  # rank 1's share: names[1::2]
    if rank == 0:
        _flip(root / "step_0000004" / name, manifest["files"][name]["size"] // 2, 8)
    torch.distributed.barrier()
    try:
        run("damaged").train(6)
    except ConfigError as e:
        assert f"is damaged (file {name} fails its" in str(e), str(e)
    else:
        raise AssertionError("a damaged checkpoint loaded")

    # A nan loss on rank 1 alone: both ranks stop before the save of step 6.
    try:
        run("nan", mode="async").train(8, corrupt=_nan_at(5) if rank == 1 else None)
    except NonFiniteLossError as e:
        assert "at step 5" in str(e)
    else:
        raise AssertionError(f"a nan loss on rank 1 did not stop rank {rank}")
    torch.distributed.barrier()  # rank 0 commits the saves in flight before it raises
    assert committed(tmp / "nan" / "checkpoints") == [2, 4]

    # A full disk seen by rank 1 alone: both ranks report it, nothing is committed.
    budget = [10**12]
    if rank == 1:
        original = writer._os_writev

        def writev(fd, buffers):
            n = sum(len(b) for b in buffers)
            if budget[0] < n:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            budget[0] -= n
            return original(fd, buffers)

        writer._os_writev = writev

    def on_step(step):
        if step == 2:
            _committed_soon(tmp / "full" / "checkpoints", 2)
            budget[0] = 100_000

    try:
        run("full", mode="async").train(8, on_step=on_step)
    except ConfigError as e:
        assert "checkpoint save of step 4 failed: no space left on device" in str(e), str(e)
    else:
        raise AssertionError(f"a full disk on rank 1 went unnoticed on rank {rank}")
    torch.distributed.barrier()
    assert committed(tmp / "full" / "checkpoints") == [2]
    assert not list((tmp / "full" / "checkpoints").glob("*.tmp"))


def test_two_ranks_fail_together(tmp_path):
    run_distributed(_two_rank_cases, 2, str(tmp_path))

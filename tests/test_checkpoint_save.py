"""checkpoint/save.py on its own: a `Saver` driven directly (the loss check before each save,
save -> commit -> prune in that order, the pruning hold), `InFlight` settling saves in order
and raising the first failure, `Committer.failure`'s lines and `stopped_line`, without a
CheckpointManager around them. The end-to-end save tests (modes, busy writers, Ctrl-C) are
test_checkpoint.py's, test_checkpoint_async.py's and test_checkpoint_silent.py's.
"""

from __future__ import annotations

import errno
import json
from concurrent.futures import Future
from pathlib import Path

import pytest

from checkpoint import store
from checkpoint.context import SAVES_LOG, Context
from checkpoint.save import (
    Committer,
    InFlight,
    Saver,
    SaveRecords,
    _Pending,
    stopped_line,
)
from errors import ConfigError
from tests.ckpt_harness import Run, ckpt_cfg, committed


def _context(run_dir: Path, messages: list[str], **cfg) -> Context:
    return Context.create(ckpt_cfg(**cfg), run_dir, 0, 1, messages.append, None)


@pytest.fixture(scope="module")
def state(tmp_path_factory):
    """A tiny training state (tests/ckpt_harness.py's, not trained) and its train state."""
    run = Run(tmp_path_factory.mktemp("state"))
    run.ckpt.close()
    return run.state, run.train_state


def test_saver_checks_losses_then_commits_then_prunes(tmp_path, state):
    parts, train = state
    messages: list[str] = []
    checked: list[int] = []
    saver = Saver(
        _context(tmp_path, messages, interval=1, keep_last=2), check_finite=checked.append
    )
    saver.start()
    try:
        for step in range(1, 5):
            train.step = step
            assert saver.maybe_save(step, parts)["save_blocking_s"] > 0
            assert saver.maybe_save(step, parts) is None  # saved at this step already
            assert saver.stats()["save_step"] == step
        saver.finish(4, parts)  # just saved: no second save of step 4
    finally:
        saver.close()
    assert checked == [1, 2, 3, 4]  # before each save
    root = tmp_path / "checkpoints"
    assert committed(root) == [3, 4]
    events = [m.split(" ")[0] for m in messages if m.startswith(("step ", "pruned "))]
    assert [m for m in messages if " committed to " in m][0].startswith("step 1 committed")
    # each save commits before anything is pruned; step_1 goes once step 3 is committed
    first_prune = next(i for i, m in enumerate(messages) if m.startswith("pruned "))
    assert "step_0000001" in messages[first_prune]
    assert any(m.startswith("step 3 committed") for m in messages[:first_prune]), events
    saved = [json.loads(x) for x in (tmp_path / SAVES_LOG).read_text().splitlines()]
    assert [r["save_step"] for r in saved if r["event"] == "saved"] == [1, 2, 3, 4]


def test_pruning_keeps_the_newest_confirmed_checkpoint_while_newer_are_unconfirmed(tmp_path, state):
    """The record on disk (store.UNCONFIRMED: a resume from step 2 not judged yet) is read at
    every prune: keep_last=1 keeps the newest, and step 1, the newest checkpoint older than
    the unconfirmed ones, stays too; once the record is gone, the next prune removes it."""
    parts, train = state
    saver = Saver(_context(tmp_path, [], interval=1, keep_last=1), check_finite=lambda s: None)
    saver.start()
    root = tmp_path / "checkpoints"
    root.mkdir()
    store.write_unconfirmed(root, {"resumed_from": 2})
    try:
        for step in range(1, 5):
            train.step = step
            saver.save(step, parts)
        saver.committer.wait_pruned()
        assert committed(root) == [1, 4]  # 2 and 3 pruned: unconfirmed, not the fallback
        assert store.clear_unconfirmed(root) and not store.clear_unconfirmed(root)
        saver.committer.prune_again()
        saver.committer.wait_pruned()
        assert committed(root) == [4]
    finally:
        saver.close()


def _pending(step: int, future: Future) -> _Pending:
    return _Pending(step, future, 0.0, 0.1, 0.0, {"drain_s": 0.0}, 100, step % 2)


def _done(step: int) -> Future:
    f: Future = Future()
    f.set_result({"write_start": 0.2, "write_s": 0.1, "times": {}})
    return f


def test_in_flight_settles_in_order_and_raises_the_first_failure(tmp_path):
    ctx = _context(tmp_path, [])
    records = SaveRecords(ctx)
    flight = InFlight(ctx, records, Committer(ctx, None))
    late: Future = Future()
    flight.add(_pending(1, _done(1)))
    flight.add(_pending(2, late))
    flight.add(_pending(3, _done(3)))
    assert flight.busy() == 1 and flight.running_steps() == {2} and flight.busy_buffers() == {0}
    flight.poll()  # step 1 only: step 3 waits behind the unfinished step 2
    assert [p.step for p in flight.pending] == [2, 3]
    assert records.take_newest()["save_step"] == 1 and records.take_newest() == {}
    late.set_result({"write_start": 0.2, "write_s": 0.1, "times": {}})
    flight.wait_all()
    assert not flight and records.take_newest()["save_step"] == 3

    failed: Future = Future()
    failed.set_exception(ValueError("boom"))
    after: Future = Future()
    after.set_result({"write_start": 0.2, "write_s": 0.1, "times": {}})
    flight.add(_pending(5, failed))
    flight.add(_pending(6, after))
    assert flight.failed()
    flight.poll()  # a failure is raised where every rank raises it, not by poll
    assert len(flight.pending) == 2
    with pytest.raises(RuntimeError, match="checkpoint save of step 5 failed: ValueError: boom"):
        flight.wait_while(lambda: True)
    assert not flight  # the saves behind it ended, their outcome not raised


def test_committer_failure_lines(tmp_path):
    ctx = _context(tmp_path, [])
    committer = Committer(ctx, None)
    tmp = tmp_path / "checkpoints" / "step_0000003.tmp"
    tmp.mkdir(parents=True)
    full = committer.failure(3, tmp, OSError(errno.ENOSPC, "No space left on device"), 2**20)
    assert isinstance(full, ConfigError) and not tmp.exists()  # rank 0 gives the space back
    assert "no space left on device under" in str(full) and "1.0 MiB of it from rank 0" in str(full)
    readonly = committer.failure(3, tmp, OSError(errno.EROFS, "Read-only file system"), 1)
    assert isinstance(readonly, ConfigError) and "writable" in str(readonly)
    other = committer.failure(3, tmp, ValueError("boom"), 1)
    assert type(other) is RuntimeError
    assert str(other) == "checkpoint save of step 3 failed: ValueError: boom"


def test_stopped_line(tmp_path):
    root = tmp_path / "checkpoints"
    assert stopped_line(root, 3, []) == (
        f"stopped at once after step 3; no checkpoint committed in {root}; steps 1-3 not saved"
    )
    (root / store.step_name(2)).mkdir(parents=True)
    assert stopped_line(root, 5, [4]) == (
        f"stopped at once after step 5; checkpoint {root / store.step_name(2)} committed; "
        "steps 3-5 not saved (the save of step 4 in flight was abandoned); run the same "
        "command to resume from it"
    )
    assert stopped_line(root, 2, []).endswith(
        f"checkpoint {root / store.step_name(2)} committed; run the same command to resume from it"
    )

"""A run that diverges stops (issue 55, item 3; divergence.py): issue 55's run at lr 1e3 (one
thread: losses 5.56, 3.23e4, 2.16e5, then, on that CPU's AVX2 kernels, 5.5530 with a gradient
norm of exactly 0; on AVX-512 kernels NaN at step 3) trained on and saved step 8. Now it stops
in one line at its first check after the blow-up (a log step, or the save before which every
loss is checked), naming the step and the learning rate, with nothing of it saved; a dead
model stops too (tests/harness/zero_weights.py: every weight 0, a dead model on any CPU);
2 ranks stop alike; train.divergence_ratio=0 gives the old behaviour. The rule's own numbers:
synthetic. Steps 1 and 2 of the lr-1e3 run are finite on every CPU measured (the blow-up is
at step 2); what follows depends on the CPU's kernels, so the tests read no later step."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from checkpoint import store
from divergence import Divergence, StepStats
from errors import ConfigError
from runlog import read_metrics
from runtime import launch
from tests.helpers import CPU_ENV

#: Issue 55's run: lr 1e3 for 8 steps of 8 sequences of 64 tokens.
DIVERGING = [
    "model=tiny",
    "data.seq_len=64",
    "train.global_batch_size=8",
    "train.steps=8",
    "optim.lr=1e3",
    "checkpoint=sync",
    "train.device=cpu",
]
HINT = (
    "the learning rate is the likely cause: lower optim.lr (now 1000) or lengthen "
    "optim.warmup_steps, and start again; train.divergence_ratio=0 turns this check off"
)


def _run(tmp: Path, name: str, *args: str, nproc: int = 1):
    return launch(
        [f"run.root={tmp}", f"run.name={name}", *DIVERGING, *args],
        nproc=nproc,
        env=CPU_ENV,
        timeout=300,
    )


def _errors(r) -> list[str]:
    return [x for x in (r.stdout + r.stderr).splitlines() if x.startswith("error:")]


@pytest.fixture(scope="module")
def unchecked_run(tmp_path_factory):
    """The run with the check off, every step logged: (the finished process, its metrics
    records, its saved steps): the reference of the lines below."""
    tmp = tmp_path_factory.mktemp("unchecked")
    r = _run(tmp, "u", "train.divergence_ratio=0", "train.log_every=1")
    saved = [c.step for c in store.list_complete(tmp / "u" / "checkpoints")]
    return r, read_metrics(tmp / "u" / "metrics.jsonl"), saved


@pytest.fixture
def unchecked(unchecked_run):
    """step -> (loss, grad norm) of the unchecked run."""
    return {x["step"]: (x["loss"], x["grad_norm"]) for x in unchecked_run[1]}


def test_the_unchecked_run_blows_up_and_only_nan_would_stop_it(unchecked_run, unchecked):
    """What main did, as issue 55 measured it: the loss at step 2 is thousands of times step
    1's, and nothing but a non-finite loss stops the run. On issue 55's kernels it trained on
    to a dead model and saved step 8; on AVX-512 kernels it turns NaN at step 3, which the
    non-finite check stops (status 2, nothing saved)."""
    r, _, saved = unchecked_run
    assert unchecked[2][0] > 1000 * unchecked[1][0], unchecked
    if r.returncode == 0:
        assert "done: step 8" in r.stdout and saved == [8], r.stdout + r.stderr
        dead = min(s for s in unchecked if all(unchecked[t][1] == 0.0 for t in range(s, 9)))
        assert dead <= 6 and len({unchecked[s][0] for s in range(dead, 9)}) == 1  # flat
    else:
        assert r.returncode == 2 and saved == [], r.stdout + r.stderr
        assert _errors(r)[0].startswith("error: the loss is not finite (nan or inf) at step ")


@pytest.mark.parametrize("log_every, interval", [(1, 4), (10, 2)])
def test_a_diverged_run_stops_before_a_checkpoint_of_it_is_saved(
    tmp_path, unchecked, unchecked_run, log_every, interval
):
    """log_every=1: the check at step 2's log step; log_every=10 (the default): the check
    before step 2's save (checkpoint.interval=2) sees the largest loss of steps 1-2."""
    r = _run(tmp_path, "d", f"train.log_every={log_every}", f"checkpoint.interval={interval}")
    assert r.returncode == 2, r.stdout + r.stderr
    first = unchecked[1][0]
    if log_every == 1:
        level, saved = f"its recent level {first:.4g}", " after step 1"
    else:
        level, saved = f"the level of its first step {first:.4g}", ""
    peak = unchecked[2][0]
    assert _errors(r) == [
        f"error: the run diverged: the loss reached {peak:.4g} at step 2, "
        f"{peak / first:.3g} times {level} (a stop above train.divergence_ratio=3 times it); "
        f"training stopped at step 2 and nothing{saved} was saved (newest checkpoint: "
        f"none); {HINT}"
    ]
    assert "Traceback" not in r.stderr
    assert store.list_complete(tmp_path / "d" / "checkpoints") == []
    metrics = tmp_path / "d" / "metrics.jsonl"
    logged = [x["step"] for x in read_metrics(metrics)] if metrics.exists() else []
    assert logged == ([1, 2] if log_every == 1 else [])
    if log_every == 1:  # tools/divergence_study.py judges the unchecked run as the run did
        from tools.divergence_study import judge

        study = judge(unchecked_run[1][:2], every=1)
        assert study["stop"] == 2 and _errors(r)[0].startswith(f"error: {study['line']}; ")


def test_a_dead_model_stops(tmp_path):
    """A gradient norm of exactly 0 for 3 steps with a flat loss stops the run at the third
    (every weight 0: tests/harness/zero_weights.py)."""
    r = launch(
        [f"run.root={tmp_path}", "run.name=z", *DIVERGING, "train.log_every=1"],
        env=CPU_ENV,
        timeout=300,
        program=("tests/harness/zero_weights.py",),
    )
    assert r.returncode == 2, r.stdout + r.stderr
    logged = read_metrics(tmp_path / "z" / "metrics.jsonl")
    assert [(x["step"], x["grad_norm"]) for x in logged] == [(1, 0.0), (2, 0.0), (3, 0.0)]
    flat = {x["loss"] for x in logged}
    assert len(flat) == 1
    assert _errors(r) == [
        f"error: the model stopped learning: its gradient norm was exactly 0 at steps 1-3 "
        f"with the loss flat at {flat.pop():.4f} (a dead model: its weights saturated, usually "
        f"after a blow-up); training stopped at step 3 and nothing after step 2 was saved "
        f"(newest checkpoint: none); {HINT}"
    ]


def test_two_ranks_stop_at_the_same_step_with_one_line(tmp_path):
    """Each rank's largest loss, over both ranks (an all-gather with the non-finite flag's):
    both stop after step 2, rank 0 says it."""
    r = _run(tmp_path, "two", "train.log_every=1", nproc=2)
    assert r.returncode == 1, r.stdout + r.stderr  # torchrun's status for failed workers
    said = _errors(r)
    assert len(said) == 1, r.stdout + r.stderr
    assert re.fullmatch(
        r"error: the run diverged: the loss reached [\d.e+]+ at step 2, [\d.e+]+ times its "
        r"recent level 5\.\d+ \(a stop above train\.divergence_ratio=3 times it\); training "
        rf"stopped at step 2 and nothing after step 1 was saved \(newest checkpoint: none\); "
        rf"{re.escape(HINT)}",
        said[0],
    ), said[0]
    assert [x["step"] for x in read_metrics(tmp_path / "two" / "metrics.jsonl")] == [1, 2]


def test_a_resume_that_diverges_keeps_the_checkpoint_it_resumed(tmp_path):
    """A run resumed from its step-4 checkpoint at lr 1e3 (accepted on purpose) blows up at
    step 6: it stops there; step 4 stays the newest checkpoint, which the line names as the
    way back (with a lower lr)."""
    same = ["train.log_every=1", "checkpoint.interval=4", "optim.schedule_steps=8"]
    r = _run(tmp_path, "g", *same, "optim.lr=3e-3", "train.steps=4")
    assert r.returncode == 0, r.stdout + r.stderr
    r = _run(tmp_path, "g", *same, "resume.accept=[optim.lr]")
    assert r.returncode == 2, r.stdout + r.stderr
    root = tmp_path / "g" / "checkpoints"
    said = _errors(r)
    assert len(said) == 1 and re.fullmatch(
        r"error: the run diverged: the loss reached [\d.e+]+ at step 6, [\d.e+]+ times its "
        r"recent level [\d.]+ \(a stop above train\.divergence_ratio=3 times it\); training "
        rf"stopped at step 6 and nothing after step 5 was saved \(newest checkpoint: "
        rf"{re.escape(str(root / 'step_0000004'))}\); the learning rate is the likely cause: "
        r"lower optim\.lr \(now 1000\) or lengthen optim\.warmup_steps, and resume from that "
        r"checkpoint with resume\.accept=\[optim\]; train\.divergence_ratio=0 turns this "
        r"check off",
        said[0],
    ), said[0]
    assert [c.step for c in store.list_complete(root)] == [4]


def _stats(peak=None, peak_step=None, first=5.5, dead=0, dead_from=0, dead_loss=0.0):
    return StepStats(peak, peak_step, first, dead, dead_from, dead_loss)


def test_the_rule_on_synthetic_numbers():
    rule = Divergence(ratio=3.0, lr=3e-3)
    # Before any logged loss the first step's loss is the level.
    assert rule.judge(1, _stats(peak=16.4, peak_step=1, first=5.5)) is None  # 2.98 times
    assert "16.6 at step 4, 3.02 times the level of its first step 5.5" in rule.judge(
        4, _stats(peak=16.6, peak_step=4, first=5.5)
    )
    # The level: the lowest median of 8 consecutive logged losses so far.
    for loss in (5.5, 5.0, 4.0, 3.0, 2.9, 2.8, 2.7, 2.6, 2.5, 6.0, 7.0, 8.0, 9.0):
        rule.logged(loss)
    assert rule.level == pytest.approx(2.85)  # steps 2-9 (not the later, higher ones)
    assert rule.judge(20, _stats(peak=8.5, peak_step=17)) is None  # 2.98 times
    assert "8.6 at step 17, 3.02 times its recent level 2.85" in rule.judge(
        20, _stats(peak=8.6, peak_step=17)
    )
    rule.logged(math.nan)  # not a level (the non-finite check has its own line)
    assert rule.level == pytest.approx(2.85)
    # Near a loss of 0 a ratio says little: 1 nat above the level at least.
    low = Divergence(ratio=3.0, lr=1.0)
    low.logged(0.1)
    assert low.judge(2, _stats(peak=1.09, peak_step=2)) is None
    assert low.judge(2, _stats(peak=1.11, peak_step=2)) is not None
    # A dead model: 3 steps of a gradient norm of exactly 0 with a flat loss.
    assert rule.judge(9, _stats(dead=2, dead_from=7, dead_loss=5.553)) is None
    assert rule.judge(9, _stats(dead=3, dead_from=7, dead_loss=5.553)) == (
        "the model stopped learning: its gradient norm was exactly 0 at steps 7-9 with the "
        "loss flat at 5.5530 (a dead model: its weights saturated, usually after a blow-up)"
    )
    assert Divergence(ratio=0, lr=1.0).judge(9, _stats(peak=1e9, peak_step=1, dead=9)) is None


def test_the_ratio_must_be_above_one_or_zero():
    from config import TrainConfig

    TrainConfig(divergence_ratio=0).validate()
    TrainConfig(divergence_ratio=1.5).validate()
    with pytest.raises(ConfigError) as e:
        TrainConfig(divergence_ratio=0.5).validate()
    assert str(e.value) == (
        "train.divergence_ratio=0.5 must be above 1 (a loss that many times the run's recent "
        "level stops it) or 0 (no divergence check)"
    )

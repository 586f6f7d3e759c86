"""Damage the checks cannot see, and a finished run asked for fewer steps (issue 37): a
checkpoint with non-finite optimizer state (its hash rewritten to match) is refused at the
load with the previous checkpoint as the way out; a file the manifest does not list, and a
manifest whose step disagrees with the directory name or the train state, are refused naming
where each number comes from; a run with nothing to train writes nothing. CPU, model=tiny.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import signal
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch

from checkpoint import store
from checkpoint.manager import close_open
from errors import ConfigError
from runlog import read_metrics
from tests.ckpt_harness import Run, committed, previous_hint, refused, small_cfg, two_checkpoints
from tools.resume_guard_study import rewrite_hash, rewrite_tensor, saved_item

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _snapshot(run_dir: Path) -> dict[str, str]:
    return {
        str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file()
    }


# -- 1. a finished run asked for fewer steps ------------------------------------------------------


def test_finished_run_asked_for_fewer_steps_writes_nothing(tmp_path, monkeypatch):
    """It used to print "nothing to do", then commit step_0000002 holding the step-4 state (a
    checkpoint that could never be loaded). Now nothing is built, loaded or written."""
    import train

    ck = ["checkpoint=sync", "checkpoint.interval=2", "checkpoint.keep_last=3"]
    assert train.run(small_cfg(tmp_path, "r", "train.steps=4", *ck)) == 0
    root = tmp_path / "r" / "checkpoints"
    assert committed(root) == [2, 4]
    before = _snapshot(tmp_path / "r")

    def no_model(*a, **k):
        raise AssertionError("a run with nothing to train built its model")

    monkeypatch.setattr(train, "build_training", no_model)
    out = io.StringIO()
    try:
        with redirect_stdout(out):
            status = train.run(
                small_cfg(tmp_path, "r", "train.steps=2", "resume.accept=[train.steps]", *ck)
            )
    finally:
        close_open()
    assert status == 0
    assert (
        f"nothing to do: {tmp_path / 'r'} is at step 4 and train.steps=2; to train further, "
        "extend this run with train.steps=N resume.accept=[train.steps] (N > 4), or start a "
        "separate run with run.name=NAME"
    ) in out.getvalue().splitlines(), out.getvalue()
    assert committed(root) == [2, 4]
    assert _snapshot(tmp_path / "r") == before


# -- 3. non-finite optimizer state ----------------------------------------------------------------


def test_nan_adam_moment_with_rewritten_hash_is_refused_with_the_way_out(tmp_path):
    root = two_checkpoints(tmp_path)
    fqn = "optimizer.state.lm_head.weight.exp_avg"
    path, offset, length = saved_item(root / "step_0000004", fqn)
    with path.open("r+b") as f:
        f.seek(offset + length // 2)
        f.write(b"\xff" * 64)  # fp32 NaNs
    rewrite_hash(root / "step_0000004", path.name)  # damage that passes every check
    assert store.verify(root / "step_0000004") is None  # every check passes
    line = (
        f"checkpoint {root / 'step_0000004'} holds non-finite values (nan or inf in {fqn}; its "
        f"files match their hashes: saved so); {previous_hint(root)}"
    )
    assert refused(tmp_path) == line
    assert refused(tmp_path) == line  # the same command: the same line, nothing changed
    assert committed(root) == [2, 4]
    # The way out the line names works.
    start, losses = Run(tmp_path, resume=str(root / "step_0000002")).train(6)
    assert start == 2 and all(map(torch.isfinite, map(torch.tensor, losses)))
    assert committed(root) == [2, 4, 6]


# -- 4. what the manifest says ----------------------------------------------------------------


def test_file_dropped_from_the_manifest_isrefused(tmp_path):
    """Its size and hash could not be checked: it used to load without a word."""
    root = two_checkpoints(tmp_path)
    ckpt = root / "step_0000004"
    name = sorted(p.name for p in ckpt.glob("*.distcp"))[0]
    manifest = store.read_manifest(ckpt)
    del manifest["files"][name]
    (ckpt / store.MANIFEST).write_text(json.dumps(manifest))
    for checksum in (True, False):
        assert refused(tmp_path, checksum=checksum) == (
            f"checkpoint {ckpt} is damaged (file {name} is not in manifest.json (its entry was "
            "dropped: its size and hash cannot be verified)) and was not loaded; "
            f"{previous_hint(root)}, or move the damaged directory away"
        )
    assert committed(root) == [2, 4]


def test_manifest_step_against_directory_name_and_train_state(tmp_path):
    root = two_checkpoints(tmp_path)
    # An edited manifest whose step is taken: renaming back is not possible as it stands.
    manifest = store.read_manifest(root / "step_0000004")
    (root / "step_0000004" / store.MANIFEST).write_text(json.dumps({**manifest, "step": 2}))
    assert refused(tmp_path) == (
        f"checkpoint {root / 'step_0000004'}: its manifest.json says step 2 but the directory "
        "is step_0000004: the manifest was edited, or the directory renamed (move "
        f"step_0000002 away first to rename it back); {previous_hint(root)}, or move it away"
    )
    (root / "step_0000004" / store.MANIFEST).write_text(json.dumps(manifest))
    renamed = root / "step_0000003"
    (root / "step_0000004").rename(renamed)
    assert refused(tmp_path) == (
        f"checkpoint {renamed}: its manifest.json says step 4 but the directory is "
        "step_0000003: the manifest was edited, or the directory renamed (then rename it back "
        f"to step_0000004); {previous_hint(root)}, or move it away"
    )
    manifest = store.read_manifest(renamed)
    manifest["step"] = 3
    (renamed / store.MANIFEST).write_text(json.dumps(manifest))
    assert refused(tmp_path) == (
        f"checkpoint {renamed}: its directory name and manifest say step 3 but its train state "
        "(the step the saved training had reached) says 4; the checkpoint is inconsistent and "
        f"was not resumed from; {previous_hint(root)}"
    )
    assert committed(root) == [2, 3]


# -- 2. damage no check can see: the older checkpoint is kept until the loss says so ----------

_RUN = [
    "train.log_every=1",
    "checkpoint=sync",
    "checkpoint.interval=4",
    "checkpoint.keep_last=2",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Issue 46's run at step 12 (checkpoints 8 and 12, every loss logged), copied by each
    test."""
    import train

    tmp = tmp_path_factory.mktemp("trained")
    try:
        assert train.run(small_cfg(tmp, "r", "train.steps=12", *_RUN)) == 0
    finally:
        close_open()
    return tmp / "r"


def _set_element(ckpt: Path, fqn: str, value: float, rehash: bool) -> None:
    """Issue 46's damage: one element of a saved weight set to `value` in place (finite)."""

    def first_set(t: torch.Tensor) -> torch.Tensor:
        t.view(-1)[0] = value
        return t

    rewrite_tensor(ckpt, fqn, first_set, rehash=rehash)


def _expected_limit(losses: list[float]) -> tuple[float, float, float]:
    """checkpoint/health.py's rule, computed here with torch: (level, noise, limit) of
    losses logged every step: the line through the last 8, the noise of the last 16 (1.4826
    x the median absolute deviation of their differences, over sqrt 2)."""
    y = torch.tensor(losses[-8:], dtype=torch.float64)
    x = torch.arange(len(y), dtype=torch.float64)
    slope = ((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum()
    level = float(y.mean() + slope * (x[-1] - x.mean()))
    d = torch.diff(torch.tensor(losses[-16:], dtype=torch.float64))
    mad = (d - d.quantile(0.5)).abs().quantile(0.5)
    noise = float(1.4826 * mad / 2**0.5)
    return level, noise, level + max(float(slope), 0) * 3 + max(5 * noise, 0.05 * level)


def _guard_line(root: Path, records: list[dict], resumed: int = 12, via: int | None = None):
    """(the guard's stop line, the judged losses, the limit) for a resume from `resumed`
    whose first 3 logged losses are in `records` (metrics.jsonl), computed here; `via`: the
    later checkpoint the stopped run resumed from."""
    before = [r["loss"] for r in records if r["step"] <= resumed]
    level, noise, limit = _expected_limit(before)
    first = [r["loss"] for r in records if resumed < r["step"] <= resumed + 3]
    above = sum(v > limit for v in first)
    ckpt = root / f"step_{resumed:07d}"
    how = (
        f"; this run resumed from step_{via:07d}, saved after it before its losses were judged"
        if via
        else ""
    )
    line = (
        f"the loss after resuming from {ckpt} (step {resumed}{how}) is above what this run "
        f"logged just before it: losses {', '.join(f'{v:.3f}' for v in first)} at steps "
        f"{resumed + 1}-{resumed + 3} ({above} of 3 above), against at most {limit:.3f} (the "
        f"level {level:.3f} that the last 8 losses logged before the resume (steps "
        f"{resumed - 7}-{resumed}) lead to, + 5 x the step-to-step noise of the last "
        f"{min(len(before), 16)}, {noise:.3f}); that checkpoint may hold damage its checks "
        "cannot see (a changed weight whose hash was rewritten, or checkpoint.checksum=false); "
        f"the older checkpoint {root / 'step_0000008'} is kept: resume from it with "
        f"checkpoint.resume={root / 'step_0000008'}"
    )
    return line, first, limit


@pytest.mark.parametrize("checksum, policy", [(True, "stop"), (False, "stop"), (True, "continue")])
def test_resume_from_undetectable_damage_keeps_the_older_checkpoint(
    trained, tmp_path, checksum, policy
):
    """Issue 46's case: one element of layers.0.self_attention.proj.weight in step 12's
    checkpoint set to 3e4 and its hash rewritten (or changed with checkpoint.checksum=false).
    The resumed losses are back at the untrained model's; the range of all 12 losses logged
    (step 1's untrained one among them) passed them, and keep_last=2 pruned the good step 8."""
    import train

    shutil.copytree(trained, tmp_path / "r")
    root = tmp_path / "r" / "checkpoints"
    fqn = "model.layers.0.self_attention.proj.weight"
    _set_element(root / "step_0000012", fqn, 3e4, rehash=checksum)
    if checksum:
        assert store.verify(root / "step_0000012") is None  # every check passes
    args = ["train.steps=20", "resume.accept=[train.steps]", *_RUN]
    args += [f"checkpoint.checksum={str(checksum).lower()}", f"resume.loss_check={policy}"]
    out = io.StringIO()
    try:
        with redirect_stdout(out):
            if policy == "stop":
                with pytest.raises(ConfigError) as e:
                    train.run(small_cfg(tmp_path, "r", *args))
            else:
                assert train.run(small_cfg(tmp_path, "r", *args)) == 0
    finally:
        close_open()
    records = read_metrics(tmp_path / "r" / "metrics.jsonl")
    before = [r["loss"] for r in records if r["step"] <= 12]
    expected, first, limit = _guard_line(root, records)
    assert min(first) > limit  # the damage shows in the loss (what the check relies on)
    assert min(first) > before[0] - 0.1  # back at the untrained model's loss ...
    assert max(first) < max(before) + max(before) - min(before)  # ... which the old rule passed
    if policy == "stop":
        assert str(e.value) == f"{expected}; or go on with resume.loss_check=continue"
        assert committed(root) == [8, 12]
        assert [r["step"] for r in records][-1] == 15  # stopped at the verdict
        assert store.read_unconfirmed(root)["resumed_from"] == 12  # still unconfirmed
    else:
        assert (
            f"checkpoint: warning: {expected}; going on (resume.loss_check=continue), keeping "
            "it and leaving the checkpoints since unconfirmed"
        ) in out.getvalue().splitlines()
        # keep_last=2, and 8: the newest confirmed one (12 and later stay unconfirmed)
        assert committed(root) == [8, 16, 20]
        assert store.read_unconfirmed(root)["resumed_from"] == 12


def _resume(tmp: Path, *args: str, sigterm_at: int | None = None):
    """train.py on tmp/r, in this process: (exit status, or the ConfigError it stopped
    with; its output). `sigterm_at`: a SIGTERM sent to this process during that step."""
    import train

    step = train._step

    def sending(loop, s):
        done = step(loop, s)
        if s == sigterm_at:
            os.kill(os.getpid(), signal.SIGTERM)  # handled at the next bytecode: mid-step
        return done

    out = io.StringIO()
    try:
        train._step = sending
        with redirect_stdout(out):
            try:
                return train.run(small_cfg(tmp, "r", *args)), out.getvalue()
            except ConfigError as e:
                return e, out.getvalue()
    finally:
        train._step = step
        close_open()


_EXTEND = ["resume.accept=[train.steps]", *_RUN]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The `trained` run's config trained to step 16 without a stop: the reference."""
    import train

    tmp = tmp_path_factory.mktemp("uninterrupted")
    try:
        assert train.run(small_cfg(tmp, "r", "train.steps=16", *_RUN)) == 0
    finally:
        close_open()
    return [
        (r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(tmp / "r" / "metrics.jsonl")
    ]


def test_a_clean_resume_stopped_before_its_verdict_is_confirmed_by_the_next(
    trained, uninterrupted, tmp_path
):
    """An intact checkpoint resumed, and the run done at step 13, after 1 of the 3 losses the
    verdict takes: step 13's checkpoint is unconfirmed on disk and step 8 is kept. The next
    resume judges the same resume (steps 13-15), says healthy, and pruning goes on as
    keep_last says; every loss is the uninterrupted run's, bit for bit."""
    shutil.copytree(trained, tmp_path / "r")
    root = tmp_path / "r" / "checkpoints"
    status, out = _resume(tmp_path, "train.steps=13", *_EXTEND)
    assert status == 0, out
    assert (
        "checkpoint: the resume from step 12 is not judged yet (1 of the 3 logged losses it "
        "takes): the checkpoints from step 12 on stay unconfirmed, and the next resume judges "
        f"it; {root / 'step_0000008'} is kept until then"
    ) in out.splitlines(), out
    assert committed(root) == [8, 12, 13]
    assert store.read_unconfirmed(root)["resumed_from"] == 12
    status, out = _resume(tmp_path, "train.steps=16", *_EXTEND)
    assert status == 0, out
    healthy = [x for x in out.splitlines() if "resumed segment healthy" in x]
    assert len(healthy) == 1 and " at steps 13-15 (0 of 3 above), " in healthy[0], out
    assert store.read_unconfirmed(root) is None
    assert committed(root) == [13, 16]
    assert [
        (r["step"], r["loss"], r["grad_norm"])
        for r in read_metrics(tmp_path / "r" / "metrics.jsonl")
    ] == (uninterrupted)


def _halve(kind: str):
    def change(t, fqn, g, early):
        return t * 0.5 if kind == "weights" or fqn == "model.lm_head.weight" else t

    return change


@pytest.mark.parametrize(
    "kind, first",
    [
        ("weights", ["train.steps=14"]),  # done after 2 of the 3 losses
        ("weights", ["train.steps=20", "sigterm_at=13"]),  # stopped after 1
        ("output head", ["train.steps=13"]),  # the milder damage, done after 1
    ],
)
def test_a_resume_stopped_before_its_verdict_is_judged_by_the_next(
    trained, tmp_path, monkeypatch, kind, first
):
    """Issue 55, item 1: step 12's weights (or its output head) halved, hashes rewritten; the
    resumed run ends inside the guard's window (train.steps reached, or a SIGTERM). The
    checkpoint it saved is unconfirmed on disk; the next resume judges the resume of step 12
    (the losses logged after it are judged, not history), stops in one line and keeps step 8,
    which resumes and trains on healthy."""
    from tools import resume_guard_study as study

    shutil.copytree(trained, tmp_path / "r")
    root = tmp_path / "r" / "checkpoints"
    monkeypatch.setitem(study.DAMAGE, "halved", _halve(kind))
    study.damage(root / "step_0000012", "halved")
    assert store.verify(root / "step_0000012") is None  # every check passes
    sigterm = [int(a.split("=")[1]) for a in first if a.startswith("sigterm_at=")]
    args = [a for a in first if not a.startswith("sigterm_at=")]
    status, out = _resume(tmp_path, *args, *_EXTEND, sigterm_at=sigterm[0] if sigterm else None)
    saved = 13 if sigterm or "train.steps=13" in args else 14
    assert status == (3 if sigterm else 0), out
    assert committed(root) == [8, 12, saved]
    assert store.read_unconfirmed(root)["resumed_from"] == 12
    status, out = _resume(tmp_path, "train.steps=20", *_EXTEND)
    records = read_metrics(tmp_path / "r" / "metrics.jsonl")
    line, judged, limit = _guard_line(root, records, via=saved)
    assert isinstance(status, ConfigError), out
    assert str(status) == f"{line}; or go on with resume.loss_check=continue"
    assert sum(v > limit for v in judged) >= 2
    assert committed(root) == [8, 12, saved]  # the confirmed step 8 kept
    if kind == "weights" and not sigterm:
        # The way out the line names: step 8 resumes, the newer ones are moved aside, and
        # its resume is judged (and found healthy) like any other.
        status, out = _resume(
            tmp_path, "train.steps=11", f"checkpoint.resume={root}/step_0000008", *_EXTEND
        )
        assert status == 0, out
        assert " at steps 9-11 (0 of 3 above), " in out, out
        assert committed(root) == [8, 11] and store.read_unconfirmed(root) is None


def test_recent_losses_rule_on_synthetic_sequences():
    from checkpoint.health import Recent, ResumeWatch, step_noise

    def verdict(before, after, start=1):
        recent = Recent.from_losses(list(enumerate(before, start)))
        watch = ResumeWatch(recent)
        steps = range(start + len(before), start + len(before) + len(after))
        return [watch.observe(s, v) for s, v in zip(steps, after)][-1], recent

    # Issue 46's numbers: 12 losses falling from the untrained 5.565 to 4.10, then a model
    # reset to chance. The old range (4.098-5.565, limit 7.031) passed it.
    before = [5.565, 5.43, 5.17, 5.00, 4.69, 4.56, 4.54, 4.35, 4.38, 4.27, 4.18, 4.10]
    got, recent = verdict(before, [5.56, 5.55, 5.55])
    assert got == "unhealthy"
    assert (recent.first_step, recent.last_step, recent.count, recent.noise_count) == (5, 12, 8, 12)
    assert recent.level == pytest.approx(4.1)  # the line through steps 5-12, at step 12
    # The 11 differences have the median -0.13 and lie a median 0.05 from it (by hand).
    assert recent.noise == pytest.approx(1.4826 * 0.05 / 2**0.5)
    limit = 4.1 + 5 * 1.4826 * 0.05 / 2**0.5  # falling: no trend; 5 noises > 5% of 4.1
    assert recent.limit == pytest.approx(limit)
    assert verdict(before, [4.05, 4.62, 3.98])[0] == "healthy"  # one spiky batch
    assert verdict(before, [4.34, 4.30, 4.35])[0] == "healthy"  # within 5 noises
    assert verdict(before, [4.40, 4.05, 4.38])[0] == "unhealthy"  # 2 of the 3 beyond
    assert verdict(before, [4.37, 4.37, 4.36])[0] == "unhealthy"
    # An early resume, only 3 losses before it: level and trend from those.
    got, recent = verdict([5.56, 5.20, 4.90], [5.56, 5.55, 5.54])
    assert got == "unhealthy" and recent.count == 3
    assert recent.margin == pytest.approx(0.05 * recent.level)  # 2 differences: the floor
    assert verdict([5.56, 5.20, 4.90], [4.70, 4.80, 4.50])[0] == "healthy"
    assert Recent.from_losses([(1, 5.5), (2, 5.4)]) is None  # too little history
    # Flat and noiseless: the 5% floor, not 5 x 0.
    flat = Recent.from_losses([(s, 2.0) for s in range(1, 9)])
    assert (flat.noise, flat.limit) == (0.0, pytest.approx(2.1))
    assert verdict([2.0] * 8, [2.09, 2.09, 2.09])[0] == "healthy"
    assert verdict([2.0] * 8, [2.11, 2.0, 2.11])[0] == "unhealthy"
    # One spiky batch (two large differences) moves neither the median nor the noise.
    assert step_noise([1.0, 1.0, 1.0, 3.0, 1.0, 1.0, 1.0]) == 0.0
    # A rising trend (0.1 a step) is carried over the 3 judged losses.
    rising = Recent.from_losses([(s, 3.0 + 0.1 * s) for s in range(1, 9)])
    assert rising.rise == pytest.approx(0.3) and rising.limit == pytest.approx(3.8 + 0.3 + 0.19)
    # log_every=5: the trend per step, carried over 3 logged losses (15 steps).
    spaced = Recent.from_losses([(5 * s, 3.0 + 0.1 * s) for s in range(1, 9)])
    assert spaced.rise == pytest.approx(0.3)
    # Losses logged after the resumed step by a segment that stopped before its verdict
    # count as judged ones: the verdict comes with the third loss, or at once.
    recent = Recent.from_losses(list(enumerate(before, 1)))
    watch = ResumeWatch(recent, seen=[(13, 5.56), (14, 5.55)])
    assert watch.decide() is None and watch.observe(15, 4.0) == "unhealthy"
    watch = ResumeWatch(recent, seen=[(13, 4.0), (14, 4.1), (15, 4.0), (16, 9.9)])
    assert watch.decide() == "healthy" and [s for s, _ in watch.seen] == [13, 14, 15]


def test_recent_losses_from_records():
    from checkpoint.health import Recent

    records = [{"step": s, "loss": 10.0 - s} for s in range(1, 13)]
    records += [{"step": 11, "loss": float("nan")}, {"step": 3}]  # non-finite, no loss
    records += [{"step": 12, "loss": 0.5}]  # a later segment's record of step 12 replaces it
    records += [{"step": 13, "loss": 99.0}]  # after the resumed step: not the run's
    r = Recent.from_records(records, resumed_step=12)
    assert (r.first_step, r.last_step, r.count) == (4, 12, 8)  # steps 4-10 and 12

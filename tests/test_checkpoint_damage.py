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
import shutil
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from checkpoint import hashing, store
from checkpoint.manager import close_open
from errors import ConfigError
from tests.ckpt_harness import SMALL, Run, committed, previous_hint, refused, two_checkpoints

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _item(ckpt: Path, fqn: str):
    """(file, offset, length) of a tensor's record in a checkpoint."""
    md = FileSystemReader(str(ckpt)).read_metadata()
    info = next(v for k, v in md.storage_data.items() if k.fqn == fqn)
    return ckpt / info.relative_path, info.offset, info.length


def _rewrite_hash(ckpt: Path, name: str) -> None:
    """What damage that passes every check looks like: the file's manifest entry rewritten
    to the hash of its new bytes."""
    manifest = store.read_manifest(ckpt)
    entry = manifest["files"][name]
    algorithm, _ = hashing.recorded(entry)
    entry[algorithm] = hashing.hash_file(ckpt / name, algorithm)
    (ckpt / store.MANIFEST).write_text(json.dumps(manifest))


def _snapshot(run_dir: Path) -> dict[str, str]:
    return {
        str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file()
    }


def _compose(tmp: Path, name: str, *extra: str):
    from config import compose_config

    return compose_config(
        [f"run.root={tmp}", f"run.name={name}", "train.device=cpu", *SMALL, *extra]
    )


# -- 1. a finished run asked for fewer steps ------------------------------------------------------


def test_finished_run_asked_for_fewer_steps_writes_nothing(tmp_path, monkeypatch):
    """It used to print "nothing to do", then commit step_0000002 holding the step-4 state (a
    checkpoint that could never be loaded). Now nothing is built, loaded or written."""
    import train

    ck = ["checkpoint=sync", "checkpoint.interval=2", "checkpoint.keep_last=3"]
    assert train.run(_compose(tmp_path, "r", "train.steps=4", *ck)) == 0
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
                _compose(tmp_path, "r", "train.steps=2", "resume.accept=[train.steps]", *ck)
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
    path, offset, length = _item(root / "step_0000004", fqn)
    with path.open("r+b") as f:
        f.seek(offset + length // 2)
        f.write(b"\xff" * 64)  # fp32 NaNs
    _rewrite_hash(root / "step_0000004", path.name)
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
        assert train.run(_compose(tmp, "r", "train.steps=12", *_RUN)) == 0
    finally:
        close_open()
    return tmp / "r"


def _set_element(ckpt: Path, fqn: str, value: float, rewrite_hash: bool) -> None:
    """Issue 46's damage: one element of a saved weight set to `value` in place (finite)."""
    path, offset, length = _item(ckpt, fqn)
    data = bytearray(path.read_bytes())
    record = bytes(data[offset : offset + length])  # torch.save's (uncompressed) zip
    tensor = torch.load(io.BytesIO(record), weights_only=True)
    raw = tensor.numpy().tobytes()
    at = offset + record.index(raw)
    damaged = tensor.clone()
    damaged.view(-1)[0] = value
    data[at : at + len(raw)] = damaged.numpy().tobytes()
    path.write_bytes(bytes(data))
    if rewrite_hash:
        _rewrite_hash(ckpt, path.name)


def _expected_limit(losses: list[float]) -> tuple[float, float, float]:
    """checkpoint/health.py's rule, computed here with torch: (level, noise, limit) of the
    last 8 losses logged every step."""
    y = torch.tensor(losses[-8:], dtype=torch.float64)
    x = torch.arange(len(y), dtype=torch.float64)
    slope = ((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum()
    level = float(y.mean() + slope * (x[-1] - x.mean()))
    noise = float(torch.diff(y).std() / 2**0.5)
    return level, noise, level + max(float(slope), 0) * 3 + max(5 * noise, 0.05 * level)


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
    _set_element(root / "step_0000012", fqn, 3e4, rewrite_hash=checksum)
    if checksum:
        assert store.verify(root / "step_0000012") is None  # every check passes
    args = ["train.steps=20", "resume.accept=[train.steps]", *_RUN]
    args += [f"checkpoint.checksum={str(checksum).lower()}", f"resume.loss_check={policy}"]
    out = io.StringIO()
    try:
        with redirect_stdout(out):
            if policy == "stop":
                with pytest.raises(ConfigError) as e:
                    train.run(_compose(tmp_path, "r", *args))
            else:
                assert train.run(_compose(tmp_path, "r", *args)) == 0
    finally:
        close_open()
    records = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").open()]
    before = [r["loss"] for r in records if r["step"] <= 12]
    level, noise, limit = _expected_limit(before)
    first = [r["loss"] for r in records if 13 <= r["step"] <= 15]
    assert min(first) > limit  # the damage shows in the loss (what the check relies on)
    assert min(first) > before[0] - 0.1  # back at the untrained model's loss ...
    assert max(first) < max(before) + max(before) - min(before)  # ... which the old rule passed
    expected = (
        f"the loss after resuming from {root / 'step_0000012'} (step 12) is above what this run "
        f"logged just before it: losses {', '.join(f'{v:.3f}' for v in first)} at steps 13-15, "
        f"against at most {limit:.3f} (the level {level:.3f} that the last 8 losses logged "
        f"before the resume (steps 5-12) lead to, + 5 x their step-to-step noise {noise:.3f}); "
        "that checkpoint may hold damage its checks cannot see (a changed weight whose hash was "
        "rewritten, or checkpoint.checksum=false); the older checkpoint "
        f"{root / 'step_0000008'} is kept: resume from it with "
        f"checkpoint.resume={root / 'step_0000008'}"
    )
    if policy == "stop":
        assert str(e.value) == f"{expected}; or go on with resume.loss_check=continue"
        assert committed(root) == [8, 12]
        assert [r["step"] for r in records][-1] == 15  # stopped at the verdict
    else:
        assert (
            f"checkpoint: warning: {expected}; going on (resume.loss_check=continue), holding it"
        ) in out.getvalue().splitlines()
        assert committed(root) == [8, 12, 16, 20]  # keep_last=2, and the held 8 and 12


def test_healthy_resume_releases_the_hold(trained, tmp_path):
    """An intact checkpoint: the segment is declared healthy after 3 logged losses and the
    older checkpoints are pruned as keep_last says."""
    import train

    shutil.copytree(trained, tmp_path / "r")
    root = tmp_path / "r" / "checkpoints"
    out = io.StringIO()
    try:
        with redirect_stdout(out):
            args = ["train.steps=16", "resume.accept=[train.steps]", *_RUN]
            assert train.run(_compose(tmp_path, "r", *args)) == 0
    finally:
        close_open()
    assert any(
        x.startswith("checkpoint: resumed segment healthy: losses ")
        for x in out.getvalue().splitlines()
    ), out.getvalue()
    assert committed(root) == [12, 16]


def test_recent_losses_rule_on_synthetic_sequences():
    from checkpoint.health import Recent, ResumeWatch

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
    assert (recent.first_step, recent.last_step, recent.count) == (5, 12, 8)
    assert recent.level == pytest.approx(4.1)  # the line through steps 5-12, at step 12
    assert recent.noise == pytest.approx(0.05097, abs=1e-5)
    assert recent.limit == pytest.approx(4.1 + 5 * 0.05097, abs=1e-4)  # falling: no trend
    # Its healthy continuation, one spiky batch included: healthy.
    assert verdict(before, [4.05, 4.62, 3.98])[0] == "healthy"
    assert verdict(before, [4.34, 4.30, 4.35])[0] == "healthy"  # within 5 noises
    assert verdict(before, [4.36, 4.37, 4.36])[0] == "unhealthy"  # all 3 beyond
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
    assert verdict([2.0] * 8, [2.11, 2.11, 2.11])[0] == "unhealthy"
    # A rising trend (0.1 a step) is carried over the 3 judged losses.
    rising = Recent.from_losses([(s, 3.0 + 0.1 * s) for s in range(1, 9)])
    assert rising.rise == pytest.approx(0.3) and rising.limit == pytest.approx(3.8 + 0.3 + 0.19)
    # log_every=5: the trend per step, carried over 3 logged losses (15 steps).
    spaced = Recent.from_losses([(5 * s, 3.0 + 0.1 * s) for s in range(1, 9)])
    assert spaced.rise == pytest.approx(0.3)


def test_recent_losses_from_records():
    from checkpoint.health import Recent

    records = [{"step": s, "loss": 10.0 - s} for s in range(1, 13)]
    records += [{"step": 11, "loss": float("nan")}, {"step": 3}]  # non-finite, no loss
    records += [{"step": 12, "loss": 0.5}]  # a later segment's record of step 12 replaces it
    records += [{"step": 13, "loss": 99.0}]  # after the resumed step: not the run's
    r = Recent.from_records(records, resumed_step=12)
    assert (r.first_step, r.last_step, r.count) == (4, 12, 8)  # steps 4-10 and 12

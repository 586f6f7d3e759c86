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
    """A run at step 8 (checkpoints 4 and 8, every loss logged), copied by each test."""
    import train

    tmp = tmp_path_factory.mktemp("trained")
    try:
        assert train.run(_compose(tmp, "r", "train.steps=8", *_RUN)) == 0
    finally:
        close_open()
    return tmp / "r"


def _scale_weight(ckpt: Path, fqn: str, factor: float, rewrite_hash: bool) -> None:
    """Multiply a saved weight by `factor` in place: every value stays finite."""
    path, offset, length = _item(ckpt, fqn)
    data = bytearray(path.read_bytes())
    record = bytes(data[offset : offset + length])  # torch.save's (uncompressed) zip
    tensor = torch.load(io.BytesIO(record), weights_only=True)
    raw = tensor.numpy().tobytes()
    at = offset + record.index(raw)
    data[at : at + len(raw)] = (tensor * factor).numpy().tobytes()
    path.write_bytes(bytes(data))
    if rewrite_hash:
        _rewrite_hash(ckpt, path.name)


@pytest.mark.parametrize("checksum, policy", [(True, "stop"), (False, "stop"), (True, "continue")])
def test_resume_from_undetectable_damage_keeps_the_older_checkpoint(
    trained, tmp_path, checksum, policy
):
    """The issue's damage: a weight changed and its hash rewritten (or changed with
    checkpoint.checksum=false). It used to resume, train on, and let keep_last=2 prune the
    good step 4: nothing good was left."""
    import train

    shutil.copytree(trained, tmp_path / "r")
    root = tmp_path / "r" / "checkpoints"
    _scale_weight(root / "step_0000008", "model.lm_head.weight", 40.0, rewrite_hash=checksum)
    if checksum:
        assert store.verify(root / "step_0000008") is None  # every check passes
    args = ["train.steps=16", "resume.accept=[train.steps]", *_RUN]
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
    before = [r["loss"] for r in records if r["step"] <= 8]
    limit = max(before) + max(max(before) - min(before), 0.02 * max(before))
    first = [r["loss"] for r in records if 9 <= r["step"] <= 11]
    assert min(first) > limit  # the damage shows in the loss (what the check relies on)
    expected = (
        f"the loss after resuming from {root / 'step_0000008'} (step 8) is above the range this "
        f"run logged before it: losses {', '.join(f'{v:.3f}' for v in first)} at steps 9-11, "
        f"against at most {limit:.3f} (the last 8 losses logged before the resume: "
        f"{min(before):.3f}-{max(before):.3f}); that checkpoint may hold damage its checks "
        "cannot see (a changed weight whose hash was rewritten, or checkpoint.checksum=false); "
        f"the older checkpoint {root / 'step_0000004'} is kept: resume from it with "
        f"checkpoint.resume={root / 'step_0000004'}"
    )
    if policy == "stop":
        assert str(e.value) == f"{expected}; or go on with resume.loss_check=continue"
        assert committed(root) == [4, 8]
        assert [r["step"] for r in records][-1] == 11  # stopped at the verdict
    else:
        assert (
            f"checkpoint: warning: {expected}; going on (resume.loss_check=continue), holding it"
        ) in out.getvalue().splitlines()
        assert committed(root) == [4, 8, 12, 16]  # keep_last=2, and the held 4 and 8


def test_healthy_resume_releases_the_hold(trained, tmp_path):
    """An intact checkpoint: the segment is declared healthy after 3 logged losses and the
    older checkpoints are pruned as keep_last says."""
    import train

    shutil.copytree(trained, tmp_path / "r")
    root = tmp_path / "r" / "checkpoints"
    out = io.StringIO()
    try:
        with redirect_stdout(out):
            args = ["train.steps=12", "resume.accept=[train.steps]", *_RUN]
            assert train.run(_compose(tmp_path, "r", *args)) == 0
    finally:
        close_open()
    assert any(
        x.startswith("checkpoint: resumed segment healthy: losses ")
        for x in out.getvalue().splitlines()
    ), out.getvalue()
    assert committed(root) == [8, 12]


def test_loss_range_limit_against_reference_numbers():
    from checkpoint.health import LossRange, ResumeWatch

    records = [{"step": s, "loss": v} for s, v in enumerate([9.0, 4.0, 3.7, 3.5, 3.6], 1)]
    records.append({"step": 6, "loss": 99.0})  # after the resumed step: not the run's range
    r = LossRange.from_records(records, resumed_step=5)
    assert (r.low, r.high, r.count) == (3.5, 9.0, 5) and r.limit == 14.5
    flat = LossRange.from_records([{"step": s, "loss": 2.0} for s in (1, 2, 3)], 3)
    assert flat.limit == pytest.approx(2.04)  # the 2% floor
    assert LossRange.from_records(records[:2], 5) is None  # too little history
    watch = ResumeWatch(LossRange(3.5, 3.9, 20))  # limit 4.3
    assert [watch.observe(s, v) for s, v in ((9, 5.6), (10, 4.0), (11, 5.5))] == [
        None,
        None,
        "healthy",  # one loss within the range: a spike, not damage
    ]
    watch = ResumeWatch(LossRange(3.5, 3.9, 20))
    assert [watch.observe(s, 5.6) for s in (9, 10, 11)] == [None, None, "unhealthy"]

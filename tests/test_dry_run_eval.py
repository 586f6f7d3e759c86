"""train.dry_run and train.eval_only, and the messages of extending a run.

Dry run: validates, decides the resume from the checkpoint's config (the same refusal a
real start gives), builds the model on the meta device and prints mesh, parameter count,
memory and checkpoint estimates; the run directory is neither created nor changed. Eval
only: the held-out loss of the checkpoint equals the one the training run logged at that
step (same batches, same weights), and nothing is written."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

from checkpoint import preflight, runlock
from config import compose_config
from runlog import read_metrics
from runtime import host_id, launch
from tests.helpers import CPU_ENV
from tests.test_eval import TINY
from tests.test_resume_config import snapshot


def run(tmp_path, *args, nproc=1):
    r = launch([*TINY, f"run.root={tmp_path}", "run.name=r", *args], nproc=nproc, env=CPU_ENV)
    return r.returncode, r.stdout, r.stderr


def lines(text: str) -> list[str]:
    return [x for x in text.splitlines() if x.strip()]


def test_long_context_preset_with_synthetic_data_needs_no_tokenizer(tmp_path):
    """experiment=llama3_8b_32k data=synthetic offline with an empty Hugging Face cache: the
    preset's hub tokenizer is never asked for (its dry run passes and says so). One process,
    so parallel.cp=1; the tokenizer step does not depend on cp. checkpoint=none: the dry
    run checks free space for 8B checkpoints too, which this test is not about."""
    r = launch(
        [
            "experiment=llama3_8b_32k",
            "data=synthetic",
            "parallel.cp=1",
            "checkpoint=none",
            "train.dry_run=true",
            f"run.root={tmp_path}",
        ],
        env={**CPU_ENV, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")},
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert (
        "data: data=synthetic seq_len=32768 global batch 32 sequences, no tokenizer loaded "
        "(data=synthetic: random ids, vocabulary 128256 = model.vocab_size; "
        "data.tokenizer='meta-llama/Llama-3.1-8B' is not used)"
    ) in lines(r.stdout)


def test_dry_run_then_extending_a_run(tmp_path):
    status, out, err = run(tmp_path, "train.steps=4", "train.dry_run=true")
    assert status == 0, out + err
    assert not tmp_path.joinpath("r").exists()  # nothing created
    got = lines(out)
    assert got[0] == "dry run: the config is valid; nothing is trained, read or written"
    assert got[1] == (
        "mesh: ParallelDims(fsdp: dp_replicate=1, dp_shard=1, cp=1, tp=1, world_size=1) on "
        "cpu, grad_accum=1"
    )
    params = re.match(
        r"model: tiny impl=torch params=(\S+)M recipe=bf16 \(built on the meta", got[2]
    )
    assert params, got[2]
    assert got[3].startswith("memory: about ") and "GiB per GPU (states " in got[3]
    assert got[4].startswith("checkpoint: about ") and "keeps the last 2" in got[4]
    assert got[5].startswith("data: data=embedded seq_len=32 global batch 4 sequences")
    assert got[6].startswith(
        f"run directory: {tmp_path}/r (would be created) is writable; {tmp_path}/r/checkpoints has "
    ), got[6]
    each = preflight.format_bytes(preflight.estimate_checkpoint_bytes(compose_config(TINY).model))
    assert got[6].endswith(f" free, room for the 3 more checkpoints it needs ({each} each)")
    assert got[7] == f"lock: {tmp_path}/r/.lock is free"
    assert got[8] == (
        f"resume: no checkpoint in {tmp_path}/r/checkpoints; starts fresh at step 0 "
        f"({tmp_path}/r would be created)"
    )
    assert got[9].startswith("not checked: the data itself")

    # The run itself: the same parameter count.
    status, out, err = run(tmp_path, "train.steps=4", "checkpoint=sync")
    assert status == 0, err[-3000:]
    assert f"params={params.group(1)}M" in out
    before = snapshot(tmp_path / "r")

    # Extending it: refused (a separate run first, then the one way to extend), in a dry run
    # as in a real start; accepted with resume.accept=[train.steps].
    refusal = (
        f"error: resume: {tmp_path}/r has a checkpoint (step 4) of another config: train.steps "
        "4 -> 8 (the LR schedule's length: 8 steps unless optim.schedule_steps=4; the lr of "
        "step 5: 3.00e-04 -> 2.33e-03 (the lr rises again)); to start a "
        "separate run, add run.name=NAME; to continue this run with the change on purpose, add "
        "resume.accept=[train.steps]; or resume with the checkpoint's values"
    )
    for dry in ("true", "false"):
        status, out, err = run(tmp_path, "train.steps=8", "checkpoint=sync", f"train.dry_run={dry}")
        assert status == 2 and lines(err) == [refusal], err
        assert snapshot(tmp_path / "r") == before
    status, out, err = run(
        tmp_path, "train.steps=8", "resume.accept=[train.steps]", "train.dry_run=true"
    )
    assert status == 0, err
    assert lines(out)[-2] == (
        f"resume: from {tmp_path}/r/checkpoints/step_0000004 (step 4) with accepted changes: "
        "train.steps 4 -> 8 (the LR schedule's length: 8 steps unless optim.schedule_steps=4; "
        "the lr of step 5: 3.00e-04 -> 2.33e-03 (the lr rises again))"
    )
    assert snapshot(tmp_path / "r") == before

    # Nothing to do: the same way to extend is named.
    status, out, err = run(tmp_path, "train.steps=4", "checkpoint=sync")
    assert status == 0, err
    assert (
        f"nothing to do: {tmp_path}/r is at step 4 and train.steps=4; to train further, extend "
        "this run with train.steps=N resume.accept=[train.steps] (N > 4), or start a separate "
        "run with run.name=NAME"
    ) in out


def test_dry_run_refuses_what_the_run_refuses_and_refusals_create_nothing(tmp_path):
    """The checks a start makes before training (free space, writability, the run lock) are the
    dry run's too, with the same line; a refused start leaves no directory behind, whether
    refused before the run directory is made (disk space) or after (the data)."""
    space = ["model=llama3_70b", "checkpoint.keep_last=1000"]  # ~840 GB a checkpoint, x 1001
    refusals = []
    for dry in ("true", "false"):
        r = launch(
            [f"run.root={tmp_path}", "run.name=r", *space, f"train.dry_run={dry}"], env=CPU_ENV
        )
        # Refused: the error line alone (no CPU note, said only by a run that goes ahead).
        assert r.returncode == 2 and lines(r.stdout) == [], r.stdout
        refusals += lines(r.stderr)
    free = [re.sub(r" has [\d.]+ \w+ free", " has ... free", x) for x in refusals]
    assert len(refusals) == 2 and free[0] == free[1], refusals  # the free space may move
    assert (
        refusals[0].startswith(f"error: checkpoint.dir=checkpoints: {tmp_path}/r/checkpoints has ")
        and "1001 more checkpoints of model llama3_70b need about" in refusals[0]
    )
    assert not any(tmp_path.iterdir())

    # A run directory that cannot be made (run.root is a file), and one a live run holds.
    (tmp_path / "file").write_text("")
    status, out, err = run(tmp_path / "file", "train.dry_run=true")
    assert status == 2 and lines(err) == [
        f"error: run.root={tmp_path}/file: cannot write to {tmp_path}/file/r ({tmp_path}/file "
        "is not a directory); choose a writable directory"
    ], err
    (tmp_path / "r").mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        lock = {"host": host_id(), "pid": holder.pid, "started": time.time(), "token": "t"}
        (tmp_path / "r" / runlock.LOCK_NAME).write_text(json.dumps(lock))
        status, out, err = run(tmp_path, "train.dry_run=true")
    finally:
        holder.kill()
        holder.wait()
    assert status == 2 and len(lines(err)) == 1, err
    assert lines(err)[0].startswith(
        f"error: run directory {tmp_path}/r is in use by another run (host "
    ), err
    (tmp_path / "r" / runlock.LOCK_NAME).unlink()
    (tmp_path / "r").rmdir()

    # Refused by the data after the run directory was made: it is removed again.
    (tmp_path / "x.jsonl").write_text('{"body": "no text field"}\n')
    data = ["data=hf", f"data.path={tmp_path}/x.jsonl", "data.tokenizer=byte"]
    status, out, err = run(tmp_path, *data)
    assert status == 2 and lines(err)[-1].startswith("error: data.text_field='text'"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "x.jsonl"]


def test_warmup_longer_than_the_schedule_warns_once(tmp_path):
    status, out, err = run(tmp_path, "train.steps=3", "optim.warmup_steps=5", "train.dry_run=true")
    assert status == 0, err
    warn = [x for x in lines(out) if x.startswith("warning:")]
    assert warn == [
        "warning: optim.warmup_steps=5 exceeds the LR schedule's 3 steps (train.steps): the lr "
        "never reaches optim.lr=0.003; lower optim.warmup_steps to train at the full lr"
    ]
    status, out, err = run(tmp_path, "train.steps=3", "optim.warmup_steps=2", "train.dry_run=true")
    assert status == 0 and "warning:" not in out + err


def test_eval_only_equals_the_logged_val_loss(tmp_path):
    evals = ["eval.every=2", "eval.batches=2", "data.eval_fraction=0.1"]
    status, out, err = run(tmp_path, "train.steps=4", "checkpoint=sync", *evals)
    assert status == 0, err[-3000:]
    ref = {r["step"]: r.get("val_loss") for r in read_metrics(tmp_path / "r" / "metrics.jsonl")}
    before = snapshot(tmp_path / "r")
    # eval.every=0 still evaluates eval.batches batches.
    status, out, err = run(
        tmp_path, "train.steps=4", "train.eval_only=true", "eval.every=0", *evals[1:]
    )
    assert status == 0, err[-3000:]
    line = lines(out)[-1]
    assert line == (
        f"eval: step 4 val_loss {ref[4]:.4f} on 2 held-out batches (8 sequences of 32 tokens) "
        f"from {tmp_path}/r/checkpoints"
    ), out
    assert "note:" not in out  # the run held these documents out
    assert snapshot(tmp_path / "r") == before

    # No checkpoint: one line.
    status, out, err = run(tmp_path, "train.eval_only=true", "run.name=none")
    assert status == 2 and lines(out + err) == [
        f"error: train.eval_only: no checkpoint in {tmp_path}/none/checkpoints; train this run "
        "first, or give one with checkpoint.resume=PATH"
    ]
    assert not (tmp_path / "none").exists()


@pytest.mark.slow
def test_dry_run_under_torchrun(tmp_path):
    status, out, err = run(
        tmp_path,
        "parallel=fsdp_tp",
        "parallel.tp=2",
        "model.n_kv_heads=2",
        "train.dry_run=true",
        nproc=2,
    )
    assert status == 0, out + err
    got = lines(out)
    assert got.count("dry run: the config is valid; nothing is trained, read or written") == 1
    assert (
        "mesh: ParallelDims(fsdp_tp: dp_replicate=1, dp_shard=1, cp=1, tp=2, world_size=2)" in out
    )
    assert not tmp_path.joinpath("r").exists()


@pytest.mark.slow
def test_eval_only_on_two_ranks_matches_one(tmp_path):
    evals = ["eval.batches=2", "data.eval_fraction=0.1", "eval.every=2"]
    status, out, err = run(tmp_path, "train.steps=2", "checkpoint=sync", *evals)
    assert status == 0, err[-3000:]
    one = run(tmp_path, "train.steps=2", "train.eval_only=true", *evals)
    two = run(tmp_path, "train.steps=2", "train.eval_only=true", *evals, nproc=2)
    assert one[0] == two[0] == 0, one[2][-2000:] + two[2][-2000:]
    line = [x for x in lines(one[1]) if x.startswith("eval: step 2 val_loss ")]
    assert len(line) == 1 and [x for x in lines(two[1]) if x.startswith("eval: ")] == line

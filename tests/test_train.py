"""End-to-end: train.py on CPU, one process and torchrun with gloo."""

from __future__ import annotations

from pathlib import Path

import pytest

from runlog import read_metrics
from runtime import launch
from tests.harness.resume import keep_only_checkpoint
from tests.helpers import CPU_ENV, TINY_RUN


def train(tmp: Path, name: str, *overrides: str, nproc: int = 1, timeout: int = 600):
    r = launch(
        [f"run.root={tmp}", f"run.name={name}", *overrides],
        nproc=nproc,
        env=CPU_ENV,
        timeout=timeout,
    )
    assert r.returncode == 0, f"{' '.join(r.args)}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    return r, read_metrics(tmp / name / "metrics.jsonl")


SMALL = ["data.seq_len=64", "data.max_bytes=400000", "train.global_batch_size=8"]


def test_default_style_run_learns_and_writes_run_dir(tmp_path):
    r, records = train(
        tmp_path, "learn", "train.steps=60", "train.log_every=10", "optim.warmup_steps=10", *SMALL
    )
    assert [rec["step"] for rec in records] == [10, 20, 30, 40, 50, 60]
    first, last = records[0]["loss"], records[-1]["loss"]
    assert last < first - 0.5, (first, last)  # bytes start near ln(384)=5.95
    assert all(rec["tokens_per_s"] > 0 and rec["grad_norm"] > 0 for rec in records)
    assert "impl=torch" in r.stdout
    cfg_text = (tmp_path / "learn" / "config.yaml").read_text()
    assert "name: tiny" in cfg_text and "steps: 60" in cfg_text


def test_two_processes_match_one_on_the_same_global_batch(tmp_path):
    steps = ["train.steps=8", "train.log_every=1", *SMALL]
    _, one = train(tmp_path, "one", *steps, "train.micro_batch_size=4")  # 2 micro-batches
    _, two = train(tmp_path, "two", *steps, "train.micro_batch_size=4", nproc=2)
    assert [r["step"] for r in one] == [r["step"] for r in two] == list(range(1, 9))
    for a, b in zip(one, two):
        # fp32 on CPU; only the reduction order differs (gradient average across ranks).
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-6), (a, b)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)


def test_tp_checkpoint_resumes_on_one_process(tmp_path):
    """train.py end to end: save under tp=2 (fc1 is a strided shard there), resume the middle
    checkpoint in one process: the second half continues the 2-process curve."""
    steps = [
        "train.steps=8",
        "train.log_every=1",
        "checkpoint=sync",
        "checkpoint.interval=4",
        *SMALL,
    ]
    _, tp_run = train(tmp_path, "tp", *steps, "parallel=tp", nproc=2)
    assert [rec["step"] for rec in tp_run] == list(range(1, 9))
    keep_only_checkpoint(tmp_path / "tp", tmp_path / "one", 4)
    r, resumed = train(tmp_path, "one", *steps)
    assert "resumed_from_step=4" in r.stdout
    assert [rec["step"] for rec in resumed] == list(range(1, 9))
    for a, b in zip(tp_run[4:], resumed[4:]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (a, b)


def test_profile_steps_write_the_trace_and_table_into_the_run_dir(tmp_path):
    import json

    r, records = train(
        tmp_path,
        "prof",
        *TINY_RUN,
        "train.steps=4",
        "train.profile_steps=[2,3]",
        "checkpoint=none",
    )
    profile = tmp_path / "prof" / "profile"
    trace, table = profile / "rank0_steps2-3.json", profile / "rank0_steps2-3.txt"
    assert f"profile of steps [2, 3] written to {trace}" in r.stdout
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("name", "").startswith("aten::") for e in events)
    assert "Self CPU" in table.read_text() and "aten::" in table.read_text()
    assert [rec["step"] for rec in records] == [1, 2, 3, 4]  # the steps still run and log


#: Short documents (mean 24 tokens, drawn) in windows of 64: most rows hold several.
DOCS = [
    "data=synthetic",
    "data.seq_len=64",
    "data.doc_len=24",
    "data.doc_len_dist=exponential",
    "data.max_bytes=200000",
    "train.global_batch_size=8",
    "train.micro_batch_size=4",  # one process: 2 micro batches, split with their documents
    "model=tiny",
]


def test_document_masked_resume_is_bitwise_and_reshards(tmp_path):
    """data.document_mask through train.py: the same command resumed from the middle
    checkpoint continues the loss curve bit for bit; the 2-process (fsdp) checkpoint resumed
    on one process continues it to fp32 rounding (only the gradient reduction order differs),
    and masking is really on (the first loss differs from a run without it)."""
    steps = ["train.steps=8", "train.log_every=1", "checkpoint=sync", "checkpoint.interval=4"]
    _, straight = train(tmp_path, "straight", *steps, *DOCS)
    keep_only_checkpoint(tmp_path / "straight", tmp_path / "resumed", 4)
    r, resumed = train(tmp_path, "resumed", *steps, *DOCS)
    assert "resumed_from_step=4" in r.stdout
    assert [rec["loss"] for rec in resumed[4:]] == [rec["loss"] for rec in straight[4:]]

    _, two = train(tmp_path, "two", *steps, *DOCS, nproc=2)
    keep_only_checkpoint(tmp_path / "two", tmp_path / "two-on-one", 4)
    r, one = train(tmp_path, "two-on-one", *steps, *DOCS)
    assert "resumed_from_step=4" in r.stdout
    for a, b in zip(two[4:], one[4:]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (a, b)
    for a, b in zip(straight, two):  # 1 and 2 processes train alike with documents too
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (a, b)

    _, causal = train(
        tmp_path, "causal", "train.steps=1", "checkpoint=none", *DOCS, "data.document_mask=false"
    )
    assert abs(causal[0]["loss"] - straight[0]["loss"]) > 1e-4


def test_context_parallel_checkpoints_resume_at_any_cp(tmp_path):
    """parallel.cp through train.py, document-masked: a cp=2 run (2 processes) equals the
    one-process run; its step-4 checkpoint resumes at cp=1 and at cp=4, and the cp=4 run's
    step-8 checkpoint resumes at cp=2 again, each continuing the cp=2 curve (fp32:
    only reduction orders differ); the one-process run's step-8 checkpoint resumes at cp=2
    and continues its own curve. The data order is the loader's, which knows nothing of cp."""
    steps = ["train.steps=12", "train.log_every=1", "checkpoint=sync", "checkpoint.interval=4"]
    steps.append("checkpoint.keep_last=3")
    cp = ["parallel.dp_shard=1"]
    _, one = train(tmp_path, "one", *steps, *DOCS)
    _, two = train(tmp_path, "cp2", *steps, *DOCS, *cp, "parallel.cp=2", nproc=2)
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (a, b)

    def resume(src: str, dst: str, step: int, *more, nproc: int, curve=two):
        keep_only_checkpoint(tmp_path / src, tmp_path / dst, step)
        r, got = train(tmp_path, dst, *steps, *DOCS, *more, nproc=nproc)
        assert f"resumed_from_step={step}" in r.stdout
        for a, b in zip(curve[step:], got[step:]):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (dst, a, b)

    resume("cp2", "cp1", 4, nproc=1)
    resume("cp2", "cp4", 4, *cp, "parallel.cp=4", nproc=4)
    resume("cp4", "cp4-cp2", 8, *cp, "parallel.cp=2", nproc=2)
    resume("one", "one-cp2", 8, *cp, "parallel.cp=2", nproc=2, curve=one)

"""A run whose ranks do not fail together ends, with the failing rank's own line
(tests/harness/fail_rank.py: rank 1 fails in step 2 while rank 0 goes on into the step's
collectives). On gloo the other rank sees a closed connection at once; on NCCL the failing rank
must abort its communicators so that its process ends and torchrun stops the rest
(runtime.end_process_group; tests/gpu/test_rank_failure_gpu.py runs the same on 2 GPUs).
"""

from __future__ import annotations

import time

import pytest

from runlog import read_metrics
from runtime import launch
from tests.helpers import CPU_ENV

ARGS = ["train.steps=4", "train.log_every=1", "data.seq_len=64", "train.global_batch_size=4"]


@pytest.mark.parametrize("kind", ["oom", "error"])
def test_one_rank_failing_ends_the_job(tmp_path, kind):
    env = {**CPU_ENV, "FAIL_RANK": "1", "FAIL_STEP": "2", "FAIL_KIND": kind}
    start = time.monotonic()
    r = launch(
        [*ARGS, f"run.root={tmp_path}", "run.name=r"],
        nproc=2,
        env=env,
        timeout=180,
        program=("tests/harness/fail_rank.py",),
    )
    took = time.monotonic() - start
    text = r.stdout + r.stderr
    assert r.returncode != 0, text
    assert [m["step"] for m in read_metrics(tmp_path / "r" / "metrics.jsonl")] == [1], text
    if kind == "oom":
        # the failing rank's own line, though it is not rank 0
        ours = [ln for ln in text.splitlines() if ln.startswith("error: rank 1 of 2 ran out")]
        assert len(ours) == 1, text
        assert "Tried to allocate 1.00 GiB." in ours[0]
        assert "parallel.activation_checkpointing=selective, mlp or full" in ours[0]
    else:
        assert "injected failure on rank 1" in text
    assert took < 120, took

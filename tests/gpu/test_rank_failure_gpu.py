"""One rank failing alone on NCCL ends the job in seconds (tests/harness/fail_rank.py: rank 1
fails in step 2 while rank 0 goes on into the step's collectives).

    python -m pytest -m gpu tests/gpu/test_rank_failure_gpu.py -q -s     # 2 GPUs

Issue 56's cp=4 run: two ranks out of memory in step 1 called NCCL's destroy_process_group
at exit, which waited for the collectives the other two were inside; no process ended, so
torchrun never learned of the failure, and the job sat there until
parallel.collective_timeout_s (600 s). The failing rank now aborts its communicators
(runtime.end_process_group), its process exits, torchrun stops the others (it gives them up
to 30 s after SIGTERM). tests/test_rank_failure.py runs the same on gloo, whose ranks see a
closed connection at once.
"""

from __future__ import annotations

import time

import pytest
import torch

from model import te_available
from runlog import read_metrics
from runtime import launch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not te_available(), reason="needs CUDA GPUs and TransformerEngine"),
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

#: The job's whole run (start-up included) must end within this; the hang lasted the
#: collective timeout, 600 s.
WITHIN_S = 120


@pytest.mark.parametrize("kind", ["oom", "error"])
def test_one_rank_failing_ends_the_job_on_nccl(tmp_path, kind):
    env = {"FAIL_RANK": "1", "FAIL_STEP": "2", "FAIL_KIND": kind}
    args = ["model=small", "train.steps=4", "train.log_every=1", "train.global_batch_size=4"]
    start = time.monotonic()
    r = launch(
        [*args, f"run.root={tmp_path}", "run.name=r"],
        nproc=2,
        env=env,
        timeout=WITHIN_S + 60,
        program=("tests/harness/fail_rank.py",),
    )
    took = time.monotonic() - start
    text = r.stdout + r.stderr
    print(f"\n{kind}: exit {r.returncode} after {took:.0f} s")
    assert r.returncode != 0, text[-3000:]
    assert [m["step"] for m in read_metrics(tmp_path / "r" / "metrics.jsonl")] == [1]
    if kind == "oom":
        assert "error: rank 1 of 2 ran out of GPU memory" in text, text[-3000:]
    assert took < WITHIN_S, took

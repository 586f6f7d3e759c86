"""tools/layout_matrix.py on CPU (gloo, reference implementation): one torchrun job runs
train.py's run() in-process for each checkpoint mode, kills nothing but copies run A's middle
checkpoint into run B, resumes it, and must find the second half bitwise equal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_in_process_resume_matrix_fsdp_tp_every_mode(tmp_path):
    out = tmp_path / "rows.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=4",
        "tools/layout_matrix.py",
        "--layout",
        "fsdp_tp",
        "--recipes",
        "bf16",
        "--all-modes",
        "--jsonl",
        str(out),
        "--",
        "model.impl=torch",
        "data.seq_len=64",
        "train.global_batch_size=8",
    ]
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["mode"] for r in rows] == ["sync", "async", "async_process"]
    for r in rows:
        assert r["resumed"] and r["bitwise"] and r["steps"] == 3 and r["max_abs"] == 0.0, r
    table = subprocess.run(
        [sys.executable, "tools/layout_matrix.py", "--table", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert table.returncode == 0 and table.stdout.count("| fsdp_tp | bf16 |") == 3

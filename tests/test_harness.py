"""tests/harness/ on CPU (gloo, reference implementation): resume.py's pieces on synthetic run
directories, its command line (two train.py subprocesses), and matrix.py, which runs
train.py's run() in-process inside one torchrun job for each checkpoint mode, kills nothing
but copies run A's middle checkpoint into run B, resumes it, and must find the second half
bitwise equal."""

from __future__ import annotations

import json
from pathlib import Path

from runtime import launch
from tests.harness.resume import (
    keep_only_checkpoint,
    loss_parity,
    replace_overrides,
    resumed,
    second_half,
)
from tests.helpers import CPU_ENV

ROOT = Path(__file__).resolve().parents[1]


def test_replace_overrides_drops_the_key_and_everything_below_it():
    base = ["parallel=fsdp", "parallel.dp_shard=2", "model=tiny", "parallelism=x"]
    assert replace_overrides(base, ["parallel=tp"]) == [
        "model=tiny",
        "parallelism=x",
        "parallel=tp",
    ]
    assert replace_overrides(base, []) == base


def _fake_run(run_dir: Path, losses: dict[int, float], checkpoints=()) -> Path:
    (run_dir / "checkpoints").mkdir(parents=True)
    for step in checkpoints:
        (run_dir / "checkpoints" / f"step_{step:07d}").mkdir()
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": v}) + "\n" for s, v in losses.items())
    )
    return run_dir


def test_keep_only_checkpoint_resumed_and_second_half(tmp_path):
    curve = {s: 5.0 - 0.1 * s for s in range(1, 9)}
    run_a = _fake_run(tmp_path / "A", curve, checkpoints=(4, 8))
    run_b = tmp_path / "B"
    keep_only_checkpoint(run_a, run_b, 4)
    assert sorted(p.name for p in (run_b / "checkpoints").iterdir()) == ["step_0000004"]
    assert resumed(run_b)  # the copied metrics are still in place
    assert second_half(run_a, run_b, 4) == dict(
        steps=4, max_abs=0.0, max_rel=0.0, bitwise=True, first_diff=None
    )
    # A fresh start moves the copied metrics aside (logger.py): not a resume.
    (run_b / "metrics.jsonl").rename(run_b / "metrics.123.jsonl")
    (run_b / "metrics.jsonl").write_text("")
    assert not resumed(run_b)

    off = {s: v + (1e-3 if s >= 6 else 0.0) for s, v in curve.items()}
    d = loss_parity(
        {s: {"loss": v} for s, v in curve.items() if s > 4},
        {s: {"loss": v} for s, v in off.items() if s > 4},
    )
    assert d["steps"] == 4 and not d["bitwise"] and d["first_diff"] == 6
    assert abs(d["max_abs"] - 1e-3) < 1e-12
    # Nothing in common compares nothing: not a pass.
    assert not loss_parity({1: {"loss": 1.0}}, {2: {"loss": 1.0}})["bitwise"]


def test_resume_command_line_on_cpu(tmp_path):
    """python -m tests.harness.resume: run A and run B as train.py subprocesses."""
    args = ["--steps", "4", "--", "model=tiny", "data.seq_len=64", "data.max_bytes=400000"]
    proc = launch(
        [*args, "train.global_batch_size=8"],
        env={**CPU_ENV, "TMPDIR": str(tmp_path)},
        timeout=600,
        program=("-m", "tests.harness.resume"),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| bf16-sync | True | 2 | 0 | True |" in proc.stdout, proc.stdout


def test_in_process_resume_matrix_fsdp_tp_every_mode(tmp_path):
    out = tmp_path / "rows.jsonl"
    args = [
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
    proc = launch(
        args,
        nproc=4,
        env={"TMPDIR": str(tmp_path)},
        timeout=600,
        program=("-m", "tests.harness.matrix"),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["mode"] for r in rows] == ["sync", "async", "async_process"]
    for r in rows:
        assert r["resumed"] and r["bitwise"] and r["steps"] == 3 and r["max_abs"] == 0.0, r
    table = launch(["--table", str(out)], program=("-m", "tests.harness.matrix"))
    assert table.returncode == 0 and table.stdout.count("| fsdp_tp | bf16 |") == 3

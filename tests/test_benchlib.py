"""tools/benchlib.py: the benchmark tools' shared case runner and table writer (CPU, fast)."""

from __future__ import annotations

import sys

from tools import benchlib


def test_table_rows_cells_and_notes():
    out = benchlib.table(
        ["case", "tokens/s", "note"],
        [["a", 1, "x"], ["b", "FAILED: boom", ""], benchlib.row(["c", 2, "-"]) + " (exit 3)"],
    )
    assert out.splitlines() == [
        "| case | tokens/s | note |",
        "|---|---|---|",
        "| a | 1 | x |",
        "| b | FAILED: boom | |",  # an empty cell is `| |`
        "| c | 2 | - | (exit 3)",  # a row written already, with a note after it
    ]


def test_cell_and_split_overrides():
    assert benchlib.cell(None, "{:.2f}") == "-"
    assert benchlib.cell(0, "{:.2f}") == "0.00"
    assert benchlib.cell(0.25, "{:.0%}") == "25%"
    assert benchlib.split_overrides(["--steps", "4", "--", "model=tiny"]) == (
        ["--steps", "4"],
        ["model=tiny"],
    )
    assert benchlib.split_overrides(["--steps", "4"]) == (["--steps", "4"], [])


def test_command_uses_torchrun_for_several_processes():
    assert benchlib.command(["a=1"]) == [sys.executable, "train.py", "a=1"]
    cmd = benchlib.command(["a=1"], nproc=2)
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    assert cmd[5:] == ["train.py", "a=1"]


def _fake_train(tmp_path, body: str):
    """A checkout whose train.py is `body` (run_case runs `train.py` from `repo`)."""
    (tmp_path / "train.py").write_text(body)
    return tmp_path


def test_run_case_reads_metrics_and_says_why_a_run_failed(tmp_path):
    run_dir = tmp_path / "run"
    repo = _fake_train(
        tmp_path,
        "import json, os, sys\n"
        f"os.makedirs({str(run_dir)!r}, exist_ok=True)\n"
        f"with open({str(run_dir / 'metrics.jsonl')!r}, 'w') as f:\n"
        "    f.write(json.dumps({'step': 1, 'loss': 2.5}) + '\\n' + '{\"step\": 2, \"lo')\n"
        "print('args', *sys.argv[1:], os.environ['BENCH_X'])\n"
        "if 'fail=1' in sys.argv:\n"
        "    print('error: train.steps=0 must be > 0', file=sys.stderr)\n"
        "    sys.exit(2)\n",
    )
    ok = benchlib.run_case(["a=1"], run_dir=run_dir, repo=repo, env={"BENCH_X": "y"})
    assert ok.ok and ok.error is None and ok.seconds > 0
    assert ok.records == [{"step": 1, "loss": 2.5}]  # the line cut short is skipped
    assert ok.stdout.strip() == "args a=1 y"
    bad = benchlib.run_case(["fail=1"], run_dir=run_dir, repo=repo, env={"BENCH_X": "y"})
    assert bad.returncode == 2 and not bad.ok
    assert bad.error == "error: train.steps=0 must be > 0" == bad.failure()
    assert bad.tail(1) == "args fail=1 y"  # stderr, then stdout: the last line
    none = benchlib.run_case(["a=1"], repo=repo, env={"BENCH_X": "y"})
    assert none.records == []  # no run_dir: no metrics read

"""tools/benchlib.py: the benchmark tools' shared case runner and table writer (CPU, fast)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from runtime import pid_alive
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


def _hanging_train(tmp_path, run_dir):
    """A train.py that logs step 1, then waits forever in `hang`, with train.py's stack-dump
    signal registered (runtime.register_stack_dump)."""
    from runtime import ROOT

    return _fake_train(
        tmp_path,
        "import json, os, sys, time\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from runtime import register_stack_dump\n"
        "register_stack_dump()\n"
        f"os.makedirs({str(run_dir)!r}, exist_ok=True)\n"
        "if os.environ.get('RANK', '0') == '0':\n"
        f"    with open({str(run_dir / 'metrics.jsonl')!r}, 'w') as f:\n"
        "        f.write(json.dumps({'step': 1, 'loss': 2.5}) + '\\n')\n"
        "def hang():\n"
        "    while True:\n"
        "        time.sleep(0.1)\n"
        "print('step 1 logged', flush=True)\n"
        "hang()\n",
    )


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_case_past_its_timeout_says_where_its_ranks_were(tmp_path, nproc):
    """The cp=4 case of issue 56 ran past the suite's limit and bench_step printed nothing:
    now a case past --timeout has its ranks' stacks printed (under torchrun too, whose
    workers live in sessions of their own), is stopped with every process, and says the last
    step it logged and where each rank waited."""
    run_dir = tmp_path / "run"
    (tmp_path / "repo").mkdir()
    repo = _hanging_train(tmp_path / "repo", run_dir)
    case = benchlib.run_case(
        ["a=1"], run_dir=run_dir, repo=repo, nproc=nproc, timeout=8, log=tmp_path / "logs/c0"
    )
    assert case.timed_out and not case.ok and case.returncode == -9
    line = case.failure()
    assert line.startswith("timed out after ") and "last logged step 1" in line, line
    where = benchlib.stack_summary(case.stderr)
    assert len(where) == nproc, case.stderr[-2000:]
    assert all(w.startswith("train.py:") and " hang" in w for w in where), where
    assert "stacks: train.py:" in line
    # the output was kept as it came, and nothing of the run is left running
    assert (tmp_path / "logs/c0.out").read_text().count("step 1 logged") == nproc
    for proc in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            cmdline = proc.read_bytes()
        except OSError:
            continue
        if str(repo).encode() in cmdline and pid_alive(int(proc.parent.name)):
            raise AssertionError(f"left running: {cmdline!r}")

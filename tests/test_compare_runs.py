"""runlog.py (loading metrics.jsonl and wandb offline logs, comparison) and its command line
tools/compare_runs.py (exit codes, the plot), on synthetic runs with known differences."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runlog import compare, load_run, read_metrics, read_wandb_segments
from tools.compare_runs import main

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def losses(steps, k=None, delta=0.0):
    """A loss curve; from step k on (if given) shifted by delta."""
    return {s: 5.0 / (1 + 0.1 * s) + (delta if k is not None and s >= k else 0.0) for s in steps}


def write_run(run_dir: Path, loss: dict[int, float], grad_norm: float = 1.0) -> Path:
    run_dir.mkdir(parents=True)
    lines = [
        json.dumps({"step": s, "loss": v, "grad_norm": grad_norm * s, "mfu": None})
        for s, v in sorted(loss.items())
    ]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run_dir


def cli(*args, cwd=ROOT):
    r = subprocess.run(
        [sys.executable, "tools/compare_runs.py", *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return r.returncode, r.stdout + r.stderr


def test_identical_runs_pass_assert_equal_and_write_png(tmp_path):
    a = write_run(tmp_path / "a", losses(range(1, 21)))
    b = write_run(tmp_path / "b", losses(range(1, 21)))
    png = tmp_path / "plots" / "cmp.png"
    rc, out = cli(a, b, "--assert-equal", "--metrics", "loss,grad_norm", "--plot", png)
    assert rc == 0, out
    assert "loss: " in out and "20 common steps" in out and "max abs diff 0.000e+00" in out
    assert "first step beyond bitwise: none" in out and "OK: runs agree" in out
    data = png.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000


def test_difference_at_step_k_is_reported_and_fails(tmp_path):
    steps = range(1, 31)
    a = write_run(tmp_path / "a", losses(steps))
    b = write_run(tmp_path / "b", losses(steps, k=17, delta=1e-6))
    rc, out = cli(a, b, "--assert-equal", "--no-plot")
    assert rc == 1, out
    assert "first step beyond bitwise: step 17" in out and "FAIL" in out

    report = compare({"a": load_run(a), "b": load_run(b)}, ["loss", "grad_norm"])
    loss, grad = report.diffs
    assert not report.ok
    assert loss.first_diff_step == 17 and loss.common_steps == 30
    assert loss.max_abs == pytest.approx(1e-6, rel=1e-6)
    # Largest relative difference is where the loss is smallest (the last step).
    assert loss.max_rel == pytest.approx(1e-6 / (5.0 / 4.0), rel=1e-6)
    assert grad.first_diff_step is None and grad.max_abs == 0.0

    # Tolerances: 1e-6 absolute on a loss >= 1.25 is below rtol 1e-5, above rtol 1e-7.
    assert cli(a, b, "--rtol", "1e-5", "--no-plot")[0] == 0
    rc, out = cli(a, b, "--rtol", "1e-7", "--no-plot")
    assert rc == 1 and "first step beyond rtol=1e-07 atol=0: step 17" in out
    assert cli(a, b, "--atol", "2e-6", "--no-plot")[0] == 0
    # Without a check the report is printed and the status is 0.
    rc, out = cli(a, b, "--no-plot")
    assert rc == 0 and "step 17" in out


def test_different_step_sets(tmp_path):
    a = write_run(tmp_path / "a", losses(range(1, 21)))
    longer = write_run(tmp_path / "longer", losses(range(1, 31)))
    disjoint = write_run(tmp_path / "disjoint", losses(range(21, 31)))

    # Overlap: compared on the 20 common steps; the extra steps are listed.
    rc, out = cli(a, longer, "--assert-equal", "--no-plot")
    assert rc == 0, out
    assert "20 common steps" in out and "only in" in out and "10 steps (21, 22" in out
    rc, out = cli(a, longer, "--assert-equal", "--same-steps", "--no-plot")
    assert rc == 1, out

    # No overlap: nothing was compared, so a check fails; a plain report does not.
    rc, out = cli(a, disjoint, "--assert-equal", "--no-plot")
    assert rc == 1 and "no common steps" in out, out
    rc, out = cli(a, disjoint, "--no-plot")
    assert rc == 0 and "no common steps" in out, out
    report = compare([load_run(a), load_run(disjoint)], ["loss"])
    assert report.diffs[0].common_steps == 0 and not report.ok


def test_three_runs_compare_against_the_first(tmp_path):
    steps = range(1, 11)
    runs = {"ref": losses(steps), "same": losses(steps), "off": losses(steps, k=4, delta=0.5)}
    report = compare(runs_as_records(runs), ["loss"], atol=0.1)
    assert [(d.other, d.first_diff_step) for d in report.diffs] == [("same", None), ("off", 4)]
    assert report.diffs[1].max_abs == pytest.approx(0.5)


def runs_as_records(runs):
    return {k: {s: {"loss": v} for s, v in r.items()} for k, r in runs.items()}


def test_nan_and_missing_values():
    ref = {1: {"loss": 1.0}, 2: {"loss": math.nan}, 3: {"loss": 2.0, "mfu": None}}
    same = {1: {"loss": 1.0}, 2: {"loss": math.nan}, 3: {"loss": 2.0}}
    diverged = {1: {"loss": 1.0}, 2: {"loss": 3.0}, 3: {"loss": math.nan}}
    assert compare([ref, same], ["loss"]).ok
    d = compare([ref, diverged], ["loss"], rtol=1.0).diffs[0]
    assert d.first_diff_step == 2 and d.max_abs == math.inf


def test_bad_input_exits_2(tmp_path):
    a = write_run(tmp_path / "a", losses(range(1, 5)))
    rc, out = cli(a, tmp_path / "missing", "--no-plot")
    assert rc == 2 and "not a run directory" in out and "Traceback" not in out
    rc, out = cli(a, a, "--metrics", "accuracy", "--no-plot")
    assert rc == 2 and "metric 'accuracy' is in none of the runs" in out
    assert main([str(a), str(a), "--assert-equal", "--rtol", "1e-3", "--no-plot"]) == 2


def test_read_metrics_skips_a_cut_line_and_later_records_replace(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert read_metrics(path) == []  # no file yet: no records
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    assert read_metrics(path) == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]
    path.write_text(
        '{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 2, "loss": 1.0}\n'
    )
    assert load_run(path) == load_run(tmp_path) == {1: {"loss": 2.0}, 2: {"loss": 1.0}}


def test_library_modules_import_neither_tools_nor_tests():
    """tools/ and tests/ use the library (runlog.py, train.py, ...), never the other way round."""
    import ast

    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("tools", "tests") or any(p.startswith(".") for p in rel.parts):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            offenders += [f"{rel}: {n}" for n in names if n.split(".")[0] in ("tools", "tests")]
    assert not offenders, offenders


WANDB_SCRIPT = """
import sys, wandb
first, last, offset = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
run = wandb.init(project="p", mode="offline", dir=sys.argv[4], id="seg123", resume="allow")
for s in range(first, last + 1):
    run.log({"loss": 5.0 / (1 + 0.1 * s) + offset, "grad_norm": 1.0 * s}, step=s)
run.finish()
"""


def wandb_segment(tmp: Path, first: int, last: int, offset: float = 0.0):
    env = dict(os.environ, WANDB_SILENT="true", WANDB_DISABLE_GIT="true")
    subprocess.run(
        [sys.executable, "-c", WANDB_SCRIPT, str(first), str(last), str(offset), str(tmp)],
        check=True,
        env=env,
        timeout=120,
    )


def test_wandb_offline_segments(tmp_path):
    # Two segments of one run id, as a resumed offline run leaves them; 150 steps cross
    # the 32 KiB block boundary of the transaction log.
    wandb_segment(tmp_path, 1, 150)
    wandb_segment(tmp_path, 121, 200, offset=1.0)  # rewrites 121..150
    segments = read_wandb_segments(tmp_path / "wandb")
    assert [len(s.rows) for s in segments] == [150, 80]
    assert segments[0].start_time < segments[1].start_time
    assert {s.run_id for s in segments} == {"seg123"}
    assert segments[0].path.stat().st_size > 32768

    merged = load_run(tmp_path / "wandb")
    assert sorted(merged) == list(range(1, 201))
    assert merged[120]["loss"] == 5.0 / (1 + 0.1 * 120)  # bitwise: json round-trips floats
    assert merged[121]["loss"] == 5.0 / (1 + 0.1 * 121) + 1.0  # later segment supersedes

    ref = write_run(tmp_path / "ref", {s: 5.0 / (1 + 0.1 * s) for s in range(1, 151)})
    first_segment = segments[0].path.parent
    rc, out = cli(ref, first_segment, "--assert-equal", "--metrics", "loss,grad_norm", "--no-plot")
    assert rc == 0 and "150 common steps" in out, out
    rc, out = cli(ref, tmp_path / "wandb", "--assert-equal", "--no-plot")
    assert rc == 1 and "first step beyond bitwise: step 121" in out, out

    # A log cut mid-record (a killed writer) reads up to the last whole record.
    log = segments[0].path
    cut = tmp_path / "cut" / "run-seg123.wandb"
    cut.parent.mkdir()
    cut.write_bytes(log.read_bytes()[:40000])
    rows = load_run(cut)
    assert 0 < len(rows) < 150 and sorted(rows) == list(range(1, len(rows) + 1))

"""runlog.py (loading metrics.jsonl, wandb runs through the public API, comparison) and its
command line tools/compare_runs.py (exit codes, the optional plot and its options, a plain
install without matplotlib), on synthetic runs with known differences."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runlog import CompareError, compare, load_run, read_metrics
from tools.compare_runs import main, moving_average

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def losses(steps, k=None, delta=0.0):
    """A loss curve; from step k on (if given) shifted by delta."""
    return {s: 5.0 / (1 + 0.1 * s) + (delta if k is not None and s >= k else 0.0) for s in steps}


def write_run(run_dir: Path, loss: dict[int, float], grad_norm: float = 1.0) -> Path:
    run_dir.mkdir(parents=True)
    lines = [
        json.dumps(
            {
                "step": s,
                "loss": v,
                "val_loss": v + 0.1 if s % 5 == 0 else None,
                "grad_norm": grad_norm * s,
                "tokens_seen": 1024 * s,
                "mfu": None,
            }
        )
        for s, v in sorted(loss.items())
    ]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run_dir


def cli(*args, cwd=ROOT, env=None):
    r = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "compare_runs.py"), *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
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


def test_plot_only_when_asked_and_its_options(tmp_path):
    a = write_run(tmp_path / "a", losses(range(1, 41)))
    b = write_run(tmp_path / "b", losses(range(1, 41), k=10, delta=0.01))
    rc, out = cli(a, b, "--metrics", "loss,val_loss", cwd=tmp_path)
    assert rc == 0 and "val_loss: " in out and "8 common steps" in out, out
    assert "plot:" not in out and not list(tmp_path.glob("*.png"))  # no --plot: no file
    png = tmp_path / "p.png"
    rc, out = cli(a, b, "--plot", png, "--smooth", "5", "--logy", "--x", "tokens")
    assert rc == 0 and f"plot: {png}" in out, out
    assert png.read_bytes()[:8] == PNG_MAGIC
    rc, out = cli(a, b, "--smooth", "5")
    assert rc == 2 and "add --plot FILE" in out
    # --x tokens needs tokens_seen.
    c = tmp_path / "c"
    c.mkdir()
    (c / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.5}\n')
    rc, out = cli(a, c, "--plot", tmp_path / "q.png", "--x", "tokens")
    assert rc == 2 and "--x tokens needs tokens_seen" in out


def test_moving_average_is_trailing():
    assert moving_average([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
    assert moving_average([1.0, 2.0, 3.0], 1) == [1.0, 2.0, 3.0]
    assert moving_average([3.0, 6.0, 9.0, 0.0], 3) == [3.0, 4.5, 6.0, 5.0]


def test_without_matplotlib_the_report_works_and_plot_says_what_to_install(tmp_path):
    blocker = tmp_path / "block" / "matplotlib"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('blocked for this test')\n")
    env = dict(os.environ, PYTHONPATH=str(blocker.parent))
    a = write_run(tmp_path / "a", losses(range(1, 11)))
    b = write_run(tmp_path / "b", losses(range(1, 11)))
    rc, out = cli(a, b, "--assert-equal", env=env)
    assert rc == 0 and "OK: runs agree" in out, out
    rc, out = cli(a, b, "--plot", tmp_path / "x.png", env=env)
    assert rc == 2 and out.strip().splitlines() == [
        "error: --plot needs matplotlib: pip install matplotlib (or pip install -e '.[dev]')"
    ]


def test_wandb_offline_directories_read_the_run_directory(tmp_path):
    run = write_run(tmp_path / "runs" / "a", losses(range(1, 6)))
    segment = run / "wandb" / "offline-run-20250101_000000-abc"
    segment.mkdir(parents=True)
    (segment / "run-abc.wandb").write_bytes(b"private format, never parsed")
    expected = load_run(run)
    assert load_run(run / "wandb") == load_run(segment) == expected
    assert load_run(segment / "run-abc.wandb") == expected
    stray = tmp_path / "elsewhere" / "wandb" / "offline-run-x"
    stray.mkdir(parents=True)
    with pytest.raises(CompareError, match=r"no run directory encloses"):
        load_run(stray)
    rc, out = cli(run, segment, "--assert-equal")
    assert rc == 0 and "5 common steps" in out, out


def test_online_runs_through_the_public_api(monkeypatch):
    import wandb

    class FakeApiRun:
        def scan_history(self):
            return [
                {"_step": 1, "_runtime": 3.0, "_timestamp": 1.0, "loss": 2.0, "lr": 0.1},
                {"_step": 2, "_runtime": 4.0, "_timestamp": 2.0, "loss": 1.5, "lr": 0.1},
            ]

    class FakeApi:
        def run(self, path):
            assert path == "me/proj/abc123"
            return FakeApiRun()

    monkeypatch.setattr(wandb, "Api", FakeApi)
    assert load_run("me/proj/abc123") == {1: {"loss": 2.0, "lr": 0.1}, 2: {"loss": 1.5, "lr": 0.1}}

    class Offline:
        def run(self, path):
            raise ConnectionError("no network")

    monkeypatch.setattr(wandb, "Api", Offline)
    with pytest.raises(CompareError, match=r"could not read the wandb run \(ConnectionError"):
        load_run("me/proj/abc123")


def test_no_reader_of_wandb_private_files_in_the_library():
    for path in sorted(ROOT.glob("*.py")):
        text = path.read_text()
        assert "wandb_internal_pb2" not in text and ":W&B" not in text, path

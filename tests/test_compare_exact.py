"""train.deterministic and tools/compare_runs.py --exact on real runs: train.py on the tiny model
on CPU (deterministic by nature), so two runs and a resume agree bit for bit; a run with another
seed differs and --exact names its first differing step; a run recorded as a GPU run without
train.deterministic gets the note that its differences are noise."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from runtime import deterministic_env, launch

ROOT = Path(__file__).resolve().parents[1]
STEPS = 4
COMMON = ["model=tiny", "data.seq_len=64", f"train.steps={STEPS}", "train.log_every=1"]


def train(root: Path, name: str, *extra: str, env=None) -> subprocess.CompletedProcess:
    r = launch(
        [*COMMON, f"run.root={root}", f"run.name={name}", *extra], env=env or {}, timeout=300
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def cli(*args) -> tuple[int, str]:
    r = launch(list(map(str, args)), program=("tools/compare_runs.py",), timeout=120)
    return r.returncode, r.stdout + r.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    out = {
        "a": train(root, "a", "checkpoint=none"),
        "det": train(root, "det", "checkpoint=none", "train.deterministic=true"),
        "seed": train(root, "seed", "checkpoint=none", "train.seed=7"),
        "env": train(
            root,
            "env",
            "checkpoint=none",
            env={"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"},
        ),
    }
    # A resume: 2 steps saved, then the same command continued to STEPS (same schedule).
    sched = f"optim.schedule_steps={STEPS}"
    train(root, "resumed", "checkpoint=sync", "train.steps=2", sched)
    out["resumed"] = train(root, "resumed", "checkpoint=sync", sched)
    return root, out


def test_deterministic_flag_prints_its_line_and_is_recorded(runs):
    root, out = runs
    assert "deterministic: on (NVTE_ALLOW_NONDETERMINISTIC_ALGO=0, " in out["det"].stdout
    assert "deterministic:" not in out["a"].stdout
    config = yaml.safe_load((root / "det" / "config.yaml").read_text())
    assert config["train"]["deterministic"] is True
    assert (
        yaml.safe_load((root / "a" / "config.yaml").read_text())["train"]["deterministic"] is False
    )
    # the environment set by hand: recorded as what was in effect
    assert "recorded as train.deterministic=true" in out["env"].stdout
    assert yaml.safe_load((root / "env" / "config.yaml").read_text())["train"]["deterministic"]
    header = (root / "a" / "configs" / "segment-0000000.yaml").read_text().splitlines()[0]
    assert header.endswith("; device: cpu")


def test_deterministic_env_needs_both_variables():
    assert deterministic_env(
        {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0", "CUBLAS_WORKSPACE_CONFIG": ":16:8"}
    )
    assert not deterministic_env({"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"})
    assert not deterministic_env(
        {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "1", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    )


def test_exact_passes_for_repeats_and_a_resume(runs):
    root, _ = runs
    code, out = cli(root / "a", root / "det", root / "resumed", root / "env", "--exact")
    assert code == 0, out
    assert "OK: runs agree" in out
    assert "first difference" not in out and "note:" not in out


def test_exact_fails_and_names_the_first_differing_step(runs):
    root, _ = runs
    code, out = cli(root / "a", root / "seed", "--exact")
    assert code == 1, out
    a = [r for r in map(yaml.safe_load, (root / "a" / "metrics.jsonl").open()) if "loss" in r]
    b = [r for r in map(yaml.safe_load, (root / "seed" / "metrics.jsonl").open()) if "loss" in r]
    first = next(x["step"] for x, y in zip(a, b) if x["loss"] != y["loss"])
    assert f"first difference: loss at step {first}: " in out
    assert f"{a[first - 1]['loss']!r}" in out and f"{b[first - 1]['loss']!r}" in out
    assert "FAIL: runs differ" in out


def test_exact_fails_on_a_missing_step(runs, tmp_path):
    root, _ = runs
    short = tmp_path / "short"
    shutil.copytree(root / "a", short)
    lines = (short / "metrics.jsonl").read_text().splitlines()
    (short / "metrics.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    code, out = cli(root / "a", short, "--exact")
    assert code == 1, out
    assert f"first difference: loss at step {STEPS}: logged by one run only" in out
    code, out = cli(root / "a", short, "--assert-equal")  # common steps only: passes
    assert code == 0, out


def test_exact_rejects_tolerances(runs):
    root, _ = runs
    code, out = cli(root / "a", root / "det", "--exact", "--rtol", "1e-3")
    assert code == 2 and "either --assert-equal/--exact or --rtol/--atol" in out


def test_a_gpu_run_without_determinism_is_called_noise(runs, tmp_path):
    """The segment header of a copy of run `a` says cuda, as train.py writes it on a GPU."""
    root, _ = runs
    gpu = tmp_path / "gpu"
    shutil.copytree(root / "a", gpu)
    seg = gpu / "configs" / "segment-0000000.yaml"
    seg.write_text(seg.read_text().replace("; device: cpu", "; device: cuda", 1))
    code, out = cli(root / "det", gpu, "--rtol", "1e-3")
    assert code == 0, out
    notes = [line for line in out.splitlines() if line.startswith("note:")]
    assert notes == [
        f"note: {gpu} ran on a GPU without train.deterministic (segment(s) from step 0): its "
        "differences from another run are expected noise (compared with rtol=0.001 atol=0); "
        "rerun both with train.deterministic=true to compare bit for bit"
    ]
    # the same run marked deterministic: no note
    seg.write_text(seg.read_text().replace("deterministic: false", "deterministic: true", 1))
    code, out = cli(root / "det", gpu, "--exact")
    assert code == 0 and "note:" not in out, out

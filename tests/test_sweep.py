"""Sweeps and the command line: Hydra multirun runs every job in its own run directory and
exits with a failure of any job; `experiment=` is checked against conf/experiment/ before
Hydra composes; sweep.py (slurm/sweep.sh's planner) names jobs as the multirun does."""

from __future__ import annotations

import pytest

import sweep
from runlog import read_metrics
from runtime import exit_status, launch
from tests.helpers import CPU_ENV
from tests.test_eval import TINY

SWEEP = ["optim.lr=1e-3,3e-3", "train.steps=3", *TINY, "checkpoint=none"]


def test_multirun_runs_each_job_in_its_own_run_directory(tmp_path):
    r = launch(["-m", *SWEEP, f"run.root={tmp_path}"], env=CPU_ENV, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    names = ["tiny-bf16-fsdp-optim.lr=0.001", "tiny-bf16-fsdp-optim.lr=0.003"]
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == names
    a, b = (read_metrics(tmp_path / n / "metrics.jsonl") for n in names)
    assert [x["step"] for x in a] == [x["step"] for x in b] == [1, 2, 3]
    assert a[0]["loss"] == b[0]["loss"]  # same weights and data before the first update
    assert a[-1]["loss"] != b[-1]["loss"] and a[-1]["lr"] * 3 == pytest.approx(b[-1]["lr"])
    assert "sweep job 1: run.name=tiny-bf16-fsdp-optim.lr=0.003" in r.stdout
    assert "sweep: 2 jobs, exit statuses [0, 0]" in r.stdout
    assert list(tmp_path.glob(".sweeps/*/multirun.yaml"))
    # slurm/sweep.sh's plan names the same jobs the same way.
    count, plan = sweep.plan([*SWEEP, f"run.root={tmp_path}"], tmp_path / "plan")
    assert count == 2
    for num, name in enumerate(names):
        lines = (plan / f"{num}.args").read_text().splitlines()
        assert (
            lines[0] == f"optim.lr={('0.001', '0.003')[num]}" and lines[-1] == f"run.name='{name}'"
        )


def test_a_failing_job_fails_the_sweep_and_the_others_still_run(tmp_path):
    # Job 0's run directory cannot be made (a file holds its name): refused at its own start.
    (tmp_path / "tiny-bf16-fsdp-train.global_batch_size=8").write_text("")
    args = ["-m", "train.micro_batch_size=4", "train.global_batch_size=8,4", "train.steps=2"]
    args += [*(a for a in TINY if not a.startswith("train.global")), "checkpoint=none"]
    r = launch([*args, f"run.root={tmp_path}"], env=CPU_ENV, timeout=600)
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    assert "global_batch_size=8 is not a directory); choose a writable" in r.stderr
    assert "exit statuses [2, 0]" in r.stdout
    ran = read_metrics(tmp_path / "tiny-bf16-fsdp-train.global_batch_size=4" / "metrics.jsonl")
    assert [x["step"] for x in ran] == [1, 2]
    # An explicit run.name is kept (every job would share it).
    assert sweep.multirun_run_name("x") is None  # outside a Hydra job


def test_every_job_is_checked_before_the_first_trains(tmp_path, capsys):
    """A rule across fields that job 1 breaks stops the sweep before job 0 trains."""
    import train

    args = ["-m", "train.global_batch_size=16,10", "train.micro_batch_size=4"]
    args += [a for a in TINY if not a.startswith("train.global")]
    assert train.cli([*args, f"run.root={tmp_path}"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [
        "error: sweep job 1 (train.global_batch_size=10): train.global_batch_size=10 must be "
        "divisible by train.micro_batch_size=4 x data-parallel size 1; change one of them (no "
        "job of the sweep was started)"
    ]
    assert not tmp_path.exists() or not any(tmp_path.iterdir())  # nothing trained or written


def test_exit_status_of_a_sweep():
    assert exit_status([]) == exit_status([0, 0]) == 0
    assert exit_status([0, 2]) == exit_status([2, 2]) == 2
    assert exit_status([3, 0]) == 3 and exit_status([2, 3]) == 1


PRESETS = "llama3_1b_fineweb, llama3_8b_128k, llama3_8b_32k, llama3_8b_fineweb"


@pytest.mark.parametrize(
    "args, bad",
    [
        (["experiment=llama3_8b_finweb"], "llama3_8b_finweb"),
        (["+experiment=nope", "--cfg", "job"], "nope"),
        (["-m", "experiment=llama3_1b_fineweb,llama3_8b_finweb"], "llama3_8b_finweb"),
    ],
)
def test_unknown_experiment_is_one_line_listing_the_presets(tmp_path, args, bad):
    r = launch([*args, f"run.root={tmp_path}"], env=CPU_ENV, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().splitlines() == [
        f"error: experiment={bad} is not a preset of conf/experiment/; choose one of: {PRESETS}"
    ]
    assert not any(tmp_path.iterdir())


def test_job_names():
    assert sweep.job_name("m", ["b=2", "a='x/y'"], 0) == "m-a=_x_y_,b=2"
    assert sweep.job_name("m", [], 4) == "m-job4"
    long = sweep.job_name("m", [f"data.path={'p' * 300}"], 0)
    assert len(long) <= 2 + sweep.MAX_SUFFIX and long != sweep.job_name("m", ["x" * 300], 0)
    jobs = sweep.expand(["a=1,2", "b=x", "c=range(0,2)"])
    assert [j for j, _ in jobs] == [
        ["a=1", "b=x", "c=0"],
        ["a=1", "b=x", "c=1"],
        ["a=2", "b=x", "c=0"],
        ["a=2", "b=x", "c=1"],
    ]
    assert jobs[3][1] == ["a=2", "c=1"]
    args = sweep.cli_args(["-m", "a=1,2", "b=x", "--cfg", "job"])
    assert args[-1] == f"{sweep.EXCLUDE_KEYS}=[b]"
    assert sweep.cli_args(["a=1", "b=x"]) == ["a=1", "b=x"]  # not a multirun: as given

"""runtime.check_determinism: the combination TE cannot keep fused on sm_90 is refused in one
line; every other combination passes. runtime.GcSchedule (train.gc_every) collects at its
steps only and changes no loss; parallel.nccl_high_priority sets its variable."""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from config import TrainConfig
from errors import ConfigError
from model.memory import cpu_note, cpu_run_estimate
from runlog import read_metrics
from runtime import (
    NCCL_HIGH_PRIORITY_ENV,
    GcSchedule,
    apply_nccl_priority,
    check_determinism,
    cpu_threads,
    launch,
)
from tests.helpers import CPU_ENV, TINY_RUN


def test_deterministic_documents_on_sm90_te_are_refused(monkeypatch):
    capability = {"value": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: capability["value"])
    cuda = torch.device("cuda", 0)
    with pytest.raises(ConfigError) as e:
        check_determinism(True, "te", True, cuda)
    line = str(e.value)
    assert "\n" not in line and "train.deterministic=true" in line
    assert "data.document_mask=false" in line
    # Off, causal, the reference model, the CPU, or another architecture: accepted.
    check_determinism(False, "te", True, cuda)
    check_determinism(True, "te", False, cuda)
    check_determinism(True, "torch", True, cuda)
    check_determinism(True, "te", True, torch.device("cpu"))
    capability["value"] = (10, 0)
    check_determinism(True, "te", True, cuda)


def test_gc_schedule_collects_after_its_steps_only():
    starts = []

    def record(phase, info):
        if phase == "start":
            starts.append(info["generation"])

    was = gc.isenabled()
    gc.callbacks.append(record)
    try:
        with GcSchedule(3, say=lambda *a, **k: None) as collector:
            assert not gc.isenabled() and gc.get_freeze_count() > 0
            starts.clear()
            during = []
            for step in range(1, 10):
                junk = [[] for _ in range(5000)]  # cycles: automatic gen-0 collections due
                for j in junk:
                    j.append(j)
                del junk
                before = len(starts)
                collector.after(step)
                during.append(len(starts) - before)
            assert during == [0, 0, 1, 0, 0, 1, 0, 0, 1]
            assert starts == [2, 2, 2]  # full collections, none automatic in between
        assert gc.isenabled() == was and gc.get_freeze_count() == 0
        with GcSchedule(0) as collector:  # off: Python's collector untouched
            assert gc.isenabled() == was and gc.get_freeze_count() == 0
            starts.clear()
            collector.after(3)
            assert starts == []
    finally:
        gc.callbacks.remove(record)


def test_nccl_priority_sets_its_variable(monkeypatch):
    monkeypatch.delenv(NCCL_HIGH_PRIORITY_ENV, raising=False)
    assert apply_nccl_priority(False, torch.device("cpu")) is None
    assert NCCL_HIGH_PRIORITY_ENV not in os.environ
    line = apply_nccl_priority(True, torch.device("cpu"))
    assert os.environ[NCCL_HIGH_PRIORITY_ENV] == "1" and "no effect here" in line


def test_gc_every_and_nccl_priority_change_no_loss(tmp_path):
    """train.py with both levers on: the same losses, bit for bit, as without."""
    losses = {}
    for name, extra in (
        ("plain", []),
        ("levers", ["train.gc_every=2", "parallel.nccl_high_priority=true"]),
    ):
        r = launch(
            [f"run.root={tmp_path}", f"run.name={name}", "train.steps=5", *TINY_RUN, *extra],
            env=CPU_ENV,
            timeout=300,
        )
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        losses[name] = [m["loss"] for m in read_metrics(tmp_path / name / "metrics.jsonl")]
        if extra:
            assert "a full collection every 2 steps (train.gc_every)" in r.stdout
            assert f"nccl: {NCCL_HIGH_PRIORITY_ENV}=1 set" in r.stdout
    assert len(losses["plain"]) == 5 and losses["levers"] == losses["plain"]


_FAILING_WORKER = """
import torch.distributed as dist
dist.init_process_group("gloo")
def quantize():
    raise RuntimeError("Cannot generate FP8 data, even from FP8 data transpose")
try:
    quantize()
except RuntimeError as e:
    raise ValueError("the step failed") from e
"""


def test_failure_line_names_the_rank_error_not_torchrun_summary(tmp_path):
    """A torchrun job whose ranks raise: the failing rank's own (outermost) exception, where
    the last line with "Error" in it is torchrun's ChildFailedError."""
    from runtime import failure_line, launch

    script = tmp_path / "worker.py"
    script.write_text(_FAILING_WORKER)
    r = launch([], nproc=2, program=(str(script),), timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "ChildFailedError" in out
    line = failure_line(out)
    assert line in ("rank 0: ValueError: the step failed", "rank 1: ValueError: the step failed")
    # One process (no rank prefix), and the project's own one-line refusal first.
    plain = "Traceback (most recent call last):\n  x\nRuntimeError: Cannot generate FP8 data\n"
    assert failure_line(plain) == "RuntimeError: Cannot generate FP8 data"
    refused = "[rank0]: warning\nerror: data.path='x' does not exist\nChildFailedError:\n"
    assert failure_line(refused) == "error: data.path='x' does not exist"
    assert failure_line("") == "?" and failure_line("last words\n") == "last words"


def test_cpu_threads_from_the_idle_cores():
    """The idle cores at start, shared among the node's processes, 1 to MAX_CPU_THREADS
    (measured: docs/PERFORMANCE.md, CPU threads); OMP_NUM_THREADS, set by the user or by
    torchrun, is kept."""
    assert cpu_threads({}, cores=2, load=0.2) == (2, "2 cores, load 0.2: 2 idle")
    assert cpu_threads({}, cores=2, load=1.0) == (1, "2 cores, load 1.0: 1 idle")
    assert cpu_threads({}, cores=2, load=4.8) == (1, "2 cores, load 4.8: 0 idle")
    assert cpu_threads({}, cores=16, load=0.0)[0] == 2  # more is not measured to help
    two = {"LOCAL_WORLD_SIZE": "2"}
    assert cpu_threads(two, cores=2, load=0.0) == (1, "2 cores, load 0.0: 2 idle over 2 processes")
    assert cpu_threads(two, cores=8, load=1.0)[0] == 2
    assert cpu_threads({"OMP_NUM_THREADS": "4"}, cores=2, load=9) == (4, "OMP_NUM_THREADS")
    assert cpu_threads({"OMP_NUM_THREADS": "0"}, cores=2, load=0)[0] == 2


def model_section(name: str):
    """conf/model/<name>.yaml's ModelConfig (the default run's train section: TrainConfig(),
    its data.seq_len: 256)."""
    from config import compose_config

    return compose_config([f"model={name}"]).model


def test_cpu_estimate_against_the_measured_runs():
    """The estimate against what was measured on 2 cores: model=tiny 0.67 s a step at a
    52 GFLOP/s probe (0.82 GiB peak RSS), model=small about a minute a step (5 GB); only models
    above SLOW_CPU_STEP_S get the start-up note."""
    tiny = cpu_run_estimate(model_section("tiny"), TrainConfig(), 256, 1, rate=52e9)
    assert 0.67 / 2 < tiny["step_s"] < 0.67 * 2 and 0.82 / 2 < tiny["memory_gib"] < 0.82 * 2
    small = cpu_run_estimate(model_section("small"), TrainConfig(), 256, 1, rate=52e9)
    assert 30 < small["step_s"] < 180 and 2.5 < small["memory_gib"] < 10
    assert cpu_note(model_section("tiny"), TrainConfig(), 256, 1, 1, rate=52e9) is None
    assert cpu_note(model_section("small"), TrainConfig(), 256, 1, 1, rate=52e9).startswith(
        "note: model=small on this CPU: about 1m"
    )


def test_a_model_too_big_for_the_cpu_says_so_unless_refused(tmp_path):
    """model=llama3_1b on CPU: the dry run gives the estimate and the way out first, before the
    model is built (and does not suggest itself). A run refused by a check, here the run
    directory's, prints its error line alone."""
    memory = cpu_run_estimate(model_section("llama3_1b"), TrainConfig(), 256, 1, rate=1.0)
    memory = memory["memory_gib"]
    note = re.compile(
        r"note: model=llama3_1b on this CPU: about \S+ a step of 16 x 256 tokens \(300 steps: "
        rf"about \S+\) and {memory:.1f} GiB of memory per process, (more|less) than this "
        r"machine's \d+ GiB \(estimate at 1 thread, \d+ GFLOP/s measured now\); for a CPU run "
        r"use model=tiny, to train it a GPU \(docs/INSTALL.md\)"
    )
    r = launch(["model=llama3_1b", "train.dry_run=true", f"run.root={tmp_path}"], env=CPU_ENV)
    out = [x for x in r.stdout.splitlines() if x.strip()]
    assert r.returncode == 0 and note.fullmatch(out[0]) and out[1].startswith("dry run: "), out
    (tmp_path / "file").write_text("")
    r = launch(["model=llama3_1b", f"run.root={tmp_path}/file"], env=CPU_ENV, timeout=300)
    assert r.returncode == 2 and not r.stdout.strip(), r.stdout + r.stderr
    assert r.stderr.strip().startswith(f"error: run.root={tmp_path}/file: cannot write to ")


def test_a_refused_resume_of_a_model_too_big_for_the_cpu_prints_only_its_error(tmp_path):
    """model=small on the run directory of a model=tiny run (issue #53): the resume check's
    one line, without the CPU estimate that a run going ahead would print first."""
    run = [f"run.root={tmp_path}", "run.name=r", "train.steps=1", "optim.warmup_steps=0"]
    r = launch(run, env=CPU_ENV, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    r = launch(["model=small", *run], env=CPU_ENV, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "note: " not in r.stdout + r.stderr, r.stdout + r.stderr
    errors = [x for x in r.stderr.splitlines() if x.startswith("error: ")]
    assert len(errors) == 1 and "model." in errors[0], r.stderr
    assert [x for x in r.stdout.splitlines() if x.strip()] == [], r.stdout


def _two_runs_in_one_process(rank, world_size, root):
    """train.run twice with the same layout in one process group (as a Hydra multirun's jobs
    or the test harnesses run it): the second run reuses the first one's mesh (no new mesh
    groups, so no new NCCL communicators on GPUs) and trains the same losses, bit for bit."""
    from torch.distributed import distributed_c10d as c10d

    import train
    from config import compose_config
    from runlog import read_metrics

    counts, losses = [], []
    for name in ("a", "b"):
        cfg = compose_config(
            [
                "model=tiny",
                "model.impl=torch",
                *TINY_RUN,
                "parallel=fsdp",
                "train.steps=3",
                "checkpoint=none",
                f"run.root={root}",
                f"run.name={name}",
            ]
        )
        assert train.run(cfg) == 0
        counts.append(sum(g.group_desc.startswith("mesh") for g in c10d._world.pg_map))
        losses.append([m["loss"] for m in read_metrics(Path(root) / name / "metrics.jsonl")])
    assert counts[1] == counts[0], f"the second run made {counts[1] - counts[0]} mesh groups"
    assert len(losses[0]) == 3 and losses[1] == losses[0]


def test_a_second_run_in_one_process_reuses_the_mesh(tmp_path):
    from tests.distributed import run_distributed

    run_distributed(_two_runs_in_one_process, 2, str(tmp_path))


def test_a_stop_signal_is_said_as_it_arrives(tmp_path, capfd):
    """SIGUSR1 during step 2 of a run that logs (and so checks for a stop) every 5 steps: one
    line at once, read during step 3, before that log step, says what will be saved and when;
    the stop then saves step 5 and exits for requeue."""
    import signal

    import train
    from config import compose_config
    from tests.ckpt_harness import committed

    real, calls, early = train.train_step, [], []

    def step_and_signal(*a, **k):
        calls.append(1)
        if len(calls) == 3:  # step 3 starts: what was said so far
            early.append(capfd.readouterr().err)
        out = real(*a, **k)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGUSR1)
        return out

    overrides = [a for a in TINY_RUN if not a.startswith("train.log_every")]
    cfg = compose_config(
        [f"run.root={tmp_path}", "run.name=s", *overrides, "train.log_every=5", "train.steps=8"]
        + ["data=synthetic", "checkpoint=sync", "checkpoint.interval=100", "train.device=cpu"]
    )
    train.train_step = step_and_signal
    try:
        assert train.run(cfg) == 3
    finally:
        train.train_step = real
    said = [x for x in early[0].splitlines() if x.startswith("stopping:")]
    assert len(said) == 1 and re.fullmatch(
        r"stopping: SIGUSR1 received during step 2; the run saves a checkpoint of step 5 at "
        r"the latest \(the next log step, train.log_every=5\), in about \d+s at this run's "
        r"pace, then exits",
        said[0],
    ), early[0]
    assert "stopping:" not in capfd.readouterr().err  # said once
    assert committed(tmp_path / "s" / "checkpoints") == [5]


def test_cpu_arithmetic_sets_mkl_strict_unless_set():
    """runtime.pin_cpu_arithmetic in a fresh process (MKL reads its variable once, at its first
    call): MKL_CBWR=AUTO,STRICT on a CPU run, a value the user set is kept, GPU runs are left
    alone; ATen's kernels stay the CPU's own, as the start-up line says."""
    code = (
        "import os, sys, torch, runtime\n"
        "dev = torch.device(sys.argv[1])\n"
        "print(runtime.pin_cpu_arithmetic(dev), os.environ.get('MKL_CBWR'),"
        " torch.backends.cpu.get_cpu_capability().lower())\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "MKL_CBWR")}

    def pinned(device: str, **extra) -> str:
        r = subprocess.run(
            [sys.executable, "-c", code, device],
            cwd=Path(__file__).resolve().parents[1],
            env={**env, **extra},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    own = pinned("cpu").split()[-1]  # this CPU's capability (avx512, avx2 or default)
    assert pinned("cpu") == f"cpu={own} AUTO,STRICT {own}"
    assert pinned("cpu", MKL_CBWR="AVX2") == f"cpu={own} AVX2 {own}"
    assert pinned("cpu", ATEN_CPU_CAPABILITY="default") == "cpu=default AUTO,STRICT default"
    assert pinned("meta") == f"None None {own}"


@pytest.mark.slow
def test_the_default_run_does_not_depend_on_the_thread_count(tmp_path):
    """The default run's first steps (model, data and batch of `python train.py`, every step
    logged) with 1 and with 2 threads: the same loss and grad_norm, bit for bit (MKL's strict
    mode, runtime.CPU_ARITHMETIC; with MKL's default they differed from step 3 on, on an Intel
    Xeon). MKL has no strict mode without AVX2."""
    if not torch.cpu._is_avx2_supported():
        pytest.skip("MKL's strict mode needs AVX2 or AVX-512; this CPU has neither")
    curves = []
    for threads in ("1", "2"):
        run = [f"run.root={tmp_path}", f"run.name=t{threads}", "checkpoint=none"]
        env = {**CPU_ENV, "OMP_NUM_THREADS": threads}
        r = launch([*run, "train.steps=6", "train.log_every=1"], env=env, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        assert f" threads={threads} (OMP_NUM_THREADS) " in r.stdout, r.stdout
        rows = read_metrics(tmp_path / f"t{threads}" / "metrics.jsonl")
        curves.append([(x["step"], x["loss"], x["grad_norm"]) for x in rows])
    assert len(curves[0]) == 6 and curves[0] == curves[1], curves


def test_the_stack_dump_registers_where_stderr_has_no_descriptor(monkeypatch, capfd):
    """An in-process run under a program that captures sys.stderr (pytest, a notebook) still
    registers kill -USR2's stack dump, on the process's own stderr (it raised fileno before)."""
    import faulthandler
    import io
    import signal as _signal

    from runtime import STACK_SIGNAL, register_stack_dump

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    register_stack_dump()
    try:
        _signal.raise_signal(STACK_SIGNAL)
        assert "Current thread" in capfd.readouterr().err
    finally:
        faulthandler.unregister(STACK_SIGNAL)

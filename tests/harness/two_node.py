"""Two nodes on one host: the same run launched by two torchrun agents (slurm/launch.py,
--nnodes=2, c10d rendezvous on 127.0.0.1, as slurm/train.sbatch launches one agent per node)
and by one agent with every trainer, compared step by step (loss, grad_norm, lr: equal, or
within --rtol).

    python -m tests.harness.two_node --nproc-per-node 2 --root /tmp/two -- \\
        model=tiny parallel=hsdp_tp parallel.dp_replicate=2 parallel.tp=2 train.steps=10
    python -m tests.harness.two_node --nproc-per-node 1 --root /tmp/two -- \\
        model=tiny train.device=cpu parallel=hsdp parallel.dp_replicate=2 train.steps=4   # CPU

On GPUs each agent sees its own half of CUDA_VISIBLE_DEVICES (or of 0..2N-1), as on two
nodes. Prints one row of tests/harness/multitier.py ({"part": "twonode", "case", "result",
"detail"}, result "passed" or "failed"; also appended to --jsonl) and
exits 0 when the runs agree, 1 when they do not or a launch failed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from runlog import read_metrics  # noqa: E402
from tests.distributed import free_port  # noqa: E402
from tests.harness.multitier import emit_row, row  # noqa: E402

METRICS = ("loss", "grad_norm", "lr")


def launch(
    nnodes: int, nproc: int, endpoint: str, args: list[str], env: dict, script: str = "train.py"
) -> list:
    """One node's torchrun agent (slurm/launch.py) running `script` (train.py, or a script
    that runs it: tests/harness/paced.py)."""
    return [
        sys.executable,
        "slurm/launch.py",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id=two-node-{nnodes}",
        "--max-restarts=0",
        script,
        *args,
    ]


def run(nnodes: int, per_node: int, args: list[str], logs: Path, timeout: float) -> str | None:
    """Start `nnodes` agents of `per_node` trainers; None when all exit 0, else what failed."""
    devices = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = devices.split(",") if devices else [str(i) for i in range(nnodes * per_node)]
    endpoint = f"127.0.0.1:{free_port()}"
    procs = []
    for node in range(nnodes):
        env = dict(os.environ)
        if devices != "":  # CPU runs pass CUDA_VISIBLE_DEVICES=""
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[node * per_node : (node + 1) * per_node])
        log = open(logs / f"{nnodes}node-agent{node}.log", "w")  # noqa: SIM115
        procs.append(
            subprocess.Popen(
                launch(nnodes, per_node, endpoint, args, env),
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    failed = []
    for node, p in enumerate(procs):
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            rc = "timeout"
        if rc != 0:
            failed.append(f"agent {node} of {nnodes}: {rc} ({logs}/{nnodes}node-agent{node}.log)")
    return "; ".join(failed) or None


def compare(one: Path, two: Path, rtol: float) -> str | None:
    a, b = read_metrics(one / "metrics.jsonl"), read_metrics(two / "metrics.jsonl")
    if [r["step"] for r in a] != [r["step"] for r in b] or not a:
        return f"steps differ: {[r['step'] for r in a]} vs {[r['step'] for r in b]}"
    for ra, rb in zip(a, b):
        for m in METRICS:
            x, y = ra[m], rb[m]
            if x != y and abs(x - y) > rtol * abs(x):
                return f"step {ra['step']} {m}: one node {x!r}, two nodes {y!r}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc-per-node", type=int, required=True)
    parser.add_argument("--root", required=True, help="run.root of both runs")
    parser.add_argument("--rtol", type=float, default=0.0, help="0: bit for bit")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--case", default=None, help="the case name in the JSON line")
    parser.add_argument("--jsonl", type=Path, default=None, help="also append the row here")
    parser.add_argument("overrides", nargs="*", help="train.py overrides (after --)")
    a = parser.parse_args(argv)
    root = Path(a.root)
    root.mkdir(parents=True, exist_ok=True)
    n = a.nproc_per_node
    case = a.case or f"2 nodes x {n} vs 1 node x {2 * n}: {' '.join(a.overrides)}"
    base = [*a.overrides, f"run.root={root}"]
    problem = run(1, 2 * n, [*base, "run.name=one-node"], root, a.timeout) or run(
        2, n, [*base, "run.name=two-nodes"], root, a.timeout
    )
    if problem is None:
        problem = compare(root / "one-node", root / "two-nodes", a.rtol)
    steps = len(read_metrics(root / "one-node" / "metrics.jsonl")) if problem is None else 0
    detail = problem or f"{steps} steps, loss/grad_norm/lr " + (
        "bit for bit" if a.rtol == 0 else f"within rtol {a.rtol}"
    )
    emit_row([], row("twonode", case, "failed" if problem else "passed", detail), 0, a.jsonl)
    return 1 if problem else 0


if __name__ == "__main__":
    sys.exit(main())

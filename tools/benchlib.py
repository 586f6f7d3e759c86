"""What the benchmark tools share: one case runner (train.py in its own process, its metrics
and, when it failed, the one line that says why) and one markdown-table writer.

    from tools.benchlib import run_case, table
    case = run_case(["model=tiny", "train.steps=4"], run_dir=root / "a")
    print(table(["run", "loss"], [["a", f"{case.records[-1]['loss']:.4f}"]]))

tools/bench_step.py, bench_recipes.py and bench_determinism.py run their cases with
`run_case`; bench_checkpoint.py runs train.run() in its own process (its disk and host-copy
ceilings are measured around it, under one torchrun) and shares the table writer and the
small helpers. bench_loss.py times the loss functions in-process: it runs no train.py case.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from runlog import read_metrics  # noqa: E402
from runtime import failure_line  # noqa: E402


@dataclass
class Case:
    """One train.py run: its exit status, wall time, output and metrics records."""

    returncode: int
    seconds: float
    stdout: str
    stderr: str
    #: <run_dir>/metrics.jsonl in file order (none when the run wrote none).
    records: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def failure(self) -> str:
        """The line of the output that says why the run failed (runtime.failure_line)."""
        return failure_line(self.stdout + "\n" + self.stderr)

    @property
    def error(self) -> str | None:
        """`failure()` when the run failed; None when it did not."""
        return None if self.ok else self.failure()

    def tail(self, n: int = 40) -> str:
        """The last `n` non-empty lines of stderr then stdout."""
        lines = [line for line in (self.stderr + self.stdout).splitlines() if line.strip()]
        return "\n".join(lines[-n:])


def command(args: Sequence[str], nproc: int = 1, program: str = "train.py") -> list[str]:
    """`python train.py ARGS`, under `torchrun --standalone` when nproc > 1."""
    cmd = [sys.executable]
    if nproc > 1:
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return [*cmd, program, *args]


def run_case(
    args: Sequence[str],
    *,
    run_dir: Path | None = None,
    nproc: int = 1,
    env: dict[str, str] | None = None,
    repo: Path | None = None,
    timeout: float | None = None,
) -> Case:
    """Run train.py with the overrides `args` in a new process (from `repo`, by default this
    checkout; output captured, PYTHONUNBUFFERED=1, `env` added to the environment) and read
    `run_dir`'s metrics.jsonl. A timeout raises subprocess.TimeoutExpired."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        command(args, nproc),
        cwd=repo or ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    seconds = time.perf_counter() - t0
    records = read_metrics(Path(run_dir) / "metrics.jsonl") if run_dir is not None else []
    return Case(proc.returncode, seconds, proc.stdout, proc.stderr, records)


def split_overrides(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the tool's arguments, the train.py overrides after `--`)."""
    argv = list(argv)
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1 :]


def cell(value, fmt: str = "{}") -> str:
    """`value` formatted, or "-" for None (a figure a run did not give)."""
    return "-" if value is None else fmt.format(value)


def row(cells: Sequence) -> str:
    """One markdown table row: `| a | b |` (an empty cell is `| |`)."""
    return "|" + "|".join(f" {c} " if str(c) else " " for c in cells) + "|"


def table(header: Sequence[str], rows: Sequence[Sequence | str]) -> str:
    """A markdown table: the header row, `|---|...`, then each row (a list of cells, or a
    line already written, e.g. a row with a note after it)."""
    lines = [row(header), "|" + "---|" * len(header)]
    lines += [r if isinstance(r, str) else row(r) for r in rows]
    return "\n".join(lines)

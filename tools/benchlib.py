"""What the benchmark tools share: one case runner (train.py in its own process, its metrics
and, when it failed, the one line that says why), one in-process run (`train_here`: the
studies, tools/divergence_study.py and resume_guard_study.py) and one markdown-table writer.

    from tools.benchlib import run_case, table
    case = run_case(["model=tiny", "train.steps=4"], run_dir=root / "a")
    print(table(["run", "loss"], [["a", f"{case.records[-1]['loss']:.4f}"]]))

tools/bench_step.py, bench_recipes.py, bench_determinism.py, bench_threads.py and
recipe_switch_demo.py run their train.py cases with `run_case`; bench_checkpoint.py runs
train.run() in its own process (its disk and host-copy ceilings are measured around it, under
one torchrun) and shares the table writer and the small helpers. bench_loss.py times the loss functions in-process: it runs no train.py case.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from runlog import read_metrics  # noqa: E402
from runtime import STACK_SIGNAL, child_pids, command, failure_line  # noqa: E402


@dataclass
class Case:
    """One train.py run: its exit status, wall time, output and metrics records."""

    returncode: int
    seconds: float
    stdout: str
    stderr: str
    #: <run_dir>/metrics.jsonl in file order (none when the run wrote none).
    records: list[dict] = field(default_factory=list)
    #: Stopped at run_case's timeout (its stacks, when printed, are in stderr).
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def failure(self) -> str:
        """The line of the output that says why the run failed (runtime.failure_line), or for
        a run stopped at its timeout, how far it got and where its ranks were."""
        if self.timed_out:
            last = self.records[-1]["step"] if self.records else None
            where = " | ".join(stack_summary(self.stderr))
            reached = f"last logged step {last}" if last is not None else "no step logged"
            return f"timed out after {self.seconds:.0f} s, {reached}" + (
                f"; stacks: {where}" if where else ""
            )
        return failure_line(self.stdout + "\n" + self.stderr)

    @property
    def error(self) -> str | None:
        """`failure()` when the run failed; None when it did not."""
        return None if self.ok else self.failure()

    def tail(self, n: int = 40) -> str:
        """The last `n` non-empty lines of stderr then stdout."""
        lines = [line for line in (self.stderr + self.stdout).splitlines() if line.strip()]
        return "\n".join(lines[-n:])


def run_case(
    args: Sequence[str],
    *,
    run_dir: Path | None = None,
    nproc: int = 1,
    env: dict[str, str] | None = None,
    repo: Path | None = None,
    timeout: float | None = None,
    log: Path | None = None,
) -> Case:
    """Run train.py with the overrides `args` in a new process (from `repo`, by default this
    checkout; PYTHONUNBUFFERED=1, `env` added to the environment) and read `run_dir`'s
    metrics.jsonl. The output goes to files as it comes (`log` + ".out" / ".err" when given,
    a temporary folder otherwise), so a run that is stopped still tells what it did.

    `timeout` (seconds): a run still going then has its trainers' stacks printed into its
    output (train.py dumps every thread on STACK_SIGNAL), then it is killed with its whole
    process group; the Case has `timed_out` set and returncode -9."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_case_") as tmp:
        base = Path(log) if log is not None else Path(tmp) / "case"
        base.parent.mkdir(parents=True, exist_ok=True)
        out_path, err_path = base.with_name(base.name + ".out"), base.with_name(base.name + ".err")
        with open(out_path, "w") as out, open(err_path, "w") as err:
            proc = subprocess.Popen(
                command(args, nproc),
                cwd=repo or ROOT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                stdout=out,
                stderr=err,
                text=True,
                start_new_session=True,  # the run and its ranks: one group to stop together
            )
            timed_out = False
            try:
                returncode = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                returncode = stop_with_stacks(proc)
        seconds = time.perf_counter() - t0
        stdout, stderr = out_path.read_text(), err_path.read_text()
    records = read_metrics(Path(run_dir) / "metrics.jsonl") if run_dir is not None else []
    return Case(returncode, seconds, stdout, stderr, records, timed_out=timed_out)


def train_here(root: Path, name: str, overrides: Sequence[str], ok=(0,)) -> str:
    """train.run() in this process for the run `name` under `root` (`overrides`: train.py's);
    its stdout, with the one-line error of a run that stopped on a ConfigError. A status not
    in `ok` exits (SystemExit) with that output."""
    import train
    from checkpoint.manager import close_open
    from config import compose_config
    from errors import ConfigError

    out = io.StringIO()
    try:
        with redirect_stdout(out):
            try:
                status = train.run(
                    compose_config([f"run.root={root}", f"run.name={name}", *overrides])
                )
            except ConfigError as e:
                status = 2
                print(f"error: {e}")
    finally:
        close_open()
    if status not in ok:
        raise SystemExit(f"{name}: train.py returned {status}:\n{out.getvalue()}")
    return out.getvalue()


def stop_with_stacks(proc: subprocess.Popen, grace: float = 3.0) -> int:
    """A run past its time: STACK_SIGNAL to the trainers (the process itself, or torchrun's
    workers: the launcher has no handler for it), `grace` seconds for them to print, then
    SIGKILL to each of them and to the run's process group (torchrun starts its workers in
    sessions of their own, so the group alone would leave them running). Returns -9."""
    torchrun = "torch.distributed.run" in " ".join(map(str, proc.args))
    trainers = child_pids(proc.pid) if torchrun else []
    for pid in trainers or [proc.pid]:  # one at a time: their prints share one file
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, STACK_SIGNAL)
        time.sleep(0.5)
    time.sleep(grace)
    for pid in trainers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return -signal.SIGKILL


_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (\S+)')


def stack_summary(text: str, frames: int = 4) -> list[str]:
    """From the stacks faulthandler printed (one block per thread, innermost call first): for
    each process's main thread ("Current thread", the one the signal interrupted), its
    innermost `frames` calls as `file:line function`, innermost first."""
    out, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        if not line.startswith("Current thread"):
            continue
        calls = []
        for frame in lines[i + 1 :]:
            m = _FRAME.match(frame)
            if not m:
                break
            calls.append(f"{Path(m.group(1)).name}:{m.group(2)} {m.group(3)}")
        out.append(" < ".join(calls[:frames]) or "(no frames)")
    return out


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

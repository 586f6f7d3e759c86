"""The suite's forked launches (tests/distributed.py, `launch_forked`: train.py ranks forked
from the preloaded server with torchrun's worker environment) against torchrun starting new
interpreters, as a user's run starts: the same losses bit for bit, and for a refused run the
same exit status and error line. And in the suite's own environment a plain run is forked
(`launch_forked` returns its result instead of None): a variable that the environment or an
earlier test set once sent every run to new interpreters without a sign, at minutes of CI."""

from __future__ import annotations

from runlog import read_metrics
from runtime import launch
from tests.distributed import launch_forked
from tests.helpers import CPU_ENV, LAUNCHED_RUN

TORCHRUN = {**CPU_ENV, "TEST_LAUNCH": "subprocess"}


def _errors(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("error: ")]


def test_forked_ranks_run_as_under_torchrun(tmp_path):
    args = [*LAUNCHED_RUN, "train.steps=3", "checkpoint=none", f"run.root={tmp_path}"]
    forked = launch_forked([*args, "run.name=forked"], nproc=2, env=CPU_ENV, timeout=300)
    assert forked is not None, "a plain 2-rank run in the suite's environment was not forked"
    real = launch([*args, "run.name=torchrun"], nproc=2, env=TORCHRUN, timeout=300)
    assert forked.returncode == real.returncode == 0, forked.stdout[-2000:] + real.stderr[-2000:]

    def losses(name: str) -> list[float]:
        return [r["loss"] for r in read_metrics(tmp_path / name / "metrics.jsonl")]

    assert losses("forked") == losses("torchrun") and len(losses("forked")) == 3

    bad = [*args, "parallel.tp=3", "run.name=bad"]
    forked = launch_forked(bad, nproc=2, env=CPU_ENV, timeout=300)
    real = launch(bad, nproc=2, env=TORCHRUN, timeout=300)
    assert forked.returncode == real.returncode == 1, (forked.returncode, real.returncode)
    said = _errors(forked.stdout + forked.stderr)
    assert said and said == _errors(real.stdout + real.stderr), (said, real.stderr[-2000:])

"""Sweeps: one run directory per job, locally (Hydra multirun) or as a Slurm job array.

    python train.py -m optim.lr=1e-3,3e-3 train.steps=200          # jobs one after the other
    slurm/sweep.sh optim.lr=1e-3,3e-3 experiment=llama3_1b_fineweb  # one array task per job

A job's run directory is `<run.root>/<run.name>-<swept overrides>`, e.g.
`runs/tiny-bf16-fsdp-optim.lr=0.001`: the job's swept overrides as Hydra spells them, sorted,
joined with ","; slashes, backslashes and quotes become "_", and `job<n>` stands in when
nothing is swept. So every job trains, checkpoints and resumes on its own, and running the
same sweep again resumes each job's run. A `run.name=...` given on the command line is kept
as it is (every job then shares that directory). Both paths name jobs with `job_name` from
the same override strings, so a local sweep and its Slurm twin use the same directories.

Local multirun: `cli_args` adds `hydra.job.config.override_dirname.exclude_keys=[<the keys
that are not swept>]` to the command line, so each job's Hydra config knows which of its
overrides are swept (whatever the launcher); `multirun_run_name` reads that in the job.

Slurm: `python sweep.py OVERRIDES...` (what slurm/sweep.sh runs) expands the sweep the way
Hydra's basic sweeper does (the cartesian product of the swept values, in command-line
order), writes one file per job, `<run.root>/.sweeps/<time>/<i>.args` (one override per
line, with the job's run.name), and prints "<count> <directory>"; slurm/train.sbatch reads
file $SLURM_ARRAY_TASK_ID when SWEEP_DIR is set.
"""

from __future__ import annotations

import hashlib
import itertools
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from errors import ConfigError

EXCLUDE_KEYS = "hydra.job.config.override_dirname.exclude_keys"
MAX_SUFFIX = 120


def is_multirun(argv: Sequence[str]) -> bool:
    return any(a in ("-m", "--multirun") for a in argv)


def override_args(argv: Sequence[str]) -> list[str]:
    """The Hydra overrides of a command line (flags and their values left out)."""
    return [a for a in argv if "=" in a and not a.startswith("-")]


def _parse(lines: Sequence[str]):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create().parse_overrides(list(lines))


def job_name(base: str, swept: Sequence[str], num: int) -> str:
    """`base-<swept overrides>` (see the module docstring)."""
    suffix = ",".join(sorted(swept)) or f"job{num}"
    for c in "/\\'\"":  # no path separators, nor quotes (the name is passed quoted)
        suffix = suffix.replace(c, "_")
    if len(suffix) > MAX_SUFFIX:
        digest = hashlib.sha1(suffix.encode()).hexdigest()[:8]
        suffix = f"{suffix[: MAX_SUFFIX - 9]}-{digest}"
    return f"{base}-{suffix}"


def cli_args(argv: Sequence[str]) -> list[str]:
    """The command line train.py hands to Hydra: for a multirun, with the keys that are not
    swept excluded from each job's override_dirname (unless the user set that list)."""
    argv = list(argv)
    overrides = override_args(argv)
    if not is_multirun(argv) or any(a.split("=", 1)[0] == EXCLUDE_KEYS for a in overrides):
        return argv
    task = [o for o in overrides if not o.lstrip("+~").startswith("hydra.")]
    try:
        parsed = _parse(task)
    except Exception:
        return argv  # Hydra reports the bad override itself
    fixed = sorted({o.key_or_group for o in parsed if not o.is_sweep_override()})
    return [*argv, f"{EXCLUDE_KEYS}=[{','.join(fixed)}]"]


def multirun_run_name(base: str) -> tuple[str, int] | None:
    """Inside a Hydra job: (run name, job number) for a multirun job without an explicit
    run.name; None otherwise."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return None
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        return None
    parsed = _parse(list(hc.overrides.task))
    if any(o.key_or_group == "run.name" for o in parsed):
        return None
    excluded = set(hc.job.config.override_dirname.exclude_keys)
    swept = [o.input_line for o in parsed if o.key_or_group not in excluded]
    return job_name(base, swept, hc.job.num), hc.job.num


def expand(overrides: Sequence[str]) -> list[tuple[list[str], list[str]]]:
    """(the job's overrides, its swept overrides) for every job of a sweep, in the order
    Hydra's basic sweeper runs them."""
    choices = []
    for o in _parse(overrides):
        key = o.get_key_element()
        if o.is_sweep_override():
            if not o.is_discrete_sweep():
                raise ConfigError(
                    f"{o.input_line}: only list sweeps (a,b), choice() and range() can be "
                    "expanded into jobs"
                )
            choices.append([(f"{key}={v}", True) for v in o.sweep_string_iterator()])
        else:
            choices.append([(f"{key}={o.get_value_element_as_str()}", False)])
    return [
        ([line for line, _ in job], [line for line, swept in job if swept])
        for job in itertools.product(*choices)
    ]


def job_configs(overrides: Sequence[str]):
    """(job number, its swept overrides, its Config) for every job of a sweep, in the order
    Hydra's basic sweeper runs them (Hydra's own overrides, `hydra.*`, left out)."""
    from config import compose_config

    task = [o for o in overrides if not o.lstrip("+~").startswith(("hydra.", "hydra/"))]
    for num, (job, swept) in enumerate(expand(task)):
        yield num, swept or job, compose_config(job)


def plan(overrides: Sequence[str], out: Path | None = None) -> tuple[int, Path]:
    """Write the job files of a Slurm sweep; returns (job count, directory)."""
    from config import check_experiment_overrides, compose_config

    check_experiment_overrides(overrides)
    jobs = expand(overrides)
    explicit = any(line.lstrip("+").startswith("run.name=") for line in overrides)
    lines = []
    for num, (job, swept) in enumerate(jobs):
        try:
            run = compose_config(job).run
        except Exception as e:
            raise ConfigError(f"job {num} ({' '.join(job)}): {' '.join(str(e).split())}") from None
        if not explicit:
            # Quoted: the name holds "=" and "," (Hydra's grammar would split it).
            job = [*job, f"run.name='{job_name(run.name, swept, num)}'"]
        lines.append(job)
        if out is None:
            out = Path(run.root) / ".sweeps" / time.strftime("%Y-%m-%d_%H-%M-%S")
    assert out is not None
    out.mkdir(parents=True, exist_ok=True)
    for num, job in enumerate(lines):
        (out / f"{num}.args").write_text("".join(line + "\n" for line in job))
        print(f"job {num}: {' '.join(job)}", file=sys.stderr)
    return len(lines), out


def main(argv: Sequence[str]) -> int:
    out = None
    if argv[:1] == ["--out"]:
        out, argv = Path(argv[1]), argv[2:]
    if not argv:
        print("usage: sweep.py [--out DIR] OVERRIDES...  (prints: <count> <dir>)", file=sys.stderr)
        return 2
    try:
        count, directory = plan(argv, out)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{count} {directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

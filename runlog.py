"""Reading what runs logged, and comparing runs step by step.

    from runlog import compare, load_run, read_metrics
    records = read_metrics(Path("runs/a/metrics.jsonl"))         # [{"step": 1, "loss": ...}, ...]
    run = load_run("runs/a")                                     # {step: {metric: value}}
    report = compare({"a": run, "b": load_run("runs/b")}, ["loss"], rtol=0, atol=0)
    report.ok, report.format()

A run (`load_run`) is any of:
  - a run directory (`runs/<name>/`) holding `metrics.jsonl`, or that file itself;
  - a wandb offline run inside a run directory (`runs/<name>/wandb/`, one of its
    `offline-run-*` directories or a file in one): read as the enclosing run directory's
    metrics.jsonl, which holds every step those segments were sent (wandb's own offline
    files are never parsed: their format is private);
  - `entity/project/run_id` of an online wandb run (its full, unsampled history through
    wandb's public API, `wandb.Api().run(path).scan_history()`).

`load_runs` also reads a CSV exported from a wandb chart (one run per "<run> - <metric>"
column), and `short_label` names a run for legends.

`compare` checks every run against the first on the steps both logged: per metric the number
of common steps, the max absolute and relative difference (relative to the reference value),
and the first step where the two differ by more than `atol + rtol * |reference|` (the
defaults, 0 and 0, mean "not bitwise equal"). Anything that cannot be read or compared raises
`CompareError` with a one-line message.

`compare_groups` compares two groups of runs against their noise: each run's mean over a
window of steps, the difference of the group means d against the pooled spread s of the runs
around their own group's mean, k = |d| / s against NOISE_THRESHOLDS (simulated by
tools/noise_sim.py for at most 5% false alarms at any ratio of the groups' spreads).

Used by logger.py (metrics.jsonl), tools/compare_runs.py (the command line and plot) and the
test harnesses (tests/harness/). Library code: it imports nothing from tools/ or tests/.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

Run = dict[int, dict]

#: entity/project/run_id (wandb names: letters, digits, '-', '_', '.').
WANDB_RUN_PATH = re.compile(r"^[\w.-]+/[\w.-]+/[\w-]+$")


class CompareError(ValueError):
    """A run that cannot be read or compared; the message says which and why."""


# --------------------------------------------------------------------------------------
# metrics.jsonl


def read_metrics(path: Path) -> list[dict]:
    """Records of metrics.jsonl in file order; a line cut by a killed run is skipped, and a
    missing file has none."""
    records = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def read_metrics_jsonl(path: Path) -> Run:
    """One record per line with a `step`; a later record for a step replaces an earlier one,
    and a line cut short by a killed run is skipped (read_metrics)."""
    return {
        int(r["step"]): {k: v for k, v in r.items() if k != "step"}
        for r in read_metrics(path)
        if isinstance(r, dict) and "step" in r
    }


# --------------------------------------------------------------------------------------
# Loading runs


def load_run(path: str | Path) -> Run:
    """Read one run as {step: {metric: value}} (see the module docstring for what a run is)."""
    p = Path(path)
    if p.exists():
        run_dir = _enclosing_run_dir(p)
        if run_dir is not None:
            return read_metrics_jsonl(run_dir / "metrics.jsonl")
        if p.is_file() and p.suffix != ".wandb":
            return read_metrics_jsonl(p)
        if _inside_wandb_dir(p):
            raise CompareError(
                f"{path}: a wandb offline run is read through the metrics.jsonl of the run "
                "directory that logged it, and no run directory encloses this one; upload it "
                "(wandb sync) and pass entity/project/run_id"
            )
        raise CompareError(f"{path}: no metrics.jsonl in it (not a run directory)")
    if WANDB_RUN_PATH.match(str(path)):
        return read_wandb_online(str(path))
    raise CompareError(
        f"{path}: not a run directory, metrics.jsonl, wandb offline run or entity/project/run_id"
    )


def load_runs(path: str | Path) -> dict[str, Run]:
    """Every run `path` holds, by name: a CSV exported from a wandb chart may hold several
    (read_wandb_csv); anything else is the one run of `load_run`, named by `short_label`."""
    if str(path).endswith(".csv") and Path(path).is_file():
        return read_wandb_csv(Path(path))
    return {short_label(path): load_run(path)}


#: A wandb chart export's column of one run's metric: "<run name> - <metric>".
_CSV_COLUMN = re.compile(r"^(?P<run>.+) - (?P<metric>[^ ].*)$")
_CSV_STEP = ("Step", "step", "_step", "trainer/global_step")


def read_wandb_csv(path: Path) -> dict[str, Run]:
    """A CSV of wandb's "Export panel data" (a chart's CSV): a step column and a column per run
    and metric, "<run name> - <metric>" (the "__MIN"/"__MAX" columns of a sampled range are
    skipped). A CSV with plain metric columns (a run's history saved with pandas) is one run
    named after the file. Empty cells are steps that run did not log."""
    import csv

    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise CompareError(f"{path}: no rows")
    step_col = next((c for c in _CSV_STEP if c in rows[0]), None)
    if step_col is None:
        raise CompareError(f"{path}: no step column (one of {', '.join(_CSV_STEP)})")
    runs: dict[str, Run] = {}
    for column in rows[0]:
        if column == step_col or column.endswith(("__MIN", "__MAX")):
            continue
        m = _CSV_COLUMN.match(column)
        name, metric = (m["run"], m["metric"]) if m else (path.stem, column)
        if metric.startswith("_"):
            continue  # wandb's own columns (_runtime, _timestamp)
        run = runs.setdefault(name, {})
        for row in rows:
            cell = (row.get(column) or "").strip()
            if not cell or not row.get(step_col, "").strip():
                continue
            try:
                value = float(cell)
            except ValueError:
                continue
            run.setdefault(int(float(row[step_col])), {})[metric] = value
    runs = {name: run for name, run in runs.items() if run}
    if not runs:
        raise CompareError(f"{path}: no numeric metric column")
    return runs


def short_label(path: str | Path) -> str:
    """A run's name for legends and tables: its run directory's name (for a metrics.jsonl or a
    path in its wandb/ directory), a file's name without .jsonl, or a wandb run id."""
    text = str(path).rstrip("/") or str(path)
    if WANDB_RUN_PATH.match(text) and not Path(text).exists():
        return text.rsplit("/", 1)[1]
    parts = Path(text).parts
    if "wandb" in parts[1:]:
        return parts[parts.index("wandb") - 1]
    p = Path(text)
    if p.name == "metrics.jsonl" and p.parent.name:
        return p.parent.name
    return p.name[: -len(".jsonl")] if p.name.endswith(".jsonl") else p.name


def _inside_wandb_dir(p: Path) -> bool:
    return any(part == "wandb" for part in p.resolve().parts)


def _enclosing_run_dir(p: Path) -> Path | None:
    """The run directory whose metrics.jsonl stands for `p`: p itself, or for a path in a
    run's wandb/ directory, the directory holding that wandb/."""
    p = p.resolve()
    if p.is_dir() and (p / "metrics.jsonl").is_file():
        return p
    for parent in [p, *p.parents]:
        if parent.name == "wandb" and (parent.parent / "metrics.jsonl").is_file():
            return parent.parent
    return None


def read_wandb_online(run_path: str) -> Run:
    try:
        import wandb

        api_run = wandb.Api().run(run_path)
        rows = list(api_run.scan_history())  # unsampled, unlike api_run.history()
    except Exception as e:  # network, login or a wrong path: one line, no traceback
        raise CompareError(
            f"{run_path}: could not read the wandb run ({type(e).__name__}: "
            f"{e}); check the path and `wandb login`"
        ) from None
    return {int(row["_step"]): _public(row) for row in rows if row.get("_step") is not None}


def _public(row: Mapping) -> dict:
    """Drop wandb's own columns (_step, _runtime, _timestamp, ...)."""
    return {k: v for k, v in row.items() if not k.startswith("_")}


@dataclass
class Segment:
    """One segment of a run directory (configs/segment-<step>.yaml: a job, or a recipe
    switch inside one): where it started, whether train.deterministic was in effect, and the
    device it ran on (None: not recorded, e.g. a run older than the record)."""

    start_step: int
    deterministic: bool
    device: str | None
    train_device: str


_DEVICE_RE = re.compile(r"; device: (\w+)")


def run_segments(path: str | Path) -> list[Segment]:
    """The segments a local run directory recorded (empty for a wandb online run, a bare
    metrics.jsonl, or a run directory without configs/)."""
    import yaml

    p = Path(path)
    run_dir = _enclosing_run_dir(p) if p.exists() else None
    configs = run_dir / "configs" if run_dir is not None else None
    if configs is None or not configs.is_dir():
        return []
    out = []
    for f in sorted(configs.glob("segment-*.yaml")):
        m = re.match(r"segment-(\d+)\.yaml$", f.name)
        if not m:
            continue  # a replaced segment (segment-<step>.<time>.yaml)
        try:
            text = f.read_text()
            config = yaml.safe_load(text) or {}
        except (OSError, yaml.YAMLError, UnicodeDecodeError):
            continue
        train = config.get("train") or {} if isinstance(config, dict) else {}
        found = _DEVICE_RE.search(text.splitlines()[0]) if text else None
        out.append(
            Segment(
                start_step=int(m.group(1)),
                deterministic=bool(train.get("deterministic", False)),
                device=found.group(1) if found else None,
                train_device=str(train.get("device", "auto")),
            )
        )
    return out


def nondeterministic_gpu_segments(path: str | Path) -> list[Segment]:
    """Segments that ran (or, unrecorded, may have run) on a GPU without train.deterministic:
    their losses differ from a repeat's by noise."""
    return [
        s
        for s in run_segments(path)
        if not s.deterministic
        and (s.device == "cuda" or (s.device is None and s.train_device != "cpu"))
    ]


# --------------------------------------------------------------------------------------
# Comparing


@dataclass
class MetricDiff:
    metric: str
    reference: str
    other: str
    common_steps: int
    only_reference: list[int]
    only_other: list[int]
    max_abs: float
    max_rel: float
    #: Step of the largest absolute difference (None without common steps).
    max_abs_step: int | None
    #: First common step where |other - ref| > atol + rtol * |ref| (None: none).
    first_diff_step: int | None

    def within(self, same_steps: bool) -> bool:
        if self.common_steps == 0 or self.first_diff_step is not None:
            return False
        return not (same_steps and (self.only_reference or self.only_other))


@dataclass
class Report:
    diffs: list[MetricDiff]
    rtol: float
    atol: float
    same_steps: bool = False

    @property
    def ok(self) -> bool:
        return all(d.within(self.same_steps) for d in self.diffs)

    def format(self) -> str:
        tol = (
            "bitwise"
            if self.rtol == 0 and self.atol == 0
            else f"rtol={self.rtol:g} atol={self.atol:g}"
        )
        lines = []
        for d in self.diffs:
            head = f"{d.metric}: {d.reference} vs {d.other}"
            if d.common_steps == 0:
                lines.append(f"{head}: no common steps")
            else:
                first = "none" if d.first_diff_step is None else f"step {d.first_diff_step}"
                lines.append(
                    f"{head}: {d.common_steps} common steps, max abs diff "
                    f"{d.max_abs:.3e} (step {d.max_abs_step}), max rel diff "
                    f"{d.max_rel:.3e}, first step beyond {tol}: {first}"
                )
            for label, steps in ((d.reference, d.only_reference), (d.other, d.only_other)):
                if steps:
                    lines.append(f"  only in {label}: {len(steps)} steps ({_span(steps)})")
        return "\n".join(lines)


def _span(steps: list[int]) -> str:
    shown = ", ".join(map(str, steps[:5]))
    return shown + (f", ... {steps[-1]}" if len(steps) > 5 else "")


def metric_value(record: dict | None, metric: str) -> float | None:
    """The metric as a float, or None where the record lacks it or it is not a number."""
    value = None if record is None else record.get(metric)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def steps_with(run: Run, metric: str) -> set[int]:
    """The steps of `run` that logged a number for `metric`."""
    return {s for s, rec in run.items() if metric_value(rec, metric) is not None}


def recipe_switches(run: Run) -> dict[int, str]:
    """The steps after which the run switched precision recipe (`recipe.switch`: train.py logs
    `recipe_switch` on the switch step's record), with what it switched to."""
    return {
        s: str(rec["recipe_switch"]) for s, rec in sorted(run.items()) if rec.get("recipe_switch")
    }


def metric_names(runs: Mapping[str, Run]) -> set[str]:
    return {
        k
        for r in runs.values()
        for rec in r.values()
        for k in rec
        if metric_value(rec, k) is not None
    }


def compare(
    runs: Mapping[str, Run] | Sequence[Run],
    metrics: Sequence[str] = ("loss",),
    rtol: float = 0.0,
    atol: float = 0.0,
    same_steps: bool = False,
) -> Report:
    """Compare every run with the first one. `runs`: {label: {step: record}} or a list."""
    if not isinstance(runs, Mapping):
        runs = {f"run{i}": r for i, r in enumerate(runs)}
    if len(runs) < 2:
        raise CompareError("compare needs two or more runs")
    labels = list(runs)
    ref_label = labels[0]
    diffs = []
    for metric in metrics:
        if not any(steps_with(r, metric) for r in runs.values()):
            raise CompareError(
                f"metric {metric!r} is in none of the runs; pick --metrics "
                f"from: {', '.join(sorted(metric_names(runs)))}"
            )
        ref = runs[ref_label]
        ref_steps = steps_with(ref, metric)
        for label in labels[1:]:
            other = runs[label]
            other_steps = steps_with(other, metric)
            common = sorted(ref_steps & other_steps)
            max_abs, max_rel, max_abs_step, first = 0.0, 0.0, None, None
            for step in common:
                a, b = metric_value(ref[step], metric), metric_value(other[step], metric)
                if a == b or (math.isnan(a) and math.isnan(b)):
                    continue  # equal, or both diverged at the same step: agreement
                diff = abs(b - a)
                if not math.isfinite(diff):
                    diff = math.inf  # a NaN or inf on one side only
                rel = diff / abs(a) if a != 0 and math.isfinite(a) else math.inf
                if max_abs_step is None or diff > max_abs:
                    max_abs, max_abs_step = diff, step
                max_rel = max(max_rel, rel)
                tolerance = atol + rtol * abs(a) if math.isfinite(a) else atol
                if first is None and diff > tolerance:
                    first = step
            if common and max_abs_step is None:
                max_abs_step = common[0]
            diffs.append(
                MetricDiff(
                    metric=metric,
                    reference=ref_label,
                    other=label,
                    common_steps=len(common),
                    only_reference=sorted(ref_steps - other_steps),
                    only_other=sorted(other_steps - ref_steps),
                    max_abs=max_abs,
                    max_rel=max_rel,
                    max_abs_step=max_abs_step,
                    first_diff_step=first,
                )
            )
    return Report(diffs=diffs, rtol=rtol, atol=atol, same_steps=same_steps)


# --------------------------------------------------------------------------------------
# Groups of runs against their noise

#: False-alarm rate the thresholds hold at any ratio of the two groups' spreads (docs/RUNS.md,
#: Comparing against the noise).
NOISE_ALARM_RATE = 0.05
#: How often a real difference must be seen for `runs_needed` to call it resolved.
NOISE_POWER = 0.8
#: `runs_needed` looks no further than this many runs a side.
NOISE_MAX_RUNS = 32

#: NOISE_THRESHOLDS[(n_a, n_b)]: the k = |difference of the group means| / pooled spread above
#: which groups of n_a and n_b runs differ. Written by `python tools/noise_sim.py thresholds`:
#: the 1 - NOISE_ALARM_RATE quantile of k over simulated groups with no difference, the largest
#: over ratios of the groups' spreads from 0 to infinity (with one run on a side, its spread
#: cannot be seen and is taken to be the other group's). Every pair up to 8 runs a side, then
#: equal groups up to NOISE_MAX_RUNS. tests/test_compare_runs.py simulates some entries again.
NOISE_THRESHOLDS: dict[tuple[int, int], float] = {
    (1, 2): 15.55,
    (1, 3): 4.997,
    (1, 4): 3.555,
    (1, 5): 3.047,
    (1, 6): 2.771,
    (1, 7): 2.618,
    (1, 8): 2.509,
    (2, 2): 12.68,
    (2, 3): 15.54,
    (2, 4): 18.1,
    (2, 5): 20.11,
    (2, 6): 22,
    (2, 7): 23.88,
    (2, 8): 25.41,
    (3, 3): 3.51,
    (3, 4): 3.916,
    (3, 5): 4.305,
    (3, 6): 4.641,
    (3, 7): 4.962,
    (3, 8): 5.283,
    (4, 4): 2.253,
    (4, 5): 2.43,
    (4, 6): 2.596,
    (4, 7): 2.76,
    (4, 8): 2.896,
    (5, 5): 1.753,
    (5, 6): 1.859,
    (5, 7): 1.963,
    (5, 8): 2.06,
    (6, 6): 1.49,
    (6, 7): 1.557,
    (6, 8): 1.623,
    (7, 7): 1.309,
    (7, 8): 1.36,
    (8, 8): 1.183,
    (9, 9): 1.087,
    (10, 10): 1.013,
    (11, 11): 0.9505,
    (12, 12): 0.8979,
    (13, 13): 0.8566,
    (14, 14): 0.818,
    (15, 15): 0.784,
    (16, 16): 0.7537,
    (17, 17): 0.7279,
    (18, 18): 0.7039,
    (19, 19): 0.683,
    (20, 20): 0.662,
    (21, 21): 0.6441,
    (22, 22): 0.6273,
    (23, 23): 0.6122,
    (24, 24): 0.597,
    (25, 25): 0.584,
    (26, 26): 0.5712,
    (27, 27): 0.5599,
    (28, 28): 0.5485,
    (29, 29): 0.5386,
    (30, 30): 0.5286,
    (31, 31): 0.5186,
    (32, 32): 0.5099,
}


def spread_statistic(a, b):
    """(d, s, k) of window means a (..., n_a) and b (..., n_b), over their last axis: d the
    difference of the group means (b - a), s the pooled standard deviation of the runs around
    their own group's mean, k = |d| / s (0 where d and s are 0, inf where only s is). numpy
    arrays in, arrays out (a leading axis holds the draws of tools/noise_sim.py)."""
    import numpy as np

    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    n_a, n_b = a.shape[-1], b.shape[-1]
    d = b.mean(-1) - a.mean(-1)
    dof = n_a + n_b - 2
    squares = ((a - a.mean(-1, keepdims=True)) ** 2).sum(-1)
    squares = squares + ((b - b.mean(-1, keepdims=True)) ** 2).sum(-1)
    s = np.sqrt(squares / dof) if dof > 0 else np.full(np.shape(d), np.nan)
    with np.errstate(divide="ignore", invalid="ignore"):
        k = np.where(s > 0, np.abs(d) / np.where(s > 0, s, 1.0), np.where(d == 0, 0.0, np.inf))
    return d, s, k


def noise_threshold(n_a: int, n_b: int) -> float | None:
    """NOISE_THRESHOLDS' entry for groups of n_a and n_b runs (either order); None for one run
    a side (nothing to measure a spread with) or beyond the table."""
    return NOISE_THRESHOLDS.get((n_a, n_b), NOISE_THRESHOLDS.get((n_b, n_a)))


def runs_needed(difference: float, spread: float, seed: int = 0, draws: int = 4000) -> int | None:
    """The fewest runs a side (2..NOISE_MAX_RUNS) with which a true `difference` between two
    groups whose runs spread by `spread` (both in the same units) is called "differs" at least
    NOISE_POWER of the time, by simulation with these thresholds; None: more than
    NOISE_MAX_RUNS (or no difference)."""
    import numpy as np

    if difference == 0 or not math.isfinite(difference) or not spread > 0:
        return None
    rng = np.random.default_rng(seed)
    for n in range(2, NOISE_MAX_RUNS + 1):
        threshold = noise_threshold(n, n)
        if threshold is None:
            continue
        a = rng.standard_normal((draws, n)) * spread
        b = rng.standard_normal((draws, n)) * spread + abs(difference)
        if (spread_statistic(a, b)[2] > threshold).mean() >= NOISE_POWER:
            return n
    return None


@dataclass
class RunGroup:
    """One side of a noise comparison: its runs' labels and their means over the window."""

    name: str
    labels: list[str]
    means: list[float]

    @property
    def mean(self) -> float:
        return sum(self.means) / len(self.means)

    @property
    def spread(self) -> float | None:
        """Sample standard deviation of the runs' window means (None with one run)."""
        n = len(self.means)
        if n < 2:
            return None
        m = self.mean
        return math.sqrt(sum((x - m) ** 2 for x in self.means) / (n - 1))

    @property
    def relative_spread(self) -> float | None:
        """`spread` as a fraction of the group's mean."""
        return None if self.spread is None else self.spread / abs(self.mean or 1)


@dataclass
class NoiseVerdict:
    """compare_groups' answer. verdict: "same" (the difference is within the noise),
    "differs", or "undecided" (one run a side: no spread to judge by). With a bound (relative
    to A's mean): bound_verdict "within" (the interval d ± threshold x s lies inside
    ±bound), "beyond" (it lies outside) or "undecided"."""

    metric: str
    steps: list[int]
    a: RunGroup
    b: RunGroup
    difference: float
    spread: float | None
    k: float | None
    threshold: float | None
    verdict: str
    #: Runs a side that would resolve a difference of this size (None: not needed or > max).
    needed: int | None = None
    #: The spread `needed` was worked out at, and where it came from ("measured"/"assumed").
    needed_spread: float | None = None
    needed_from: str = ""
    bound: float | None = None
    bound_verdict: str | None = None
    #: Runs a side that would decide against the bound (bound_verdict "undecided" only).
    bound_needed: int | None = None

    @property
    def level(self) -> float:
        """The reference level relative figures are taken against: |A's mean|."""
        return abs(self.a.mean) or 1.0

    def rel(self, value: float) -> float:
        return value / self.level

    @property
    def interval(self) -> tuple[float, float] | None:
        """d ± threshold x s (absolute), where both are known."""
        if self.spread is None or self.threshold is None:
            return None
        half = self.threshold * self.spread
        return self.difference - half, self.difference + half

    @property
    def ok(self) -> bool:
        """With a bound: the difference is shown to lie within it; without: "same"."""
        if self.bound is not None:
            return self.bound_verdict == "within"
        return self.verdict == "same"

    def summary(self) -> str:
        """The verdict line."""
        d = f"{self.rel(self.difference):+.2%}"
        if self.verdict == "undecided":
            return (
                f"cannot decide: difference {d} with one run a side, and no spread between "
                "runs of a group to judge it by"
            )
        s = f"{self.rel(self.spread):.2%}"
        if self.verdict == "same":
            if self.spread == 0:
                return f"same: the runs are identical (difference {d}, spread {s})"
            return f"same within noise: difference {d}, spread {s} between runs of a group"
        if self.spread == 0:
            return f"differs: difference {d}, and the runs of each group are identical (spread 0)"
        return f"differs: d = {self.k:.1f} x the spread (difference {d}, spread {s})"

    def lines(self) -> list[str]:
        first, last = self.steps[0], self.steps[-1]
        out = [
            f"noise check on {self.metric} over steps {first}-{last} ({len(self.steps)} steps "
            "every run logged; each run's mean over them):"
        ]
        for g in (self.a, self.b):
            spread = "" if g.relative_spread is None else f", spread {g.relative_spread:.2%}"
            runs = "run" if len(g.means) == 1 else "runs"
            out.append(
                f"  {g.name} ({len(g.means)} {runs}): "
                + ", ".join(f"{m:.6g}" for m in g.means)
                + f" -> mean {g.mean:.6g}{spread}"
            )
        line = (
            f"  difference {self.b.name} - {self.a.name}: {self.difference:+.4g} "
            f"({self.rel(self.difference):+.2%} of {self.a.name}'s mean)"
        )
        if self.spread is not None:
            line += f"; pooled spread s {self.rel(self.spread):.2%}"
        if self.k is not None and self.threshold is not None:
            line += (
                f"; k = |d|/s = {self.k:.2f}, threshold {self.threshold:.2f} for "
                f"{len(self.a.means)} + {len(self.b.means)} runs"
            )
        out.append(line)
        if self.interval is not None:
            lo, hi = (self.rel(v) for v in self.interval)
            out.append(
                f"  interval for the difference (d ± threshold x s): {lo:+.2%} .. {hi:+.2%}; "
                "these runs would call a difference beyond "
                f"±{self.rel(self.threshold * self.spread):.2%} different"
            )
        if self.needed_spread is not None and self.verdict != "differs":
            size = f"{abs(self.rel(self.difference)):.2%}"
            spread = f"{self.rel(self.needed_spread):.2%} ({self.needed_from})"
            if self.needed is None:
                out.append(
                    f"  a difference of {size} at a spread of {spread} needs more than "
                    f"{NOISE_MAX_RUNS} runs a side to resolve"
                )
            else:
                out.append(
                    f"  a difference of {size} at a spread of {spread}: {self.needed} runs a "
                    f"side resolve it ({NOISE_POWER:.0%} of the time)"
                )
        out.append(self.summary())
        if self.bound is not None:
            out.append(self.bound_line())
        return out

    def bound_line(self) -> str:
        b = f"bound ±{self.bound:.2%}"
        if self.bound_verdict == "within":
            return f"{b}: within (the interval lies inside it)"
        if self.bound_verdict == "beyond":
            return f"{b}: BEYOND (the interval lies outside it)"
        more = ""
        if self.bound_needed is not None:
            more = f"; about {self.bound_needed} runs a side would decide it"
        return f"{b}: UNDECIDED (the interval reaches across it{more})"


def _window_steps(runs: Sequence[Run], metric: str, window: tuple[int, int] | None) -> list[int]:
    common = set.intersection(*(steps_with(r, metric) for r in runs))
    if window is None:
        ordered = sorted(common)
        steps = ordered[len(ordered) // 2 :]
    else:
        steps = sorted(s for s in common if window[0] <= s <= window[1])
    if not steps:
        where = "" if window is None else f" within steps {window[0]}-{window[1]}"
        raise CompareError(f"the runs share no step with {metric}{where}")
    return steps


def compare_groups(
    group_a: Mapping[str, Run],
    group_b: Mapping[str, Run],
    metric: str = "loss",
    *,
    names: tuple[str, str] = ("A", "B"),
    window: tuple[int, int] | None = None,
    spread: float | None = None,
    bound: float | None = None,
) -> NoiseVerdict:
    """Is the difference between two groups of runs larger than the spread between runs of a
    group? Each run is reduced to its mean of `metric` over the window (the steps in
    [first, last] that every run logged; default: the second half of them). d is the
    difference of the group means (B - A), s the pooled standard deviation of the runs around
    their group's mean, and the groups differ when k = |d| / s exceeds NOISE_THRESHOLDS for
    their sizes. One run a side: undecided. `spread` (relative to A's mean): the spread to
    assume there for the number of runs that would decide; `bound` (relative): also say
    whether d ± threshold x s lies within ±bound. Raises CompareError when the runs share no
    step in the window or a mean is not finite."""
    if not group_a or not group_b:
        raise CompareError("a noise comparison needs at least one run in each group")
    runs = [*group_a.values(), *group_b.values()]
    steps = _window_steps(runs, metric, window)
    groups = []
    for name, group in zip(names, (group_a, group_b)):
        means = []
        for label, run in group.items():
            m = sum(metric_value(run[s], metric) for s in steps) / len(steps)
            if not math.isfinite(m):
                raise CompareError(f"{label}: {metric} is not finite within the window")
            means.append(m)
        groups.append(RunGroup(name, list(group), means))
    a, b = groups
    d, s, k = (float(x) for x in spread_statistic(a.means, b.means))
    n_a, n_b = len(a.means), len(b.means)
    verdict = NoiseVerdict(
        metric=metric,
        steps=steps,
        a=a,
        b=b,
        difference=d,
        spread=None,
        k=None,
        threshold=None,
        verdict="undecided",
    )
    if n_a + n_b > 2:
        threshold = noise_threshold(n_a, n_b)
        if threshold is None:
            raise CompareError(
                f"no threshold for {n_a} + {n_b} runs (tools/noise_sim.py has them up to 8 a "
                f"side, and {NOISE_MAX_RUNS} + {NOISE_MAX_RUNS}): use fewer runs"
            )
        verdict.spread, verdict.k, verdict.threshold = s, k, threshold
        verdict.verdict = "differs" if k > threshold else "same"
    level = verdict.level
    if verdict.spread:
        verdict.needed_spread, verdict.needed_from = verdict.spread, "measured"
    elif spread is not None and verdict.spread is None:
        verdict.needed_spread, verdict.needed_from = spread * level, "assumed"
    if verdict.needed_spread:
        verdict.needed = runs_needed(d, verdict.needed_spread)
    if bound is not None:
        verdict.bound = bound
        limit = bound * level
        lo_hi = verdict.interval
        if lo_hi is None:
            verdict.bound_verdict = "undecided"
        elif -limit <= lo_hi[0] and lo_hi[1] <= limit:
            verdict.bound_verdict = "within"
        elif lo_hi[0] > limit or lo_hi[1] < -limit:
            verdict.bound_verdict = "beyond"
        else:
            verdict.bound_verdict = "undecided"
            verdict.bound_needed = _runs_for_bound(abs(d), verdict.spread, limit)
    return verdict


def _runs_for_bound(difference: float, spread: float, limit: float) -> int | None:
    """Fewest runs a side whose interval (d ± threshold(n, n) x s) would lie on one side of
    the bound if d and s stay what they are; None: none up to NOISE_MAX_RUNS."""
    for n in range(2, NOISE_MAX_RUNS + 1):
        threshold = noise_threshold(n, n)
        if threshold is None:
            continue
        half = threshold * spread
        if difference + half <= limit or difference - half > limit:
            return n
    return None
